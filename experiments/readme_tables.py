"""Renders README.md's measured section (between the results markers) from docs/results.

python experiments/readme_tables.py           rewrite the block in README.md
python experiments/readme_tables.py --check   exit 1 if the block differs from the rendering
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from specdraft.bench import readme  # noqa: E402

_CHECK = flags.DEFINE_bool("check", False, "Only compare; exit 1 when README.md is stale.")
_ROOT = flags.DEFINE_string(
  "root", os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "Repository root."
)


def main(argv):
  del argv
  current = readme.update(_ROOT.value, check=_CHECK.value)
  if _CHECK.value and not current:
    print("README.md's measured section is stale: run python experiments/readme_tables.py")
    sys.exit(1)
  print("README.md measured section " + ("up to date" if current else "rewritten"))


if __name__ == "__main__":
  app.run(main)
