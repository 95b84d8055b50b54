"""Renders docs/results.md (between the results markers) from docs/results.

python experiments/readme_tables.py           rewrite the block in docs/results.md
python experiments/readme_tables.py --check   exit 1 if the block differs from the rendering
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from experiments import results_doc as readme  # noqa: E402

_CHECK = flags.DEFINE_bool(
  "check", False, "Only compare; exit 1 when docs/results.md is out of date."
)
_ROOT = flags.DEFINE_string(
  "root", os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "Repository root."
)


def main(argv):
  del argv
  current = readme.update(_ROOT.value, check=_CHECK.value)
  if _CHECK.value and not current:
    print("docs/results.md is out of date: run python experiments/readme_tables.py")
    sys.exit(1)
  print("docs/results.md " + ("up to date" if current else "rewritten"))


if __name__ == "__main__":
  app.run(main)
