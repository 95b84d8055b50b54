"""Draws the trunk, EAGLE-3 and DFlash/DSpark attention masks side by side (from the oracle).

python experiments/plot_masks.py --out=docs/figures/masks.png
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402

from experiments.bench import masks  # noqa: E402

_OUT = flags.DEFINE_string("out", "docs/figures/masks.png", "Where the picture goes.")


def main(argv):
  del argv
  masks.plot(_OUT.value)
  print(f"wrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main)
