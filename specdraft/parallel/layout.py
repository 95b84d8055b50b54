"""A layout as one value: the mesh, its logical-axis rules, the pipeline and the cp size.

Everything that places an array asks a `Layout`: the trainer's phases (`train/phases.py`), the
train states (`train/state.py`, the one owner of state initialisation and state shardings), the
rollouts, and the layout comparison and its sharding snapshots (`bench/compare_layouts.py`). So a
snapshot shows what training runs, not a copy of it.

Rules map logical axes to mesh axes (`layouts.DEFAULT_RULES`). Parameters and the training batch
read different logical axes of the same table: parameters their width ('embed'), heads, MLP and
layers; a training batch its rows ('batch') and its sequence ('length'); a decoding batch its rows
('rows').
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from specdraft.parallel import layouts
from specdraft.parallel import mesh as mesh_lib
from specdraft.parallel.pipeline import PipelineSpec


def weights_over(rules: tuple, axis: str, mesh) -> tuple:
  """`rules` with `axis` added to the parameters' width rule ('embed') when the mesh has it with
  size > 1: weights and their optimizer state are then sharded over it too. Every other rule is
  unchanged; only parameters carry the 'embed' logical axis (activations are placed by 'batch',
  'length' and 'rows')."""
  if int(mesh.shape.get(axis, 1)) <= 1:
    return rules
  out = []
  for name, axes in rules:
    if name == "embed":
      axes = () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
      axes = axes if axis in axes else (*axes, axis)
    out.append((name, axes))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class Layout:
  """How a run is laid out over its devices (built once from `config.parallel`).

  name: the named layout (`parallel/layouts.py`) or 'custom'.
  parallel: the config section it was built from (kept for reports).
  mesh: the device mesh over the axes data, fsdp, tensor, cp, pp.
  rules: (logical axis, mesh axes) pairs.
  pipeline: how the policy is pipelined over 'pp', or None when pp = 1.
  """

  name: str
  parallel: Any
  mesh: jax.sharding.Mesh
  rules: tuple
  pipeline: PipelineSpec | None

  @classmethod
  def from_config(cls, parallel, *, name: str | None = None, devices=None) -> Layout:
    """The layout of a `config.parallel` section (mesh over `devices`, default every device the
    section asks for)."""
    mesh = mesh_lib.make_mesh(parallel, devices)
    pipeline = None
    if int(parallel.mesh.get("pp", 1)) > 1:
      pipeline = PipelineSpec.from_config(parallel.pipeline)
    rules = tuple(
      (r[0], r[1] if isinstance(r[1], str | None) else tuple(r[1])) for r in parallel.rules
    )
    if bool(parallel.get("shard_weights_over_cp", True)):
      rules = weights_over(rules, "cp", mesh)
    return cls(name or parallel.get("name", "custom"), parallel, mesh, rules, pipeline)

  @property
  def cp(self) -> int:
    """Context-parallel ranks: training steps run on sequence shards over 'cp'."""
    return int(self.mesh.shape.get("cp", 1))

  @property
  def devices(self) -> int:
    return int(self.mesh.size)

  def sharding(self, logical: tuple, shape=None) -> NamedSharding:
    """The sharding of an array whose axes have the logical names `logical` (None: replicated
    axis); with `shape`, an axis that does not divide its mesh axes raises, naming it."""
    return NamedSharding(self.mesh, mesh_lib.logical_to_spec(logical, self.rules, self.mesh, shape))

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec())

  def batch_sharding(self, ndim: int = 2) -> NamedSharding:
    """A training batch's [B, ...] array: rows by the 'batch' rule."""
    return mesh_lib.batch_sharding(self.mesh, self.rules, ndim)

  def rows_sharding(self, ndim: int = 1) -> NamedSharding:
    """A decoding batch's [rows, ...] array: rows by the 'rows' rule."""
    return mesh_lib.rows_sharding(self.mesh, self.rules, ndim)

  def tree_shardings(self, logical_tree, shapes_tree):
    """Shardings of a parameter pytree from its logical axes (`param_logical_axes`)."""
    return mesh_lib.tree_shardings(logical_tree, shapes_tree, self.rules, self.mesh)

  def decode_shardings(self, shardings):
    """The shardings a decoding loop reads weights with: each parameter's spec with every mesh
    axis but 'tensor' dropped. A rollout places its weights so once (one all-gather over fsdp, cp
    and pp per rollout) instead of leaving the loop to gather them on every round."""

    def keep_tensor(sh):
      spec = []
      for axes in sh.spec:
        kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a == "tensor")
        spec.append(kept[0] if kept else None)
      return NamedSharding(self.mesh, PartitionSpec(*spec))

    return jax.tree.map(keep_tensor, shardings)

  def describe(self) -> str:
    """'fsdp=4, tensor=2': the mesh axes of size > 1."""
    return layouts.describe(dict(self.mesh.shape))
