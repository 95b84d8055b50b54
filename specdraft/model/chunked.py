"""Vocabulary-sized work in sequence chunks: no [B, S, V] float32 array lives through a step.

Log-probabilities, entropies and the draft's soft cross-entropy need the logits of every position,
but only one position's logits at a time. `over_chunks` maps a per-token function over chunks of
the sequence axis with `lax.map` and rematerialises each chunk in the backward pass
(`jax.checkpoint`), so the forward keeps only the chunk inputs (hidden states, width E) and the
vocabulary costs O(B * chunk * V) instead of O(B * S * V) (a 32K vocabulary at 32K local tokens
would be 4 GiB per float32 array).

Shape letters: B batch, S sequence (local), E width, V vocabulary, X any feature width.
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

# run(fn, params, xs) from `parallel.mesh.rows_local`, set by the training steps on a mesh
# (`train.sequence.run`): every chunk loop then runs with its rows local to each device.
_ROWS_LOCAL = contextvars.ContextVar("rows_local", default=None)


@contextlib.contextmanager
def rows_local(run):
  """Within it (while tracing), `over_chunks` runs its loop through `run` (None: directly)."""
  token = _ROWS_LOCAL.set(run)
  try:
    yield
  finally:
    _ROWS_LOCAL.reset(token)


def chunk_size(S: int, chunk: int) -> int:
  """The largest divisor of S that is <= chunk (0 or >= S: the whole row)."""
  if chunk <= 0 or chunk >= S:
    return S
  c = chunk
  while S % c:
    c -= 1
  return c


def over_chunks(fn, chunk: int, *xs_BS, params=()):
  """fn(params, *xs) computed chunk by chunk along axis 1 of every x (outputs [B, S, ...]
  pytrees). `params` holds every array `fn` reads besides the chunks (the LM heads): `fn` must
  not close over traced arrays.

  Each chunk's intermediates are recomputed in the backward pass, never saved. Under
  `rows_local` (the training steps on a mesh) the whole loop runs on each device's own rows,
  with `params` whole on every device: gathered once and their gradient summed once
  (`parallel.mesh.rows_local`), not on every chunk."""
  run = _ROWS_LOCAL.get()
  loop = lambda p, *xs: _over_chunks(fn, chunk, p, *xs)
  return loop(params, *xs_BS) if run is None else run(loop, params, xs_BS)


def _over_chunks(fn, chunk: int, params, *xs_BS):
  S = xs_BS[0].shape[1]
  c = chunk_size(S, chunk)
  if c == S:
    return fn(params, *xs_BS)
  n = S // c

  def split(x):
    return jnp.moveaxis(x.reshape(x.shape[0], n, c, *x.shape[2:]), 1, 0)

  def merge(y):
    y = jnp.moveaxis(y, 0, 1)
    return y.reshape(y.shape[0], n * c, *y.shape[3:])

  outs = jax.lax.map(jax.checkpoint(lambda args: fn(params, *args)), tuple(split(x) for x in xs_BS))
  return jax.tree.map(merge, outs)


def logits(h_BSE, w_EV):
  return jnp.einsum("bse,ev->bsv", h_BSE, w_EV.astype(h_BSE.dtype)).astype(jnp.float32)


def logprob_and_entropy(h_BSE, w_EV, targets_BS, *, chunk: int, transform=None):
  """Per position, from softmax(h W): log-prob of the target and entropy (float32 [B, S]), and
  whether the target is the argmax (bool [B, S]). `transform` (logits -> logits, e.g. the
  rollouts' temperature and top-k / top-p: `decode.sampling.processed_logits`) is applied to
  each chunk's logits first."""

  def per_chunk(params, h, t):
    z = logits(h, params)
    if transform is not None:
      z = transform(z)
    lp = jax.nn.log_softmax(z, axis=-1)
    ent = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
    top1 = jnp.argmax(z, axis=-1) == t
    return jnp.take_along_axis(lp, t[..., None], axis=-1)[..., 0], ent, top1

  return over_chunks(per_chunk, chunk, h_BSE, targets_BS, params=w_EV)


def soft_cross_entropy(
  target_BSX, target_logits_of, draft_BSE, draft_logits_of, *, chunk: int, params=(None, None)
):
  """-sum_v p log q with p = softmax(target_logits_of(params[0], target)) under stop_gradient
  and q = softmax(draft_logits_of(params[1], draft)), per position; plus top-1 agreement of the
  two. `params` = (what the target logits read, what the draft logits read): see `over_chunks`.

  Returns (ce [B, S] float32, agree [B, S] bool)."""

  def per_chunk(params, t, d):
    tl = jax.lax.stop_gradient(target_logits_of(params[0], t)).astype(jnp.float32)
    dl = draft_logits_of(params[1], d).astype(jnp.float32)
    ce = -jnp.sum(jax.nn.softmax(tl, axis=-1) * jax.nn.log_softmax(dl, axis=-1), axis=-1)
    return ce, jnp.argmax(dl, -1) == jnp.argmax(tl, -1)

  return over_chunks(per_chunk, chunk, target_BSX, draft_BSE, params=params)
