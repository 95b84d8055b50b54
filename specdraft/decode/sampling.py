"""Token sampling shared by autoregressive and speculative decoding."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


def probs_at(logits_V, temperature: float):
  """The distribution sampled at `temperature` (0 = greedy one-hot), float32."""
  logits = logits_V.astype(jnp.float32)
  if temperature == 0:
    return jax.nn.one_hot(jnp.argmax(logits, -1), logits.shape[-1], dtype=jnp.float32)
  return jax.nn.softmax(logits / temperature, axis=-1)


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
