"""GRPO: group-relative advantages, the clipped importance-ratio loss, aggregation modes and an
optional KL penalty to a reference policy.

Shape letters: B rollouts (the batch's rows: prompts x group size), S tokens.
"""

from __future__ import annotations

import jax.numpy as jnp

ADVANTAGES = ("grpo", "drgrpo", "rloo")
AGGREGATIONS = ("token-mean", "sequence-mean-token-mean", "sequence-mean-token-scale")
KL_ESTIMATORS = ("k1", "k3")


def group_advantages(rewards_B, group_size: int, *, mode: str = "grpo", eps: float = 1e-6):
  """Advantages for rollouts laid out as consecutive groups of `group_size` per prompt.

  grpo: (r - mean_g) / (std_g + eps) (population std); drgrpo: r - mean_g (no std);
  rloo: r - mean of the other members of the group.
  """
  if mode not in ADVANTAGES:
    raise ValueError(f"rl.advantage={mode!r} is invalid; expected one of {ADVANTAGES}")
  B = rewards_B.shape[0]
  if B % group_size:
    raise ValueError(f"{B} rollouts are not a whole number of groups of {group_size}")
  r = rewards_B.astype(jnp.float32).reshape(-1, group_size)
  mean = r.mean(axis=1, keepdims=True)
  if mode == "grpo":
    adv = (r - mean) / (r.std(axis=1, keepdims=True) + eps)
  elif mode == "drgrpo":
    adv = r - mean
  else:
    if group_size < 2:
      raise ValueError("rl.advantage='rloo' needs rl.group_size >= 2")
    adv = (r - mean) * group_size / (group_size - 1)
  return adv.reshape(B)


def _sum_rows(x_BS):
  return jnp.sum(x_BS, axis=1)


def aggregate(x_BS, mask_BS, mode: str, max_tokens: int | None = None, *, row_sum=_sum_rows):
  """token-mean (DAPO): over all tokens; sequence-mean-token-mean (GRPO): per sequence then over
  sequences; sequence-mean-token-scale (Dr.GRPO): per-sequence sums over a constant budget.

  `row_sum(x_BS) -> [B]` sums each sequence; a context-parallel shard passes one that also sums
  over the other shards of the row (every aggregate is built from per-row sums)."""
  mask = mask_BS.astype(jnp.float32)
  if mode == "token-mean":
    return jnp.sum(row_sum(x_BS * mask)) / jnp.maximum(jnp.sum(row_sum(mask)), 1.0)
  if mode == "sequence-mean-token-mean":
    per_seq = row_sum(x_BS * mask) / jnp.maximum(row_sum(mask), 1.0)
    return per_seq.mean()
  if mode == "sequence-mean-token-scale":
    budget = max_tokens if max_tokens is not None else x_BS.shape[1]
    return jnp.mean(row_sum(x_BS * mask) / budget)
  raise ValueError(f"rl.aggregation={mode!r} is invalid; expected one of {AGGREGATIONS}")


def kl_penalty(logp_BS, ref_logp_BS, estimator: str):
  """Per-token KL(pi || ref) estimates from log-probs of the sampled tokens."""
  d = ref_logp_BS - logp_BS
  if estimator == "k1":
    return -d
  if estimator == "k3":
    return jnp.exp(d) - d - 1.0
  raise ValueError(f"rl.kl_estimator={estimator!r} is invalid; expected one of {KL_ESTIMATORS}")


def policy_loss(
  logp_BS,
  old_logp_BS,
  adv_B,
  mask_BS,
  *,
  eps_low: float,
  eps_high: float,
  aggregation: str,
  max_tokens: int | None = None,
  ref_logp_BS=None,
  beta: float = 0.0,
  kl_estimator: str = "k3",
  row_sum=_sum_rows,
):
  """Clipped surrogate `max(-A r, -A clip(r, 1-eps_low, 1+eps_high))`, aggregated, plus
  `beta * KL` when a reference is given. The log-ratio is clipped to +-20 for safety.
  `row_sum`: see `aggregate`. Returns (loss, metrics)."""
  log_ratio = jnp.clip(logp_BS - old_logp_BS, -20.0, 20.0)
  ratio = jnp.exp(log_ratio)
  adv = adv_B[:, None]
  unclipped = -adv * ratio
  clipped = -adv * jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high)
  pg = jnp.maximum(unclipped, clipped)
  loss = aggregate(pg, mask_BS, aggregation, max_tokens, row_sum=row_sum)
  m = mask_BS.astype(jnp.float32)
  total = lambda x: jnp.sum(row_sum(x))
  n = jnp.maximum(total(m), 1.0)
  metrics = {
    "pg_loss": loss,
    "clip_frac": total((clipped > unclipped) * m) / n,
    "ratio_mean": total(ratio * m) / n,
  }
  if ref_logp_BS is not None and beta > 0:
    kl = kl_penalty(logp_BS, ref_logp_BS, kl_estimator)
    kl_mean = aggregate(kl, mask_BS, aggregation, max_tokens, row_sum=row_sum)
    loss = loss + beta * kl_mean
    metrics["kl"] = total(kl * m) / n
  metrics["rl_loss"] = loss
  return loss, metrics
