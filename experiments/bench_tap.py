"""TapChannel benchmark. See configs/bench_tap.py for the command."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdraft import devices  # noqa: E402  (imports no JAX)

# The benchmark builds its own meshes of up to 8 devices; on CPU they are simulated (before JAX
# is imported: XLA reads the device count once).
devices.simulate_cpu_devices(sys.argv, count=8)

from specdraft.parallel import multihost  # noqa: E402

# one host: a multi-process launch is refused before any work
multihost.single_process_only("experiments/bench_tap.py")

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments.bench import tap  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/bench_tap.py", "Bench config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_tap", "Output directory.")


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  tap.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
