"""Lossless verification by rejection sampling (docs/design.md "Speculative decoding").

The exact probabilities (`acceptance_probs`, `final_distributions`) are separate from the random
draws (`rejection_sample`), so tests can enumerate the former exactly and sample the latter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _draft_probs(draft_tokens_BG, draft_probs_BGV, V, dtype):
  if draft_probs_BGV is None:  # deterministic draft: q = one-hot(x)
    return jax.nn.one_hot(draft_tokens_BG, V, dtype=dtype)
  return draft_probs_BGV.astype(dtype)


def acceptance_probs(draft_tokens_BG, draft_probs_BGV, target_probs_BG1V):
  """alpha_i = min(1, p_i(x_i) / q_i(x_i)); a token with q = 0 is accepted iff p > 0."""
  dt = jnp.promote_types(target_probs_BG1V.dtype, jnp.float32)
  G = draft_tokens_BG.shape[1]
  p = target_probs_BG1V.astype(dt)
  q = _draft_probs(draft_tokens_BG, draft_probs_BGV, p.shape[-1], dt)
  p_x = jnp.take_along_axis(p[:, :G], draft_tokens_BG[..., None], -1)[..., 0]
  q_x = jnp.take_along_axis(q, draft_tokens_BG[..., None], -1)[..., 0]
  ratio = p_x / jnp.where(q_x > 0, q_x, 1.0)
  return jnp.where(q_x > 0, jnp.minimum(ratio, 1.0), (p_x > 0).astype(dt))


def final_distributions(draft_tokens_BG, draft_probs_BGV, target_probs_BG1V):
  """[B,G+1,V]: row i < G is norm(max(0, p_i - q_i)) (after a rejection at i); row G is the
  bonus p_{G+1}. Where p_i == q_i the residual is empty (rejection impossible) and p_i is used."""
  dt = jnp.promote_types(target_probs_BG1V.dtype, jnp.float32)
  B, G = draft_tokens_BG.shape
  p = target_probs_BG1V.astype(dt)
  q = _draft_probs(draft_tokens_BG, draft_probs_BGV, p.shape[-1], dt)
  q_pad = jnp.concatenate([q, jnp.zeros((B, 1, p.shape[-1]), dt)], axis=1)
  residual = jnp.maximum(p - q_pad, 0.0)
  mass = residual.sum(-1, keepdims=True)
  return jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p)


def rejection_sample(key, draft_tokens_BG, draft_probs_BGV, target_probs_BG1V):
  """Accept x_i w.p. min(1, p_i(x_i)/q_i(x_i)); at the first rejection emit a sample of
  norm(max(0, p_i - q_i)) and stop; if all G are accepted emit a bonus sample of p_{G+1}.

  `draft_probs=None` means a deterministic draft (q_i = one-hot(x_i)). Vectorised over rows,
  jittable, no host sync.
  Returns (tokens [B,G+1] int32: accepted drafts, then the correction or bonus, then -1;
  num_accepted [B] int32).
  """
  B, G = draft_tokens_BG.shape
  k_acc, k_res = jax.random.split(key)
  alpha = acceptance_probs(draft_tokens_BG, draft_probs_BGV, target_probs_BG1V)
  accept = jax.random.uniform(k_acc, (B, G), alpha.dtype) < alpha
  n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
  dists = final_distributions(draft_tokens_BG, draft_probs_BGV, target_probs_BG1V)
  final_dist = jnp.take_along_axis(dists, n[:, None, None], axis=1)[:, 0]
  pos = final_dist > 0
  final = jax.random.categorical(
    k_res, jnp.where(pos, jnp.log(jnp.where(pos, final_dist, 1.0)), -jnp.inf)
  )
  idx = jnp.arange(G + 1)[None]
  drafts = jnp.concatenate([draft_tokens_BG, jnp.zeros((B, 1), jnp.int32)], axis=1)
  tokens = jnp.where(idx < n[:, None], drafts, jnp.where(idx == n[:, None], final[:, None], -1))
  return tokens.astype(jnp.int32), n.astype(jnp.int32)
