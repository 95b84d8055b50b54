"""Projected SD-over-AR rollout and RL-step speedups on accelerators. See
configs/project_speedup.py for the command."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments.bench import projection  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file(
  "config", "configs/project_speedup.py", "Projection config."
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/project_speedup", "Output directory.")


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  projection.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
