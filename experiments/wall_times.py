"""Wall times of `.ci/run`'s steps and `make run` from clean clones. See configs/wall_times.py."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments.bench import wall_times  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/wall_times.py", "Config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/wall_times", "Output directory.")


def main(argv):
  del argv
  wall_times.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
