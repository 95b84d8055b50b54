"""Token sampling shared by autoregressive and speculative decoding.

Shape letters: B batch, S prompt width (BOS + prompt, right-padded), N max new tokens,
V vocabulary.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from specdraft.tasks.tokenizer import PAD


def probs_at(logits_V, temperature: float):
  """The distribution sampled at `temperature` (0 = greedy one-hot), float32; any leading axes."""
  logits_V = logits_V.astype(jnp.float32)
  if temperature == 0:
    return jax.nn.one_hot(jnp.argmax(logits_V, -1), logits_V.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(logits_V / temperature, axis=-1)


def sample(key, logits_BV, temperature: float):
  if temperature == 0:
    return jnp.argmax(logits_BV, -1).astype(jnp.int32)
  return jax.random.categorical(key, logits_BV.astype(jnp.float32) / temperature).astype(jnp.int32)


class Generation(NamedTuple):
  """Output of `generate` (autoregressive or speculative; same interface).

  tokens [B,N]: generated tokens, PAD after the end; logprobs [B,N]: log pi(token) under the
  policy at temperature 1 (0 after the end); lengths [B]: tokens generated including EOS;
  stats: decoding statistics (policy_passes, and for SD the acceptance counters).
  """

  tokens: jax.Array
  logprobs: jax.Array
  lengths: jax.Array
  stats: dict


def join_prompt_completion(prompt_BS, prompt_lengths_B, gen: Generation):
  """Rows of [prompt ; completion ; PAD] as a training batch (one document per row).

  Returns a dict of [B, S+N] arrays: tokens, positions, segment_ids (1 on real tokens) and
  loss_mask (1 on completion tokens), plus `logprobs` (behaviour log-probs aligned with tokens).
  """
  B, S = prompt_BS.shape
  N = gen.tokens.shape[1]
  i = jnp.arange(S + N)[None]
  plen, glen = prompt_lengths_B[:, None], gen.lengths[:, None]
  in_prompt = i < plen
  in_gen = (i >= plen) & (i < plen + glen)
  gi = jnp.clip(i - plen, 0, N - 1)
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
