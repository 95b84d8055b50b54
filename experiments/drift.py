"""The drift experiment. See configs/drift.py for the command."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdraft import devices  # noqa: E402  (imports no JAX)

# On CPU, simulate the devices the chosen layout needs (before JAX is imported: XLA reads the
# device count once). Not under a multi-process launch, on GPU/TPU, or over a count already set.
devices.simulate_cpu_devices(sys.argv)

from specdraft.parallel import multihost  # noqa: E402

# A multi-process run (as for experiments/train.py) joins JAX's distributed runtime first.
multihost.initialize(sys.argv)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments.bench import drift  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/drift.py", "Drift config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/drift", "Output directory.")
multihost.define_flags()


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  drift.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
