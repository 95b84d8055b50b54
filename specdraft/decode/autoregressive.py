"""Plain autoregressive generation with a KV cache (jittable, static shapes, per-row stop)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from specdraft.decode.sampling import Generation, sample
from specdraft.model import policy as pol
from specdraft.tasks.tokenizer import EOS, PAD


@functools.partial(jax.jit, static_argnames=("cfg", "max_new_tokens", "temperature"))
def generate(
  params,
  cfg: pol.PolicyConfig,
  prompt_BP,
  prompt_lengths_B,
  key,
  *,
  max_new_tokens: int,
  temperature: float,
) -> Generation:
  """Samples up to `max_new_tokens` per row after right-padded prompts; stops rows at EOS.

  One policy pass per generated token; the loop ends early once every row has stopped.
  """
  B, P = prompt_BP.shape
  N = max_new_tokens
  cache = pol.init_cache(cfg, B, P + N)
  logits, _, cache = pol.prefill(params, cfg, cache, prompt_BP, prompt_lengths_B)
  last = jnp.take_along_axis(logits, (prompt_lengths_B - 1)[:, None, None], axis=1)[:, 0]

  def cond(c):
    step, done = c[0], c[4]
    return (step < N) & ~jnp.all(done)

  def body(c):
    step, cache, last, key, done, toks, lps, passes = c
    key, sub = jax.random.split(key)
    tok = sample(sub, last, temperature)
    lp = jnp.take_along_axis(jax.nn.log_softmax(last), tok[:, None], -1)[:, 0]
    toks = toks.at[:, step].set(jnp.where(done, PAD, tok))
    lps = lps.at[:, step].set(jnp.where(done, 0.0, lp))
    done = done | (tok == EOS)
    logits, _, cache = pol.decode(params, cfg, cache, tok[:, None])
    return step + 1, cache, logits[:, 0], key, done, toks, lps, passes + 1

  init = (
    jnp.int32(0),
    cache,
    last,
    key,
    jnp.zeros((B,), bool),
    jnp.full((B, N), PAD, jnp.int32),
    jnp.zeros((B, N), jnp.float32),
    jnp.int32(1),
  )
  _, _, _, _, _, toks, lps, passes = jax.lax.while_loop(cond, body, init)
  lengths = output_lengths(toks)
  return Generation(toks, lps, lengths, {"policy_passes": passes})


def output_lengths(tokens_BN):
  """Generated length per row: up to and including the first EOS, else N."""
  N = tokens_BN.shape[1]
  is_eos = tokens_BN == EOS
  first = jnp.argmax(is_eos, axis=1)
  return jnp.where(is_eos.any(1), first + 1, N).astype(jnp.int32)
