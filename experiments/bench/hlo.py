"""Collective traffic and matmul FLOPs read from a compiled (per-device) HLO module.

Every `collective-permute` (sync or `-start`) is listed with its source->target pairs, the bytes
of its operand(s), and how many times it runs: the product of the trip counts
(`known_trip_count`) of the while loops around it. Wire bytes = operand bytes x pairs x runs
(each pair moves one copy of the operand).

`dot_flops` counts the FLOPs of every `dot` the same way, times its runs. XLA's own
`compiled.cost_analysis()["flops"]` counts a while loop's body once, whatever its trip count,
so a policy whose layers run under `lax.scan` would be undercounted by about its depth. Written
for the CPU backend's HLO: every branch of a `conditional` counts as run (an upper bound where
empty tiles are skipped), and a backend that lowers matmuls to library `custom-call`s (cuBLAS on
GPU) has no `dot` to count, so use it on CPU-compiled programs.
"""

from __future__ import annotations

import dataclasses
import math
import re

_DTYPE_BYTES = {
  "pred": 1,
  "s8": 1,
  "u8": 1,
  "s16": 2,
  "u16": 2,
  "f16": 2,
  "bf16": 2,
  "s32": 4,
  "u32": 4,
  "f32": 4,
  "s64": 8,
  "u64": 8,
  "f64": 8,
  "c64": 8,
  "c128": 16,
}
_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128)\[([0-9,]*)\]")
_CALLEES = re.compile(
  r"\b(body|condition|calls|to_apply|true_computation|false_computation)="
  r"%?([\w.\-]+)"
)
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_DEF = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+?\[[0-9,]*\])")
_DOT = re.compile(r" dot\(%?([\w.\-]+), %?([\w.\-]+)\)")
_LHS_CONTRACT = re.compile(r"lhs_contracting_dims=\{([0-9,]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")


@dataclasses.dataclass(frozen=True)
class Permute:
  name: str
  computation: str
  pairs: tuple[tuple[int, int], ...]
  operand_bytes: int  # per device, one execution
  runs: int  # executions per program run (enclosing loop trip counts)
  op_name: str  # the JAX op path from metadata (tells forward from transpose)

  @property
  def wire_bytes(self) -> int:
    return self.operand_bytes * len(self.pairs) * self.runs


def _shape_bytes(text: str) -> int:
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
    total += n * _DTYPE_BYTES[dtype]
  return total


def _computations(hlo: str) -> dict[str, list[str]]:
  comps, cur = {}, None
  for line in hlo.splitlines():
    m = _HEADER.match(line)
    if m and not line.startswith(" "):
      cur = m.group(1)
      comps[cur] = []
    elif cur is not None:
      comps[cur].append(line)
  return comps


def collective_permutes(hlo: str) -> list[Permute]:
  """Every collective-permute of the program with its pairs, bytes and how often it runs."""
  comps = _computations(hlo)
  runs = _run_counts(hlo, comps)
  out = []
  for comp, lines in comps.items():
    for line in lines:
      if " collective-permute(" in line or " collective-permute-start(" in line:
        out.append(_permute(line, comp, max(runs.get(comp, 1), 1)))
  return out


def _run_counts(hlo: str, comps: dict) -> dict[str, int]:
  """How many times each computation runs per program run (loop bodies times their trip count),
  breadth-first over the call graph from ENTRY (HLO call graphs are acyclic)."""
  entry = next(
    (m.group(1) for line in hlo.splitlines() if line.startswith("ENTRY")
     for m in [_HEADER.match(line)] if m),
    None,
  )  # fmt: skip
  runs = {name: 0 for name in comps}
  if entry is None:
    return runs
  edges = {name: [] for name in comps}  # caller -> [(callee, multiplier)]
  for caller, lines in comps.items():
    for line in lines:
      trip = _TRIP.search(line)
      callees = [(k, v) for k, v in _CALLEES.findall(line)]
      for b in _BRANCHES.findall(line):
        callees += [("branch", x.strip().lstrip("%")) for x in b.split(",") if x.strip()]
      for kind, callee in callees:
        if callee in comps:
          mult = int(trip.group(1)) if (kind == "body" and trip) else 1
          edges[caller].append((callee, mult))
  # topological order (Kahn) so a computation passes on its runs only once every caller has added
  # theirs, however many call sites reach it at different depths
  indegree = {name: 0 for name in comps}
  for caller in comps:
    for callee, _ in edges[caller]:
      indegree[callee] += 1
  runs[entry] = 1
  ready = [name for name, d in indegree.items() if d == 0]
  while ready:
    caller = ready.pop()
    for callee, mult in edges[caller]:
      runs[callee] += runs[caller] * mult
      indegree[callee] -= 1
      if indegree[callee] == 0:
        ready.append(callee)
  return runs


def _permute(line: str, comp: str, runs: int) -> Permute:
  """One collective-permute line: its name, pairs, operand bytes and op name."""
  lhs, _, rhs = line.partition(" = ")
  pm = _PAIRS.search(line)
  pairs = ()
  if pm:
    pairs = tuple(
      tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}", pm.group(1))
    )
  shape_text = rhs.split(" collective-permute", 1)[0]
  nbytes = _shape_bytes(shape_text)
  if "collective-permute-start" in rhs:  # (operand, result, ...) tuple: count the operand
    arrays = _ARRAY.findall(shape_text)
    nbytes = _shape_bytes(" ".join(f"{d}[{s}]" for d, s in arrays[: max(len(arrays) // 2, 1)]))
  opn = re.search(r'op_name="([^"]*)"', line)
  return Permute(lhs.strip().lstrip("%"), comp, pairs, nbytes, runs, opn.group(1) if opn else "")


def summarize(permutes: list[Permute]) -> dict:
  """Wire bytes by direction: forward ops vs transposed (gradient) ops."""
  fwd = sum(p.wire_bytes for p in permutes if "transpose(" not in p.op_name)
  bwd = sum(p.wire_bytes for p in permutes if "transpose(" in p.op_name)
  return {
    "forward_bytes": fwd,
    "gradient_bytes": bwd,
    "total_bytes": fwd + bwd,
    "num_ops": len(permutes),
  }


def _dims(shape_text: str) -> list[int]:
  m = _ARRAY.search(shape_text)
  return [int(d) for d in m.group(2).split(",") if d] if m else []


def dot_flops(hlo: str) -> int:
  """FLOPs of every dot in the program per run: 2 x (result elements) x (contracted size),
  times the runs of its computation (loop trip counts included). Elementwise work is left out:
  this is the matmul work that dominates a transformer step."""
  comps = _computations(hlo)
  runs = _run_counts(hlo, comps)
  total = 0
  for comp, lines in comps.items():
    shapes = {}
    for line in lines:
      d = _DEF.match(line)
      if d:
        shapes[d.group(1)] = d.group(2)
    for line in lines:
      m, d = _DOT.search(line), _DEF.match(line)
      if not (m and d):
        continue
      if m.group(1) not in shapes:
        raise ValueError(f"dot_flops: no shape for operand {m.group(1)!r} in {comp}: {line[:120]}")
      lhs = _dims(shapes[m.group(1)])
      contract = _LHS_CONTRACT.search(line)
      idx = [int(i) for i in contract.group(1).split(",") if i] if contract else []
      k = math.prod(lhs[i] for i in idx)
      total += 2 * math.prod(_dims(d.group(2))) * k * max(runs.get(comp, 1), 1)
  return total


# ----------------------------------------------------------------------------- every collective

# The collective kinds a sharded step uses; `-start` forms (async) count once, `-done` never.
COLLECTIVE_KINDS = (
  "all-gather",
  "reduce-scatter",
  "all-reduce",
  "collective-permute",
  "all-to-all",
)
_COLLECTIVE = re.compile(
  r" (all-gather|reduce-scatter|all-reduce|collective-permute|all-to-all)(-start)?\("
)
_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[0-9,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_MESH_AXIS = re.compile(r"'([^']+)'=(\d+)")
_GROUP_AXIS = re.compile(r"'([^']+)'(?::\((\d+)\)(\d+))?")
_PARTITIONS = re.compile(r"\bnum_partitions=(\d+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
  kind: str  # one of COLLECTIVE_KINDS
  name: str
  computation: str
  result_bytes: int  # per device, one execution (the gathered buffer for all-gather)
  group_size: int  # devices that take part together (n)
  runs: int  # executions per program run (enclosing loop trip counts)
  op_name: str = ""  # the JAX op path from the metadata (which source op it came from)

  @property
  def sent_bytes(self) -> float:
    """Bytes one device sends per program run, under the ring algorithm XLA's collectives use on
    a ring or torus (a bandwidth figure: latency and topology are left out):

      all-gather      result x (n-1)/n        (every device receives the n-1 shards it lacks)
      reduce-scatter  result x (n-1)          (operand = n x result; (n-1)/n of it is sent)
      all-reduce      2 x result x (n-1)/n    (a reduce-scatter, then an all-gather)
      all-to-all      result x (n-1)/n        (every device keeps 1/n of its operand)
      collective-permute  result              (one copy to its target)
    """
    n, r = self.group_size, self.result_bytes
    if self.kind == "collective-permute":
      per_run = r
    elif n <= 1:
      per_run = 0.0
    elif self.kind == "reduce-scatter":
      per_run = r * (n - 1)
    elif self.kind == "all-reduce":
      per_run = 2 * r * (n - 1) / n
    else:
      per_run = r * (n - 1) / n
    return per_run * self.runs


def _group_size(line: str, num_devices: int) -> int:
  """n from the op's replica groups: explicit lists `{{0,1},{2,3}}`, iota `[4,2]<=[8]`, or mesh
  axes `mesh['axis_0'=4,'axis_1'=2] {'axis_1'}` (a sub-axis `'axis_0':(1)2` has its own size)."""
  m = _GROUPS_MESH.search(line)
  if m:
    sizes = {name: int(size) for name, size in _MESH_AXIS.findall(m.group(1))}
    n = 1
    for name, _, sub in _GROUP_AXIS.findall(m.group(2)):
      n *= int(sub) if sub else sizes[name]
    return n
  m = _GROUPS_IOTA.search(line)
  if m:
    return int(m.group(2))
  m = _GROUPS_LIST.search(line)
  if m and m.group(1):
    first = re.match(r"\{([0-9,]*)\}", m.group(1)).group(1)
    return len([x for x in first.split(",") if x])
  return num_devices  # replica_groups={} (or none): every device of the program


def _result_bytes(kind: str, is_start: bool, shape_text: str) -> int:
  """The result's bytes; an async `-start` returns a tuple that also holds the operand."""
  if not is_start or kind in ("all-reduce", "reduce-scatter", "all-to-all"):
    return _shape_bytes(shape_text)
  arrays = _ARRAY.findall(shape_text)
  if kind == "collective-permute":  # (operand, result, context...): count the operand
    arrays = arrays[: max(len(arrays) // 2, 1)]
  else:  # all-gather-start: (operands..., results...)
    arrays = arrays[len(arrays) // 2 :]
  return _shape_bytes(" ".join(f"{d}[{s}]" for d, s in arrays))


def collectives(hlo: str, num_devices: int | None = None) -> list[Collective]:
  """Every collective of the program (kinds in COLLECTIVE_KINDS) with its result bytes, group size
  and how often it runs. `num_devices` (default: the module's num_partitions) sizes groups that
  the HLO leaves implicit."""
  if num_devices is None:
    m = _PARTITIONS.search(hlo)
    num_devices = int(m.group(1)) if m else 1
  comps = _computations(hlo)
  runs = _run_counts(hlo, comps)
  out = []
  for comp, lines in comps.items():
    for line in lines:
      m = _COLLECTIVE.search(line)
      if not m or " = " not in line:
        continue
      kind, is_start = m.group(1), bool(m.group(2))
      lhs, _, rhs = line.partition(" = ")
      shape_text = rhs[: rhs.index(m.group(0).lstrip())]
      out.append(
        Collective(
          kind=kind,
          name=lhs.strip().removeprefix("ROOT ").lstrip("%"),
          computation=comp,
          result_bytes=_result_bytes(kind, is_start, shape_text),
          group_size=_group_size(line, num_devices),
          runs=max(runs.get(comp, 1), 1),
          op_name=next(iter(_OP_NAME.findall(line)), ""),
        )
      )
  return out


def collective_bytes(hlo: str, num_devices: int | None = None) -> dict[str, dict[str, float]]:
  """{kind: {"sent_bytes": per device per run (see `Collective.sent_bytes`), "ops": count}} for
  every kind in COLLECTIVE_KINDS (zeros where the program has none)."""
  out = {k: {"sent_bytes": 0.0, "ops": 0} for k in COLLECTIVE_KINDS}
  for c in collectives(hlo, num_devices):
    out[c.kind]["sent_bytes"] += c.sent_bytes
    out[c.kind]["ops"] += 1
  return out
