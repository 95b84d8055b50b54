"""Attention kernel benchmark. See configs/bench_kernel.py for the command."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments.bench import kernel  # noqa: E402
from specdraft.parallel import multihost  # noqa: E402

# one process, one device: a multi-process launch is refused before any work
multihost.single_process_only("experiments/bench_kernel.py")

_CONFIG = config_flags.DEFINE_config_file("config", "configs/bench_kernel.py", "Bench config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_kernel", "Output directory.")


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  kernel.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
