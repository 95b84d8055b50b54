"""Blockwise attention primitives of the all-gather baseline: a tiled, float32, (out, lse) block
(differentiated by autodiff), the overflow-safe LSE merge, and the rank-local branch block. The
ring (ring.py) runs its own in-place online softmax over the same mask.

A block attends query rows to key rows under the mask
  same segment, segment != 0, and  k_pos + strict <= q_pos
where `strict` is 0 for trunk and TTT-branch queries and 1 for block-branch queries (which see
trunk keys s < t). Masks use only positions and segment ids, so they are exact in any token order.
Empty rows give (0, -inf) and receive zero gradient.

Shape letters: B batch, T query rows, S key rows, H heads, K kv heads, Q = H // K query heads
per kv head, D head dim, W branch width.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdraft.attention import reference

_MASKED = -1e30


class Rows(NamedTuple):
  """Per-row mask metadata: positions, segment ids and (queries only) strictness."""

  pos: jax.Array  # [B,N] int32
  seg: jax.Array  # [B,N] int32
  strict: jax.Array | None = None  # [B,N] int32 (0 or 1)


def block_mask(qr: Rows, kr: Rows):
  strict = 0 if qr.strict is None else qr.strict[:, :, None]
  same = (qr.seg[:, :, None] == kr.seg[:, None, :]) & (qr.seg[:, :, None] != 0)
  return same & (kr.pos[:, None, :] + strict <= qr.pos[:, :, None])


def query_rows(q_BLHD, q_BLWHD, pos_BL, seg_BL, branch: str):
  """Every query of an anchor as consecutive rows (its trunk query, then its W branch queries):
  q [B, L * R, H, D] (R = 1 + W) and their mask metadata, strict 1 for block-branch queries
  (they see trunk keys strictly before their anchor)."""
  B, L, H, D = q_BLHD.shape
  R = 1 + q_BLWHD.shape[2]
  q = jnp.concatenate([q_BLHD[:, :, None], q_BLWHD.astype(q_BLHD.dtype)], axis=2)
  strict_R = jnp.asarray([0] + [int(branch == "block")] * (R - 1), jnp.int32)
  rows = Rows(
    jnp.repeat(pos_BL, R, axis=1),
    jnp.repeat(seg_BL, R, axis=1),
    jnp.broadcast_to(jnp.tile(strict_R, L), (B, L * R)),
  )
  return q.reshape(B, L * R, H, D), rows


def tile_size(n: int, want: int) -> int:
  """The largest divisor of n that is <= want (tiles must divide the row count)."""
  t = max(1, min(n, want))
  while n % t:
    t -= 1
  return t


def _split(x, n_tiles, axis=1):
  """[B, N, ...] -> [n_tiles, B, N / n_tiles, ...]."""
  shape = x.shape
  x = x.reshape(shape[:axis] + (n_tiles, shape[axis] // n_tiles) + shape[axis + 1 :])
  return jnp.moveaxis(x, axis, 0)


def _merge_tiles(x, axis=1):
  x = jnp.moveaxis(x, 0, axis)
  return x.reshape(x.shape[:axis] + (x.shape[axis] * x.shape[axis + 1],) + x.shape[axis + 2 :])


def _scores(q, k, scale):
  """q [B,T,K,Q,D], k [B,S,K,D] -> [B,K,Q,T,S] float32."""
  return jnp.einsum("btkqd,bskd->bkqts", q, k, preferred_element_type=jnp.float32) * scale


def blk(q_BTHD, k_BSKD, v_BSKD, qr: Rows, kr: Rows, *, tile_q: int = 512, tile_k: int = 512):
  """Masked attention of a query block against a key block: (out_BTHD f32, lse_BHT f32).

  Large blocks are tiled (a map over query tiles, an online-softmax scan over key tiles), so
  memory is O(tile_q * tile_k) per head instead of O(T * S).
  """
  B, T, H, D = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  Q = H // K
  scale = D**-0.5
  # Inputs stay in their dtype; each tile is upcast on its own, so no full-size float32 copy
  # of q, k or v is ever materialised.
  q = q_BTHD.reshape(B, T, K, Q, D)
  k, v = k_BSKD, v_BSKD
  tq, tk = tile_size(T, tile_q), tile_size(S, tile_k)

  def q_tile(args):
    qt, qpos, qseg, qstr = args
    qt = qt.astype(jnp.float32)
    qrt = Rows(qpos, qseg, qstr)

    def k_step(carry, kargs):
      m, l, acc = carry
      kt, vt, kpos, kseg = kargs
      kt, vt = kt.astype(jnp.float32), vt.astype(jnp.float32)
      mask = block_mask(qrt, Rows(kpos, kseg))[:, None, None]
      s = jnp.where(mask, _scores(qt, kt, scale), _MASKED)
      m_new = jnp.maximum(m, jax.lax.stop_gradient(s.max(-1)))
      p = jnp.where(mask, jnp.exp(s - m_new[..., None]), 0.0)
      corr = jnp.exp(m - m_new)
      l = l * corr + p.sum(-1)
      acc = acc * corr[..., None] + jnp.einsum("bkqts,bskd->bkqtd", p, vt)
      return (m_new, l, acc), None

    init = (
      jnp.full((B, K, Q, tq), _MASKED, jnp.float32),
      jnp.zeros((B, K, Q, tq), jnp.float32),
      jnp.zeros((B, K, Q, tq, D), jnp.float32),
    )
    nk = S // tk
    # Rematerialised under autodiff (the all-gather path): the backward keeps per-step carries,
    # never a tile's probabilities, so memory stays O(tile) rather than O(T * S).
    (m, l, acc), _ = jax.lax.scan(
      jax.checkpoint(k_step),
      init,
      (_split(k, nk), _split(v, nk), _split(kr.pos, nk), _split(kr.seg, nk)),
    )
    ok = l > 0
    safe = jnp.where(ok, l, 1.0)
    out = jnp.moveaxis(acc / safe[..., None], 3, 1)  # [B,tq,K,Q,D]
    lse = jnp.where(ok, m + jnp.log(safe), -jnp.inf)
    return out.reshape(B, tq, H, D), lse.reshape(B, H, tq)

  strict = qr.strict if qr.strict is not None else jnp.zeros_like(qr.pos)
  nq = T // tq
  outs, lses = jax.lax.map(
    jax.checkpoint(q_tile),
    (_split(q, nq), _split(qr.pos, nq), _split(qr.seg, nq), _split(strict, nq)),
  )
  return _merge_tiles(outs), _merge_tiles(lses, axis=2)


def merge(out1, lse1, out2, lse2):
  """Exact, overflow-safe merge of two partial softmax results over disjoint key sets.

  out [B,T,H,D] f32, lse [B,H,T] f32; (0, -inf) is the identity. No NaN in value or gradient.
  """
  m = jnp.maximum(lse1, lse2)
  m_safe = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
  w1, w2 = jnp.exp(lse1 - m_safe), jnp.exp(lse2 - m_safe)
  s = w1 + w2
  ok = s > 0
  safe = jnp.where(ok, s, 1.0)
  lse = jnp.where(ok, m_safe + jnp.log(safe), -jnp.inf)
  t = lambda w: jnp.moveaxis(w / safe, 1, 2)[..., None]  # [B,H,T] -> [B,T,H,1]
  return out1 * t(w1) + out2 * t(w2), lse


def branch_local(q_BSWHD, k_BSWKD, v_BSWKD, seg_BS, branch: str):
  """Each anchor's branch queries against its own branch keys (never leaves the rank).

  Returns (out_BSWHD f32, lse_BHSW f32).
  """
  B, S, W, H, D = q_BSWHD.shape
  K = k_BSWKD.shape[3]
  Q = H // K
  q = q_BSWHD.astype(jnp.float32).reshape(B, S, W, K, Q, D)
  s = jnp.einsum("btjkqd,btikd->bkqtji", q, k_BSWKD.astype(jnp.float32)) * D**-0.5
  p, lse = reference.masked_softmax(s, _branch_mask(seg_BS, W, branch))
  out = jnp.einsum("bkqtji,btikd->btjkqd", p, v_BSWKD.astype(jnp.float32))
  return out.reshape(B, S, W, H, D), lse.reshape(B, H, S, W)


def row_local(q_BSHD, k_BSWKD, v_BSWKD, seg_BS):
  """One query per anchor against W keys of that same anchor, all visible (the newest TTT step
  against the branch keys of steps 1..W at its anchor; rank-local).

  Returns (out_BSHD f32, lse_BHS f32); rows with segment 0 give (0, -inf)."""
  B, S, H, D = q_BSHD.shape
  K = k_BSWKD.shape[3]
  q = q_BSHD.astype(jnp.float32).reshape(B, S, K, H // K, D)
  s = jnp.einsum("btkqd,btikd->bkqti", q, k_BSWKD.astype(jnp.float32)) * D**-0.5
  mask = jnp.broadcast_to((seg_BS != 0)[:, None, None, :, None], s.shape)
  p, lse = reference.masked_softmax(s, mask)
  out = jnp.einsum("bkqti,btikd->btkqd", p, v_BSWKD.astype(jnp.float32))
  return out.reshape(B, S, H, D), lse.reshape(B, H, S)


def _branch_mask(seg_BS, W, branch):
  vis = jnp.tril(jnp.ones((W, W), bool)) if branch == "ttt" else jnp.ones((W, W), bool)
  return vis[None, None, None, None] & (seg_BS != 0)[:, None, None, :, None, None]
