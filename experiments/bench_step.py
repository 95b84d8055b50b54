"""Co-training vs RL-only step time. See configs/bench_step.py for the command."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdraft import devices  # noqa: E402  (imports no JAX)

# On CPU, simulate the devices the chosen layout needs (before JAX is imported: XLA reads the
# device count once). Not under a multi-process launch, on GPU/TPU, or over a count already set.
devices.simulate_cpu_devices(sys.argv)

from specdraft.parallel import multihost  # noqa: E402

# one host: a multi-process launch is refused before any work
multihost.single_process_only("experiments/bench_step.py")

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments.bench import step_time  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/bench_step.py", "Bench config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/bench_step", "Output directory.")


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  step_time.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
