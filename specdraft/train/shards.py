"""Data shards: a run's batch stream split by data-parallel slice, not by process.

A global batch of B rows is the concatenation of S shard batches of B / S rows, each drawn from
its own stream (every S-th record from the j-th, shuffled and packed on its own). S is fixed by
the config and the layout alone, `gcd(data * fsdp, units)` (units: the batch's rows, or its
prompts for rollouts, whose groups of `group_size` rows stay in one shard), so the global batch,
and with it the run, does not depend on how many processes share the mesh. Each process builds
only the shards whose rows its devices hold (`multihost.local_shards`) and places them with
`multihost.assemble`; a single process builds all of them. A single data-parallel slice (the
`single` layout and every layout without data or fsdp axes) is one shard: the stream of
`loader.sft_dataset` / `loader.prompt_dataset` unchanged.

The iterator state is one grain state per shard ({"<j>": state}); `global_state` gathers every
process's shards into the one dict a checkpoint stores, and `set_state` takes the shards it
builds back out of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from specdraft.parallel import multihost


def data_parallel_size(mesh, rules, rule: str = "batch") -> int:
  """Product of the mesh axes the `rule` logical axis is sharded over (data * fsdp for
  'batch')."""
  table = {r[0]: r[1] for r in rules}
  axes = table.get(rule) or ()
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  return math.prod(int(mesh.shape[a]) for a in axes if a in mesh.shape)


def num_shards(mesh, rules, units: int) -> int:
  """Shards of a stream whose batch has `units` rows (or prompts): one per data-parallel slice,
  fewer when the units do not split that far."""
  return math.gcd(data_parallel_size(mesh, rules), int(units))


class ShardedStream:
  """Endless batches {shard j: batch dict} of the shards this process builds.

  `make(j, S)` returns shard j's grain iterator; `sharding` is the placement of the global
  [rows, ...] arrays, `rows` their count, `rows_per_unit` rows per stream unit (group_size for
  prompts that roll out in groups, else 1)."""

  def __init__(self, make: Callable, *, units: int, mesh, rules, sharding, rows_per_unit: int = 1):
    self.num_shards = num_shards(mesh, rules, units)
    self.units_per_shard = units // self.num_shards
    self.rows_per_shard = self.units_per_shard * rows_per_unit
    rows = units * rows_per_unit
    self.shards = multihost.local_shards(sharding, rows, self.num_shards)
    self.iters = {j: iter(make(j, self.num_shards)) for j in self.shards}

  def __iter__(self):
    return self

  def __next__(self) -> dict[int, dict]:
    return {j: next(it) for j, it in self.iters.items()}

  def get_state(self) -> dict:
    """This process's shards' states (see `global_state` for a checkpoint's)."""
    return {str(j): it.get_state() for j, it in self.iters.items()}

  def global_state(self) -> dict:
    """Every shard's state, gathered from every process (the same dict on each)."""
    merged = {}
    for part in multihost.gather_objects(self.get_state()):
      merged.update(part)
    return merged

  def set_state(self, state: dict) -> None:
    legacy = not all(k.isdigit() for k in state)  # one grain state: before data shards
    if legacy and self.num_shards == 1:
      state = {"0": state}
    elif legacy:
      raise ValueError(
        "the checkpoint's data iterator state was written before data shards (one stream for "
        f"the whole batch); this run splits its batch into {self.num_shards} data shards, one "
        "per data-parallel slice, and cannot continue that stream: start a new run (workdir)"
      )
    missing = [str(j) for j in self.shards if str(j) not in state]
    if missing:
      raise ValueError(
        f"the checkpoint's data iterator state has shards {sorted(state)}, but this run builds "
        f"{self.num_shards} shards and this process needs {missing}: was it written with "
        "another layout or batch size?"
      )
    for j, it in self.iters.items():
      it.set_state(state[str(j)])
