"""Sharding layouts side by side. See configs/compare_layouts.py for the commands."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specdraft import devices  # noqa: E402  (imports no JAX)

# The named layouts use up to 8 devices, a mesh given on the command line its own count, and
# --plan the plan's (compare.plan.devices, 64); on CPU they are simulated before JAX is imported
# (XLA reads the device count once).
if any(a in ("--plan", "--plan=true", "--plan=True") for a in sys.argv):
  _COUNT = devices.config_int(sys.argv, "compare.plan.devices", 64)
else:
  _COUNT = max(8, devices.layout_devices(sys.argv)[0])
devices.simulate_cpu_devices(sys.argv, count=_COUNT)

from specdraft.parallel import multihost  # noqa: E402

# one host: a multi-process launch is refused before any work
multihost.single_process_only("experiments/compare_layouts.py")

from absl import app, flags, logging  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from experiments.bench import compare_layouts  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", "configs/compare_layouts.py", "Config.")
_WORKDIR = flags.DEFINE_string("workdir", "runs/compare_layouts", "Output directory.")
_PLAN = flags.DEFINE_bool("plan", False, "Plan compare.plan.model on compare.plan.devices.")
_UPDATE = flags.DEFINE_bool(
  "update_snapshots", False, "Rewrite tests/snapshots/shardings/*.txt and exit."
)
SNAPSHOTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                         "snapshots", "shardings")  # fmt: skip


def main(argv):
  del argv
  logging.set_verbosity(logging.ERROR)
  if _UPDATE.value:
    for path in compare_layouts.write_snapshots(_CONFIG.value, SNAPSHOTS):
      print(f"wrote {path}")
  elif _PLAN.value:
    compare_layouts.run_plan(_CONFIG.value, _WORKDIR.value)
  else:
    compare_layouts.run(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
