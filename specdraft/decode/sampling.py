"""Token sampling shared by autoregressive and speculative decoding.

Shape letters: B batch, S prompt width (BOS + prompt, right-padded), O max new tokens (the output),
V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdraft.tasks.tokenizer import PAD


class Sampling(NamedTuple):
  """A sampling setting (hashable: a static argument): temperature (0 = greedy), top_k (0 = off),
  top_p (1 = off)."""

  temperature: float = 1.0
  top_k: int = 0
  top_p: float = 1.0


# Logits of tokens outside the top-k / top-p set: finite, so log-probabilities, entropies and
# their gradients stay free of NaN (exp gives exactly 0).
MASKED = -1e30


def processed_logits(logits_V, temperature: float, top_k: int = 0, top_p: float = 1.0):
  """The logits of the distribution actually sampled (float32, any leading axes): divided by
  `temperature` (> 0), then every token outside the `top_k` largest (0: off) and outside the
  smallest most-probable set whose mass reaches `top_p` (1: off; top-k first, then top-p, both
  keeping ties) set to MASKED. softmax of the result is the truncated, renormalised target that
  autoregressive sampling, the draft and SD verification all use."""
  z = logits_V.astype(jnp.float32) / temperature
  if top_k and top_k < z.shape[-1]:
    kth = jax.lax.top_k(jax.lax.stop_gradient(z), top_k)[0][..., -1:]
    z = jnp.where(z >= kth, z, MASKED)
  if top_p < 1.0:
    p = jax.nn.softmax(jax.lax.stop_gradient(z), axis=-1)
    p_desc = -jnp.sort(-p, axis=-1)
    kept = (jnp.cumsum(p_desc, axis=-1) - p_desc) < top_p  # mass before a token < top_p
    n_kept = jnp.sum(kept, axis=-1, keepdims=True)
    smallest = jnp.take_along_axis(p_desc, n_kept - 1, axis=-1)
    z = jnp.where(p >= smallest, z, MASKED)
  return z


def distribution(logits_V, temperature: float, top_k: int = 0, top_p: float = 1.0):
  """(probs, logp) of the distribution sampled, float32, any leading axes, from ONE pass of
  `processed_logits` (whose top-p sorts the vocabulary): probs is what verification compares
  (one-hot argmax at temperature 0), logp the log-softmax that tokens are drawn from and
  behaviour log-probs are read from (at temperature 0 the policy's own, untempered)."""
  z = logits_V.astype(jnp.float32)
  if temperature == 0:
    return jax.nn.one_hot(jnp.argmax(z, -1), z.shape[-1], dtype=jnp.float32), (
      jax.nn.log_softmax(z, axis=-1)
    )
  z = processed_logits(z, temperature, top_k, top_p)
  return jax.nn.softmax(z, axis=-1), jax.nn.log_softmax(z, axis=-1)


def draw(key, logp_BV, temperature: float):
  """A token from `distribution(...)[1]`: its argmax at temperature 0, else a sample of it
  (log-probs differ from the processed logits by a constant per row: the same distribution)."""
  if temperature == 0:
    return jnp.argmax(logp_BV, -1).astype(jnp.int32)
  return jax.random.categorical(key, logp_BV).astype(jnp.int32)


def draw_rows(keys_B, logp_BV, temperature: float):
  """One token per row, each from its own key (`draw`): a row's draws depend on its key alone,
  not on the batch it decodes in."""
  return jax.vmap(lambda k, lp: draw(k, lp, temperature))(keys_B, logp_BV)


def split_rows(keys_B, n: int):
  """Each row's key split in n: a list of n [B] key arrays."""
  ks_Bn = jax.vmap(lambda k: jax.random.split(k, n))(keys_B)
  return [ks_Bn[:, i] for i in range(n)]


def num_active(carry):
  """Rows of a decoding loop's carry still generating."""
  return jnp.sum(~carry["done"]).astype(jnp.int32)


def take(logp_BV, tokens_B):
  """log-probs of `tokens` from `distribution(...)[1]` (negative ids read entry 0)."""
  return jnp.take_along_axis(logp_BV, jnp.maximum(tokens_B, 0)[..., None], -1)[..., 0]


def probs_at(logits_V, temperature: float, top_k: int = 0, top_p: float = 1.0):
  """The distribution sampled (0 = greedy one-hot), float32; any leading axes."""
  return distribution(logits_V, temperature, top_k, top_p)[0]


def sample(key, logits_BV, temperature: float, top_k: int = 0, top_p: float = 1.0):
  return draw(key, distribution(logits_BV, temperature, top_k, top_p)[1], temperature)


def logprob_at(logits_BV, tokens_B, temperature: float, top_k: int = 0, top_p: float = 1.0):
  """Behaviour log-probability of `tokens` under the distribution they were sampled from (at
  temperature 0, greedy, the policy's own log-softmax). Any leading axes."""
  return take(distribution(logits_BV, temperature, top_k, top_p)[1], tokens_B)


class Generation(NamedTuple):
  """Output of `generate` (autoregressive or speculative; same interface).

  tokens [B,O]: generated tokens, PAD after the end; logprobs [B,O]: the behaviour log-prob of
  each token under the distribution it was sampled from (temperature, top-k, top-p:
  `logprob_at`; 0 after the end); lengths [B]: tokens generated including EOS;
  stats: decoding statistics (policy_passes, and for SD the acceptance counters).
  """

  tokens: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  stats: dict


def join_prompt_completion(prompt_BS, prompt_lengths_B, gen: Generation):
  """Rows of [prompt ; completion ; PAD] as a training batch (one document per row).

  Returns a dict of [B, S+O] arrays: tokens, positions, segment_ids (1 on real tokens) and
  loss_mask (1 on completion tokens), plus `logprobs` (behaviour log-probs aligned with tokens).
  """
  B, S = prompt_BS.shape
  O = gen.tokens.shape[1]
  i = jnp.arange(S + O)[None]
  plen, glen = prompt_lengths_B[:, None], gen.lengths[:, None]
  in_prompt = i < plen
  in_gen = (i >= plen) & (i < plen + glen)
  gi = jnp.clip(i - plen, 0, O - 1)
  tokens = jnp.where(
    in_prompt,
    jnp.take_along_axis(prompt_BS, jnp.minimum(i, S - 1), 1),
    jnp.where(in_gen, jnp.take_along_axis(gen.tokens, gi, 1), PAD),
  )
  logprobs = jnp.where(in_gen, jnp.take_along_axis(gen.logprobs, gi, 1), 0.0)
  valid = in_prompt | in_gen
  return {
    "tokens": tokens.astype(jnp.int32),
    "positions": jnp.where(valid, i, 0).astype(jnp.int32),
    "segment_ids": valid.astype(jnp.int32),
    "loss_mask": in_gen.astype(jnp.float32),
    "logprobs": logprobs,
  }
