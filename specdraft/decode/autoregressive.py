"""Plain autoregressive generation with a KV cache (jittable, static shapes, per-row stop).

Shape letters: B batch, S prompt width (BOS + prompt, right-padded), N max new tokens,
V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specdraft.decode.sampling import Generation, distribution, draw, take
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
  ends early once every row has stopped.
  """
  B, S = prompt_BS.shape
  N = max_new_tokens
  cache = pol.init_cache(cfg, B, S + N)
  logits_BSV, _, cache = pol.prefill(params, cfg, cache, prompt_BS, prompt_lengths_B)
  last_BV = jnp.take_along_axis(logits_BSV, (prompt_lengths_B - 1)[:, None, None], axis=1)[:, 0]

  def cond(carry):
    step, done_B = carry[0], carry[4]
    return (step < N) & ~jnp.all(done_B)

  def body(carry):
    step, cache, last_BV, key, done_B, tokens_BN, logprobs_BN, passes = carry
    key, sub = jax.random.split(key)
    _, logp_BV = distribution(last_BV, temperature, top_k, top_p)
    token_B = draw(sub, logp_BV, temperature)
    logprob_B = take(logp_BV, token_B)
    tokens_BN = tokens_BN.at[:, step].set(jnp.where(done_B, PAD, token_B))
    logprobs_BN = logprobs_BN.at[:, step].set(jnp.where(done_B, 0.0, logprob_B))
    done_B = done_B | pol.is_stop(cfg, token_B)
    logits_B1V, _, cache = pol.decode(params, cfg, cache, token_B[:, None])
    return step + 1, cache, logits_B1V[:, 0], key, done_B, tokens_BN, logprobs_BN, passes + 1

  init = (
    jnp.int32(0),
    cache,
    last_BV,
    key,
    jnp.zeros((B,), bool),
    jnp.full((B, N), PAD, jnp.int32),
    jnp.zeros((B, N), jnp.float32),
    jnp.int32(1),
  )
  _, _, _, _, _, tokens_BN, logprobs_BN, passes = jax.lax.while_loop(cond, body, init)
  lengths_B = output_lengths(tokens_BN, cfg)
  return Generation(tokens_BN, logprobs_BN, lengths_B, {"policy_passes": passes})


def output_lengths(tokens_BN, cfg=None):
  """Generated length per row: up to and including the first stop token (`cfg`'s EOS and stop
  ids; the character tokenizer's EOS without a config), else N."""
  N = tokens_BN.shape[1]
  is_eos_BN = tokens_BN == EOS if cfg is None else pol.is_stop(cfg, tokens_BN)
  first_B = jnp.argmax(is_eos_BN, axis=1)
  return jnp.where(is_eos_BN.any(1), first_B + 1, N).astype(jnp.int32)
