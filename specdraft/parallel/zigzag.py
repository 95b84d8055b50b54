"""Zigzag order for context parallelism (token order only; knows nothing of models).

A row of length S (padded to a multiple of 2*cp with segment 0) is cut into 2*cp chunks; CP rank
r holds chunks r and 2*cp-1-r, so causal attention work is balanced across ranks. The
permutation is applied once per batch, on the data side, to every per-token array.

That balances one causal document per row. A packed row (many documents, each attending only
to itself) needs the same cut made per document: `document_permutation` splits every document
into 2*cp chunks and gives rank r chunk r of each document, then chunk 2*cp-1-r of each, so
every rank holds an equal share of every document's causal triangle. Each document's length must be a
multiple of 2*cp (the packer pads documents to that granule; `document_lengths` reads the
documents of a row from its segment ids).
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


def document_lengths(segment_ids_S) -> np.ndarray:
  """Lengths of the maximal runs of equal segment id in one row (host; padding runs included)."""
  seg = np.asarray(segment_ids_S)
  if seg.ndim != 1 or seg.size == 0:
    raise ValueError(f"segment ids must be one non-empty row, got shape {seg.shape}")
  starts = np.flatnonzero(np.r_[True, seg[1:] != seg[:-1]])
  return np.diff(np.r_[starts, seg.size])


def document_permutation(lengths, cp: int) -> np.ndarray:
  """Indices `perm` with ordered = natural[perm] for a row of consecutive documents of the given
  lengths. Rank r holds chunk r of every document (in document order), then chunk 2cp-1-r of
  every document. Keeping the two halves apart keeps the balance at tile granularity: a tile of
  first halves on rank r sees the first halves of ranks <= r only, a tile of second halves sees
  every first half and the second halves of ranks >= r, 2cp+1 chunk pairs per document on every
  rank. With one document this is `permutation`."""
  lengths = np.asarray(lengths, np.int64)
  bad = [int(n) for n in lengths if n <= 0 or n % (2 * cp)]
  if bad:
    raise ValueError(
      f"document lengths {bad[:5]} are not positive multiples of 2*cp={2 * cp}: pack documents "
      f"to a granule of {2 * cp} tokens (padding inside each document) for the per-document "
      "zigzag order"
    )
  starts = np.r_[0, np.cumsum(lengths)[:-1]]
  chunk = lambda j: np.concatenate(
    [s + j * (n // (2 * cp)) + np.arange(n // (2 * cp)) for s, n in zip(starts, lengths)]
  )
  return np.concatenate([np.concatenate([chunk(r), chunk(2 * cp - 1 - r)]) for r in range(cp)])


def to_zigzag(x, cp: int, axis: int = 1):
  return jnp.take(x, jnp.asarray(permutation(x.shape[axis], cp)), axis=axis)


def from_zigzag(x, cp: int, axis: int = 1):
  inv = np.argsort(permutation(x.shape[axis], cp))
  return jnp.take(x, jnp.asarray(inv), axis=axis)


def shift_local(x, n: int, *, axis_name: str, cp: int, fill=0):
  """Per-shard global shift `out[t] = x[t + n]` of data in zigzag order (axis 1).

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
