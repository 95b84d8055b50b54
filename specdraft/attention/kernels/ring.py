"""Branch attention under context parallelism with the fused block: the ring of
`attention/ring.py`, each step attended by the Pallas kernels (`flash`).

Per device (inside shard_map over the cp axis), every local query row (an anchor's trunk query
and its W branch queries, with the branch's strictness) meets every rank's trunk key block once:
the key blocks travel around the ring by `ppermute` with their positions and segment ids, and
each step's (out, lse) joins the running pair by the exact LSE merge (`blockwise.merge`). The
backward (custom VJP) is a second ring pass: each step's block gradient comes from the final
(out, lse) (`flash.block_attention_bwd`: the softmax over all keys factorises through lse), dq
sums on its rank in float32 and dk, dv travel with their key block, arriving home after the
last step. Branch keys never leave the rank: the branch rows merge with their rank-local branch
block as in the all-gather path. Masks come from positions and segment ids, so any row order
(zigzag, per-document zigzag, contiguous) is exact; the kernels skip the tiles a step cannot see.

Shape letters as in `attention/ring.py`: B batch, L local anchors, W branch width, R = 1 + W
query rows per anchor, H heads, K kv heads, D head dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specdraft.attention import blockwise as bw
from specdraft.attention.kernels.flash import (
  KernelSettings,
  block_attention,
  block_attention_bwd,
  block_attention_fwd,
)


def _shift(tree, axis_name: str, cp: int):
  """Every rank's arrays to the next rank on the ring."""
  perm = [(i, (i + 1) % cp) for i in range(cp)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)


def _ring_forward(q, k, v, qr, kr, axis_name, cp, settings):
  out, lse = block_attention_fwd(q, k, v, qr, kr, settings)
  out = out.astype(jnp.float32)

  def step(carry, _):
    out, lse, block = carry
    block = _shift(block, axis_name, cp)
    k_, v_, pos, seg = block
    o, l = block_attention_fwd(q, k_, v_, qr, bw.Rows(pos, seg), settings)
    out, lse = bw.merge(out, lse, o.astype(jnp.float32), l)
    return (out, lse, block), None

  block = (k, v, kr.pos, kr.seg)
  (out, lse, _), _ = jax.lax.scan(step, (out, lse, block), None, length=cp - 1)
  return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _ring(q, k, v, qr, kr, axis_name, cp, settings):
  return _ring_forward(q, k, v, qr, kr, axis_name, cp, settings)


def _ring_fwd(q, k, v, qr, kr, axis_name, cp, settings):
  out, lse = _ring_forward(q, k, v, qr, kr, axis_name, cp, settings)
  return (out, lse), (q, k, v, qr, kr, out, lse)


def _ring_bwd(axis_name, cp, settings, res, cotangents):
  q, k, v, qr, kr, out, lse = res
  dout, dlse = cotangents
  f32 = jnp.float32

  def step(carry, _):
    dq, block = carry
    k_, v_, pos, seg, dk, dv = block
    g = block_attention_bwd(
      q, k_, v_, qr, bw.Rows(pos, seg), out, lse, dout, dlse, settings, grad_dtype=f32
    )
    block = (k_, v_, pos, seg, dk + g[1], dv + g[2])
    return (dq + g[0], _shift(block, axis_name, cp)), None

  zeros = lambda x: jnp.zeros(x.shape, f32)
  block = (k, v, kr.pos, kr.seg, zeros(k), zeros(v))
  # cp steps, each followed by a shift: after the last, every key block (and the gradient it
  # gathered on every rank) is home again
  (dq, block), _ = jax.lax.scan(step, (zeros(q), block), None, length=cp)
  dk, dv = block[4], block[5]
  no_grad = jax.tree.map(lambda _: None, (qr, kr))
  return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), *no_grad)


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_block_attention(
  q_BTHD, k_BSKD, v_BSKD, qr: bw.Rows, kr: bw.Rows, *, axis_name: str | None, cp: int,
  settings=None,
):  # fmt: skip
  """Local query rows against every rank's key block (call inside shard_map over `axis_name`):
  (out_BTHD float32, lse_BHT float32), differentiable through both, as `blockwise.blk` over the
  gathered keys would give. At cp = 1 with no axis (outside shard_map) it is the block itself."""
  settings = settings or KernelSettings()
  if axis_name is None:
    if cp != 1:
      raise ValueError(f"cp={cp} needs the ring's axis_name (call inside shard_map)")
    out, lse = block_attention(q_BTHD, k_BSKD, v_BSKD, qr, kr, settings=settings)
    return out.astype(jnp.float32), lse
  return _ring(q_BTHD, k_BSKD, v_BSKD, qr, kr, axis_name, cp, settings)


def trunk_attention_shard(
  q, k, v, seg, pos, *, axis_name=None, cp: int = 1, settings=None, return_lse: bool = False
):  # fmt: skip
  """`attention.ring.trunk_attention_shard` with the fused block: packed causal attention of a
  trunk with no branch (the policy's layers in training; with `return_lse` the trunk part of a
  draft's TTT branch rows). q [B,L,H,D], k/v [B,L,K,D], seg/pos [B,L] (global positions).
  Returns out [B,L,H,D] in q's dtype, and with `return_lse` lse [B,H,L] float32."""
  rows = bw.Rows(pos, seg, jnp.zeros_like(pos))
  out, lse = ring_block_attention(
    q, k, v, rows, bw.Rows(pos, seg), axis_name=axis_name, cp=cp, settings=settings
  )
  out = out.astype(q.dtype)
  return (out, lse) if return_lse else out


def ring_attention_shard(
  q, k, v, q_br, k_br, v_br, seg, pos, *, branch, axis_name, cp, settings=None
):  # fmt: skip
  """`attention.ring.ring_attention_shard` with the fused block: the same local arrays (q
  [B,L,H,D], k/v [B,L,K,D], q_br [B,L,W,H,D], k_br/v_br [B,L,W,K,D], seg/pos [B,L] with global
  positions) and outputs (out [B,L,H,D], out_br [B,L,W,H,D] in the inputs' dtypes)."""
  B, L, H, D = q.shape
  W = q_br.shape[2]
  R = 1 + W
  rows_q, qr = bw.query_rows(q, q_br, pos, seg, branch)
  out, lse = ring_block_attention(
    rows_q, k, v, qr, bw.Rows(pos, seg), axis_name=axis_name, cp=cp, settings=settings
  )
  out = out.reshape(B, L, R, H, D)
  if W:
    lse = lse.reshape(B, H, L, R)
    o_local, l_local = bw.branch_local(q_br, k_br, v_br, seg, branch)
    o_br, _ = bw.merge(
      out[:, :, 1:].reshape(B, L * W, H, D),
      lse[..., 1:].reshape(B, H, L * W),
      o_local.reshape(B, L * W, H, D),
      l_local.reshape(B, H, L * W),
    )
    out = jnp.concatenate([out[:, :, :1], o_br.reshape(B, L, W, H, D)], axis=2)
  return out[:, :, 0].astype(q.dtype), out[:, :, 1:].astype(q_br.dtype)
