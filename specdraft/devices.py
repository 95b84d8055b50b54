"""Simulated CPU devices for the entry points, decided before JAX is imported.

A layout's mesh must cover exactly its devices (`parallel.devices`, 0 = all of them). A normal CPU
machine shows JAX one device, so `experiments/*.py` ask XLA for as many host devices as the chosen
layout needs (`XLA_FLAGS=--xla_force_host_platform_device_count=N`). XLA reads that flag once, when
the backend starts, so the count comes from the command line rather than from the loaded config:

  --config=configs/default.py:layout=pp4_dp2   -> pp=4 * data=2 -> 8 devices
  --config.parallel.mesh.cp=4                  -> overrides one axis of the layout
  --config.parallel.devices=4                  -> the mesh covers 4 devices

Nothing is simulated under a multi-process launch (each process sees its own real devices), when
JAX_PLATFORMS asks for a GPU or TPU backend, or when the user already chose a count in XLA_FLAGS
(or JAX_NUM_CPU_DEVICES). This module imports no JAX.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence

from specdraft.parallel.argv import flag_values
from specdraft.parallel.layouts import AXES, LAYOUTS

COUNT_FLAG = "--xla_force_host_platform_device_count"

# Set by launchers that start one process per host or per accelerator.
_MULTIPROCESS_VARS = (
  "JAX_COORDINATOR_ADDRESS",
  "JAX_NUM_PROCESSES",
  "JAX_PROCESS_ID",
  "OMPI_COMM_WORLD_SIZE",
  "PMI_SIZE",
  "TPU_NAME",
  "TPU_WORKER_ID",
  "TPU_WORKER_HOSTNAMES",
  "TPU_ACCELERATOR_TYPE",
  "CLOUD_TPU_TASK_ID",
)
_MULTIPROCESS_PREFIXES = ("SLURM_",)


def _overrides(argv: Sequence[str], prefix: str) -> dict[str, str]:
  """`--config.<prefix><key>=v` (or with a space) -> {key: v}; later flags win."""
  out = {}
  for i, a in enumerate(argv):
    if not a.startswith(f"--config.{prefix}"):
      continue
    key, eq, val = a[len(f"--config.{prefix}") :].partition("=")
    if not eq:
      if i + 1 >= len(argv):
        continue
      val = argv[i + 1]
    out[key] = val
  return out


def layout_devices(argv: Sequence[str]) -> tuple[int, str]:
  """(devices the run's mesh covers, a description) from the command line alone.

  The layout is the config arg's `layout=NAME` (else the config file's `DEFAULT_LAYOUT`, else
  `single`), with the axis sizes and
  `parallel.devices` of `--config.parallel.*` overrides applied. An unknown layout or a value that
  is not an integer counts as one device: the config's own validation reports it by name.
  """
  name = "single"
  for spec in flag_values(argv, "config"):
    path, _, arg = spec.partition(":")
    name = _default_layout(path) or name
    for part in arg.split(","):
      key, _, val = part.partition("=")
      if key.strip() == "layout":
        name = val.strip()
  sizes = {a: 1 for a in AXES}
  sizes.update(LAYOUTS.get(name, {}))
  want = 0
  try:
    for axis, val in _overrides(argv, "parallel.mesh.").items():
      if axis in sizes:
        sizes[axis] = int(val)
    want = int(_overrides(argv, "parallel.").get("devices", 0))
  except ValueError:
    return 1, f"layout {name!r}"
  shape = ", ".join(f"{a}={s}" for a, s in sizes.items() if s != 1) or "all axes 1"
  return max(math.prod(sizes.values()), want, 1), f"layout {name!r} ({shape})"


def config_int(argv: Sequence[str], key: str, default: int) -> int:
  """The integer of `--config.<key>=N` on the command line (the last one wins), else `default`;
  a value that is not an integer gives `default` (the config's own validation reports it)."""
  prefix, _, name = key.rpartition(".")
  try:
    return int(_overrides(argv, f"{prefix}." if prefix else "").get(name, default))
  except ValueError:
    return default


def _default_layout(path: str) -> str | None:
  """A config file's module-level `DEFAULT_LAYOUT = "name"` (read with `ast`, not imported: the
  config imports JAX, which must not be imported yet)."""
  import ast

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for candidate in (path, os.path.join(root, path)):
    try:
      with open(candidate) as f:
        tree = ast.parse(f.read())
      break
    except (OSError, SyntaxError):
      continue
  else:
    return None
  for node in tree.body:
    if (
      isinstance(node, ast.Assign)
      and any(isinstance(t, ast.Name) and t.id == "DEFAULT_LAYOUT" for t in node.targets)
      and isinstance(node.value, ast.Constant)
      and isinstance(node.value.value, str)
    ):
      return node.value.value
  return None


def blocked(environ: Mapping[str, str]) -> str | None:
  """Why CPU devices must not be simulated in this environment, or None."""
  for var in _MULTIPROCESS_VARS:
    if environ.get(var):
      return f"{var} is set (a multi-process or TPU launch: each process uses its real devices)"
  for var in environ:
    if var.startswith(_MULTIPROCESS_PREFIXES):
      return f"{var} is set (a multi-process launch: each process uses its real devices)"
  platforms = [p.strip().lower() for p in environ.get("JAX_PLATFORMS", "").split(",") if p.strip()]
  if platforms and platforms[0] != "cpu":
    return f"JAX_PLATFORMS={environ['JAX_PLATFORMS']} asks for an accelerator backend"
  if COUNT_FLAG in environ.get("XLA_FLAGS", "") or environ.get("JAX_NUM_CPU_DEVICES"):
    return "the CPU device count is already set (XLA_FLAGS or JAX_NUM_CPU_DEVICES)"
  return None


def simulate_cpu_devices(
  argv: Sequence[str] | None = None,
  environ: dict | None = None,
  *,
  count: int | None = None,
  quiet: bool = False,
) -> int | None:
  """Sets XLA_FLAGS so the CPU backend shows the devices the run needs; returns that count.

  `count` fixes the number (benchmarks that build their own meshes of up to N devices); otherwise
  it is `layout_devices(argv)`. Returns None when nothing was set: one device is enough, or
  `blocked()` gives a reason (printed to stderr when the layout needs more than one device, since
  the mesh check will then fail and the reason tells why no devices were simulated).
  Call it before `import jax`.
  """
  argv = sys.argv if argv is None else argv
  environ = os.environ if environ is None else environ
  n, what = (count, f"{count} devices") if count is not None else layout_devices(argv)
  if n <= 1:
    return None
  reason = blocked(environ)
  procs = flag_values(argv, "num_processes")
  if reason is None and procs and procs[-1].isdigit() and int(procs[-1]) > 1:
    reason = f"--num_processes={procs[-1]} (a multi-process launch: each process uses its devices)"
  if reason is not None:
    if not quiet and COUNT_FLAG not in environ.get("XLA_FLAGS", ""):
      print(f"specdraft: not simulating {n} CPU devices for {what}: {reason}", file=sys.stderr)
    return None
  environ["XLA_FLAGS"] = f"{environ.get('XLA_FLAGS', '')} {COUNT_FLAG}={n}".strip()
  if not quiet:
    print(
      f"specdraft: simulating {n} CPU devices for {what}: XLA_FLAGS={COUNT_FLAG}={n}",
      file=sys.stderr,
    )
  return n
