"""A GPipe-style microbatched pipeline over the mesh axis 'pp', for use inside `jax.shard_map`.

Stage `s` owns a contiguous slice of stacked layer parameters (the leading axis sharded over
'pp'). The loop runs `M + P - 1` iterations in one `lax.scan`: at iteration `i` stage `s` works
on microbatch `m = i - s` (the others are bubble iterations whose results are never used), then
every stage's output moves to the next stage with one `ppermute` `[(s, s+1)]`. The backward
schedule comes from autodiff (the transpose of a ppermute is the inverse permutation).

A `TapChannel` (parallel/tap.py) can ride along: the stage function returns a tap buffer
beside its output and the channel moves it to the last stage on its own path; the main shift
is the same program with or without it.

Nothing here knows about models: `stage_fn(stage_params, x, side) -> (y, taps or None)`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specdraft.parallel.tap import MODES, TapChannel


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  """How the policy is pipelined (config section `parallel.pipeline`)."""

  microbatches: int = 4
  tap_mode: str = "direct"
  tap_delay: bool = False
  remat: bool = False
  axis_name: str = "pp"

  def __post_init__(self):
    if not isinstance(self.microbatches, int) or self.microbatches < 1:
      raise ValueError(f"parallel.pipeline.microbatches={self.microbatches!r} must be an int >= 1")
    if self.tap_mode not in MODES:
      raise ValueError(
        f"parallel.pipeline.tap_mode={self.tap_mode!r} is unknown; expected one of {MODES}"
      )
    if self.tap_delay and self.tap_mode != "direct":
      raise ValueError("parallel.pipeline.tap_delay=True only applies to tap_mode='direct'")

  @classmethod
  def from_config(cls, pipeline_cfg) -> PipelineSpec:
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: pipeline_cfg[k] for k in names if k in pipeline_cfg})


def _is_varying(x, axis_name: str) -> bool:
  mat = getattr(jax.typeof(x), "manual_axis_type", None)
  return mat is not None and axis_name in mat.varying


def varying(tree, axis_name: str):
  """Marks values as varying over `axis_name` (zero-initialised scan carries, both branches of a
  stage-dependent `cond`); values already varying are left alone."""
  return jax.tree.map(
    lambda x: x if _is_varying(x, axis_name) else jax.lax.pcast(x, (axis_name,), to="varying"), tree
  )


def on_stage(stage: int, fn, *args, axis_name: str = "pp"):
  """`fn(*args)` evaluated only on pipeline stage `stage` (`lax.cond`); other stages get zeros
  of the same shapes. Results are varying over `axis_name`.

  Every argument is cast to varying BEFORE the cond: an invariant value turned varying inside a
  branch would put the transpose's psum inside that branch, which the other stages never run.
  """
  args = varying(args, axis_name)
  shapes = jax.eval_shape(fn, *args)
  others = lambda *_: jax.tree.map(lambda s: _zeros_varying_like(s, axis_name), shapes)
  return jax.lax.cond(
    jax.lax.axis_index(axis_name) == stage, lambda *a: varying(fn(*a), axis_name), others, *args
  )


def kept_on_stage(stage: int, fn, *args, axis_name: str = "pp"):
  """`fn(*args)` evaluated on every stage and kept on stage `stage` (zeros elsewhere, and zero
  cotangents into the other stages' evaluations).

  For a `fn` with collectives over another manual axis (the last stage's objective under
  pp x cp: ring attention, shifts and sums over 'cp'). Inside `on_stage`'s `cond` only the
  devices of that stage would reach them, and a collective waits for every device of the program
  (XLA's rendezvous is module-wide): it would hang. The other stages' evaluations run while they
  would otherwise wait for the last stage."""
  out = fn(*args)
  keep = jax.lax.axis_index(axis_name) == stage
  return jax.tree.map(lambda x: varying(jnp.where(keep, x, jnp.zeros_like(x)), axis_name), out)


def _varying_axes(aval) -> set:
  mat = getattr(aval, "manual_axis_type", None)
  return set(getattr(mat, "varying", ()) or ())


def _vary_like(x, aval, axis_name: str):
  """x varying over `axis_name` and over every axis `aval` varies over (e.g. 'cp' under pp x cp,
  where per-token values vary over both)."""
  return jax.lax.pcast(x, tuple(sorted(_varying_axes(aval) | {axis_name})), to="varying")


def _zeros_varying_like(s, axis_name: str):
  """Zeros of `s`'s shape and dtype, varying like `s` and over `axis_name`."""
  return _vary_like(jnp.zeros(s.shape, s.dtype), s, axis_name)


def split_microbatches(x, num_microbatches: int):
  """[B, ...] -> [M, B/M, ...] with row r in microbatch r % M.

  Interleaving keeps a batch sharded in contiguous blocks (over 'data') evenly spread: every
  data shard holds the same rows of every microbatch, so no resharding is needed.
  """
  B = x.shape[0]
  if B % num_microbatches:
    raise ValueError(
      f"batch of {B} rows cannot be split into parallel.pipeline.microbatches={num_microbatches}"
    )
  return jnp.swapaxes(x.reshape((B // num_microbatches, num_microbatches) + x.shape[1:]), 0, 1)


def merge_microbatches(x):
  """Inverse of `split_microbatches`: [M, B/M, ...] -> [B, ...]."""
  return jnp.swapaxes(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def gpipe(
  stage_fn,
  stage_params,
  first_inputs,
  side,
  *,
  num_stages: int,
  axis_name: str = "pp",
  channel: TapChannel | None = None,
  remat: bool = False,
  return_sent: bool = False,
):
  """Runs the pipeline; call inside shard_map with `axis_name` manual.

  stage_params: this stage's parameters (its slice of the stacked layers).
  first_inputs: [M, ...] the first stage's input for every microbatch (e.g. embeddings).
  side: pytree of [M, ...] per-microbatch inputs every stage reads (positions, segment ids).
  stage_fn(stage_params, x, side_m) -> (y, tap_buffer or None), y shaped like x.

  Returns (outputs [M, ...], received taps [M, N, ...] or None, sent): outputs and received
  taps are meaningful on the last stage only. With `return_sent` (and a channel), `sent` is this
  stage's own tap buffer for every microbatch [M, ...] (for tests and benchmarks), else None.
  """
  P = num_stages
  M = first_inputs.shape[0]
  n_iter = M + P - 1
  stage = jax.lax.axis_index(axis_name)
  fn = jax.checkpoint(stage_fn) if remat else stage_fn
  shift = [(s, s + 1) for s in range(P - 1)]

  x0 = varying(jnp.zeros_like(first_inputs[0]), axis_name)
  probe = jax.eval_shape(fn, stage_params, x0, jax.tree.map(lambda a: a[0], side))
  buf_aval = probe[1]
  if channel is not None and buf_aval is None:
    raise ValueError("a TapChannel needs a stage function that returns a tap buffer")
  ch0 = None
  if channel is not None:
    # the carry varies wherever the taps do (over 'cp' too when the rows are sequence shards)
    ch0 = jax.tree.map(
      lambda z: _vary_like(z, buf_aval, axis_name),
      channel.init(M, buf_aval.shape[1:], buf_aval.dtype),
    )

  def body(carry, it):
    x_prev, ch = carry
    m = jnp.clip(it - stage, 0, M - 1)
    x_first = jax.lax.dynamic_index_in_dim(first_inputs, jnp.clip(it, 0, M - 1), 0, False)
    x_in = jnp.where(stage == 0, x_first, x_prev)
    side_m = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, m, 0, False), side)
    y, buf = fn(stage_params, x_in, side_m)
    if channel is not None:
      ch = channel.step(ch, buf, it=it, stage=stage)
    x_next = jax.lax.ppermute(y, axis_name, perm=shift) if P > 1 else y
    return (x_next, ch), y

  (_, ch), ys = jax.lax.scan(body, (x0, ch0), jnp.arange(n_iter, dtype=jnp.int32))
  outputs = ys[P - 1 :]  # the last stage works on microbatch m at iteration m + P - 1
  recv, sent = None, None
  if channel is not None:
    recv = channel.finish(ch, num_iterations=n_iter, stage=stage)
    if return_sent:
      sent = ch["own"][:M]  # this stage's own buffer for every microbatch
  return outputs, recv, sent


def schedule(num_microbatches: int, num_stages: int):
  """[(iteration, stage, microbatch or None)] of the GPipe forward (for docs and tests)."""
  out = []
  for it in range(num_microbatches + num_stages - 1):
    for s in range(num_stages):
      m = it - s
      out.append((it, s, m if 0 <= m < num_microbatches else None))
  return out
