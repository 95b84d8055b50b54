"""Restates the drift A - C equivalence under a two-look design. See
configs/restate_equivalence.py for the command."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments.bench import drift  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/restate_equivalence.py", "Config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/drift_equivalence_restated", "Output directory.")


def main(argv):
  del argv
  drift.restate_equivalence(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
