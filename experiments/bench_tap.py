"""TapChannel benchmark. See configs/bench_tap.py for the command."""

import os
import sys

os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from specdraft.bench import tap  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/bench_tap.py", "Bench config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_tap", "Output directory.")


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  tap.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
