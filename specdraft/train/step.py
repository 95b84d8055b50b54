"""Optimizers, the SFT loss and the jitted pure SFT step `(state, batch) -> (state, metrics)`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from specdraft.model import policy as pol
from specdraft.train import sequence


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


def sft_loss(
  params,
  cfg: pol.PolicyConfig,
  batch,
  *,
  mesh=None,
  pipeline=None,
  vocab_chunk=0,
  attn_tile=512,
  remat=False,
):
  """Next-token cross-entropy on a batch laid out by `sequence.lay_out` (on sequence shards over
  the mesh's 'cp' axis; `train/sequence.py`). With `pipeline` (a PipelineSpec) the policy runs as
  a pipeline over the mesh's 'pp' axis and the loss on the last stage."""
  if pipeline is not None:
    on_last_stage = lambda sh, theta, extra, h, taps, b, ref: sequence.sft_from_hidden(
      sh, theta, h, b, pcfg=cfg, vocab_chunk=vocab_chunk
    )
    return sequence.run_pipelined(
      on_last_stage, mesh, pipeline, params, None, batch, pcfg=cfg, tile=attn_tile
    )
  body = functools.partial(sequence.sft_body, pcfg=cfg, vocab_chunk=vocab_chunk)
  return sequence.run(body, mesh, (params,), batch, tile=attn_tile, remat=remat)


def sft_step(
  state,
  batch,
  *,
  cfg: pol.PolicyConfig,
  tx: optax.GradientTransformation,
  mesh=None,
  pipeline=None,
  vocab_chunk=0,
  attn_tile=512,
  remat=False,
):
  """One pure SFT step on a state dict {step, params, opt_state}."""
  (_, metrics), grads = jax.value_and_grad(sft_loss, has_aux=True)(
    state["params"],
    cfg,
    batch,
    mesh=mesh,
    pipeline=pipeline,
    vocab_chunk=vocab_chunk,
    attn_tile=attn_tile,
    remat=remat,
  )
  return apply_sft_gradients(state, grads, metrics, tx)


def apply_sft_gradients(state, grads, metrics, tx):
  """The optimizer half of `sft_step`: one `tx` update from `grads` (the gradient of `sft_loss`),
  the step counter advanced, the gradient norm added to `metrics` (see `apply_gradients`)."""
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  metrics = dict(metrics)
  metrics["grad_norm"] = optax.tree.norm(grads)
  return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics


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


def cotrain_objective(
  theta,
  phi,
  logits,
  taps,
  batch,
  ref_logp=None,
  *,
  pcfg,
  dcfg,
  rl_cfg,
  lam: float,
  train_draft: bool = True,
  attn_impl: str = "dense",
  mesh=None,
):
  """L_RL + lam * L_draft from the policy's logits and (stop-gradient) taps of ONE forward, in
  natural order (the dense oracle of `sequence.cotrain_body`). The RL log-probs and the entropy
  are of the distribution the rollouts sample (`rl.temperature`, `rl.top_k`, `rl.top_p`), as in
  the sharded step; the draft's targets stay the policy's own logits."""
  from specdraft.decode.sampling import Sampling, processed_logits
  from specdraft.model import drafts
  from specdraft.rl import grpo

  sampling = Sampling(rl_cfg.temperature, rl_cfg.get("top_k", 0), rl_cfg.get("top_p", 1.0))
  sampled = logits
  if sampling.temperature > 0 and sampling != Sampling():
    sampled = processed_logits(logits, *sampling)
  logp = completion_logprobs(sampled, batch["tokens"])
  rl_loss, metrics = grpo.policy_loss(
    logp,
    batch["logprobs"],
    batch["advantages"],
    batch["loss_mask"],
    eps_low=rl_cfg.eps_low,
    eps_high=rl_cfg.eps_high,
    aggregation=rl_cfg.aggregation,
    max_tokens=batch["tokens"].shape[1],
    ref_logp_NS=ref_logp,
    beta=rl_cfg.beta,
    kl_estimator=rl_cfg.kl_estimator,
  )
  metrics["entropy"] = jax.lax.stop_gradient(entropy_of(sampled, batch["loss_mask"]))
  total = rl_loss
  if train_draft:
    draft_loss, dm = drafts.natural_loss(
      phi, dcfg, theta, pcfg, taps.layers, logits, batch, attn_impl=attn_impl, mesh=mesh
    )
    metrics.update(dm)
    total = total + lam * draft_loss
  metrics["loss"] = total
  return total, metrics


def cotrain_loss(
  trainable,
  batch,
  *,
  pcfg,
  dcfg,
  rl_cfg,
  lam: float,
  train_draft: bool = True,
  ref_params=None,
  stop_tap_gradient: bool = True,
  mesh=None,
  pipeline=None,
  max_tokens: int | None = None,
  vocab_chunk: int = 0,
  attn_tile: int = 512,
  remat: bool = False,
):
  """L = L_RL(theta) + lam * L_draft(phi; sg(taps_theta)) from ONE policy forward.

  `trainable = {"policy": theta, "draft": phi}`; `batch` holds the rollout rows (tokens,
  positions, segment_ids, loss_mask on completion tokens, behaviour `logprobs`) laid out once by
  `sequence.lay_out`, and per-row `advantages`. The loss runs on sequence shards over the mesh's
  'cp' axis (`train/sequence.py`: the policy trunk through the ring, vocabulary in chunks of
  `vocab_chunk` tokens, the draft's TTT branch attention on the same shards; `remat`
  rematerialises each policy layer in the backward pass). `max_tokens` is the
  budget of the sequence-mean-token-scale aggregation (default: the batch's length).
  With `pipeline` (a `model.pipelined.PipelineSpec`) the policy runs as a pipeline over the
  mesh's 'pp' axis (every stage's layers through the trunk ring over 'cp'), the taps reach the
  last stage through the TapChannel and the same objective runs there on its shards
  (`sequence.cotrain_from_hidden`).
  """
  theta, phi = trainable["policy"], trainable["draft"]
  ref = ref_params if ref_params is not None and rl_cfg.beta > 0 else None
  common = dict(pcfg=pcfg, dcfg=dcfg, rl_cfg=rl_cfg, lam=lam, train_draft=train_draft)
  body_options = dict(
    **common, stop_tap_gradient=stop_tap_gradient, max_tokens=max_tokens, vocab_chunk=vocab_chunk
  )
  if pipeline is not None:

    def on_last_stage(sh, th, ph, h, taps, b, ref_pair):
      ref_theta, h_ref = ref_pair if ref_pair is not None else (None, None)
      return sequence.cotrain_from_hidden(sh, th, ph, ref_theta, h, taps, h_ref, b, **body_options)

    return sequence.run_pipelined(
      on_last_stage,
      mesh,
      pipeline,
      theta,
      phi,
      batch,
      pcfg=pcfg,
      tile=attn_tile,
      stop_tap_gradient=stop_tap_gradient,
      ref_theta=ref,
    )
  body = functools.partial(sequence.cotrain_body, **body_options)
  return sequence.run(body, mesh, (theta, phi, ref), batch, tile=attn_tile, remat=remat)


def cotrain_step(
  state,
  batch,
  *,
  pcfg,
  dcfg,
  rl_cfg,
  tx,
  lam: float,
  train_draft: bool = True,
  ref_params=None,
  stop_tap_gradient: bool = True,
  mesh=None,
  pipeline=None,
  max_tokens: int | None = None,
  vocab_chunk: int = 0,
  attn_tile: int = 512,
  remat: bool = False,
):
  """One pure co-training step on {step, params: {policy, draft}, opt_state, ...} (arguments as
  in `cotrain_loss`)."""
  (_, metrics), grads = jax.value_and_grad(cotrain_loss, has_aux=True)(
    state["params"],
    batch,
    pcfg=pcfg,
    dcfg=dcfg,
    rl_cfg=rl_cfg,
    lam=lam,
    train_draft=train_draft,
    ref_params=ref_params,
    stop_tap_gradient=stop_tap_gradient,
    mesh=mesh,
    pipeline=pipeline,
    max_tokens=max_tokens,
    vocab_chunk=vocab_chunk,
    attn_tile=attn_tile,
    remat=remat,
  )
  return apply_gradients(state, grads, metrics, tx)


def apply_gradients(state, grads, metrics, tx):
  """The optimizer half of `cotrain_step`: one `tx` update of {policy, draft} from `grads` (the
  gradient of `cotrain_loss`), the step counter advanced, the two gradient norms added to
  `metrics`. Tests that also need the gradients themselves compose it with their own
  `value_and_grad(cotrain_loss)` into one program, so the forward/backward is traced once."""
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  metrics = dict(metrics)
  metrics["policy_grad_norm"] = optax.tree.norm(grads["policy"])
  metrics["draft_grad_norm"] = optax.tree.norm(grads["draft"])
  params = optax.apply_updates(state["params"], updates)
  return {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics
