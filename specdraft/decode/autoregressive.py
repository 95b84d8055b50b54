"""Plain autoregressive generation with a KV cache (jittable, static shapes, per-row stop).

Shape letters: B batch, S prompt width (BOS + prompt, right-padded), O max new tokens (the output),
V vocabulary.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdraft.decode.sampling import (
  Generation,
  Sampling,
  distribution,
  draw_rows,
  num_active,
  split_rows,
  take,
)
from specdraft.model import policy as pol
from specdraft.tasks.tokenizer import EOS, PAD


@functools.partial(
  jax.jit, static_argnames=("cfg", "max_new_tokens", "temperature", "top_k", "top_p")
)
def generate(
  params,
  cfg: pol.PolicyConfig,
  prompt_BS,
  prompt_lengths_B,
  key,
  *,
  max_new_tokens: int,
  temperature: float,
  top_k: int = 0,
  top_p: float = 1.0,
) -> Generation:
  """Samples up to `max_new_tokens` per row after right-padded prompts; stops rows at EOS
  (`cfg.eos_id`, or one of `cfg.stop_ids`).

  Tokens come from `sampling.processed_logits` (temperature, then top-k, then top-p); the
  recorded log-probs are of that distribution. One policy pass per generated token; the loop
  ends early once every row has stopped. Every row draws from its own key (split from `key`),
  so `decode.engine` can compact finished rows away without changing any row's tokens.
  """
  spec = Spec(cfg, max_new_tokens, Sampling(temperature, top_k, top_p))
  carry = init(params, prompt_BS, prompt_lengths_B, key, spec=spec)
  return finish(run(params, carry, jnp.int32(0), spec=spec), spec)


class Spec(NamedTuple):
  """The static settings of one generation (hashable: part of the compiled program)."""

  pcfg: pol.PolicyConfig
  max_new_tokens: int  # O
  sampling: Sampling


def init(params, prompt_BS, prompt_lengths_B, key, *, spec: Spec) -> dict:
  """The prefill: the loop's carry (one PRNG key per row, split from `key`)."""
  B, S = prompt_BS.shape
  O = spec.max_new_tokens
  cache = pol.init_cache(spec.pcfg, B, S + O)
  logits_BSV, _, cache = pol.prefill(params, spec.pcfg, cache, prompt_BS, prompt_lengths_B)
  last_BV = jnp.take_along_axis(logits_BSV, (prompt_lengths_B - 1)[:, None, None], axis=1)[:, 0]
  return {
    "step": jnp.int32(0),
    "cache": cache,
    "last": last_BV,
    "key": jax.random.split(key, B),
    "done": jnp.zeros((B,), bool),
    "tokens": jnp.full((B, O), PAD, jnp.int32),
    "logprobs": jnp.zeros((B, O), jnp.float32),
    "stats": {
      "policy_passes": jnp.int32(1),
      "row_passes": jnp.int32(B),
      "active_trace": jnp.zeros((O,), jnp.int32),
    },
  }


def run(params, carry, stop_below, *, spec: Spec) -> dict:
  """Steps until every row is done, O tokens are out, or no more than `stop_below` rows still
  generate (the engine then compacts them into a smaller batch)."""
  cfg, O, sm = spec.pcfg, spec.max_new_tokens, spec.sampling

  def cond(c):  # stop_below >= 0: some row is active
    return (c["step"] < O) & (num_active(c) > stop_below)

  def body(c):
    step, done_B = c["step"], c["done"]
    keys_B, sub_B = split_rows(c["key"], 2)
    _, logp_BV = distribution(c["last"], *sm)
    token_B = draw_rows(sub_B, logp_BV, sm.temperature)
    logprob_B = take(logp_BV, token_B)
    logits_B1V, _, cache = pol.decode(params, cfg, c["cache"], token_B[:, None])
    st = dict(c["stats"])
    st["policy_passes"] += 1
    st["row_passes"] += done_B.shape[0]
    st["active_trace"] = st["active_trace"].at[step].set(num_active(c), mode="drop")
    return {
      "step": step + 1,
      "cache": cache,
      "last": logits_B1V[:, 0],
      "key": keys_B,
      "done": done_B | pol.is_stop(cfg, token_B) | (step + 1 >= O),  # O tokens out: done too
      "tokens": c["tokens"].at[:, step].set(jnp.where(done_B, PAD, token_B)),
      "logprobs": c["logprobs"].at[:, step].set(jnp.where(done_B, 0.0, logprob_B)),
      "stats": st,
    }

  return jax.lax.while_loop(cond, body, carry)


def finish(carry, spec: Spec) -> Generation:
  """The batch's Generation from the loop's carry."""
  tokens_BO = carry["tokens"]
  return Generation(
    tokens_BO, carry["logprobs"], output_lengths(tokens_BO, spec.pcfg), carry["stats"]
  )


def output_lengths(tokens_BO, cfg=None):
  """Generated length per row: up to and including the first stop token (`cfg`'s EOS and stop
  ids; the character tokenizer's EOS without a config), else O."""
  O = tokens_BO.shape[1]
  is_eos_BO = tokens_BO == EOS if cfg is None else pol.is_stop(cfg, tokens_BO)
  first_B = jnp.argmax(is_eos_BO, axis=1)
  return jnp.where(is_eos_BO.any(1), first_B + 1, O).astype(jnp.int32)
