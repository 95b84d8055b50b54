"""Context-parallel trunk + branch attention: zigzag ring (and all-gather) per-shard programs.

"Trunk rides the ring, branch stays local": trunk K/V (with their global positions and segment
ids) rotate by ppermute; each ring step yields a partial (out, lse) for the local trunk AND
branch queries (a branch query (t, j) sees trunk keys like its anchor t, strictly before t for
"block"); branch K/V never enter a collective and are attended locally; all parts merge exactly
through their LSE in float32. Zigzag balance: after step 0 (local causal, 3 sub-blocks) every
step computes exactly two chunk-by-chunk sub-blocks on every rank:
  source < rank: (local chunk 1, incoming chunk 1) and (local chunk 2, incoming chunk 1)
  source > rank: (local chunk 2, incoming chunk 1) and (local chunk 2, incoming chunk 2)
The backward (jax.custom_vjp) is a second ring pass in which dK/dV accumulators travel with their
K/V and return to the owner with one more ppermute; branch gradients are local, from the merged
LSE.

Shape letters (local): B batch, L local rows (= 2 chunks of c), W branch width, R = 1 + W query
rows per anchor, H/K heads, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specdraft.attention import blockwise as bw


def _query_rows(q_BLHD, q_BLWHD, pos_BL, seg_BL, branch):
  """All queries of an anchor as consecutive rows: [B, L*R, H, D] and their mask metadata."""
  B, L, H, D = q_BLHD.shape
  W = q_BLWHD.shape[2]
  R = 1 + W
  q = jnp.concatenate([q_BLHD[:, :, None], q_BLWHD.astype(q_BLHD.dtype)], axis=2)
  strict = jnp.asarray([0] + [int(branch == "block")] * W, jnp.int32)
  rows = bw.Rows(
    jnp.repeat(pos_BL, R, axis=1),
    jnp.repeat(seg_BL, R, axis=1),
    jnp.broadcast_to(jnp.tile(strict, L), (B, L * R)),
  )
  return q.reshape(B, L * R, H, D), rows


def _take(rows: bw.Rows, sl):
  return bw.Rows(*(None if a is None else a[:, sl] for a in rows))


def _dyn(x, start, size, axis=1):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _dyn_rows(rows: bw.Rows, start, size):
  return bw.Rows(*(None if a is None else _dyn(a, start, size) for a in rows))


def _halves(kv, c):
  """Split local (k, v, rows) into its two zigzag chunks."""
  k, v, kr = kv
  return (
    (k[:, :c], v[:, :c], _take(kr, slice(0, c))),
    (k[:, c:], v[:, c:], _take(kr, slice(c, None))),
  )


def _ring_forward(q, k, v, q_br, k_br, v_br, seg, pos, *, branch, axis_name, cp, tile):
  B, L, H, D = q.shape
  W = q_br.shape[2]
  R, c = 1 + W, L // 2
  qa, qrows = _query_rows(q, q_br, pos, seg, branch)
  q1, q2 = qa[:, : c * R], qa[:, c * R :]
  r1, r2 = _take(qrows, slice(0, c * R)), _take(qrows, slice(c * R, None))
  blk = functools.partial(bw.blk, tile_q=tile, tile_k=tile)
  kv = (k, v, bw.Rows(pos, seg))
  rank = jax.lax.axis_index(axis_name) if cp > 1 else 0

  # step 0, local causal: (1,1), (2,1), (2,2); (1,2) is entirely in the future
  h1, h2 = _halves(kv, c)
  acc1 = blk(q1, h1[0], h1[1], r1, h1[2])
  acc2 = bw.merge(*blk(q2, h1[0], h1[1], r2, h1[2]), *blk(q2, h2[0], h2[1], r2, h2[2]))
  acc = (jnp.concatenate([acc1[0], acc2[0]], axis=1), jnp.concatenate([acc1[1], acc2[1]], axis=2))
  perm = [(j, (j + 1) % cp) for j in range(cp)]
  n1 = c * R

  def ring_step(carry, i):
    """Receive the previous rank's K/V (source = rank - i) and compute two sub-blocks.

    The chunk choices are dynamic slices (not selects), so the float32 accumulators are updated
    in place and no chunk-sized copies are made."""
    kv, (out_acc, lse_acc) = carry
    kv = jax.lax.ppermute(kv, axis_name, perm)
    k_, v_, kr = kv
    early = (rank - i) % cp < rank  # the source rank precedes this one
    off_q = jnp.where(early, 0, n1)  # local chunk that meets incoming chunk 1
    off_k = jnp.where(early, 0, c)  # incoming chunk that local chunk 2 meets (besides chunk 1)
    p1 = blk(
      _dyn(qa, off_q, n1), k_[:, :c], v_[:, :c], _dyn_rows(qrows, off_q, n1), _take(kr, slice(0, c))
    )
    p2 = blk(q2, _dyn(k_, off_k, c), _dyn(v_, off_k, c), r2, _dyn_rows(kr, off_k, c))
    m = bw.merge(_dyn(out_acc, off_q, n1), _dyn(lse_acc, off_q, n1, axis=2), *p1)
    out_acc = jax.lax.dynamic_update_slice_in_dim(out_acc, m[0], off_q, axis=1)
    lse_acc = jax.lax.dynamic_update_slice_in_dim(lse_acc, m[1], off_q, axis=2)
    m = bw.merge(out_acc[:, n1:], lse_acc[:, :, n1:], *p2)
    return (kv, (out_acc.at[:, n1:].set(m[0]), lse_acc.at[:, :, n1:].set(m[1]))), None

  if cp > 1:  # a scan, not an unrolled loop, so every step reuses the same buffers
    (_, acc), _ = jax.lax.scan(ring_step, (kv, acc), jnp.arange(1, cp))
  out = acc[0].reshape(B, L, R, H, D)
  lse = acc[1].reshape(B, H, L, R)
  if W:
    o_bl, l_bl = bw.branch_local(q_br, k_br, v_br, seg, branch)
    # merge expects [B,T,H,D] / [B,H,T]: flatten (L, W) into T
    o_br, l_br = bw.merge(
      out[:, :, 1:].reshape(B, L * W, H, D),
      lse[..., 1:].reshape(B, H, L * W),
      o_bl.reshape(B, L * W, H, D),
      l_bl.reshape(B, H, L * W),
    )
    out = jnp.concatenate([out[:, :, :1], o_br.reshape(B, L, W, H, D)], axis=2)
    lse = jnp.concatenate([lse[..., :1], l_br.reshape(B, H, L, W)], axis=-1)
  return out, lse


def ring_attention_shard(
  q, k, v, q_br, k_br, v_br, seg, pos, *, branch, axis_name, cp, tile=512, custom_grad=True
):
  """Per-device zigzag ring trunk + local branch attention (call inside shard_map).

  Local arrays in zigzag layout: q [B,L,H,D], k/v [B,L,K,D], q_br [B,L,W,H,D], k_br/v_br
  [B,L,W,K,D], seg/pos [B,L] (global positions). Returns (out [B,L,H,D], out_br [B,L,W,H,D]) in
  q's dtype; accumulation is float32 throughout. `custom_grad=False` differentiates through the
  ring by autodiff (the reference for the custom backward).
  """
  if q.shape[1] % 2:
    raise ValueError(f"local length {q.shape[1]} must be two equal zigzag chunks (S % 2cp == 0)")
  f = _ring_vjp if custom_grad else _ring_plain
  out_all = f(q, k, v, q_br, k_br, v_br, seg, pos, branch, axis_name, cp, tile)
  return out_all[:, :, 0].astype(q.dtype), out_all[:, :, 1:].astype(q_br.dtype)


def _ring_plain(q, k, v, q_br, k_br, v_br, seg, pos, branch, axis_name, cp, tile):
  return _ring_forward(
    q, k, v, q_br, k_br, v_br, seg, pos, branch=branch, axis_name=axis_name, cp=cp, tile=tile
  )[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11))
def _ring_vjp(q, k, v, q_br, k_br, v_br, seg, pos, branch, axis_name, cp, tile):
  return _ring_plain(q, k, v, q_br, k_br, v_br, seg, pos, branch, axis_name, cp, tile)


def _ring_vjp_fwd(q, k, v, q_br, k_br, v_br, seg, pos, branch, axis_name, cp, tile):
  out, lse = _ring_forward(
    q, k, v, q_br, k_br, v_br, seg, pos, branch=branch, axis_name=axis_name, cp=cp, tile=tile
  )
  return out, (q, k, v, q_br, k_br, v_br, seg, pos, out, lse)


def _ring_vjp_bwd(branch, axis_name, cp, tile, res, dout):
  q, k, v, q_br, k_br, v_br, seg, pos, out, lse = res
  B, L, H, D = q.shape
  W = q_br.shape[2]
  R = 1 + W
  dout = dout.astype(jnp.float32)
  delta = jnp.moveaxis(jnp.sum(dout * out, axis=-1), 3, 1)  # [B,H,L,R]
  dq, dkv = _ring_trunk_bwd(
    q, k, v, q_br, seg, pos, dout, lse, delta, branch=branch, axis_name=axis_name, cp=cp, tile=tile
  )
  dq_rows = dq.reshape(B, L, R, H, D)
  dq, dq_br = dq_rows[:, :, 0], dq_rows[:, :, 1:]
  if W:
    g_bl = bw.branch_local_bwd(
      q_br, k_br, v_br, seg, branch, dout[:, :, 1:], lse[..., 1:], delta[..., 1:]
    )
    dq_br = dq_br + g_bl[0]
    dk_br, dv_br = g_bl[1], g_bl[2]
  else:
    dk_br, dv_br = jnp.zeros_like(k_br, jnp.float32), jnp.zeros_like(v_br, jnp.float32)
  cast = lambda g, x: g.astype(x.dtype)
  return (
    cast(dq, q),
    cast(dkv[0], k),
    cast(dkv[1], v),
    cast(dq_br, q_br),
    cast(dk_br, k_br),
    cast(dv_br, v_br),
    None,
    None,
  )


def _ring_trunk_bwd(q, k, v, q_br, seg, pos, dout, lse, delta, *, branch, axis_name, cp, tile):
  """The second ring pass: dq of every local query row (trunk and branch) against the trunk
  keys, and dK/dV of this rank's trunk keys (accumulated while they travel, then returned)."""
  B, L, H, D = q.shape
  W = q_br.shape[2]
  R, c = 1 + W, L // 2
  qa, qrows = _query_rows(q, q_br, pos, seg, branch)
  do_rows = dout.reshape(B, L * R, H, D)
  lse_rows, delta_rows = lse.reshape(B, H, L * R), delta.reshape(B, H, L * R)
  n1 = c * R
  part = lambda x, s: x[:, s] if x.ndim != 3 else x[:, :, s]
  s1, s2 = slice(0, n1), slice(n1, None)
  q1, q2 = qa[:, s1], qa[:, s2]
  r1, r2 = _take(qrows, s1), _take(qrows, s2)
  g1 = (do_rows[:, s1], part(lse_rows, s1), part(delta_rows, s1))
  g2 = (do_rows[:, s2], part(lse_rows, s2), part(delta_rows, s2))
  bwd = functools.partial(bw.blk_bwd, tile_q=tile, tile_k=tile)
  rank = jax.lax.axis_index(axis_name) if cp > 1 else 0
  kv = (k, v, bw.Rows(pos, seg))
  perm = [(j, (j + 1) % cp) for j in range(cp)]
  cat = lambda a, b: jnp.concatenate([a, b], axis=1)

  # step 0, local: (1,1), (2,1), (2,2)
  h1, h2 = _halves(kv, c)
  a = bwd(q1, *h1[:2], r1, h1[2], *g1)
  b = bwd(q2, *h1[:2], r2, h1[2], *g2)
  d = bwd(q2, *h2[:2], r2, h2[2], *g2)
  dq1, dq2 = a[0], b[0] + d[0]
  dkv = (cat(a[1] + b[1], d[1]), cat(a[2] + b[2], d[2]))

  dq = jnp.concatenate([dq1, dq2], axis=1)
  g_all = (do_rows, lse_rows, delta_rows)

  def ring_step(carry, i):
    """K/V of source rank - i arrive with their dK/dV accumulators; add this rank's share.
    Chunk choices are dynamic slices so accumulators update in place."""
    kv, (dk, dv), dq = carry
    kv, (dk, dv) = jax.lax.ppermute((kv, (dk, dv)), axis_name, perm)
    k_, v_, kr = kv
    early = (rank - i) % cp < rank
    off_q = jnp.where(early, 0, n1)
    off_k = jnp.where(early, 0, c)
    ga_ = (
      _dyn(g_all[0], off_q, n1),
      _dyn(g_all[1], off_q, n1, axis=2),
      _dyn(g_all[2], off_q, n1, axis=2),
    )
    a = bwd(
      _dyn(qa, off_q, n1),
      k_[:, :c],
      v_[:, :c],
      _dyn_rows(qrows, off_q, n1),
      _take(kr, slice(0, c)),
      *ga_,
    )
    b = bwd(q2, _dyn(k_, off_k, c), _dyn(v_, off_k, c), r2, _dyn_rows(kr, off_k, c), *g2)
    upd = lambda x, d, off, n: jax.lax.dynamic_update_slice_in_dim(x, _dyn(x, off, n) + d, off, 1)
    dq = upd(dq, a[0], off_q, n1).at[:, n1:].add(b[0])
    dk = upd(dk.at[:, :c].add(a[1]), b[1], off_k, c)
    dv = upd(dv.at[:, :c].add(a[2]), b[2], off_k, c)
    return (kv, (dk, dv), dq), None

  if cp > 1:
    (_, dkv, dq), _ = jax.lax.scan(ring_step, (kv, dkv, dq), jnp.arange(1, cp))
    dkv = jax.lax.ppermute(dkv, axis_name, perm)  # the last hop returns them to the owner
  return dq, dkv


_ring_vjp.defvjp(_ring_vjp_fwd, _ring_vjp_bwd)


def allgather_attention_shard(
  q, k, v, q_br, k_br, v_br, seg, pos, *, branch, axis_name, cp, tile=512
):
  """Baseline: gather the trunk K/V once, attend locally (autodiff backward)."""
  B, L, H, D = q.shape
  W = q_br.shape[2]
  R = 1 + W
  if cp > 1:
    g = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
    k_all, v_all, kr = g(k), g(v), bw.Rows(g(pos), g(seg))
  else:
    k_all, v_all, kr = k, v, bw.Rows(pos, seg)
  qa, qrows = _query_rows(q, q_br, pos, seg, branch)
  out, lse = bw.blk(qa, k_all, v_all, qrows, kr, tile_q=tile, tile_k=tile)
  out = out.reshape(B, L, R, H, D)
  lse = lse.reshape(B, H, L, R)
  if W:
    o_bl, l_bl = bw.branch_local(q_br, k_br, v_br, seg, branch)
    o_br, _ = bw.merge(
      out[:, :, 1:].reshape(B, L * W, H, D),
      lse[..., 1:].reshape(B, H, L * W),
      o_bl.reshape(B, L * W, H, D),
      l_bl.reshape(B, H, L * W),
    )
    out = jnp.concatenate([out[:, :, :1], o_br.reshape(B, L, W, H, D)], axis=2)
  return out[:, :, 0].astype(q.dtype), out[:, :, 1:].astype(q_br.dtype)
