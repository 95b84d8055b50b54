"""The draft kinds behind one interface: `draft.kind = eagle3 | dflash | dspark`.

EAGLE-3 (model/eagle3.py) chains its own predictions through training-time test steps; DFlash and
DSpark (model/dflash.py) propose a whole block per anchor in one pass. Everything above the
model (the co-training step, distillation, rollouts, checkpoints) reaches a draft through the
functions here, so a new kind is added in one place.
"""

from __future__ import annotations

import jax

from specdraft.model import dflash, eagle3
from specdraft.model import policy as pol

KINDS = ("eagle3",) + dflash.KINDS
DraftConfig = eagle3.DraftConfig | dflash.BlockDraftConfig


def is_block(dcfg) -> bool:
  return isinstance(dcfg, dflash.BlockDraftConfig)


def draft_config(draft_cfg, pcfg: pol.PolicyConfig, num_draft: int = 0, vocab_ids=None):
  """The draft's static config from the run config's `draft` block (`num_draft`, the tokens
  proposed per SD round, sizes a block draft whose block_size is 0; `vocab_ids`, an EAGLE-3
  draft's reduced vocabulary when draft.vocab_size > 0)."""
  kind = draft_cfg.get("kind", "eagle3")
  if kind not in KINDS:
    raise ValueError(f"config.draft.kind={kind!r} is invalid: expected one of {KINDS}")
  if kind == "eagle3":
    nv = int(draft_cfg.get("vocab_size", 0))
    if 0 < nv < pcfg.vocab_size and vocab_ids is None:
      raise ValueError(
        f"config.draft.vocab_size={nv} needs the draft's token ids, chosen from the training "
        "data's counts (train.phases.Context does this: experiments/train.py, drift.py); this "
        "program builds its draft without them: set draft.vocab_size=0"
      )
    return eagle3.DraftConfig.from_config(draft_cfg, pcfg, vocab_ids)
  return dflash.BlockDraftConfig.from_config(draft_cfg, pcfg, num_draft)


# Logical axes of the draft's parameters, by leaf name (every kind). The draft is sharded like the
# policy's layers (width over fsdp, heads and MLP over tensor), except that its stacked layers
# (a block draft's `layers`) are never split over 'pp': the draft lives on the last stage.
_AXES = {
  "fc": (None, "embed"),
  "wq": ("embed", "heads", "head_dim"),
  "wk": ("embed", "kv_heads", "head_dim"),
  "wv": ("embed", "kv_heads", "head_dim"),
  "wo": ("heads", "head_dim", "embed"),
  "w_gate": ("embed", "mlp"),
  "w_up": ("embed", "mlp"),
  "w_down": ("mlp", "embed"),
  "head": ("embed", "vocab"),
  "q_norm": ("head_dim",),
  "k_norm": ("head_dim",),
  "markov_in": ("vocab", None),
  "markov_out": (None, "vocab"),
}
_WIDTH_VECTORS = ("embed_norm", "hidden_norm", "mlp_norm", "attn_norm", "final_norm", "ctx_norm",
                  "mask_embed")  # fmt: skip


def param_logical_axes(dparams):
  """Logical axis names of every draft parameter (mapped onto the mesh by the layout's rules,
  as the policy's are: `parallel.mesh.tree_shardings`)."""

  def names(path, x):
    key = path[-1].key
    axes = ("embed",) if key in _WIDTH_VECTORS else _AXES.get(key)
    if axes is None:
      raise ValueError(f"draft parameter {jax.tree_util.keystr(path)} has no logical axes")
    stacked = len(path) > 1 and path[0].key == "layers"
    axes = ((None,) if stacked else ()) + axes  # a block draft's layer axis: never split
    if len(axes) != x.ndim:
      raise ValueError(
        f"draft parameter {jax.tree_util.keystr(path)} of shape {x.shape} does not match its "
        f"logical axes {axes}"
      )
    return axes

  return jax.tree_util.tree_map_with_path(names, dparams)


def init_params(dcfg, seed: int, policy_params=None, pcfg=None):
  module = dflash if is_block(dcfg) else eagle3
  return module.init_params(dcfg, seed, policy_params, pcfg)


def loss_on_shard(
  dp, dcfg, theta, pcfg, taps_NBSE, policy_BSX, batch, *, shift, attend, total,
  policy_head, vocab_chunk: int,
):  # fmt: skip
  """The draft's loss on one shard from global sums: EAGLE-3's TTT loss or the block loss.

  `attend` is the shard's attention for the draft's kind (`ShardOps.branch` or
  `ShardOps.block_branch`, train/sequence.py)."""
  args = (batch["tokens"], batch["positions"], batch["segment_ids"], batch["loss_mask"])
  common = dict(
    shift=shift, attend=attend, total=total, policy_head=policy_head,
    vocab_chunk=vocab_chunk,
  )  # fmt: skip
  if is_block(dcfg):
    head_w = pol.head_weight(theta, pcfg)
    return dflash.block_loss_on_shard(
      dp, dcfg, theta["embed"], head_w, taps_NBSE, policy_BSX, *args, **common
    )
  return eagle3.ttt_loss_on_shard(dp, dcfg, theta["embed"], taps_NBSE, policy_BSX, *args, **common)
