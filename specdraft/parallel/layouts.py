"""Named sharding layouts as plain data: mesh axis sizes and logical-axis rules.

Configs copy a layout into `config.parallel`, so every size and rule can be overridden from the
command line (`--config.parallel.mesh.data=4`). Axis order is fixed: data, fsdp, tensor, cp, pp.
"""

from __future__ import annotations

AXES = ("data", "fsdp", "tensor", "cp", "pp")

# Logical axis -> mesh axes (a tuple shards over their product; None replicates).
DEFAULT_RULES = (
  ("batch", ("data", "fsdp")),
  ("embed", "fsdp"),
  ("heads", "tensor"),
  ("kv_heads", "tensor"),
  ("mlp", "tensor"),
  ("vocab", None),
  ("head_dim", None),
  ("layers", "pp"),  # pipeline stages own contiguous layer slices
  ("length", "cp"),  # training batches: the sequence axis of every per-token array
  # decoding (rollouts, evaluation): rows are independent, so cp acts as a data axis there
  ("rows", ("data", "fsdp", "cp")),
)

LAYOUTS = {
  "single": {},
  "dp2": {"data": 2},
  "dp8": {"data": 8},
  "fsdp8": {"fsdp": 8},
  "tp2_dp4": {"tensor": 2, "data": 4},
  "fsdp4_tp2": {"fsdp": 4, "tensor": 2},
  "fsdp2_dp4": {"fsdp": 2, "data": 4},
  "cp2": {"cp": 2},
  "cp4": {"cp": 4},
  "cp8": {"cp": 8},
  "cp4_dp2": {"cp": 4, "data": 2},
  "fsdp2_cp4": {"fsdp": 2, "cp": 4},  # parameters and moments over (fsdp, cp): 8 ways
  "pp2": {"pp": 2},
  "pp4": {"pp": 4},
  "pp4_dp2": {"pp": 4, "data": 2},
  "pp2_cp2_dp2": {"pp": 2, "cp": 2, "data": 2},
  "pp2_tp2_dp2": {"pp": 2, "tensor": 2, "data": 2},
  "tp2_cp2_dp2": {"tensor": 2, "cp": 2, "data": 2},
}


def layout(name: str) -> dict:
  """{'name', 'devices', 'mesh': {axis: size}, 'rules': [(logical, mesh axes), ...]}.

  `devices` is 0 (the mesh must cover every device) or a count (use the first N). On CPU the
  entry points simulate the devices a layout needs (specdraft/devices.py); `mesh.check_mesh`
  says what to do when they are missing.
  `pipeline` configures the microbatched pipeline over 'pp' (ignored when pp = 1).
  `shard_weights_over_cp` folds 'cp' into the parameters' 'embed' rule when cp > 1.
  """
  if name not in LAYOUTS:
    raise ValueError(f"parallel.layout={name!r} is unknown; expected one of {sorted(LAYOUTS)}")
  sizes = {a: 1 for a in AXES}
  sizes.update(LAYOUTS[name])
  return {
    "name": name,
    "devices": 0,
    "mesh": sizes,
    "rules": [list(r) for r in DEFAULT_RULES],
    # With cp > 1, parameters and optimizer state are also sharded over 'cp' (the 'embed' rule
    # becomes (fsdp, cp)): the cp ranks of a row hold different slices of the weights, as the fsdp
    # ranks do, and gather them for the step (parallel/layout.py).
    "shard_weights_over_cp": True,
    "pipeline": dict(PIPELINE_DEFAULTS, microbatches=2 * sizes["pp"]),
  }


def describe(sizes) -> str:
  """'fsdp=4, tensor=2': the axes of size > 1 of a mesh's sizes {axis: size}, in AXES order."""
  return ", ".join(f"{a}={int(sizes[a])}" for a in AXES if int(sizes.get(a, 1)) > 1) or "all axes 1"


# Used when the layout has pp > 1 (model/pipelined.py): M microbatches (GPipe bubble fraction
# (P-1)/(M+P-1)), how taps reach the last stage (off | direct | bulk | hop), direct sends delayed
# one iteration, rematerialised stage bodies.
PIPELINE_DEFAULTS = {"microbatches": 2, "tap_mode": "direct", "tap_delay": False, "remat": False}
