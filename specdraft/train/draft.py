"""Draft pretraining by distillation: the (fixed) SFT policy generates completions, and the
draft learns the policy's distribution on them (EAGLE-3's TTT loss or a block draft's loss)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specdraft.decode import autoregressive
from specdraft.decode.sampling import join_prompt_completion
from specdraft.train import sequence
from specdraft.train import step as step_lib
from specdraft.train.spec import StepSpec


def draft_loss(dparams, params, batch, spec: StepSpec):
  """The draft's loss (EAGLE-3's TTT loss or a block draft's) on a batch laid out by
  `sequence.zigzag_order`, the policy fixed (under stop_gradient), run by `sequence.run` under `spec`
  (on sequence shards over the mesh's 'cp' axis, or on the pipeline's last stage)."""
  theta = jax.lax.stop_gradient(params)
  return sequence.run(sequence.draft_terms, spec, (theta, dparams, None), batch)


def draft_train_step(dstate, params, batch, spec: StepSpec):
  """One pure draft step on {step, params, opt_state, ...}; the policy is an input, never
  updated (`spec.tx` the draft's optimizer)."""
  loss = lambda d, b: draft_loss(d, params, b, spec)  # noqa: E731
  return step_lib.train_step(loss, dstate, batch, spec.tx, norms="draft_grad_norm")


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
  dstate, params, prompts_BP, prompt_lengths_B, *, spec: StepSpec, max_new_tokens: int,
  temperature: float,
):  # fmt: skip
  """Rollout from the fixed policy, then one draft step; jitted as one program.

  The rollout batch is laid out (zigzag over the mesh's cp) where it is built. `dstate["key"]`
  holds raw PRNG key data (checkpointable) and advances every call.
  """
  key, sub = jax.random.split(jax.random.wrap_key_data(dstate["key"]))
  batch, _ = rollout_batch(
    params,
    spec.pcfg,
    prompts_BP,
    prompt_lengths_B,
    sub,
    max_new_tokens=max_new_tokens,
    temperature=temperature,
  )
  batch.pop("logprobs")
  multiple = sequence.row_multiple(spec.compute.attn_kernel)
  batch = sequence.zigzag_order(batch, sequence.cp_size(spec.mesh), multiple=multiple)
  dstate = {**dstate, "key": jax.random.key_data(key)}
  return draft_train_step(dstate, params, batch, spec)
