"""Meshes over (data, fsdp, tensor, cp, pp) from a config's layout, and logical-axis shardings."""

from __future__ import annotations

import math

import jax
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from specdraft.parallel.layouts import AXES, DEFAULT_RULES


def mesh_shape(parallel_cfg) -> tuple[int, ...]:
  sizes = dict(parallel_cfg.mesh)
  unknown = set(sizes) - set(AXES)
  if unknown:
    raise ValueError(f"parallel.mesh has unknown axes {sorted(unknown)}; valid axes are {AXES}")
  for a in AXES:
    if int(sizes.get(a, 1)) < 1:
      raise ValueError(f"parallel.mesh.{a}={sizes[a]} must be >= 1")
  return tuple(int(sizes.get(a, 1)) for a in AXES)


HOW_TO_GET_DEVICES = (
  "On CPU, experiments/*.py simulate the devices a layout needs by themselves; in your own "
  "process set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX is imported. On "
  "GPU/TPU, choose a layout whose axis sizes multiply to your device count, or set "
  "parallel.devices to use the first N devices."
)


def _describe(parallel_cfg) -> str:
  shape = mesh_shape(parallel_cfg)
  sizes = ", ".join(f"{a}={s}" for a, s in zip(AXES, shape) if s > 1) or "all axes 1"
  return f"parallel.layout={parallel_cfg.get('name', '?')!r} ({sizes})"


def mesh_devices(parallel_cfg, num_devices: int | None = None) -> int:
  """How many devices the mesh must cover: `parallel.devices` (0 = all, else a count)."""
  n = jax.device_count() if num_devices is None else num_devices
  want = parallel_cfg.get("devices", 0)
  if want == 0:
    return n
  if not isinstance(want, int) or want < 1:
    raise ValueError(
      f"parallel.devices={want!r} is invalid: expected 0 (all devices) or a count in [1, {n}]"
    )
  if want > n:
    raise ValueError(
      f"parallel.devices={want!r} is invalid: {_describe(parallel_cfg)} asks for {want} devices "
      f"but this process has {n} ({_platform()}). {HOW_TO_GET_DEVICES}"
    )
  return want


def _platform() -> str:
  try:
    return f"{jax.default_backend()} backend"
  except RuntimeError:  # no backend could start; the count alone is still worth reporting
    return "no backend"


def check_mesh(parallel_cfg, num_devices: int | None = None) -> None:
  """Raises (before anything compiles) unless the layout's mesh covers exactly its devices.

  The message names the layout, the devices it needs and has, and how to get them.
  """
  n = mesh_devices(parallel_cfg, num_devices)
  size = math.prod(mesh_shape(parallel_cfg))
  if size == n:
    return
  have = jax.device_count() if num_devices is None else num_devices
  if size > have:
    raise ValueError(
      f"{_describe(parallel_cfg)} needs {size} devices but this process has {have} "
      f"({_platform()}). {HOW_TO_GET_DEVICES}"
    )
  raise ValueError(
    f"{_describe(parallel_cfg)} has mesh size {size} but it must cover {n} devices "
    f"(parallel.devices={parallel_cfg.get('devices', 0)!r}, 0 = every device of the {have}). "
    f"Set parallel.devices={size} to use the first {size}, or choose a layout whose axis sizes "
    f"multiply to {n}."
  )


def make_mesh(parallel_cfg, devices=None) -> jax.sharding.Mesh:
  """A mesh with Auto axis types (the compiler propagates shardings outside shard_map).

  It covers every device unless `parallel.devices` names a count (the first N devices).
  """
  devices = jax.devices() if devices is None else devices
  check_mesh(parallel_cfg, len(devices))
  devices = devices[: mesh_devices(parallel_cfg, len(devices))]
  return jax.make_mesh(
    mesh_shape(parallel_cfg), AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices
  )


def logical_to_spec(logical: tuple, rules, mesh: jax.sharding.Mesh, shape=None) -> PartitionSpec:
  """PartitionSpec for a tuple of logical axis names under `rules`.

  With `shape`, a dimension is sharded only if its size divides the mesh axes' product; otherwise
  a ValueError names the dimension.
  """
  table = {r[0]: r[1] for r in rules}
  spec, used = [], set()
  for i, name in enumerate(logical):
    axes = table.get(name)
    if axes is None:
      spec.append(None)
      continue
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    axes = tuple(a for a in axes if mesh.shape[a] > 1 and a not in used)
    if not axes:
      spec.append(None)
      continue
    size = math.prod(mesh.shape[a] for a in axes)
    if shape is not None and shape[i] % size:
      raise ValueError(
        f"logical axis {name!r} of size {shape[i]} is not divisible by mesh axes "
        f"{axes} of size {size}; change the layout rules or the model size"
      )
    used.update(axes)
    spec.append(axes[0] if len(axes) == 1 else axes)
  return PartitionSpec(*spec)


def tree_shardings(logical_tree, shapes_tree, rules, mesh):
  """NamedShardings for a pytree of parameters from their logical axes."""
  is_leaf = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)
  return jax.tree.map(
    lambda names, s: NamedSharding(mesh, logical_to_spec(names, rules, mesh, s.shape)),
    logical_tree,
    shapes_tree,
    is_leaf=is_leaf,
  )


def batch_sharding(mesh, rules, ndim: int = 2) -> NamedSharding:
  """Sharding of a [B, ...] batch array: batch over the 'batch' rule's axes."""
  return NamedSharding(mesh, logical_to_spec(("batch",) + (None,) * (ndim - 1), rules, mesh))


def rows_sharding(mesh, rules, ndim: int = 1) -> NamedSharding:
  """Sharding of a [rows, ...] decoding array (prompts, lengths): rows by the 'rows' rule."""
  return NamedSharding(mesh, logical_to_spec(("rows",) + (None,) * (ndim - 1), rules, mesh))


def shard_rows(tree, mesh, rules):
  """Every [rows, ...] leaf placed with its rows sharded by the 'rows' rule (host leaves the same
  on every process of a multi-process run)."""
  from specdraft.parallel import multihost

  return multihost.put_tree(tree, jax.tree.map(lambda x: rows_sharding(mesh, rules, x.ndim), tree))


def shard_batch(tree, mesh, rules):
  """Every [B, ...] leaf placed with its batch dimension sharded by the 'batch' rule."""
  from specdraft.parallel import multihost

  return multihost.put_tree(tree, jax.tree.map(lambda x: batch_sharding(mesh, rules, x.ndim), tree))


def activation_constraint(mesh, rules=None):
  """constrain(x) for the policy trunk's activations [B, ...] under `mesh`, or None on one device.

  The residual stream is pinned to rows over the 'batch' rule's axes (data, fsdp) and nothing
  else: its width is never sharded, so a layer's weights sharded over fsdp are all-gathered for
  their matmuls (the FSDP pattern) and tensor-parallel weights leave a partial sum that is
  all-reduced back to whole rows (Megatron's), instead of the compiler resharding or all-reducing
  activations as wide as the batch. Without it XLA's sharding propagation follows the weights
  into the activations (the 'embed' rule shards weights' width over fsdp), which at scale moves
  activations, not weights. Inside the cp and pp steps' shard_maps it pins the stream too, over
  the batch axes that are still automatic there."""
  if mesh is None or mesh.size == 1:
    return None
  axes = _batch_axes(mesh, rules)

  def constrain(x):
    # inside the cp and pp steps' shard_maps the manual axes are left out (they already split
    # the array)
    manual, target = _traced_in(mesh)
    if not _automatic_split(mesh, manual):
      return x  # every axis of size > 1 is manual here: nothing for the compiler to choose
    keep = tuple(a for a in axes if mesh.shape[a] > 1 and a not in manual)
    rows = math.prod(mesh.shape[a] for a in keep)
    if x.shape[0] % max(rows, 1):
      keep = ()
    first = None if not keep else (keep[0] if len(keep) == 1 else keep)
    spec = PartitionSpec(first, *([None] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(target, spec))

  return constrain


def metadata_constraint(mesh):
  """whole(x) for the attention's mask metadata (positions and segment ids [B, L], int32) under
  `mesh`: the array replicated over every automatic mesh axis (a manual axis, cp inside the
  steps' shard_maps, keeps splitting it), or None on one device.

  The attention's tile loops skip a (query tile, key tile) pair when no row of the batch sees
  any of its keys, a test over the whole batch. With the batch split over data or fsdp that
  test became an all-reduce inside the innermost loops, one per tile pair, per layer, per ring
  step, in the forward and the backward: latency on every accelerator, and on the CPU runtime
  small collectives over the batch axes interleaved with the ring's permutes (the rendezvous
  aborts tp2_cp2_dp2 and pp2_cp2_dp2 had). With the metadata whole on every device (gathered
  outside the loops: once per step for the batch's own arrays, `train.sequence._once_per_step`)
  the test is local, decided alike on every device, and nothing in the loops communicates but
  the ring itself."""
  if mesh is None or mesh.size == 1:
    return None

  def whole(x):
    manual, target = _traced_in(mesh)
    if not _automatic_split(mesh, manual):
      return x  # already whole wherever the compiler could split it
    return jax.lax.with_sharding_constraint(x, NamedSharding(target, PartitionSpec()))

  return whole


def _traced_in(mesh) -> tuple[set, object]:
  """(the mesh axes that are manual where this is traced, the mesh a sharding there names): the
  abstract mesh inside a shard_map (the cp and pp steps), else `mesh` itself."""
  am = jax.sharding.get_abstract_mesh()
  return (set(), mesh) if am.empty else (set(am.manual_axes), am)


def _automatic_split(mesh, manual) -> bool:
  """Whether an axis of size > 1 of `mesh` is automatic (not in `manual`) where this is traced."""
  return any(size > 1 and name not in manual for name, size in mesh.shape.items())


def _batch_axes(mesh, rules=None) -> tuple[str, ...]:
  table = {r[0]: r[1] for r in (rules if rules is not None else DEFAULT_RULES)}
  axes = table.get("batch")
  return () if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))


def rows_local(mesh, rules=None):
  """run(fn, params, xs) -> fn(params, *xs) with the rows of every x (axis 0) local to each
  device of the 'batch' rule's axes (a shard_map manual over them), `params` (a pytree) whole
  on every device; or None on one device.

  For a loop over sequence chunks that reads weights (the vocabulary-sized head): inside, each
  device accumulates its own rows' contribution to the weights' gradient, and the shard_map's
  boundary sums it over the devices once (its transpose of an input whole on every device),
  where the compiler, left to itself, reduces a weight-sized gradient on every iteration of the
  loop (and gathers the weight on every iteration too). Inside the cp steps' shard_map it nests,
  manual over the batch axes that are automatic there, and so in the pipelined steps' (whose
  shard_map leaves varying axes unchecked for it: the cotangents it returns carry no
  annotations)."""
  if mesh is None or mesh.size == 1:
    return None
  axes = _batch_axes(mesh, rules)

  def run(fn, params, xs):
    # inside the cp step's shard_map: nested in it, manual over the batch axes still automatic
    manual, target = _traced_in(mesh)
    keep = tuple(a for a in axes if mesh.shape[a] > 1 and a not in manual)
    rows = math.prod(mesh.shape[a] for a in keep)
    if not keep or any(x.shape[0] % rows for x in xs):
      return fn(params, *xs)
    spec = PartitionSpec(keep[0] if len(keep) == 1 else keep)
    return jax.shard_map(
      fn,
      mesh=target,
      in_specs=(PartitionSpec(), *(spec for _ in xs)),
      out_specs=spec,
      axis_names=set(keep),
      check_vma=False,
    )(params, *xs)

  return run
