"""Optimizers, the SFT loss and the jitted pure SFT step `(state, batch) -> (state, metrics)`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from specdraft.model import policy as pol


def make_optimizer(opt_cfg, total_steps: int) -> optax.GradientTransformation:
  """AdamW with linear warm-up, cosine decay and global-norm clipping."""
  warmup = min(int(opt_cfg.warmup_steps), max(total_steps - 1, 0))
  sched = optax.warmup_cosine_decay_schedule(
    0.0, opt_cfg.lr, warmup_steps=max(warmup, 1), decay_steps=max(total_steps, warmup + 1),
    end_value=opt_cfg.lr * 0.1)
  return optax.chain(
    optax.clip_by_global_norm(opt_cfg.grad_clip),
    optax.adamw(sched, b2=opt_cfg.b2, weight_decay=opt_cfg.weight_decay))


def token_logprobs(logits_BSV, targets_BS):
  """log softmax(logits)[target] in float32."""
  lp = jax.nn.log_softmax(logits_BSV.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(lp, targets_BS[..., None], axis=-1)[..., 0]


def next_token_targets(batch):
  """Targets and weights for next-token prediction on packed rows.

  Position t predicts token t+1 when both are in the same document and t+1 is a loss token.
  """
  tokens, seg, mask = batch["tokens"], batch["segment_ids"], batch["loss_mask"]
  targets = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
  same = jnp.concatenate([(seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0),
                          jnp.zeros_like(seg[:, :1], bool)], axis=1)
  w = jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1) * same
  return targets, w.astype(jnp.float32)


def sft_loss(params, cfg: pol.PolicyConfig, batch):
  logits, _ = pol.forward(params, cfg, batch["tokens"], batch["positions"], batch["segment_ids"])
  targets, w = next_token_targets(batch)
  lp = token_logprobs(logits, targets)
  n = jnp.maximum(w.sum(), 1.0)
  loss = -(lp * w).sum() / n
  acc = ((jnp.argmax(logits, -1) == targets) * w).sum() / n
  return loss, {"loss": loss, "token_accuracy": acc, "tokens": w.sum()}


def sft_step(state, batch, *, cfg: pol.PolicyConfig, tx: optax.GradientTransformation):
  """One pure SFT step on a state dict {step, params, opt_state}."""
  (_, metrics), grads = jax.value_and_grad(sft_loss, has_aux=True)(state["params"], cfg, batch)
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  metrics["grad_norm"] = optax.tree.norm(grads)
  return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics
