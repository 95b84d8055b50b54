"""Zigzag layout for context parallelism (layout only; knows nothing of models).

A row of length S (padded to a multiple of 2*cp with segment 0) is cut into 2*cp chunks; CP rank
r holds chunks r and 2*cp-1-r, so causal attention work is balanced across ranks. The
permutation is applied once per batch, on the data side, to every per-token array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def padded_length(S: int, cp: int) -> int:
  return -(-S // (2 * cp)) * (2 * cp)


def check_length(S: int, cp: int, what: str = "sequence length") -> None:
  if S % (2 * cp):
    raise ValueError(
      f"{what} S={S} is not divisible by 2*cp={2 * cp}; pad rows to "
      f"{padded_length(S, cp)} (segment 0) with zigzag.pad first"
    )


def pad(x, S_pad: int, axis: int = 1, value=0):
  """Pads `axis` of x to S_pad (padding is segment 0 / zeros)."""
  n = S_pad - x.shape[axis]
  if n == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, n)
  return jnp.pad(x, widths, constant_values=value)


def permutation(S: int, cp: int) -> np.ndarray:
  """Indices `perm` with zigzag = natural[perm] (rank r's chunks r, 2cp-1-r, in rank order)."""
  check_length(S, cp)
  c = S // (2 * cp)
  chunks = np.arange(S).reshape(2 * cp, c)
  return np.concatenate([np.concatenate([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def to_zigzag(x, cp: int, axis: int = 1):
  return jnp.take(x, jnp.asarray(permutation(x.shape[axis], cp)), axis=axis)


def from_zigzag(x, cp: int, axis: int = 1):
  inv = np.argsort(permutation(x.shape[axis], cp))
  return jnp.take(x, jnp.asarray(inv), axis=axis)


def shift_local(x, n: int, *, axis_name: str, cp: int, fill=0):
  """Per-shard global shift `out[t] = x[t + n]` of data in zigzag layout (axis 1).

  Runs inside shard_map over `axis_name`; the rank's local rows are [chunk r ; chunk 2cp-1-r].
  The head of chunk r+1 comes from rank r+1 (or from this rank's own second chunk when
  r = cp-1); the head of chunk 2cp-r comes from rank r-1 (rank 0's second chunk is the end of
  the row and is filled). Callers mask document boundaries by shifting segment ids alike.
  """
  c = x.shape[1] // 2
  if x.shape[1] % 2:
    raise ValueError(f"local length {x.shape[1]} is not two equal zigzag chunks")
  while n > c:
    x = shift_local(x, c, axis_name=axis_name, cp=cp, fill=fill)
    n -= c
  if n == 0:
    return x
  first, second = x[:, :c], x[:, c:]
  r = jax.lax.axis_index(axis_name) if cp > 1 else 0
  if cp > 1:
    from_next = jax.lax.ppermute(first[:, :n], axis_name, [(i, i - 1) for i in range(1, cp)])
    from_prev = jax.lax.ppermute(second[:, :n], axis_name, [(i, i + 1) for i in range(cp - 1)])
  else:
    from_next = from_prev = jnp.zeros_like(first[:, :n])
  tail_first = jnp.where(r == cp - 1, second[:, :n], from_next)
  tail_second = jnp.where(r == 0, jnp.full_like(from_prev, fill), from_prev)
  return jnp.concatenate([first[:, n:], tail_first, second[:, n:], tail_second], axis=1)
