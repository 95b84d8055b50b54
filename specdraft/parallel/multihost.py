"""Several processes, one program: JAX's multi-controller runtime for specdraft's entry points.

Every process runs the same script on its own devices; `jax.distributed.initialize` joins them,
after which `jax.devices()` lists every process's devices and a mesh spans them all. What a
single process did with whole host arrays, the run does here with global arrays:

  initialize(argv)       join the run (flags or the launcher's environment), before any JAX work
  is_primary()           process 0: the one that writes metrics, plots and progress bars
  sync(name)             a barrier across processes
  local_rows(sh, n)      the row ranges of an [n, ...] array this process's devices hold
  put(x, sh)             a host array (the same on every process) as a global array
  assemble(...)          a global array from the row blocks this process built (its data shards)
  to_host(x)             a global array as a numpy array on every process
  gather_objects(obj)    every process's JSON-able object, in process order

On one process each of these is the plain operation (put = device_put by shard, to_host =
np.asarray), so a run's code has one path. Settings come from flags (--coordinator_address,
--num_processes, --process_id, --init_timeout) or from the variables launchers set
(JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); under SLURM or on a TPU slice
JAX finds them itself. On CPU the processes' collectives run over gloo.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Mapping, Sequence

import jax
import numpy as np

from specdraft.parallel.argv import flag_values

FLAGS = ("coordinator_address", "num_processes", "process_id", "init_timeout", "distributed")
ENV = {
  "coordinator_address": "JAX_COORDINATOR_ADDRESS",
  "num_processes": "JAX_NUM_PROCESSES",
  "process_id": "JAX_PROCESS_ID",
  "init_timeout": "SPECDRAFT_INIT_TIMEOUT",
  "distributed": "SPECDRAFT_DISTRIBUTED",
}
DEFAULT_TIMEOUT_S = 300
_initialized = False


def define_flags() -> None:
  """absl flags of the settings (initialize() reads argv itself, before absl parses it; these
  make absl accept them and list them in --help)."""
  from absl import flags

  if "coordinator_address" in flags.FLAGS:
    return
  flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (multi-process runs; else env)."
  )
  flags.DEFINE_integer("num_processes", None, "Processes in the run (else JAX_NUM_PROCESSES).")
  flags.DEFINE_integer("process_id", None, "This process's index (else JAX_PROCESS_ID).")
  flags.DEFINE_integer(
    "init_timeout",
    None,
    f"Seconds to wait for every process to join (default {DEFAULT_TIMEOUT_S}).",
  )
  flags.DEFINE_enum(
    "distributed",
    None,
    ["auto"],
    "auto: let JAX find the cluster's processes itself (a TPU VM slice, a cluster JAX knows).",
  )


def settings(argv: Sequence[str], environ: Mapping[str, str]) -> dict:
  """{coordinator_address, num_processes, process_id, init_timeout} from argv (`--name=v` or
  `--name v`), else the environment; None where neither gives one. Raises ValueError naming
  the flag for a value that is not a number, and for an incomplete explicit set."""
  out = {}
  for name in FLAGS:
    vals = flag_values(argv, name)
    raw = vals[-1] if vals else environ.get(ENV[name])
    if raw in (None, ""):
      out[name] = None
    elif name == "distributed":
      if raw != "auto":
        raise ValueError(f"--distributed={raw!r} is invalid: expected 'auto' (or leave it unset)")
      out[name] = raw
    elif name == "coordinator_address":
      host, _, port = raw.rpartition(":")
      if not host or not port.isdigit():
        raise ValueError(
          f"--coordinator_address={raw!r} is invalid: expected host:port (e.g. 10.0.0.1:1234)"
        )
      out[name] = raw
    else:
      try:
        out[name] = int(raw)
      except ValueError:
        raise ValueError(f"--{name}={raw!r} is invalid: expected an integer") from None
  n, i = out["num_processes"], out["process_id"]
  if n is not None and n < 1:
    raise ValueError(f"--num_processes={n} is invalid: expected >= 1")
  if n is not None and n > 1:
    if out["coordinator_address"] is None or i is None:
      missing = [f for f in ("coordinator_address", "process_id") if out[f] is None]
      raise ValueError(
        f"--num_processes={n} also needs {', '.join('--' + m for m in missing)} (or "
        f"{', '.join(ENV[m] for m in missing)})"
      )
    if not 0 <= i < n:
      raise ValueError(f"--process_id={i} is invalid: expected 0 <= process_id < {n}")
  if out["init_timeout"] is not None and out["init_timeout"] < 1:
    raise ValueError(f"--init_timeout={out['init_timeout']} is invalid: expected >= 1 second")
  return out


def _cluster_launch(environ: Mapping[str, str]) -> str | None:
  """A multi-process launch JAX detects by itself: a SLURM job step of several tasks (`srun`
  sets the step's variables; a plain `python` inside an allocation is one process), or a GKE
  TPU slice of several workers. A TPU VM slice reached over ssh describes itself through its
  metadata server instead: pass --distributed=auto there."""
  step_vars = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_PROCID", "SLURM_LOCALID")
  if all(environ.get(v) for v in step_vars):
    try:
      if int(environ.get("SLURM_STEP_NUM_TASKS", "1")) > 1:
        return "SLURM"
    except ValueError:
      pass
  if "," in environ.get("TPU_WORKER_HOSTNAMES", ""):
    return "TPU slice"
  return None


def initialize(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
  """Joins the multi-process run the flags or environment describe; returns the process count.

  Nothing happens for a single process. Call it before any JAX computation (the entry points
  call it right after `devices.simulate_cpu_devices`). A process that cannot reach the
  coordinator fails within --init_timeout seconds with a message naming the address.
  """
  global _initialized
  argv = sys.argv if argv is None else argv
  environ = os.environ if environ is None else environ
  s = settings(argv, environ)
  timeout = s["init_timeout"] or DEFAULT_TIMEOUT_S
  n = s["num_processes"]
  if _initialized:
    return jax.process_count()
  if n is None or n == 1:
    cluster = "auto" if s["distributed"] == "auto" else _cluster_launch(environ)
    if cluster is None or n == 1:
      return 1
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(initialization_timeout=timeout)  # JAX reads the cluster's env
    _initialized = True
    return jax.process_count()
  address, pid = s["coordinator_address"], s["process_id"]
  if pid != 0:  # the coordinator must be listening; JAX would abort the process, not raise
    wait_for_coordinator(address, timeout)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  print(
    f"specdraft: process {pid} of {n} joining the run at {address} "
    f"(waits up to {timeout} s for every process)",
    file=sys.stderr,
    flush=True,
  )
  jax.distributed.initialize(address, n, pid, initialization_timeout=timeout)
  _initialized = True
  return n


# The entry points that join a multi-process run (the rest measure or report on one host).
MULTI_PROCESS_ENTRY_POINTS = (
  "experiments/train.py",
  "experiments/long_run.py",
  "experiments/drift.py",
)


def single_process_only(entry: str, argv=None, environ=None) -> None:
  """For an entry point that runs on one process (the benchmarks and the layout comparison:
  they time or report from one host): refuses, before any work, a launch
  that asks for several processes, naming the setting and the entry points that do join one.
  Without this the setting would be an unknown flag, or a cluster launch would run N copies."""
  argv = sys.argv if argv is None else argv
  environ = os.environ if environ is None else environ
  s = settings(argv, environ)
  n = s["num_processes"]
  if n is not None and n > 1:
    asked = f"--num_processes={n}"
  elif s["distributed"] == "auto":
    asked = "--distributed=auto"
  elif n is None and _cluster_launch(environ) is not None:
    asked = f"a {_cluster_launch(environ)} launch of several processes"
  else:
    return
  raise SystemExit(
    f"{entry} runs on one process, but {asked} asks for several. Run it as one process (on "
    f"one host); multi-process runs: {', '.join(MULTI_PROCESS_ENTRY_POINTS)}."
  )


def wait_for_coordinator(address: str, timeout: float, *, poll_s: float = 0.25) -> None:
  """Returns once something accepts TCP connections at `address`; raises RuntimeError naming
  it after `timeout` seconds."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout
  last = None
  while time.monotonic() < deadline:
    try:
      with socket.create_connection((host, int(port)), timeout=min(2.0, timeout)):
        return
    except OSError as e:
      last = e
      time.sleep(poll_s)
  raise RuntimeError(
    f"could not reach the coordinator at {address} within {timeout:g} s ({last}). Process 0 "
    "must be started with the same --coordinator_address and be reachable from this host; "
    "raise --init_timeout (SPECDRAFT_INIT_TIMEOUT) if it starts later."
  )


def is_primary() -> bool:
  return jax.process_index() == 0


def sync(name: str) -> None:
  """Every process waits here until all have arrived (no-op on one process)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


# ----------------------------------------------------------------------------- rows


def local_rows(sharding, num_rows: int) -> list[tuple[int, int]]:
  """Sorted, merged [start, stop) row ranges that this process's devices hold of an array of
  `num_rows` rows laid out by `sharding` (rows = dimension 0)."""
  if hasattr(sharding, "spec"):  # rows only: the other dimensions' sharding does not matter
    sharding = sharding.update(spec=jax.sharding.PartitionSpec(*sharding.spec[:1]))
  ranges = []
  for idx in sharding.addressable_devices_indices_map((num_rows,)).values():
    r = idx[0] if idx else slice(None)
    ranges.append((r.start or 0, num_rows if r.stop is None else r.stop))
  merged = []
  for a, b in sorted(set(ranges)):
    if merged and a <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], b))
    else:
      merged.append((a, b))
  return merged


def local_shards(sharding, num_rows: int, num_shards: int) -> list[int]:
  """The shards (equal consecutive row blocks, `num_shards` of them) that overlap the rows this
  process's devices hold."""
  per = num_rows // num_shards
  out = set()
  for a, b in local_rows(sharding, num_rows):
    out.update(range(a // per, (b - 1) // per + 1))
  return sorted(out)


def put(x, sharding):
  """A host array that every process holds whole, as a global array with `sharding`."""
  if isinstance(x, jax.Array):
    return jax.device_put(x, sharding)
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def put_tree(tree, shardings):
  return jax.tree.map(put, tree, shardings)


def assemble(blocks: Mapping[int, np.ndarray], rows_per_block: int, num_blocks: int, sharding):
  """The global [num_blocks * rows_per_block, ...] array whose row block j is `blocks[j]`,
  from the blocks this process built (every block its devices hold must be there)."""
  first = next(iter(blocks.values()))
  shape = (num_blocks * rows_per_block,) + first.shape[1:]

  def rows(idx):
    r = idx[0] if idx else slice(None)
    a, b = r.start or 0, shape[0] if r.stop is None else r.stop
    parts = []
    for j in range(a // rows_per_block, (b - 1) // rows_per_block + 1):
      if j not in blocks:
        raise RuntimeError(
          f"rows {a}:{b} need data shard {j}, which process {jax.process_index()} did not build "
          f"(it built {sorted(blocks)})"
        )
      lo, hi = max(a, j * rows_per_block), min(b, (j + 1) * rows_per_block)
      parts.append(blocks[j][lo - j * rows_per_block : hi - j * rows_per_block])
    out = np.concatenate(parts) if len(parts) > 1 else parts[0]
    return out[(slice(None),) + tuple(idx[1:])]

  return jax.make_array_from_callback(shape, sharding, rows)


def to_host(x) -> np.ndarray:
  """A (global) array as a numpy array, the same on every process."""
  if not isinstance(x, jax.Array) or x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def host_rows(x) -> dict[int, np.ndarray]:
  """{row: values} of the rows of a row-sharded global array this process's devices hold."""
  out = {}
  for shard in x.addressable_shards:
    r = shard.index[0] if shard.index else slice(None)
    start = r.start or 0
    for k, row in enumerate(np.asarray(shard.data)):
      out.setdefault(start + k, row)
  return out


def gather_objects(obj) -> list:
  """Every process's `obj` (JSON-able), in process order; [obj] on one process."""
  if jax.process_count() == 1:
    return [obj]
  from jax.experimental import multihost_utils

  data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
  sizes = np.asarray(multihost_utils.process_allgather(np.int64(data.size))).reshape(-1)
  buf = np.zeros(int(sizes.max()), np.uint8)
  buf[: data.size] = data
  gathered = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(sizes), -1)
  return [json.loads(bytes(gathered[i, : sizes[i]]).decode()) for i in range(len(sizes))]


def gather_rows(values: Mapping[int, object]) -> dict[int, object]:
  """{row: value} merged over every process (each gives the rows it holds)."""
  merged = {}
  for part in gather_objects({str(k): v for k, v in values.items()}):
    merged.update({int(k): v for k, v in part.items()})
  return merged
