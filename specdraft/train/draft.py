"""Draft pretraining by distillation: the (fixed) SFT policy generates completions, and the
draft learns the policy's distribution on them (EAGLE-3's TTT loss or a block draft's loss)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

from specdraft.decode import autoregressive
from specdraft.decode.sampling import join_prompt_completion
from specdraft.model import drafts
from specdraft.model import policy as pol
from specdraft.train import sequence


def draft_loss_on_batch(
  dparams,
  params,
  pcfg: pol.PolicyConfig,
  dcfg: drafts.DraftConfig,
  batch,
  *,
  attn_impl: str = "dense",
  mesh=None,
):
  """Policy forward under stop_gradient (taps and target logits), then the draft's TTT loss, on
  natural-order rows with whole-row logits: the oracle of the sequence-shard step
  (`draft_train_step`)."""
  logits, taps = pol.forward(
    params, pcfg, batch["tokens"], batch["positions"], batch["segment_ids"]
  )
  return drafts.natural_loss(
    dparams, dcfg, params, pcfg, taps.layers, logits, batch, attn_impl=attn_impl, mesh=mesh
  )


def draft_train_step(
  dstate,
  params,
  batch,
  *,
  pcfg,
  dcfg,
  tx,
  mesh=None,
  pipeline=None,
  vocab_chunk=0,
  attn_tile=512,
  remat=False,
):
  """One pure draft step on {step, params, opt_state}; the policy is an input, never updated.

  The batch is laid out by `sequence.lay_out`; the loss runs on sequence shards over the mesh's
  'cp' axis (train/sequence.py), or, with `pipeline`, on the pipeline's last stage."""
  if pipeline is not None:
    on_last_stage = lambda sh, theta, d, h, taps, b, ref: sequence.draft_terms(
      sh, theta, d, h, taps, b, pcfg=pcfg, dcfg=dcfg, vocab_chunk=vocab_chunk
    )
    loss = lambda d: sequence.run_pipelined(
      on_last_stage,
      mesh,
      pipeline,
      jax.lax.stop_gradient(params),
      d,
      batch,
      pcfg=pcfg,
      tile=attn_tile,
    )
  else:
    body = functools.partial(sequence.draft_body, pcfg=pcfg, dcfg=dcfg, vocab_chunk=vocab_chunk)
    loss = lambda d: sequence.run(body, mesh, (d, params), batch, tile=attn_tile, remat=remat)
  (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(dstate["params"])
  updates, opt_state = tx.update(grads, dstate["opt_state"], dstate["params"])
  metrics["draft_grad_norm"] = optax.tree.norm(grads)
  return {
    **dstate,
    "step": dstate["step"] + 1,
    "params": optax.apply_updates(dstate["params"], updates),
    "opt_state": opt_state,
  }, metrics


def rollout_batch(
  params, pcfg, prompts_BP, prompt_lengths_B, key, *, max_new_tokens: int, temperature: float
):
  """The policy's own generations joined to their prompts, as a training batch."""
  gen = autoregressive.generate(
    params,
    pcfg,
    prompts_BP,
    prompt_lengths_B,
    key,
    max_new_tokens=max_new_tokens,
    temperature=temperature,
  )
  return join_prompt_completion(jnp.asarray(prompts_BP), jnp.asarray(prompt_lengths_B), gen), gen


def draft_iteration(
  dstate,
  params,
  prompts_BP,
  prompt_lengths_B,
  *,
  pcfg,
  dcfg,
  tx,
  max_new_tokens: int,
  temperature: float,
  mesh=None,
  pipeline=None,
  **compute,
):
  """Rollout from the fixed policy, then one draft step; jitted as one program.

  The rollout batch is laid out (zigzag over cp) where it is built; `compute` holds the
  training step's knobs (vocab_chunk, attn_tile, remat). `dstate["key"]` holds raw PRNG key data
  (checkpointable) and advances every call.
  """
  key, sub = jax.random.split(jax.random.wrap_key_data(dstate["key"]))
  batch, _ = rollout_batch(
    params,
    pcfg,
    prompts_BP,
    prompt_lengths_B,
    sub,
    max_new_tokens=max_new_tokens,
    temperature=temperature,
  )
  batch.pop("logprobs")
  batch = sequence.lay_out(batch, sequence.cp_size(mesh))
  dstate = {**dstate, "key": jax.random.key_data(key)}
  return draft_train_step(
    dstate, params, batch, pcfg=pcfg, dcfg=dcfg, tx=tx, mesh=mesh, pipeline=pipeline, **compute
  )
