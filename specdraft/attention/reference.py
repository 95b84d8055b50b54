"""The attention oracle: dense, float32, obviously correct.

Every other implementation (ring, all-gather, kernels) is tested against these functions in value
and gradient. Masks use only (position, segment id); segment 0 is padding.

Shape letters: B batch, S keys / trunk length, T queries, W branch width, H query heads,
K kv heads, Q = H // K query heads per kv head (the GQA group), D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# A finite "minus infinity": masked scores are replaced before exp, so no inf - inf appears in
# values or gradients.
_MASKED = -1e30


def masked_softmax(s, mask):
  """Softmax over the last axis restricted to `mask`: (probabilities, lse). Empty rows give
  all-zero probabilities and lse = -inf, with finite (zero) gradients."""
  s = jnp.where(mask, s, _MASKED)
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  p = jnp.where(mask, jnp.exp(s - m), 0.0)
  l = jnp.sum(p, axis=-1, keepdims=True)
  nonempty = l > 0
  safe_l = jnp.where(nonempty, l, 1.0)
  lse = jnp.where(nonempty, m + jnp.log(safe_l), -jnp.inf)[..., 0]
  return p / safe_l, lse


def masked_attention(q_BTHD, k_BSKD, v_BSKD, mask_BTS, *, scale=None):
  """Softmax attention under an explicit boolean mask, with GQA; float32 throughout.

  Rows whose mask is empty produce exactly zero output, lse = -inf, and zero gradient.
  Returns (out_BTHD float32, lse_BHT float32).
  """
  B, T, H, D = q_BTHD.shape
  K = k_BSKD.shape[2]
  if H % K:
    raise ValueError(f"query heads H={H} must be a multiple of kv heads K={K}")
  Q = H // K
  scale = D**-0.5 if scale is None else scale
  q = q_BTHD.astype(jnp.float32).reshape(B, T, K, Q, D)
  k = k_BSKD.astype(jnp.float32)
  v = v_BSKD.astype(jnp.float32)
  s_BKQTS = jnp.einsum("btkqd,bskd->bkqts", q, k) * scale
  p, lse = masked_softmax(s_BKQTS, mask_BTS[:, None, None, :, :])
  out = jnp.einsum("bkqts,bskd->btkqd", p, v).reshape(B, T, H, D)
  return out, lse.reshape(B, H, T)


def causal_mask(q_pos_BT, k_pos_BS, q_seg_BT, k_seg_BS):
  """Causal, same-document mask from positions and segment ids (segment 0 = padding)."""
  same = (q_seg_BT[:, :, None] == k_seg_BS[:, None, :]) & (q_seg_BT[:, :, None] != 0)
  return same & (k_pos_BS[:, None, :] <= q_pos_BT[:, :, None])


def causal_attention(q_BSHD, k_BSKD, v_BSKD, segment_ids_BS, positions_BS=None):
  """Trunk-only causal attention within packed documents (what the policy uses).

  `positions_BS` are global row positions used for the causal test (default: 0..S-1).
  """
  B, S = segment_ids_BS.shape
  if positions_BS is None:
    positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  mask = causal_mask(positions_BS, positions_BS, segment_ids_BS, segment_ids_BS)
  out, _ = masked_attention(q_BSHD, k_BSKD, v_BSKD, mask)
  return out.astype(q_BSHD.dtype)


def branch_attention_dense(
  q_BSHD, k_BSKD, v_BSKD, q_BSWHD, k_BSWKD, v_BSWKD, segment_ids_BS, *, branch
):
  """Trunk + branch attention exactly as docs/design.md "Branch attention"; float32 outputs.

  Trunk query t sees trunk keys s <= t. Branch query (t, j) sees trunk keys s <= t ("ttt") or
  s < t ("block"), and its own branch keys (t, i) with i <= j ("ttt") or all i ("block").
  Everything within one segment; padding rows (segment 0) are exactly zero.
  Returns (out_BSHD, out_BSWHD, lse_BHS, lse_BHSW).
  """
  if branch not in ("ttt", "block"):
    raise ValueError(f"branch must be 'ttt' or 'block', got {branch!r}")
  B, S, H, D = q_BSHD.shape
  W = q_BSWHD.shape[2]
  K = k_BSKD.shape[2]
  Q = H // K
  scale = D**-0.5
  seg = segment_ids_BS
  pos = jnp.arange(S)
  out, lse = masked_attention(
    q_BSHD, k_BSKD, v_BSKD, causal_mask(pos[None].repeat(B, 0), pos[None].repeat(B, 0), seg, seg)
  )

  # Branch queries: keys are [S trunk keys ; W own-branch keys], softmax over both jointly.
  same_doc_TS = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
  if branch == "ttt":
    trunk_vis_TS = same_doc_TS & (pos[None, None, :] <= pos[None, :, None])
    br_vis_WW = jnp.tril(jnp.ones((W, W), bool))
  else:
    trunk_vis_TS = same_doc_TS & (pos[None, None, :] < pos[None, :, None])
    br_vis_WW = jnp.ones((W, W), bool)
  valid_T = seg != 0
  mask_trunk = jnp.broadcast_to(trunk_vis_TS[:, :, None, :], (B, S, W, S))
  mask_br = br_vis_WW[None, None] & valid_T[:, :, None, None]
  mask_BTWX = jnp.concatenate([mask_trunk, mask_br], axis=-1)

  qb = q_BSWHD.astype(jnp.float32).reshape(B, S, W, K, Q, D)
  s_trunk = jnp.einsum("btwkqd,bskd->bkqtws", qb, k_BSKD.astype(jnp.float32))
  s_br = jnp.einsum("btwkqd,btikd->bkqtwi", qb, k_BSWKD.astype(jnp.float32))
  s = jnp.concatenate([s_trunk, s_br], axis=-1) * scale
  p, lse_br = masked_softmax(s, mask_BTWX[:, None, None])
  out_br = jnp.einsum("bkqtws,bskd->btwkqd", p[..., :S], v_BSKD.astype(jnp.float32)) + jnp.einsum(
    "bkqtwi,btikd->btwkqd", p[..., S:], v_BSWKD.astype(jnp.float32)
  )
  out_br = out_br.reshape(B, S, W, H, D)
  return out, out_br, lse, lse_br.reshape(B, H, S, W)
