"""The policy run as a pipeline over 'pp', its taps carried to the last stage by the TapChannel.

Composition of `parallel.pipeline` (schedule) and `parallel.tap` (channel) with the policy:
stage `s` runs layers `[s L/P, (s+1) L/P)` with `policy.run_layers`; the embedding runs on the
first stage, the final norm and whatever objective the caller gives (RL loss, the draft's loss) on the last
stage. Only 'pp' (and, for training under a 'cp' axis, 'cp') is manual inside the shard_map;
data/fsdp/tensor sharding of the batch and the weights is left to the compiler.

Training (`loss`) runs on sequence shards: with a 'cp' axis every per-token array is sharded on
its sequence axis in zigzag order, every stage's layers attend through the trunk ring and
the last stage runs the objective on its shards from the final hidden state and the taps the
TapChannel delivered (the same objective bodies as the unpipelined step, `train/sequence.py`).

Shape letters as in policy.py; M microbatches of b = B/M rows.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from specdraft.model import policy as pol
from specdraft.parallel import pipeline as pipe
from specdraft.parallel.pipeline import PipelineSpec
from specdraft.parallel.tap import TapChannel, TapPlan, stage_buffer


def tap_plan(pcfg: pol.PolicyConfig, num_stages: int) -> TapPlan:
  return TapPlan(tuple(pcfg.taps), pcfg.n_layers, num_stages)


def num_stages(mesh, axis_name: str = "pp") -> int:
  if axis_name not in mesh.shape:
    raise ValueError(
      f"pipelining needs a mesh with a {axis_name!r} axis (mesh axes {tuple(mesh.shape)})"
    )
  return int(mesh.shape[axis_name])


def check(pcfg: pol.PolicyConfig, spec: PipelineSpec, num_stages: int, batch_rows: int) -> TapPlan:
  """Clear errors before anything compiles: stages, tap layers, microbatches."""
  plan = tap_plan(pcfg, num_stages)
  if batch_rows % spec.microbatches:
    raise ValueError(
      f"batch of {batch_rows} rows cannot be split into "
      f"parallel.pipeline.microbatches={spec.microbatches}"
    )
  return plan


def param_specs(theta, axis_name: str = "pp") -> Any:
  """In-specs of the policy parameters over the pipeline axis: stacked layers split by stage,
  the rest (embedding, final norm, head) on every stage (their gradients are summed)."""
  return {
    k: (
      jax.tree.map(lambda _: PartitionSpec(axis_name), v)
      if k == "layers"
      else jax.tree.map(lambda _: PartitionSpec(), v)
    )
    for k, v in theta.items()
  }


def _stage_fn(
  pcfg: pol.PolicyConfig,
  plan: TapPlan | None,
  axis_name: str,
  stop_tap_gradient: bool,
  attend,
  constrain=None,
):
  def fn(layers, x, side):
    pos, seg = side
    tap_at = () if plan is None else plan.local_union
    x, union, _ = pol.run_layers(
      layers,
      x,
      pcfg,
      positions_BT=pos,
      segment_ids_BT=seg,
      tap_at=tap_at,
      attend=attend,
      constrain=constrain,
    )
    if plan is None:
      return x, None
    buf = stage_buffer(plan, union, jax.lax.axis_index(axis_name))
    return x, (jax.lax.stop_gradient(buf) if stop_tap_gradient else buf)

  return fn


def _run(
  theta,
  tokens_M,
  pos_M,
  seg_M,
  *,
  pcfg,
  spec: PipelineSpec,
  plan: TapPlan | None,
  stages: int,
  stop_tap_gradient: bool,
  return_sent: bool = False,
  attend=None,
  constrain=None,
):
  """Inside the shard_map: embedding, the pipelined layer stack, the tap channel."""
  # The embedding runs on the first stage only (its gradient is scattered there only).
  emb = pipe.on_stage(
    0,
    lambda table, tok: pol.embed({"embed": table}, tok, pcfg),
    theta["embed"],
    tokens_M,
    axis_name=spec.axis_name,
  )  # [M,b,S,E]
  channel = (
    None if plan is None else TapChannel(plan, spec.tap_mode, spec.tap_delay, spec.axis_name)
  )
  fn = _stage_fn(pcfg, plan, spec.axis_name, stop_tap_gradient, attend, constrain)
  return pipe.gpipe(
    fn,
    theta["layers"],
    emb,
    (pos_M, seg_M),
    num_stages=stages,
    axis_name=spec.axis_name,
    channel=channel,
    remat=spec.remat,
    return_sent=return_sent,
  )


def _taps_from(recv_MNbSE):
  """Receiver buffer [M,N,b,S,E] -> tap layers [N,B,S,E] in natural row order."""
  return jax.vmap(pipe.merge_microbatches, in_axes=1)(recv_MNbSE)


def _defaults(tokens_BS, positions_BS, segment_ids_BS):
  B, S = tokens_BS.shape
  if positions_BS is None:
    positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  if segment_ids_BS is None:
    segment_ids_BS = jnp.ones((B, S), jnp.int32)
  return positions_BS, segment_ids_BS


def forward(
  theta,
  pcfg: pol.PolicyConfig,
  tokens_BS,
  positions_BS=None,
  segment_ids_BS=None,
  *,
  mesh,
  spec: PipelineSpec,
  stop_tap_gradient: bool = True,
):
  """Pipelined counterpart of `policy.forward`: (logits_BSV, Taps, sent) where `sent` is every
  stage's own tap buffer per microbatch [P, M, n_max, b, S, E] (what each stage sent).

  The logits and taps are those the last stage holds (its receiver buffer for the taps).
  For tests and benchmarks; training uses `loss` (the objective runs on the last stage).
  """
  positions_BS, segment_ids_BS = _defaults(tokens_BS, positions_BS, segment_ids_BS)
  stages = num_stages(mesh, spec.axis_name)
  plan = check(pcfg, spec, stages, tokens_BS.shape[0])
  split = lambda x: pipe.split_microbatches(x, spec.microbatches)

  def body(theta, tokens_M, pos_M, seg_M):
    outs, recv, sent = _run(
      theta,
      tokens_M,
      pos_M,
      seg_M,
      pcfg=pcfg,
      spec=spec,
      plan=plan,
      stages=stages,
      stop_tap_gradient=stop_tap_gradient,
      return_sent=True,
    )
    h, logits = pol.head(theta, pipe.merge_microbatches(outs), pcfg)
    return logits[None], _taps_from(recv)[None], h[None], sent[None]

  fn = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(
      param_specs(theta, spec.axis_name),
      PartitionSpec(),
      PartitionSpec(),
      PartitionSpec(),
    ),
    out_specs=PartitionSpec(spec.axis_name),
    axis_names={spec.axis_name},
  )
  logits, layers, h, sent = fn(theta, split(tokens_BS), split(positions_BS), split(segment_ids_BS))
  taps = pol.Taps(layers[-1], h[-1])
  if stop_tap_gradient:
    taps = jax.lax.stop_gradient(taps)
  return logits[-1], taps, sent


Objective = Callable[..., tuple[jax.Array, dict]]


def _last_stage(objective, pcfg, ops, theta, extra, batch, outs, recv, ref_outs, ref):
  """The objective on the last stage, from the merged microbatches and the tapped features."""
  h = pol.final_hidden(theta, pipe.merge_microbatches(outs), pcfg)
  if ref_outs is not None:
    ref = (ref, jax.lax.stop_gradient(pipe.merge_microbatches(ref_outs)))
  return objective(ops, theta, extra, h, _taps_from(recv), batch, ref)


def loss(
  theta,
  extra,
  batch,
  objective: Objective,
  *,
  pcfg: pol.PolicyConfig,
  mesh,
  spec: PipelineSpec,
  ops,
  stop_tap_gradient: bool = True,
  ref_theta=None,
):
  """Runs the policy as a pipeline and `objective` on the last stage; returns (loss, metrics).

  objective(ops, theta, extra, h_BSE, taps_NBSE, batch, ref) -> (scalar loss, {name: scalar})
  on this rank's sequence shard: h is the final normed hidden state, taps the tapped layers (as
  the TapChannel delivered them), ref None or (ref_theta, the reference policy's final hidden
  state) when `ref_theta` is given.
  `ops` (a `train.sequence.ShardOps`) names the context-parallel axis and degree: with
  ops.cp > 1 the shard_map is manual over 'pp' and the cp axis, every per-token array of
  `batch` (laid out once by `sequence.zigzag_order`) is sharded on its sequence axis, and every
  stage attends through `ops.trunk()` (the ring); at cp = 1 the same tiled attention runs
  without collectives. `extra` (e.g. the draft's parameters) is visible on every stage; only the
  last stage's objective counts: at cp = 1 only the last stage evaluates it (`lax.cond`); under
  cp every stage evaluates it and keeps the last stage's (`pipeline.kept_on_stage`: collectives
  inside a branch some devices skip would hang). The result is summed over 'pp'. `ref_theta` (a frozen reference policy) runs through the same pipeline
  without taps.
  """
  tokens = batch["tokens"]
  positions, segs = _defaults(tokens, batch.get("positions"), batch.get("segment_ids"))
  stages = num_stages(mesh, spec.axis_name)
  plan = check(pcfg, spec, stages, tokens.shape[0])
  split = lambda x: pipe.split_microbatches(x, spec.microbatches)
  ax = spec.axis_name
  cp_axis = ops.axis if ops.cp > 1 else None

  run = functools.partial(
    _run, pcfg=pcfg, spec=spec, stages=stages, attend=ops.trunk(), constrain=ops.constrain
  )

  def body(theta, extra, batch, ref_theta, tokens_M, pos_M, seg_M):
    outs, recv, _ = run(
      theta, tokens_M, pos_M, seg_M, plan=plan, stop_tap_gradient=stop_tap_gradient
    )
    ref_outs = None
    if ref_theta is not None:
      ref_theta = jax.lax.stop_gradient(ref_theta)
      ref_outs, _, _ = run(ref_theta, tokens_M, pos_M, seg_M, plan=None, stop_tap_gradient=True)
      ref_outs = pol.final_hidden(ref_theta, ref_outs, pcfg)
    last_stage = functools.partial(_last_stage, objective, pcfg, ops)
    # with collectives over 'cp' in the objective every stage evaluates it (see kept_on_stage)
    select = pipe.on_stage if cp_axis is None else pipe.kept_on_stage
    out = select(
      stages - 1, last_stage, theta, extra, batch, outs, recv, ref_outs, ref_theta, axis_name=ax
    )
    return jax.lax.psum(out, ax)

  fn = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=_in_specs(theta, batch, ref_theta, ax, cp_axis),
    out_specs=PartitionSpec(),
    axis_names={ax} if cp_axis is None else {ax, cp_axis},
    # unchecked, so that the last stage's vocabulary loops can run rows-local
    # (`parallel.mesh.rows_local` nests a shard_map over the batch axes, whose cotangents carry
    # no varying-axes annotations): their head gradients are then reduced once per loop, not per
    # chunk. Parity with the unpipelined step is tested per layout.
    check_vma=False,
  )
  return fn(theta, extra, batch, ref_theta, split(tokens), split(positions), split(segs))


def _in_specs(theta, batch, ref_theta, ax: str, cp_axis: str | None):
  """(theta, extra, batch, ref_theta, tokens_M, positions_M, segment_ids_M): layers over 'pp';
  every per-token array's sequence axis over `cp_axis` (None: whole rows); the rest replicated."""
  replicated = PartitionSpec()
  token = PartitionSpec(None, cp_axis)  # [B, S]
  micro = PartitionSpec(None, None, cp_axis)  # [M, b, S]
  B_S = batch["tokens"].shape
  per_token = lambda x: jnp.ndim(x) >= 2 and x.shape[:2] == B_S
  batch_specs = {k: token if per_token(v) else replicated for k, v in batch.items()}
  ref_specs = None if ref_theta is None else param_specs(ref_theta, ax)
  return (param_specs(theta, ax), replicated, batch_specs, ref_specs, micro, micro, micro)
