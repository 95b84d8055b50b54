"""The natural-order oracles the training steps are tested against. No training run calls them
(bench_long compiles `cotrain_loss` as the dense step it measures the sequence path against).

Every training loss runs on sequence shards (`train/sequence.py`: zigzag order, chunked
vocabulary, the ring's custom backward). The functions here compute the same losses the plain
way, on natural-order rows with whole-row [B, S, V] logits and the attention of
`attention.branch_attention` ("dense": the float32 oracle; "ring" / "allgather": the natural-order
wrappers of the cp implementations), so the tests can hold the real step equal to them in value
and gradient:

  cotrain_loss   L_RL + lam * L_draft from one policy forward   (`step.cotrain_loss`)
  distill_loss   the draft's loss on a fixed policy's forward    (`draft.draft_loss`)
  draft_loss     the draft's loss from given logits and taps      (either kind)
  ttt_loss       EAGLE-3's TTT loss (attn_impl "ring": its per-shard form over a 'cp' axis)
  block_loss     a block draft's (DFlash / DSpark) loss

Shape letters: B batch, S sequence, V vocabulary, N taps, E width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specdraft.attention import branch_attention
from specdraft.model import dflash, drafts, eagle3
from specdraft.model import policy as pol


def cotrain_loss(
  theta,
  phi,
  logits,
  taps,
  batch,
  ref_logp=None,
  *,
  pcfg,
  dcfg,
  rl_cfg,
  lam: float,
  train_draft: bool = True,
  attn_impl: str = "dense",
  mesh=None,
):
  """L_RL + lam * L_draft from the policy's logits and (stop-gradient) taps of ONE forward, in
  natural order (the oracle of `sequence.cotrain_terms` run by `sequence.run`). The RL log-probs
  and the entropy are of the distribution the rollouts sample (`rl.temperature`, `rl.top_k`,
  `rl.top_p`), as in the sharded step; the draft's targets stay the policy's own logits."""
  from specdraft.decode.sampling import Sampling, processed_logits
  from specdraft.rl import grpo
  from specdraft.train.step import completion_logprobs, entropy_of

  sampling = Sampling(rl_cfg.temperature, rl_cfg.get("top_k", 0), rl_cfg.get("top_p", 1.0))
  sampled = logits
  if sampling.temperature > 0 and sampling != Sampling():
    sampled = processed_logits(logits, *sampling)
  logp = completion_logprobs(sampled, batch["tokens"])
  rl_loss, metrics = grpo.policy_loss(
    logp,
    batch["logprobs"],
    batch["advantages"],
    batch["loss_mask"],
    eps_low=rl_cfg.eps_low,
    eps_high=rl_cfg.eps_high,
    aggregation=rl_cfg.aggregation,
    max_tokens=batch["tokens"].shape[1],
    ref_logp_BS=ref_logp,
    beta=rl_cfg.beta,
    kl_estimator=rl_cfg.kl_estimator,
  )
  metrics["entropy"] = jax.lax.stop_gradient(entropy_of(sampled, batch["loss_mask"]))
  total = rl_loss
  if train_draft:
    loss, dm = draft_loss(
      phi, dcfg, theta, pcfg, taps.layers, logits, batch, attn_impl=attn_impl, mesh=mesh
    )
    metrics.update(dm)
    total = total + lam * loss
  metrics["loss"] = total
  return total, metrics


def distill_loss(
  dparams,
  params,
  pcfg: pol.PolicyConfig,
  dcfg: drafts.DraftConfig,
  batch,
  *,
  attn_impl: str = "dense",
  mesh=None,
):
  """Policy forward (taps and target logits), then the draft's loss, on natural-order rows with
  whole-row logits: the oracle of the sequence-shard distillation step (`draft.draft_loss`)."""
  logits, taps = pol.forward(
    params, pcfg, batch["tokens"], batch["positions"], batch["segment_ids"]
  )
  return draft_loss(
    dparams, dcfg, params, pcfg, taps.layers, logits, batch, attn_impl=attn_impl, mesh=mesh
  )


def draft_loss(
  dp, dcfg, theta, pcfg, taps_NBSE, policy_logits_BSV, batch, *, attn_impl="dense", mesh=None
):
  """The draft's loss (either kind) on natural-order rows with whole-row policy logits."""
  args = (
    jax.lax.stop_gradient(policy_logits_BSV),
    batch["tokens"],
    batch["positions"],
    batch["segment_ids"],
    batch["loss_mask"],
  )
  if drafts.is_block(dcfg):
    head_w = pol.head_weight(theta, pcfg)
    return block_loss(
      dp, dcfg, theta["embed"], head_w, taps_NBSE, *args, attn_impl=attn_impl, mesh=mesh
    )
  return ttt_loss(dp, dcfg, theta["embed"], taps_NBSE, *args, attn_impl=attn_impl, mesh=mesh)


def ttt_loss(
  dp,
  cfg: eagle3.DraftConfig,
  embed_table,
  taps_NBSE,
  policy_logits_BSV,
  tokens_BS,
  positions_BS,
  segment_ids_BS,
  loss_mask_BS,
  *,
  attn_impl: str = "dense",
  mesh=None,
  cp_axis: str = "cp",
):
  """EAGLE-3's soft cross-entropy to the (stop-gradient) policy distribution, step k weighted
  decay**k (`eagle3.ttt_loss_on_shard` on one natural-order shard).

  attn_impl="ring" runs the whole loss per shard over `cp_axis` on data laid out in zigzag order
  once; "dense" and "allgather" run on natural-order arrays through
  `branch_attention`, every TTT step recomputing the trunk and earlier branch rows.
  Returns (loss, metrics) with per-step top-1 agreement with the policy (`ttt_acc_k`).
  """
  args = (
    dp,
    cfg,
    embed_table,
    taps_NBSE,
    policy_logits_BSV,
    tokens_BS,
    positions_BS,
    segment_ids_BS,
    loss_mask_BS,
  )
  if attn_impl == "ring":
    return _ttt_loss_on_ring(args, mesh=mesh, cp_axis=cp_axis)
  attend = eagle3.attend_by_branch(
    lambda *a: branch_attention(
      *a, segment_ids_BS, branch="ttt", impl=attn_impl, mesh=mesh, cp_axis=cp_axis
    )
  )
  return eagle3.ttt_loss_on_shard(*args, shift=eagle3.natural_shift, attend=attend, total=jnp.sum)


def _ttt_loss_on_ring(args, *, mesh, cp_axis="cp"):
  """`ttt_loss`'s "ring": the TTT loss under context parallelism from natural-order arrays (its
  arguments `args`, in order): every per-token array is padded and laid out in zigzag order
  once; each shard shifts with `zigzag.shift_local`, attends with the ring's per-shard function
  and contributes partial sums that are psum-ed over `cp_axis`."""
  (
    dp, cfg, embed_table, taps_NBSE, policy_logits_BSV, tokens_BS, positions_BS, segment_ids_BS,
    loss_mask_BS,
  ) = args  # fmt: skip
  from jax.sharding import PartitionSpec

  from specdraft.attention import ring
  from specdraft.parallel import zigzag

  if mesh is None or cp_axis not in mesh.shape:
    raise ValueError(f"attn_impl='ring' needs a mesh with a {cp_axis!r} axis (got {mesh})")
  cp = mesh.shape[cp_axis]
  B, S = tokens_BS.shape
  S_pad = zigzag.padded_length(S, cp)
  lay = lambda x, axis=1: zigzag.to_zigzag(zigzag.pad(x, S_pad, axis), cp, axis)  # noqa: E731
  gpos = jnp.broadcast_to(jnp.arange(S_pad, dtype=jnp.int32), (B, S_pad))
  names = ("logits", "tokens", "positions", "seg", "mask", "gpos")
  per_token = (policy_logits_BSV, tokens_BS, positions_BS, segment_ids_BS, loss_mask_BS, gpos)
  arrays = {k: lay(x) for k, x in zip(names, per_token)}
  arrays["mask"] = arrays["mask"].astype(jnp.float32)
  arrays["taps"] = lay(taps_NBSE, 2)

  def body(dp, embed_table, a):
    seg = a["seg"]
    return eagle3.ttt_loss_on_shard(
      dp,
      cfg,
      embed_table,
      *(a[k] for k in ("taps", "logits", "tokens", "positions", "seg", "mask")),
      shift=lambda x, n, fill: zigzag.shift_local(x, n, axis_name=cp_axis, cp=cp, fill=fill),
      attend=eagle3.attend_by_merge(
        lambda q, k, v: ring.trunk_attention_shard(
          q, k, v, seg, a["gpos"], axis_name=cp_axis, cp=cp, return_lse=True
        ),
        seg,
      ),
      total=lambda x: jax.lax.psum(jnp.sum(x), cp_axis),
    )

  # [B, S, ...] arrays have their sequence axis over cp; the taps [N, B, S, E] their third
  specs = {k: PartitionSpec(None, cp_axis) for k in names}
  specs["taps"] = PartitionSpec(None, None, cp_axis)
  fn = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(PartitionSpec(), PartitionSpec(), specs),
    out_specs=PartitionSpec(),
    check_vma=False,
  )
  return fn(dp, embed_table, arrays)


def block_loss(
  dp,
  cfg: dflash.BlockDraftConfig,
  embed_table,
  head_w_EV,
  taps_NBSE,
  policy_logits_BSV,
  tokens_BS,
  positions_BS,
  segment_ids_BS,
  loss_mask_BS,
  *,
  attn_impl: str = "dense",
  mesh=None,
):
  """A block draft's loss (`dflash.block_loss_on_shard`) on natural-order rows with whole-row
  logits: the oracle of the sequence-shard path (`train/sequence.py::draft_terms`)."""
  return dflash.block_loss_on_shard(
    dp, cfg, embed_table, head_w_EV, taps_NBSE, policy_logits_BSV, tokens_BS, positions_BS,
    segment_ids_BS, loss_mask_BS, shift=eagle3.natural_shift,
    attend=dflash.attend_dense(segment_ids_BS, impl=attn_impl, mesh=mesh), total=jnp.sum,
  )  # fmt: skip
