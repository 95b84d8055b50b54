"""Context-parallel trunk + branch attention: the ring (and the all-gather baseline), per shard.

"Trunk rides the ring, branch stays local": trunk K/V (with their global positions and segment
ids) rotate around the `cp` ring by ppermute; every local query row (the trunk query of an anchor
and its W branch queries; a branch query (t, j) sees trunk keys like its anchor t, strictly before
t for "block") meets every K/V block once; branch K/V never enter a collective and are attended
where they live. Everything is one flash-style online softmax over float32 state that lives
across the ring steps, so nothing is merged after the fact.

Memory. One `jax.custom_vjp` covers the whole ring. The forward keeps, per query row and head,
the running max and sum and a float32 numerator (the only query-sized float32 buffer), and returns
the outputs in the input dtype; the backward saves only the inputs, the outputs (input dtype) and
one float32 log-sum-exp per row and head, and keeps one float32 dq accumulator across its ring
steps (dK/dV accumulators travel with their K/V and are trunk-sized). Queries are gathered into
rows tile by tile (never a `[B, L*R, H, D]` copy), every tile is upcast on its own, and the state
is updated in place by dynamic slices inside the loops, so temporaries are O(tile).

Work. The ring is agnostic of the token order: every (query tile, key tile) pair whose mask has no visible
entry (positions and segment ids decide) is skipped by `lax.cond`, in forward and backward, and
the pairs computed are counted by a counter carried through the schedule. In zigzag order
(rank r holds chunks r and 2cp-1-r) the skipped pairs leave each rank the same causal work; under a
contiguous order rank r computes r+1 blocks and the last rank waits for all of them.

Shape letters (local, per shard): B batch, L local anchors (two zigzag chunks of c), W branch
width, R = 1 + W query rows per anchor, H query heads, K kv heads, Q = H // K query heads per kv
head, D head dim, A anchors per query tile, T keys per key tile.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.attention import blockwise as bw

_MASKED = -1e30
_F32 = jnp.float32


class _Plan(NamedTuple):
  """Static sizes of one shard's problem."""

  B: int
  L: int
  W: int
  H: int
  K: int
  D: int
  A: int  # anchors per query tile
  T: int  # keys per key tile
  branch: str
  skip: bool  # skip (query tile, key tile) pairs with no visible entry

  @property
  def R(self):
    return 1 + self.W

  @property
  def Q(self):
    return self.H // self.K

  @property
  def strict_R(self):
    """Per query row of an anchor: 1 where trunk keys must be strictly earlier ("block")."""
    return np.asarray([0] + [int(self.branch == "block")] * self.W, np.int32)


def tile_sizes(L: int, W: int, tile: int) -> tuple[int, int]:
  """(anchors per query tile A, keys per key tile T) for L local rows: about `tile` query rows
  and `tile` keys, each dividing a zigzag chunk (L / 2) so no tile straddles the two chunks."""
  c = L // 2
  return bw.tile_size(c, max(1, tile // (1 + W))), bw.tile_size(c, tile)


def _plan(q_BLHD, k_BLKD, q_BLWHD, branch, tile, skip=True) -> _Plan:
  B, L, H, D = q_BLHD.shape
  K, W = k_BLKD.shape[2], q_BLWHD.shape[2]
  A, T = tile_sizes(L, W, tile)
  return _Plan(B, L, W, H, K, D, A, T, branch, skip)


def _dyn(x, start, size, axis=1):
  return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _tile_f32(x, start, size):
  """A tile of x upcast to float32.

  Call it only inside a `lax.cond` branch: in straight-line loop code XLA rewrites
  convert(slice(x)) as slice(convert(x)) and hoists a float32 copy of the WHOLE array out of the
  loop (gigabytes at long context); a conditional's branch is not hoisted from. Every tile load
  here sits in the branch that skips empty tiles anyway."""
  return _dyn(x, start, size).astype(_F32)


def _varying_axes(*xs) -> tuple[str, ...]:
  """Manual mesh axes any of xs varies over (inside a shard_map that checks them, e.g. a pipeline
  stage); empty outside."""
  axes = set()
  for x in xs:
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    axes |= set(mat.varying) if mat is not None else set()
  return tuple(sorted(axes))


def _vary(tree, axes):
  """Fresh state (zeros, counters) marked varying over `axes`, like the inputs it is updated from,
  so loop carries and both branches of each `lax.cond` keep one type."""

  def one(x):
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    missing = tuple(a for a in axes if mat is None or a not in mat.varying)
    return jax.lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(one, tree) if axes else tree


def _when(pred, fn, operand):
  """fn(operand) if pred else operand (a `lax.cond`; see `_tile_f32`)."""
  return jax.lax.cond(pred, fn, lambda x: x, operand)


def _live(seg_BL, a0, size):
  return (_dyn(seg_BL, a0, size) != 0).any()


def _skip_meta(whole, pos_BL, seg_BL):
  """(positions, segment ids) for the tile loops' skip tests, or None when they are the masks'
  own. A test asks whether ANY row of the batch sees a tile pair, so with the batch split over
  devices (data, fsdp: automatic axes) it would be an all-reduce in the innermost loop; `whole`
  (`parallel.mesh.metadata_constraint`) makes these copies whole on every device, gathered before
  the loops (and kept for the backward), so the test is local and decided alike everywhere. The
  masks themselves read the inputs as they are (each device its rows)."""
  if whole is None:
    return None
  meta = (whole(pos_BL), whole(seg_BL))
  return None if (meta[0] is pos_BL and meta[1] is seg_BL) else meta


def _skip_vis(pl: _Plan, vis_BAT, meta, kv, a0, t0):
  """The anchor-level visibility the skip test reads: `vis_BAT` itself when `meta` is None (the
  masks' own metadata), else the same test on the whole metadata (the key block's rides in
  kv[4:6])."""
  if meta is None:
    return vis_BAT
  q = (_dyn(meta[0], a0, pl.A), _dyn(meta[1], a0, pl.A))
  k = (_dyn(kv[4], t0, pl.T), _dyn(kv[5], t0, pl.T))
  return _visible_AT(pl, *q, *k)


def _put(x, update, start, axis=1):
  return jax.lax.dynamic_update_slice_in_dim(x, update.astype(x.dtype), start, axis=axis)


def _q_tile(pl: _Plan, q_BLHD, q_BLWHD, a0):
  """The R query rows of anchors [a0, a0 + A): [B, A, R, K, Q, D] float32."""
  q = _tile_f32(q_BLHD, a0, pl.A)[:, :, None]
  if pl.W:
    q = jnp.concatenate([q, _tile_f32(q_BLWHD, a0, pl.A)], axis=2)
  return q.reshape(pl.B, pl.A, pl.R, pl.K, pl.Q, pl.D)


def _rows_tile(pl: _Plan, x_BLRH, a0):
  """A slice of per-row state [B, L, R, H(, D)] as [B, A, R, K, Q(, D)]."""
  t = _dyn(x_BLRH, a0, pl.A)
  return t.reshape(t.shape[:3] + (pl.K, pl.Q) + t.shape[4:])


def _visible_AT(pl: _Plan, qpos_BA, qseg_BA, kpos_BT, kseg_BT):
  """Anchor-level trunk visibility [B, A, T] (strict = 0: a superset of every row's mask)."""
  same = (qseg_BA[:, :, None] == kseg_BT[:, None, :]) & (qseg_BA[:, :, None] != 0)
  return same & (kpos_BT[:, None, :] <= qpos_BA[:, :, None])


def _computed(pl: _Plan, vis_BAT):
  """Whether a tile pair is computed: it has a visible entry (or skipping is off)."""
  return vis_BAT.any() | (not pl.skip)


def _row_mask(pl: _Plan, vis_BAT, qpos_BA, kpos_BT):
  """Per query row [B, A, R, 1, 1, T]: block-branch rows also need k_pos < q_pos."""
  if pl.branch != "block" or not pl.W:
    return vis_BAT[:, :, None, None, None, :]
  earlier = kpos_BT[:, None, :] < qpos_BA[:, :, None]
  strict = jnp.asarray(pl.strict_R, bool)[None, None, :, None]
  m = vis_BAT[:, :, None] & (~strict | earlier[:, :, None])  # [B, A, R, T]
  return m[:, :, :, None, None, :]


def _online(state, s, mask, v_fn):
  """One online-softmax update of (m, l, acc) with scores s [..., T] under mask."""
  m, l, acc = state
  s = jnp.where(mask, s, _MASKED)
  m_new = jnp.maximum(m, s.max(-1))
  p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
  corr = jnp.exp(m - m_new)
  # with a float32 state (always, except in the test that shows why) these casts are no-ops
  l = (l * corr + p.sum(-1)).astype(l.dtype)
  acc = (acc * corr[..., None] + v_fn(p)).astype(acc.dtype)
  return m_new, l, acc


def _for(n, body, init):
  """A loop over n steps: a fori_loop (in-place updates of its carry) unless n == 1."""
  if n == 1:
    return body(0, init)
  return jax.lax.fori_loop(0, n, body, init)


# ----------------------------------------------------------------------------- forward


def _attend_trunk(pl: _Plan, q_BLHD, q_BLWHD, pos_BL, seg_BL, meta, state, count, kv):
  """Every local query tile against one trunk K/V block, skipping pairs with nothing visible
  (decided on `meta`, the skip test's metadata: `_skip_meta`)."""
  k_BLKD, v_BLKD, kpos_BL, kseg_BL = kv[:4]
  scale = pl.D**-0.5
  n_q, n_k = pl.L // pl.A, k_BLKD.shape[1] // pl.T

  def q_body(i, carry):
    (m_all, l_all, acc_all), count = carry
    a0 = i * pl.A
    qpos, qseg = _dyn(pos_BL, a0, pl.A), _dyn(seg_BL, a0, pl.A)
    st = tuple(_rows_tile(pl, x, a0) for x in (m_all, l_all, acc_all))

    def k_body(j, carry):
      st, count = carry
      t0 = j * pl.T
      kpos, kseg = _dyn(kpos_BL, t0, pl.T), _dyn(kseg_BL, t0, pl.T)
      vis = _visible_AT(pl, qpos, qseg, kpos, kseg)

      def compute(st):
        q_t = _q_tile(pl, q_BLHD, q_BLWHD, a0)
        k_t = _tile_f32(k_BLKD, t0, pl.T)
        v_t = _tile_f32(v_BLKD, t0, pl.T)
        s = jnp.einsum("barknd,btkd->barknt", q_t, k_t) * scale
        mask = _row_mask(pl, vis, qpos, kpos)
        return _online(st, s, mask, lambda p: jnp.einsum("barknt,btkd->barknd", p, v_t))

      any_vis = _computed(pl, _skip_vis(pl, vis, meta, kv, a0, t0))
      st = _when(any_vis, compute, st)
      return st, count + any_vis.astype(jnp.int32)

    st, count = _for(n_k, k_body, (st, count))
    new = tuple(
      _put(x, t.reshape(t.shape[:3] + (pl.H,) + t.shape[5:]), a0)
      for x, t in zip((m_all, l_all, acc_all), st)
    )
    return new, count

  return _for(n_q, q_body, (state, count))


def _branch_scores(pl: _Plan, q_BLWHD, k_BLWKD, seg_BL, a0):
  """Branch queries of anchors [a0, a0+A) against their own branch keys: scores and mask."""
  q_t = _tile_f32(q_BLWHD, a0, pl.A).reshape(pl.B, pl.A, pl.W, pl.K, pl.Q, pl.D)
  k_t = _tile_f32(k_BLWKD, a0, pl.A)
  s = jnp.einsum("bajknd,baikd->bajkni", q_t, k_t) * pl.D**-0.5
  vis_WW = (
    np.tril(np.ones((pl.W, pl.W), bool)) if pl.branch == "ttt" else np.ones((pl.W,) * 2, bool)
  )
  live = _dyn(seg_BL, a0, pl.A) != 0
  mask = jnp.asarray(vis_WW)[None, None, :, None, None, :] & live[:, :, None, None, None, None]
  return q_t, k_t, s, mask


def _put_branch_rows(x_BLRH, t_BAWKQ, a0, pl: _Plan):
  """Writes branch rows (R index 1..W) of anchors [a0, a0+A) into per-row state."""
  t = t_BAWKQ.reshape(t_BAWKQ.shape[:3] + (pl.H,) + t_BAWKQ.shape[5:])
  start = (0, a0, 1) + (0,) * (x_BLRH.ndim - 3)
  return jax.lax.dynamic_update_slice(x_BLRH, t.astype(x_BLRH.dtype), start)


def _attend_branch(pl: _Plan, q_BLWHD, k_BLWKD, v_BLWKD, seg_BL, wseg_BL, state):
  """Each anchor's branch queries against its own branch keys (rank-local, no collective)."""

  def q_body(i, state):
    a0 = i * pl.A

    def compute(state):
      _, _, s, mask = _branch_scores(pl, q_BLWHD, k_BLWKD, seg_BL, a0)
      v_t = _tile_f32(v_BLWKD, a0, pl.A)
      st = tuple(_rows_tile(pl, x, a0)[:, :, 1:] for x in state)
      st = _online(st, s, mask, lambda p: jnp.einsum("bajkni,baikd->bajknd", p, v_t))
      return tuple(_put_branch_rows(x, t, a0, pl) for x, t in zip(state, st))

    return _when(_live(wseg_BL, a0, pl.A), compute, state)

  return _for(pl.L // pl.A, q_body, state)


def _forward(
  q,
  k,
  v,
  q_br,
  k_br,
  v_br,
  seg,
  pos,
  *,
  branch,
  axis_name,
  cp,
  tile,
  acc_dtype,
  skip=True,
  meta=None,
):
  """(out [B,L,H,D], out_br [B,L,W,H,D]) in the input dtype, lse [B,L,R,H] f32, tile pairs;
  `meta` from `_skip_meta` (None: the skip test reads seg and pos themselves)."""
  pl = _plan(q, k, q_br, branch, tile, skip)
  B, L, R, H, D = pl.B, pl.L, pl.R, pl.H, pl.D
  axes = _varying_axes(q, k, v, q_br, k_br, v_br, seg, pos)
  state = (
    jnp.full((B, L, R, H), _MASKED, _F32),
    jnp.zeros((B, L, R, H), acc_dtype),
    jnp.zeros((B, L, R, H, D), acc_dtype),
  )
  state, count = _vary((state, jnp.zeros((), jnp.int32)), axes)
  wseg = seg if meta is None else meta[1]
  if pl.W:
    state = _attend_branch(pl, q_br, k_br, v_br, seg, wseg, state)
  attend = functools.partial(_attend_trunk, pl, q, q_br, pos, seg, meta)
  kv = (k, v, pos, seg) + (meta or ())
  if cp > 1:
    perm = [(j, (j + 1) % cp) for j in range(cp)]

    def ring_step(carry, _):
      """Send this block on while attending to it (the next one arrives meanwhile)."""
      kv, state, count = carry
      nxt = jax.lax.ppermute(kv, axis_name, perm)
      state, count = attend(state, count, kv)
      return (nxt, state, count), None

    (kv, state, count), _ = jax.lax.scan(ring_step, (kv, state, count), None, length=cp - 1)
  (m, l, acc), count = attend(state, count, kv)
  ok = l > 0
  safe = jnp.where(ok, l, 1.0).astype(_F32)
  # normalise straight into the input dtype (one fusion each: no float32 output copy)
  out = (acc[:, :, 0] / safe[:, :, 0, :, None]).astype(q.dtype)
  out_br = (acc[:, :, 1:] / safe[:, :, 1:, :, None]).astype(q_br.dtype)
  lse = jnp.where(ok, m + jnp.log(safe), -jnp.inf)
  return out, out_br, lse, count


# ----------------------------------------------------------------------------- backward


def _pair_tile(pl: _Plan, pair, a0):
  """Rows of anchors [a0, a0+A) from a (trunk [B,L,H,D], branch [B,L,W,H,D]) pair of arrays:
  [B, A, R, K, Q, D] float32."""
  return _q_tile(pl, *pair, a0)


def _put_pair(pl: _Plan, pair, t_BARKND, a0):
  t = t_BARKND.reshape(pl.B, pl.A, pl.R, pl.H, pl.D)
  return _put(pair[0], t[:, :, 0], a0), _put(pair[1], t[:, :, 1:], a0)


def _delta_rows(pl: _Plan, dos, outs, wseg_BL, axes):
  """delta = rowsum(dO * O) per row and head, [B, L, R, H] float32, tile by tile."""

  def body(i, delta):
    a0 = i * pl.A

    def compute(delta):
      d = jnp.sum(_pair_tile(pl, dos, a0) * _pair_tile(pl, outs, a0), axis=-1)
      return _put(delta, d.reshape(pl.B, pl.A, pl.R, pl.H), a0)

    return _when(_live(wseg_BL, a0, pl.A), compute, delta)

  return _for(pl.L // pl.A, body, _vary(jnp.zeros((pl.B, pl.L, pl.R, pl.H), _F32), axes))


def _attend_trunk_bwd(pl: _Plan, qs, gs, pos_BL, seg_BL, meta, carry, kv):
  """dq of every local query tile, dK/dV of one trunk block; invisible pairs skipped (decided on
  `meta`, as in the forward)."""
  q_BLHD, q_BLWHD = qs
  do_BLHD, do_BLWHD, lse_BLRH, delta_BLRH = gs
  k_BLKD, v_BLKD, kpos_BL, kseg_BL = kv[:4]
  scale = pl.D**-0.5
  n_q, n_k = pl.L // pl.A, k_BLKD.shape[1] // pl.T

  def q_body(i, carry):
    dqs, dk, dv, count = carry
    a0 = i * pl.A
    lse_t, delta_t = _rows_tile(pl, lse_BLRH, a0), _rows_tile(pl, delta_BLRH, a0)
    finite = jnp.isfinite(lse_t)
    lse_t = jnp.where(finite, lse_t, 0.0)
    qpos, qseg = _dyn(pos_BL, a0, pl.A), _dyn(seg_BL, a0, pl.A)

    def k_body(j, carry):
      dq_t, dk, dv, count = carry
      t0 = j * pl.T
      kpos, kseg = _dyn(kpos_BL, t0, pl.T), _dyn(kseg_BL, t0, pl.T)
      vis = _visible_AT(pl, qpos, qseg, kpos, kseg)

      def compute(c):
        dq_t, dk, dv = c
        q_t = _q_tile(pl, q_BLHD, q_BLWHD, a0)
        do_t = _pair_tile(pl, (do_BLHD, do_BLWHD), a0)
        k_t = _tile_f32(k_BLKD, t0, pl.T)
        v_t = _tile_f32(v_BLKD, t0, pl.T)
        mask = _row_mask(pl, vis, qpos, kpos) & finite[..., None]
        s = jnp.einsum("barknd,btkd->barknt", q_t, k_t) * scale
        p = jnp.where(mask, jnp.exp(jnp.where(mask, s, 0.0) - lse_t[..., None]), 0.0)
        dp = jnp.einsum("barknd,btkd->barknt", do_t, v_t)
        ds = p * (dp - delta_t[..., None])
        dq_t = dq_t + jnp.einsum("barknt,btkd->barknd", ds, k_t) * scale
        dk_t = jnp.einsum("barknt,barknd->btkd", ds, q_t) * scale
        dv_t = jnp.einsum("barknt,barknd->btkd", p, do_t)
        dk = _put(dk, _dyn(dk, t0, pl.T) + dk_t, t0)
        dv = _put(dv, _dyn(dv, t0, pl.T) + dv_t, t0)
        return dq_t, dk, dv

      any_vis = _computed(pl, _skip_vis(pl, vis, meta, kv, a0, t0))
      dq_t, dk, dv = _when(any_vis, compute, (dq_t, dk, dv))
      return dq_t, dk, dv, count + any_vis.astype(jnp.int32)

    dq_t = _pair_tile(pl, dqs, a0)
    dq_t, dk, dv, count = _for(n_k, k_body, (dq_t, dk, dv, count))
    return _put_pair(pl, dqs, dq_t, a0), dk, dv, count

  return _for(n_q, q_body, carry)


def _branch_bwd(
  pl: _Plan,
  q_BLWHD,
  k_BLWKD,
  v_BLWKD,
  seg_BL,
  wseg_BL,
  do_BLWHD,
  lse_BLRH,
  delta_BLRH,
  dq_BLWHD,
  axes,
):
  """Closed-form gradients of the rank-local branch block from the final lse."""
  dk_br = _vary(jnp.zeros(k_BLWKD.shape, k_BLWKD.dtype), axes)
  dv_br = _vary(jnp.zeros(v_BLWKD.shape, v_BLWKD.dtype), axes)

  def q_body(i, carry):
    a0 = i * pl.A

    def compute(carry):
      dq, dk_br, dv_br = carry
      q_t, k_t, s, mask = _branch_scores(pl, q_BLWHD, k_BLWKD, seg_BL, a0)
      v_t = _tile_f32(v_BLWKD, a0, pl.A)
      do_t = _tile_f32(do_BLWHD, a0, pl.A).reshape(q_t.shape)
      lse_t = _rows_tile(pl, lse_BLRH, a0)[:, :, 1:]
      delta_t = _rows_tile(pl, delta_BLRH, a0)[:, :, 1:]
      finite = jnp.isfinite(lse_t)
      mask = mask & finite[..., None]
      lse_t = jnp.where(finite, lse_t, 0.0)
      p = jnp.where(mask, jnp.exp(jnp.where(mask, s, 0.0) - lse_t[..., None]), 0.0)
      dp = jnp.einsum("bajknd,baikd->bajkni", do_t, v_t)
      ds = p * (dp - delta_t[..., None])
      scale = pl.D**-0.5
      dq_t = jnp.einsum("bajkni,baikd->bajknd", ds, k_t) * scale
      dq = _put(dq, _dyn(dq, a0, pl.A) + dq_t.reshape(pl.B, pl.A, pl.W, pl.H, pl.D), a0)
      dk_br = _put(dk_br, jnp.einsum("bajkni,bajknd->baikd", ds, q_t) * scale, a0)
      dv_br = _put(dv_br, jnp.einsum("bajkni,bajknd->baikd", p, do_t), a0)
      return dq, dk_br, dv_br

    return _when(_live(wseg_BL, a0, pl.A), compute, carry)

  return _for(pl.L // pl.A, q_body, (dq_BLWHD, dk_br, dv_br))


def _backward(branch, axis_name, cp, tile, acc_dtype, skip, res, cotangents):
  del acc_dtype  # the backward always accumulates in float32
  q, k, v, q_br, k_br, v_br, seg, pos, meta, out, out_br, lse = res
  do, do_br, dlse = cotangents
  pl = _plan(q, k, q_br, branch, tile, skip)
  axes = _varying_axes(q, k, v, q_br, k_br, v_br, seg, pos, do, do_br, dlse)
  # dS = P * (dP - delta) with delta = rowsum(dO * O); a cotangent on lse adds P * dlse
  # (d lse / d s = P), i.e. delta - dlse. Rows with nothing visible have P = 0 either way.
  wseg = seg if meta is None else meta[1]
  delta = _delta_rows(pl, (do, do_br), (out, out_br), wseg, axes)
  delta = delta - jnp.where(jnp.isfinite(lse), dlse.astype(_F32), 0.0)
  # dq accumulates in float32 across the ring, trunk and branch rows in separate arrays (so the
  # final casts read them in place)
  dq, dq_br = _vary((jnp.zeros(q.shape, _F32), jnp.zeros(q_br.shape, _F32)), axes)
  if pl.W:
    dq_br, dk_br, dv_br = _branch_bwd(
      pl, q_br, k_br, v_br, seg, wseg, do_br, lse, delta, dq_br, axes
    )
  else:
    dk_br, dv_br = _vary((jnp.zeros_like(k_br), jnp.zeros_like(v_br)), axes)
  gs = (do, do_br, lse, delta)
  attend = functools.partial(_attend_trunk_bwd, pl, (q, q_br), gs, pos, seg, meta)
  kv = (k, v, pos, seg) + (meta or ())
  zeros = _vary(jnp.zeros(k.shape, _F32), axes)
  count0 = _vary(jnp.zeros((), jnp.int32), axes)
  dqs, dk, dv, _ = attend(((dq, dq_br), zeros, zeros, count0), kv)
  if cp > 1:
    perm = [(j, (j + 1) % cp) for j in range(cp)]

    def ring_step(carry, _):
      """K/V of an earlier rank arrive with their dK/dV accumulators; add this rank's share."""
      kv, dqs, dk, dv, count = carry
      kv, (dk, dv) = jax.lax.ppermute((kv, (dk, dv)), axis_name, perm)
      dqs, dk, dv, count = attend((dqs, dk, dv, count), kv)
      return (kv, dqs, dk, dv, count), None

    init = (kv, dqs, dk, dv, count0)
    (_, dqs, dk, dv, _), _ = jax.lax.scan(ring_step, init, None, length=cp - 1)
    dk, dv = jax.lax.ppermute((dk, dv), axis_name, perm)  # the last hop returns them home
  grads = (dqs[0], dk, dv, dqs[1], dk_br, dv_br)
  return (*(_like(g, x) for g, x in zip(grads, (q, k, v, q_br, k_br, v_br))), None, None, None)


def _like(ct, primal):
  """A cotangent in its primal's dtype and manual-axis type: summed over the axes along which the
  primal is invariant but the cotangent varies (a replicated input's gradient is the sum)."""
  extra = tuple(a for a in _varying_axes(ct) if a not in _varying_axes(primal))
  ct = jax.lax.psum(ct, extra) if extra else ct
  return ct.astype(primal.dtype)


# ----------------------------------------------------------------------------- public


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12, 13, 14))
def _ring(q, k, v, q_br, k_br, v_br, seg, pos, meta, branch, axis_name, cp, tile, acc_dtype, skip):
  kw = dict(branch=branch, axis_name=axis_name, cp=cp, tile=tile, acc_dtype=acc_dtype, skip=skip)
  return _forward(q, k, v, q_br, k_br, v_br, seg, pos, **kw, meta=meta)[:3]


def _ring_fwd(
  q, k, v, q_br, k_br, v_br, seg, pos, meta, branch, axis_name, cp, tile, acc_dtype, skip
):
  kw = dict(branch=branch, axis_name=axis_name, cp=cp, tile=tile, acc_dtype=acc_dtype, skip=skip)
  out, out_br, lse, _ = _forward(q, k, v, q_br, k_br, v_br, seg, pos, **kw, meta=meta)
  return (out, out_br, lse), (q, k, v, q_br, k_br, v_br, seg, pos, meta, out, out_br, lse)


_ring.defvjp(_ring_fwd, _backward)


def ring_attention_shard(
  q,
  k,
  v,
  q_br,
  k_br,
  v_br,
  seg,
  pos,
  *,
  branch,
  axis_name,
  cp,
  tile=512,
  custom_grad=True,
  accumulate_dtype=jnp.float32,
  skip_empty=True,
  return_work=False,
  return_lse=False,
  whole=None,
):
  """Per-device ring trunk + local branch attention (call inside shard_map).

  Local arrays in the ring's token order (zigzag for balance; any order is exact): q [B,L,H,D],
  k/v [B,L,K,D], q_br [B,L,W,H,D], k_br/v_br [B,L,W,K,D], seg/pos [B,L] (global positions).
  Returns (out [B,L,H,D], out_br [B,L,W,H,D]) in the inputs' dtypes. `tile` is the number of
  query rows and of keys per tile. `custom_grad=False` differentiates the forward by autodiff (the
  reference for the custom backward); `accumulate_dtype` exists for the test that shows why the
  state is float32; `skip_empty=False` computes every tile pair (to measure what skipping saves);
  `return_work=True` also returns the number of (query tile, key tile) pairs this rank computed
  in the forward (the backward computes the same pairs). `return_lse=True` also returns the
  float32 log-sum-exp of every query row, lse [B,L,R,H] (R = 1 + W: the trunk row, then the
  branch rows; -inf where nothing is visible), differentiable like the outputs, for merging with
  attention over other keys (`blockwise.merge`). `whole` (`parallel.mesh.metadata_constraint`,
  when the batch is split over automatic mesh axes) keeps the tile loops' skip tests local:
  see `_skip_meta`.
  """
  if q.shape[1] % 2:
    raise ValueError(f"local length {q.shape[1]} must be two equal zigzag chunks (S % 2cp == 0)")
  kw = dict(
    branch=branch,
    axis_name=axis_name,
    cp=cp,
    tile=tile,
    acc_dtype=accumulate_dtype,
    skip=skip_empty,
  )
  meta = _skip_meta(whole, pos, seg)
  if return_work:
    out, out_br, _, count = _forward(q, k, v, q_br, k_br, v_br, seg, pos, **kw, meta=meta)
    return out, out_br, count
  if custom_grad:
    out = _ring(q, k, v, q_br, k_br, v_br, seg, pos, meta, *kw.values())
  else:
    out = _forward(q, k, v, q_br, k_br, v_br, seg, pos, **kw, meta=meta)[:3]
  return out if return_lse else out[:2]


# ----------------------------------------------------------------------------- all-gather


def allgather_attention_shard(
  q, k, v, q_br, k_br, v_br, seg, pos, *, branch, axis_name, cp, tile=512, kernel=None
):
  """Baseline: gather the trunk K/V once, attend locally (autodiff backward through the XLA
  tiles, or with `kernel` (a `kernels.KernelSettings`) the fused Pallas block and its backward)."""
  B, L, H, D = q.shape
  W = q_br.shape[2]
  R = 1 + W
  if cp > 1:
    g = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
    k_all, v_all, kr = g(k), g(v), bw.Rows(g(pos), g(seg))
  else:
    k_all, v_all, kr = k, v, bw.Rows(pos, seg)
  qa, qrows = bw.query_rows(q, q_br, pos, seg, branch)
  if kernel is None:
    out, lse = bw.blk(qa, k_all, v_all, qrows, kr, tile_q=tile, tile_k=tile)
  else:
    from specdraft.attention.kernels import flash

    out, lse = flash.block_attention(qa, k_all, v_all, qrows, kr, settings=kernel)
    out = out.astype(jnp.float32)
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


# ----------------------------------------------------------------------------- trunk only


def trunk_attention_shard(
  q,
  k,
  v,
  seg,
  pos,
  *,
  axis_name=None,
  cp=1,
  tile=512,
  return_lse=False,
  custom_grad=True,
  whole=None,
):
  """Packed causal attention of a trunk with no branch (W = 0): the policy's layers in training,
  and (with `return_lse`) the trunk part of a draft's TTT branch rows (model/eagle3.py).

  The same tiled online softmax and custom backward as `ring_attention_shard`; at cp = 1 (no
  collective, callable outside shard_map) it is a flash-style attention over one device's row, so
  no [B, S, S] mask or score tensor exists. q [B,L,H,D], k/v [B,L,K,D], seg/pos [B,L] (pos: any
  order-preserving position within a segment, e.g. the RoPE positions). An odd L (cp = 1 only)
  is padded by one invisible row. Returns out [B,L,H,D] in q's dtype, and with `return_lse` also
  lse [B,H,L] float32 (-inf where nothing is visible; the convention of `blockwise.merge`).
  `custom_grad=False` differentiates the forward by autodiff (the reference in tests); `whole`
  as in `ring_attention_shard`."""
  B, L, H, D = q.shape
  K = k.shape[2]
  odd = L % 2
  if odd and cp > 1:
    raise ValueError(f"local length {L} must be two equal zigzag chunks (S % 2cp == 0)")
  if odd:
    pad = lambda x: jnp.pad(x, [(0, 0), (0, 1)] + [(0, 0)] * (x.ndim - 2))
    q, k, v, seg, pos = (pad(x) for x in (q, k, v, seg, pos))
  n = L + odd
  out, _, lse = ring_attention_shard(
    q,
    k,
    v,
    jnp.zeros((B, n, 0, H, D), q.dtype),
    jnp.zeros((B, n, 0, K, D), k.dtype),
    jnp.zeros((B, n, 0, K, D), v.dtype),
    seg,
    pos,
    branch="ttt",
    axis_name=axis_name,
    cp=cp,
    tile=tile,
    custom_grad=custom_grad,
    return_lse=True,
    whole=whole,
  )
  if return_lse:
    return out[:, :L], jnp.moveaxis(lse[:, :L, 0], 1, 2)
  return out[:, :L]
