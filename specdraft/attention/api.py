"""Public entry point for trunk + branch attention, with input checks before anything compiles."""

from __future__ import annotations

import numpy as np

from specdraft.attention import reference

IMPLS = ("dense", "ring", "allgather")
BRANCHES = ("ttt", "block")


def check_branch_shapes(q_BSHD, k_BSKD, v_BSKD, q_BSWHD, k_BSWKD, v_BSWKD, segment_ids_BS, branch):
  """Raises ValueError naming the offending argument when shapes or options do not fit."""
  if branch not in BRANCHES:
    raise ValueError(f"branch={branch!r} is not valid; expected one of {BRANCHES}")
  if q_BSHD.ndim != 4:
    raise ValueError(f"q must be [B,S,H,D], got shape {q_BSHD.shape}")
  B, S, H, D = q_BSHD.shape
  if (
    k_BSKD.shape != v_BSKD.shape
    or k_BSKD.ndim != 4
    or k_BSKD.shape[:2] != (B, S)
    or k_BSKD.shape[3] != D
  ):
    raise ValueError(
      f"k and v must be [B,S,K,D]=[{B},{S},K,{D}], got k{k_BSKD.shape} v{v_BSKD.shape}"
    )
  K = k_BSKD.shape[2]
  if H % K:
    raise ValueError(f"query heads H={H} must be a multiple of kv heads K={K} (GQA)")
  if q_BSWHD.ndim != 5 or q_BSWHD.shape[:2] != (B, S) or q_BSWHD.shape[3:] != (H, D):
    raise ValueError(f"q_br must be [B,S,W,H,D]=[{B},{S},W,{H},{D}], got {q_BSWHD.shape}")
  W = q_BSWHD.shape[2]
  want = (B, S, W, K, D)
  if k_BSWKD.shape != want or v_BSWKD.shape != want:
    raise ValueError(
      f"k_br and v_br must be [B,S,W,K,D]={want}, got k_br{k_BSWKD.shape} v_br{v_BSWKD.shape}"
    )
  if segment_ids_BS.shape != (B, S):
    raise ValueError(f"segment_ids must be [B,S]=[{B},{S}], got {segment_ids_BS.shape}")


def branch_attention(
  q_BSHD,
  k_BSKD,
  v_BSKD,
  q_BSWHD,
  k_BSWKD,
  v_BSWKD,
  segment_ids_BS,
  *,
  branch,
  impl="dense",
  mesh=None,
  cp_axis="cp",
):
  """Trunk + branch attention (docs/design.md "Branch attention").

  Args (natural token order): q [B,S,H,D]; k, v [B,S,K,D]; q_br [B,S,W,H,D];
    k_br, v_br [B,S,W,K,D]; segment_ids [B,S] int32 (0 = padding).
    branch: "ttt" (EAGLE-3 training-time test) or "block" (DFlash / DSpark).
    impl: "dense" (the float32 oracle), "ring" (zigzag ring over `cp_axis`, custom backward) or
    "allgather" (trunk K/V gathered once).
    mesh, cp_axis: the mesh and its context-parallel axis, for the sharded implementations.
  Returns (out [B,S,H,D], out_br [B,S,W,H,D]) in q's dtype.
  """
  check_branch_shapes(q_BSHD, k_BSKD, v_BSKD, q_BSWHD, k_BSWKD, v_BSWKD, segment_ids_BS, branch)
  if impl not in IMPLS:
    raise ValueError(f"impl={impl!r} is not available; expected one of {IMPLS}")
  if impl in ("ring", "allgather"):
    return context_parallel(
      q_BSHD,
      k_BSKD,
      v_BSKD,
      q_BSWHD,
      k_BSWKD,
      v_BSWKD,
      segment_ids_BS,
      branch=branch,
      impl=impl,
      mesh=mesh,
      cp_axis=cp_axis,
    )
  if q_BSWHD.shape[2] == 0:  # no branch entries: trunk only
    out = reference.causal_attention(q_BSHD, k_BSKD, v_BSKD, segment_ids_BS)
    return out, q_BSWHD
  out, out_br, _, _ = reference.branch_attention_dense(
    q_BSHD, k_BSKD, v_BSKD, q_BSWHD, k_BSWKD, v_BSWKD, segment_ids_BS, branch=branch
  )
  return out.astype(q_BSHD.dtype), out_br.astype(q_BSWHD.dtype)


def context_parallel(
  q_BSHD,
  k_BSKD,
  v_BSKD,
  q_BSWHD,
  k_BSWKD,
  v_BSWKD,
  segment_ids_BS,
  *,
  branch,
  impl,
  mesh,
  cp_axis="cp",
  tile=512,
  custom_grad=True,
  order="zigzag",
  kernel=None,
  **ring_options,
):
  """Natural-order global arrays in, natural-order out: pads S to a multiple of 2*cp, puts the
  rows in `order` once, runs the per-shard program under shard_map over `cp_axis`, and undoes the
  order. The model path calls the per-shard functions directly instead.

  order: "zigzag" (the whole row cut into 2*cp chunks) or "document" (the cut made per
  document, for packed rows; segment ids must then be a host array whose documents, padding
  runs included, are multiples of 2*cp tokens long). kernel: None (the XLA tiles) or a
  `kernels.KernelSettings`: every block through the fused Pallas kernel (the ring of
  `kernels/ring.py`, or the all-gather path's block)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec

  from specdraft.attention import ring
  from specdraft.parallel import zigzag

  if mesh is None or cp_axis not in mesh.shape:
    raise ValueError(f"impl={impl!r} needs a mesh with a {cp_axis!r} axis (got mesh={mesh})")
  cp = mesh.shape[cp_axis]
  B, S = segment_ids_BS.shape
  S_pad = zigzag.padded_length(S, cp)
  pos_BS = jnp.broadcast_to(jnp.arange(S_pad, dtype=jnp.int32), (B, S_pad))
  perm_BS = _order_permutation(order, segment_ids_BS, S_pad, cp)
  lay = lambda x: _take_rows(zigzag.pad(x, S_pad), perm_BS)
  args = [
    lay(x)
    for x in (q_BSHD, k_BSKD, v_BSKD, q_BSWHD, k_BSWKD, v_BSWKD, segment_ids_BS.astype(jnp.int32))
  ]
  args.append(_take_rows(pos_BS, perm_BS))
  body = ring.ring_attention_shard if impl == "ring" else ring.allgather_attention_shard
  kw = dict(branch=branch, axis_name=cp_axis, cp=cp, tile=tile)
  if kernel is not None and (ring_options or not custom_grad):
    raise ValueError(
      f"{sorted(ring_options) + ['custom_grad'] * (not custom_grad)} apply to the XLA tiles' "
      "ring only (kernel given)"
    )
  if impl == "ring" and kernel is not None:
    from specdraft.attention.kernels import ring as kernel_ring

    body = kernel_ring.ring_attention_shard
    kw = dict(branch=branch, axis_name=cp_axis, cp=cp, settings=kernel)
  elif impl == "ring":
    kw.update(custom_grad=custom_grad, **ring_options)  # accumulate_dtype, skip_empty
  elif ring_options:
    raise ValueError(f"{sorted(ring_options)} apply to impl='ring' only (impl={impl!r})")
  else:
    kw.update(kernel=kernel)
  spec = PartitionSpec(None, cp_axis)  # every per-token array is sharded on its sequence axis
  fn = jax.shard_map(
    lambda *a: body(*a, **kw),
    mesh=mesh,
    in_specs=(spec,) * 8,
    out_specs=(spec, spec),
    check_vma=False,
  )
  out, out_br = fn(*args)
  inverse_BS = np.argsort(perm_BS, axis=1)
  unlay = lambda x: _take_rows(x, inverse_BS)[:, :S]
  return unlay(out), unlay(out_br)


ORDERS = ("zigzag", "document")  # the token orders of context_parallel


def _order_permutation(order, segment_ids_BS, S_pad: int, cp: int):
  """[B, S_pad] host indices: row b in `order` is row b of the padded natural order at
  perm[b]."""
  from specdraft.parallel import zigzag

  B = segment_ids_BS.shape[0]
  if order == "zigzag":
    return np.broadcast_to(zigzag.permutation(S_pad, cp), (B, S_pad))
  if order != "document":
    raise ValueError(f"order={order!r} is not valid; expected one of {ORDERS}")
  try:
    seg = np.asarray(segment_ids_BS)
  except Exception as e:  # a tracer: the order is made on the host, once per batch
    raise ValueError(
      "order='document' reads each row's documents from its segment ids, which must be a host "
      "(numpy or committed) array, not a traced value"
    ) from e
  seg = np.pad(seg, [(0, 0), (0, S_pad - seg.shape[1])])
  return np.stack([zigzag.document_permutation(zigzag.document_lengths(row), cp) for row in seg])


def _take_rows(x, perm_BS):
  import jax.numpy as jnp

  idx = jnp.asarray(perm_BS).reshape(perm_BS.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, idx, axis=1)
