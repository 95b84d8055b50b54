"""Main entry point: `python experiments/train.py --config=configs/default.py --workdir=runs/x`.

SFT -> draft pretraining -> GRPO with co-trained speculative rollouts, then a summary table.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdraft import devices  # noqa: E402  (imports no JAX)

# On CPU, simulate the devices the chosen layout needs (before JAX is imported: XLA reads the
# device count once). Not under a multi-process launch, on GPU/TPU, or over a count already set.
devices.simulate_cpu_devices(sys.argv)

from specdraft.parallel import multihost  # noqa: E402

# A multi-process run (--coordinator_address/--num_processes/--process_id, the launcher's
# environment, SLURM or a TPU slice) joins JAX's distributed runtime before anything else.
multihost.initialize(sys.argv)

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from specdraft.train.loop import summary_table, train_and_evaluate  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "Experiment config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/default", "Directory for metrics and checkpoints.")
multihost.define_flags()


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  summary = train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  if multihost.is_primary():
    print(summary_table(summary))


if __name__ == "__main__":
  app.run(main)
