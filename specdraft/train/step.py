"""Optimizers, the losses and the pure training steps `(state, batch, spec) -> (state, metrics)`
(`train.spec.StepSpec`), every one through `sequence.run` and `train_step`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from specdraft.train import sequence
from specdraft.train.spec import StepSpec


def make_optimizer(opt_cfg, total_steps: int) -> optax.GradientTransformation:
  """AdamW with linear warm-up, cosine decay and global-norm clipping."""
  warmup = min(int(opt_cfg.warmup_steps), max(total_steps - 1, 0))
  sched = optax.warmup_cosine_decay_schedule(
    0.0,
    opt_cfg.lr,
    warmup_steps=max(warmup, 1),
    # (a phase of 0 or 1 steps still builds its optimizer: optax needs decay past the warm-up)
    decay_steps=max(total_steps, max(warmup, 1) + 1),
    end_value=opt_cfg.lr * 0.1,
  )
  return optax.chain(
    optax.clip_by_global_norm(opt_cfg.grad_clip),
    optax.adamw(sched, b2=opt_cfg.b2, weight_decay=opt_cfg.weight_decay),
  )


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
  same = jnp.concatenate(
    [(seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0), jnp.zeros_like(seg[:, :1], bool)], axis=1
  )
  w = jnp.concatenate([mask[:, 1:], jnp.zeros_like(mask[:, :1])], axis=1) * same
  return targets, w.astype(jnp.float32)


def sft_loss(params, batch, spec: StepSpec):
  """Next-token cross-entropy on a batch laid out by `sequence.zigzag_order`, run by `sequence.run`
  under `spec` (on sequence shards over the mesh's 'cp' axis, or with `spec.pipeline` as a
  pipeline over its 'pp' axis with the loss on the last stage)."""
  return sequence.run(sequence.sft_terms, spec, (params, None, None), batch)


def sft_step(state, batch, spec: StepSpec):
  """One pure SFT step on a state dict {step, params, opt_state} (`spec.tx` the optimizer)."""
  return train_step(functools.partial(sft_loss, spec=spec), state, batch, spec.tx)


def train_step(loss, state, batch, tx, *, norms: str | None = "grad_norm"):
  """The one gradient step every trainer runs: the gradient of `loss(params, batch) -> (scalar,
  metrics)` at state["params"], then `apply_update`."""
  (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(state["params"], batch)
  return apply_update(state, grads, metrics, tx, norms=norms)


def apply_update(state, grads, metrics, tx, *, norms: str | None = "grad_norm"):
  """The optimizer half of a step: one `tx` update of state["params"] from `grads`, the step
  counter advanced, the gradients' global norm added to `metrics` as `norms` (None: one norm per
  top-level entry, "{name}_grad_norm", e.g. the policy's and the draft's). Tests that also need
  the gradients compose it with their own `value_and_grad`, so the loss is traced once."""
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  metrics = dict(metrics)
  if norms is None:
    for name, g in grads.items():
      metrics[f"{name}_grad_norm"] = optax.tree.norm(g)
  else:
    metrics[norms] = optax.tree.norm(grads)
  params = optax.apply_updates(state["params"], updates)
  return {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics


# ----------------------------------------------------------------------------- co-training


def _adamw(cfg, lr):
  return optax.chain(
    optax.clip_by_global_norm(cfg.grad_clip),
    optax.adamw(lr, b2=cfg.b2, weight_decay=cfg.weight_decay),
  )


def make_cotrain_optimizer(rl_cfg, draft_cfg, *, train_draft: bool = True):
  """One optax update for both parameter sets: per-partition clipping and learning rates, so the
  draft's large early gradients never shrink the policy update through a shared global clip."""
  draft_tx = (
    optax.chain(
      optax.clip_by_global_norm(draft_cfg.grad_clip),
      optax.adamw(draft_cfg.cotrain_lr, b2=draft_cfg.b2, weight_decay=draft_cfg.weight_decay),
    )
    if train_draft
    else optax.set_to_zero()
  )
  labels = lambda params: {k: jax.tree.map(lambda _: k, v) for k, v in params.items()}
  # rl.warmup_steps: the policy's learning rate ramps linearly from rl.lr / (warmup + 1) to rl.lr.
  # A fresh Adam state moves every parameter by about the full learning rate on its first steps
  # (the update is ~sign(g) before the second moment has averaged), which noisy policy gradients
  # turn into a random step away from the SFT policy; the ramp keeps those first steps small.
  warmup = int(rl_cfg.get("warmup_steps", 0))
  lr = rl_cfg.lr
  if warmup:
    lr = optax.linear_schedule(rl_cfg.lr / (warmup + 1), rl_cfg.lr, transition_steps=warmup)
  return optax.multi_transform({"policy": _adamw(rl_cfg, lr), "draft": draft_tx}, labels)


def completion_logprobs(logits_BSV, tokens_BS):
  """log pi(x_i | x_<i) at each token position i (0 at i = 0)."""
  lp = token_logprobs(logits_BSV[:, :-1], tokens_BS[:, 1:])
  return jnp.concatenate([jnp.zeros_like(lp[:, :1]), lp], axis=1)


def entropy_of(logits_BSV, mask_BS):
  """Mean policy entropy over the positions that predict masked tokens."""
  lp = jax.nn.log_softmax(logits_BSV.astype(jnp.float32), -1)
  ent = -jnp.sum(jnp.exp(lp) * lp, -1)
  ent = jnp.concatenate([jnp.zeros_like(ent[:, :1]), ent[:, :-1]], axis=1)
  m = mask_BS.astype(jnp.float32)
  return jnp.sum(ent * m) / jnp.maximum(m.sum(), 1.0)


def cotrain_loss(trainable, batch, spec: StepSpec, ref=None):
  """L = L_RL(theta) + lam * L_draft(phi; sg(taps_theta)) from ONE policy forward.

  `trainable = {"policy": theta, "draft": phi}`; `batch` holds the rollout rows (tokens,
  positions, segment_ids, loss_mask on completion tokens, behaviour `logprobs`) laid out once by
  `sequence.zigzag_order`, and per-row `advantages`. `spec.rl` holds the loss's settings; `ref` the
  frozen reference policy of the KL term (used when spec.rl.beta > 0). `sequence.run` runs it:
  on sequence shards over the mesh's 'cp' axis (the policy trunk through the ring, vocabulary in
  chunks, the draft's branch attention on the same shards), or with `spec.pipeline` as a
  pipeline over 'pp' whose taps reach the last stage through the TapChannel, where the same
  objective runs (`sequence.cotrain_terms`)."""
  ref = ref if ref is not None and spec.rl.beta > 0 else None
  params = (trainable["policy"], trainable["draft"], ref)
  return sequence.run(sequence.cotrain_terms, spec, params, batch)


def cotrain_step(state, batch, spec: StepSpec, ref=None):
  """One pure co-training step on {step, params: {policy, draft}, opt_state, ...} (`spec.tx`
  the optimizer; `ref` as in `cotrain_loss`)."""
  loss = functools.partial(cotrain_loss, spec=spec, ref=ref)
  return train_step(loss, state, batch, spec.tx, norms=None)
