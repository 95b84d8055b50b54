"""Draft pretraining by distillation: the (fixed) SFT policy generates completions, and the
EAGLE-3 draft learns the policy's distribution on them with the TTT loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from specdraft.decode import autoregressive
from specdraft.decode.sampling import join_prompt_completion
from specdraft.model import eagle3
from specdraft.model import policy as pol


def draft_loss_on_batch(
  dparams,
  params,
  pcfg: pol.PolicyConfig,
  dcfg: eagle3.DraftConfig,
  batch,
  *,
  attn_impl: str = "dense",
  mesh=None,
  pipeline=None,
):
  """Policy forward under stop_gradient (taps and target logits), then the draft's TTT loss.

  With `pipeline` (a PipelineSpec) the policy runs as a pipeline over 'pp' and the draft's loss
  on the last stage, fed by the TapChannel."""
  if pipeline is not None:
    from specdraft.model import pipelined

    def on_last_stage(theta, dp, logits, taps, b, ref_logits):
      return eagle3.ttt_loss(
        dp,
        dcfg,
        theta["embed"],
        taps.layers,
        jax.lax.stop_gradient(logits),
        b["tokens"],
        b["positions"],
        b["segment_ids"],
        b["loss_mask"],
      )

    return pipelined.loss(
      jax.lax.stop_gradient(params),
      dparams,
      batch,
      on_last_stage,
      pcfg=pcfg,
      mesh=mesh,
      spec=pipeline,
    )
  logits, taps = pol.forward(
    params, pcfg, batch["tokens"], batch["positions"], batch["segment_ids"]
  )
  return eagle3.ttt_loss(
    dparams,
    dcfg,
    params["embed"],
    taps.layers,
    jax.lax.stop_gradient(logits),
    batch["tokens"],
    batch["positions"],
    batch["segment_ids"],
    batch["loss_mask"],
    attn_impl=attn_impl,
    mesh=mesh,
  )


def draft_train_step(dstate, params, batch, *, pcfg, dcfg, tx, mesh=None, pipeline=None):
  """One pure draft step on {step, params, opt_state}; the policy is an input, never updated."""
  (_, metrics), grads = jax.value_and_grad(draft_loss_on_batch, has_aux=True)(
    dstate["params"], params, pcfg, dcfg, batch, mesh=mesh, pipeline=pipeline
  )
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
):
  """Rollout from the fixed policy, then one draft step; jitted as one program.

  `dstate["key"]` holds raw PRNG key data (checkpointable) and advances every call.
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
  dstate = {**dstate, "key": jax.random.key_data(key)}
  return draft_train_step(
    dstate, params, batch, pcfg=pcfg, dcfg=dcfg, tx=tx, mesh=mesh, pipeline=pipeline
  )
