"""The training steps on sequence shards: one program for every context-parallel degree.

One order, once. A training batch is padded (segment 0, loss mask 0) to a multiple of 2·cp and
put in zigzag order on the host, where the batch is built (`zigzag_order`): rank r of the 'cp'
axis holds chunks r and 2cp-1-r of every row, so causal work is balanced. At cp = 1 the zigzag
order is the natural order; the single-device step is the same program on one shard.

The step, in place. With cp > 1 the whole loss runs inside one `shard_map` over 'cp' (partially
manual: data, fsdp and tensor stay automatic), on the local chunks of every per-token array:

- every policy layer's packed causal attention is the ring with no branch
  (`ring.trunk_attention_shard`); at cp = 1 the same tiled attention runs without collectives;
- position t is scored against the next token, `shift(tokens, 1)` (`zigzag.shift_local` brings
  the head of the following chunk from the neighbouring rank), so log pi(x_{t+1} | x_<=t) lives
  at t and the GRPO inputs (loss mask, behaviour log-probs) are shifted alike;
- the vocabulary is touched in sequence chunks only (`model/chunked.py`): no [B, S, V] float32
  array lives through the step;
- the draft's TTT loss runs the ring's branch attention on the same shards, its soft targets
  computed from the policy's (stop-gradient) final hidden state;
- totals are psum-ed over 'cp'; the GRPO aggregations are built from per-row sums that are
  psum-ed per row, so every aggregation mode equals the single-device value.

Nothing inside the step changes the order. Shape letters: B batch, S (local) sequence, E width,
N taps.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from specdraft.attention import ring
from specdraft.decode.sampling import Sampling, processed_logits
from specdraft.model import chunked, drafts, eagle3
from specdraft.model import policy as pol
from specdraft.parallel import mesh as mesh_lib
from specdraft.parallel import zigzag
from specdraft.rl import grpo

# The mesh axis of the context-parallel ring (train/sequence.py shards every token array over it).
CP_AXIS = "cp"

# Batch keys that have a sequence axis (axis 1); everything else (advantages) is per row.
TOKEN_KEYS = ("tokens", "positions", "segment_ids", "loss_mask", "logprobs")


# Zigzag chunks longer than 256 tokens are padded to a multiple of CHUNK_MULTIPLE (at most 12%
# more): the ring's tiles (up to `compute.attn_tile` rows) must divide a chunk, and a prime chunk
# length (e.g. 521) would leave tiles of one token. Shorter chunks fit in one or two tiles.
CHUNK_MULTIPLE = 32


def zigzag_order(batch: dict, cp: int, *, multiple: int = 1) -> dict:
  """The batch padded to a multiple of 2·cp·`multiple` tokens (chunks longer than 256 tokens to
  a multiple of CHUNK_MULTIPLE) and put in zigzag order (host).

  Padding is segment 0, loss mask 0, position 0. Per-row arrays pass through unchanged. Host
  arrays stay on the host (numpy); traced or device arrays are laid out by jax.numpy (inside a
  jitted program that builds its batch, e.g. draft distillation)."""
  S = np.shape(batch["tokens"])[1]
  step = 2 * cp * multiple
  S_pad = -(-S // step) * step
  chunk = S_pad // (2 * cp)
  if chunk > 256:  # attention tiles must divide a chunk: keep it a round number
    S_pad = 2 * cp * (-(-chunk // CHUNK_MULTIPLE) * CHUNK_MULTIPLE)
    S_pad = -(-S_pad // step) * step
  perm = zigzag.permutation(S_pad, cp)
  out = dict(batch)
  for key in TOKEN_KEYS:
    if key in batch:
      x = batch[key]
      xp = jnp if isinstance(x, jax.Array) else np
      x = xp.pad(xp.asarray(x), [(0, 0), (0, S_pad - S)] + [(0, 0)] * (np.ndim(x) - 2))
      out[key] = x[:, perm]
  return out


def batch_shardings(batch: dict, mesh, rules) -> dict:
  """Shardings of a laid-out batch: rows by the 'batch' rule, per-token arrays' sequence axis by
  the 'length' rule (the 'cp' axis)."""

  def sharding(key, x):
    logical = ("batch", "length") if key in TOKEN_KEYS else ("batch",)
    logical += (None,) * (np.ndim(x) - len(logical))
    return jax.sharding.NamedSharding(mesh, mesh_lib.logical_to_spec(logical, rules, mesh))

  return {k: sharding(k, x) for k, x in batch.items()}


def shard(batch: dict, mesh, rules):
  """A laid-out batch placed with `batch_shardings` (host arrays: the same on every process)."""
  from specdraft.parallel import multihost

  return multihost.put_tree(batch, batch_shardings(batch, mesh, rules))


def cp_size(mesh, axis: str = "cp") -> int:
  return int(mesh.shape[axis]) if mesh is not None and axis in mesh.shape else 1


def row_multiple(kernel) -> int:
  """`zigzag_order`'s `multiple` for the attention kernel `kernel` (None: the XLA tiles, any length
  serves; else `KernelSettings.row_multiple`)."""
  return 1 if kernel is None else kernel.row_multiple()


def check_laid_out(batch, cp: int) -> None:
  """Raises (before compiling) when the batch's length cannot be put in zigzag order over cp."""
  S = batch["tokens"].shape[1]
  if S % (2 * cp):
    raise ValueError(
      f"batch length S={S} is not a multiple of 2*cp={2 * cp}: training batches must be laid out "
      f"once with train.sequence.zigzag_order(batch, cp={cp}) (pads to {zigzag.padded_length(S, cp)} "
      "and puts the rows in zigzag order)"
    )


@dataclasses.dataclass(frozen=True)
class ShardOps:
  """The per-token operations of one shard: global shifts, sums and the attentions.

  cp = 1: natural order, plain sums, tiled attention without collectives."""

  cp: int = 1
  axis: str | None = None
  tile: int = 512
  remat: bool = False  # rematerialise each policy layer in the backward pass
  # pins the policy trunk's residual stream to rows over (data, fsdp) (None: one device);
  # `parallel.mesh.activation_constraint`
  constrain: object = None
  # the attention's mask metadata whole on every device, so its tile loops' skip test is local
  # (None: one device); `parallel.mesh.metadata_constraint`
  whole: object = None
  # the fused Pallas block (`attention.kernels.KernelSettings`) for every attention of the step,
  # or None: the XLA tiles (`compute.attn_kernel`, config `attention.kernel`)
  kernel: object = None

  def shift(self, x, n: int, fill=0):
    """x[t + n] in the row's global order (`fill` past the row's end)."""
    if self.cp == 1:
      return eagle3.natural_shift(x, n, fill)
    return zigzag.shift_local(x, n, axis_name=self.axis, cp=self.cp, fill=fill)

  def _psum(self, x):
    return x if self.cp == 1 else jax.lax.psum(x, self.axis)

  def total(self, x):
    return self._psum(jnp.sum(x))

  def rows(self, x_BS):
    """Per-row sums [B] over the whole row."""
    return self._psum(jnp.sum(x_BS, axis=1))

  def trunk(self):
    """attend(q, k, v, positions, segment_ids): the policy layers' packed causal attention on
    this shard."""
    if self.kernel is not None:
      return lambda q, k, v, pos, seg: _kernel_ring().trunk_attention_shard(
        q, k, v, seg, pos, axis_name=self.axis, cp=self.cp, settings=self.kernel
      )
    return lambda q, k, v, pos, seg: ring.trunk_attention_shard(
      q, k, v, seg, pos, axis_name=self.axis, cp=self.cp, tile=self.tile, whole=self.whole
    )

  def branch(self, positions_BS, segment_ids_BS):
    """The draft's TTT attention on this shard (`eagle3.attend_by_merge`): each step's new rows
    ride the trunk ring once and merge by log-sum-exp with their rank-local branch keys."""
    if self.kernel is not None:
      trunk = lambda q, k, v: _kernel_ring().trunk_attention_shard(
        q, k, v, segment_ids_BS, positions_BS, axis_name=self.axis, cp=self.cp,
        settings=self.kernel, return_lse=True,
      )  # fmt: skip
      return eagle3.attend_by_merge(trunk, segment_ids_BS)
    trunk = lambda q, k, v: ring.trunk_attention_shard(
      q,
      k,
      v,
      segment_ids_BS,
      positions_BS,
      axis_name=self.axis,
      cp=self.cp,
      tile=self.tile,
      return_lse=True,
      whole=self.whole,
    )
    return eagle3.attend_by_merge(trunk, segment_ids_BS)

  def block_branch(self, positions_BS, segment_ids_BS):
    """A block draft's attention on this shard: the block queries of every anchor ride the
    ring over the context keys (strictly earlier positions of the same document) and merge with
    their own block's keys, which stay on this rank (`ring.ring_attention_shard`, "block").
    The context has no queries of its own: its trunk rows are zeros, and their output unused.
    Returns attend(k_ctx, v_ctx, q_br, k_br, v_br) -> out_br for `dflash.block_hidden`."""

    def attend(k_ctx, v_ctx, q_br, k_br, v_br):
      # zeros shaped (and, under shard_map, varying) like the block queries
      q0 = jnp.zeros_like(q_br[:, :, 0])
      if self.kernel is not None:
        return _kernel_ring().ring_attention_shard(
          q0, k_ctx, v_ctx, q_br, k_br, v_br, segment_ids_BS.astype(jnp.int32),
          positions_BS.astype(jnp.int32), branch="block", axis_name=self.axis, cp=self.cp,
          settings=self.kernel,
        )[1]  # fmt: skip
      return ring.ring_attention_shard(
        q0, k_ctx, v_ctx, q_br, k_br, v_br, segment_ids_BS.astype(jnp.int32),
        positions_BS.astype(jnp.int32), branch="block", axis_name=self.axis, cp=self.cp,
        tile=self.tile, whole=self.whole,
      )[1]  # fmt: skip

    return attend


def _kernel_ring():
  """attention/kernels/ring.py, imported where the fused block is asked for (it imports Pallas)."""
  from specdraft.attention.kernels import ring as kernel_ring

  return kernel_ring


def run(objective, spec, params: tuple, batch: dict):
  """The one runner of every training loss: (loss, metrics) of `objective` on `batch` under
  `spec` (a `train.spec.StepSpec`), unsharded, over the 'cp' ring, or as a pipeline over 'pp'.

  objective(spec, ops, theta, extra, h_BSE, taps_NBSE, batch, ref) -> (scalar loss,
  {name: scalar}) on one shard: h the policy's final normed hidden state, taps its tapped layers,
  ref None or (ref_theta, the reference policy's final hidden state). `params` = (theta, extra,
  ref_theta): the policy, what else the objective differentiates or reads (the draft), and a
  frozen reference policy (None: none; it runs the same forward, under stop_gradient).
  Without a pipeline: at cp = 1 on one shard, else inside one shard_map over 'cp' with every
  per-token array sharded on its sequence axis. With `spec.pipeline`: `model.pipelined.loss`
  (every stage's layers through the trunk ring over 'cp', the taps to the last stage through the
  TapChannel, the objective there)."""
  theta, extra, ref_theta = params
  mesh, tile, kernel = spec.mesh, spec.compute.attn_tile, spec.compute.attn_kernel
  cp = cp_size(mesh)
  check_laid_out(batch, cp)
  pin = mesh_lib.activation_constraint(mesh)
  whole = mesh_lib.metadata_constraint(mesh)
  local = chunked.rows_local(mesh_lib.rows_local(mesh))
  if spec.pipeline is not None:
    from specdraft.model import pipelined

    over_cp = dict(cp=cp, axis=CP_AXIS) if cp > 1 else {}
    ops = ShardOps(tile=tile, constrain=pin, whole=whole, kernel=kernel, **over_cp)
    # the last stage's vocabulary loops run rows-local too: one reduction per loop
    with local:
      return pipelined.loss(
        theta,
        extra,
        batch,
        functools.partial(objective, spec),
        pcfg=spec.pcfg,
        mesh=mesh,
        spec=spec.pipeline,
        ops=ops,
        stop_tap_gradient=spec.stop_tap_gradient,
        ref_theta=ref_theta,
      )

  def on_shard(ops: ShardOps, theta, extra, ref_theta, batch):
    ops = dataclasses.replace(ops, whole=_once_per_step(whole, batch))
    h, taps = policy_hidden(theta, spec.pcfg, batch, ops)
    ref = None
    if ref_theta is not None:
      ref_theta = jax.lax.stop_gradient(ref_theta)
      ref = (ref_theta, policy_hidden(ref_theta, spec.pcfg, batch, ops)[0])
    return objective(spec, ops, theta, extra, h, taps, batch, ref)

  remat = spec.compute.remat
  if cp == 1:
    ops = ShardOps(tile=tile, remat=remat, constrain=pin, kernel=kernel)
    with local:
      return on_shard(ops, theta, extra, ref_theta, batch)
  tok = PartitionSpec(None, CP_AXIS)
  batch_specs = {k: tok if k in TOKEN_KEYS else PartitionSpec() for k in batch}
  fn = jax.shard_map(
    functools.partial(on_shard, ShardOps(cp, CP_AXIS, tile, remat, pin, kernel=kernel)),
    mesh=mesh,
    in_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(), batch_specs),
    out_specs=PartitionSpec(),
    axis_names={CP_AXIS},
    check_vma=False,
  )
  with local:
    return fn(theta, extra, ref_theta, batch)


def _once_per_step(whole, batch: dict):
  """`whole` (`parallel.mesh.metadata_constraint`) that gathers the batch's positions and segment
  ids once for the whole step: every attention call of the step reads those same arrays (each
  layer, the draft's steps, forward and backward), so each would otherwise gather them again.
  Other arrays are gathered where they are passed."""
  if whole is None:
    return None
  done = [(batch[k], whole(batch[k])) for k in ("positions", "segment_ids") if k in batch]

  def once(x):
    for src, out in done:
      if x is src:
        return out
    return whole(x)

  return once


# ----------------------------------------------------------------------------- the policy


def policy_hidden(theta, pcfg, batch, ops: ShardOps):
  """(final normed hidden h_BSE, tapped layers x_NBSE) of this shard's rows."""
  pos, seg = batch["positions"], batch["segment_ids"]
  return pol.hidden(
    theta,
    pcfg,
    batch["tokens"],
    pos,
    seg,
    attend=ops.trunk(),
    remat=ops.remat,
    constrain=ops.constrain,
  )


def next_token_scores(theta, pcfg, h_BSE, next_BS, *, vocab_chunk: int, sampling=None):
  """(log pi(next | prefix), entropy, next is the argmax) at every position, in vocab chunks.
  With `sampling` (a `decode.sampling.Sampling` with temperature > 0), pi is the distribution the
  rollouts sample: the logits at that temperature, truncated to its top-k / top-p set."""
  w = pol.head_weight(theta, pcfg)
  transform = None
  if sampling is not None and sampling.temperature > 0 and sampling != Sampling():
    transform = lambda z: processed_logits(z, *sampling)
  return chunked.logprob_and_entropy(h_BSE, w, next_BS, chunk=vocab_chunk, transform=transform)


def sft_terms(spec, ops: ShardOps, theta, extra, h_BSE, taps_NBSE, batch, ref):
  """Next-token cross-entropy on loss tokens of the same document, on one shard, from the
  policy's final hidden state (a `run` objective; `extra`, the taps and `ref` unused)."""
  tok, seg = batch["tokens"], batch["segment_ids"]
  nxt = ops.shift(tok, 1, 0)
  same = (ops.shift(seg, 1, 0) == seg) & (seg != 0)
  w = jnp.where(same, ops.shift(batch["loss_mask"].astype(jnp.float32), 1, 0.0), 0.0)
  vocab_chunk = spec.compute.vocab_chunk
  lp, _, top1 = next_token_scores(theta, spec.pcfg, h_BSE, nxt, vocab_chunk=vocab_chunk)
  n_tokens = ops.total(w)
  n = jnp.maximum(n_tokens, 1.0)
  loss = -ops.total(lp * w) / n
  return loss, {"loss": loss, "token_accuracy": ops.total(top1 * w) / n, "tokens": n_tokens}


def cotrain_terms(spec, ops: ShardOps, theta, phi, h_BSE, taps_NBSE, batch, ref):
  """L_RL(theta) + lam * L_draft(phi; sg(taps)) on one shard, from ONE policy forward: its final
  hidden state and taps, and `ref` (the reference policy and its final hidden state; None
  without a KL term). A `run` objective under `spec.rl` (`train.spec.RLLoss`)."""
  rl, pcfg = spec.rl, spec.pcfg
  tok = batch["tokens"]
  chunk = dict(vocab_chunk=spec.compute.vocab_chunk)
  h, taps = h_BSE, taps_NBSE
  if spec.stop_tap_gradient:
    taps = jax.lax.stop_gradient(taps)
  nxt = ops.shift(tok, 1, 0)
  # the rollouts' distribution (temperature, top-k, top-p): the behaviour log-probs are of it
  lp, ent, _ = next_token_scores(theta, pcfg, h, nxt, sampling=rl.sampling, **chunk)
  mask = ops.shift(batch["loss_mask"].astype(jnp.float32), 1, 0.0)  # x_{t+1} is a loss token
  ref_lp = None
  if ref is not None:
    ref_theta, h_ref = jax.lax.stop_gradient(ref)
    ref_lp, _, _ = next_token_scores(ref_theta, pcfg, h_ref, nxt, sampling=rl.sampling, **chunk)
  rl_loss, metrics = grpo.policy_loss(
    lp,
    ops.shift(batch["logprobs"], 1, 0.0),
    batch["advantages"],
    mask,
    eps_low=rl.eps_low,
    eps_high=rl.eps_high,
    aggregation=rl.aggregation,
    max_tokens=rl.max_tokens if rl.max_tokens is not None else tok.shape[1] * ops.cp,
    ref_logp_BS=ref_lp,
    beta=rl.beta,
    kl_estimator=rl.kl_estimator,
    row_sum=ops.rows,
  )
  metrics["entropy"] = jax.lax.stop_gradient(
    ops.total(ent * mask) / jnp.maximum(ops.total(mask), 1)
  )
  total = rl_loss
  if rl.train_draft:
    draft_loss, dm = draft_terms(spec, ops, theta, phi, h, taps, batch, None)
    metrics.update(dm)
    total = total + rl.lam * draft_loss
  metrics["loss"] = total
  return total, metrics


def draft_terms(spec, ops: ShardOps, theta, phi, h_BSE, taps_NBSE, batch, ref):
  """The draft's loss on this shard (EAGLE-3's TTT loss or a block draft's, `model/drafts.py`):
  ring branch attention on the policy's shards, soft targets from the policy's (stop-gradient)
  final hidden state through its LM head. A `run` objective (draft distillation passes the
  policy under stop_gradient; `ref` unused)."""
  pcfg, dcfg = spec.pcfg, spec.dcfg
  pos, seg = batch["positions"], batch["segment_ids"]
  w = jax.lax.stop_gradient(pol.head_weight(theta, pcfg))
  return drafts.loss_on_shard(
    phi,
    dcfg,
    jax.lax.stop_gradient(theta),
    pcfg,
    taps_NBSE,
    h_BSE,
    batch,
    shift=ops.shift,
    attend=(ops.block_branch if drafts.is_block(dcfg) else ops.branch)(pos, seg),
    total=ops.total,
    policy_head=w,
    vocab_chunk=spec.compute.vocab_chunk,
  )
