"""Block drafts: DFlash (a block of proposals per anchor in one pass) and DSpark (DFlash with a
light Markov head and every block slot supervised).

The draft has no embedding or LM head of its own: it reads the policy's, under stop_gradient.
Its context feature at position s is `RMSNorm(fc(concat of the tapped policy layers at s))`.
A block anchored at trunk position t is `[x_t, MASK x (W - 1)]` (the anchor's own token, then a
learned mask embedding), at RoPE positions t .. t + W - 1. In every draft layer the queries come
from the block only; keys and values are the same layer's projections of [context; block]: a
block query sees the context strictly before its anchor (s < t, same document) and its whole
block both ways, never another block. That is `branch_attention(..., branch="block")` with the
context as the trunk, so training runs under context parallelism through the ring (block queries
join the trunk ring, block keys stay on their rank). The residual stream runs through the block.

Training places one block at every trunk position (the branch layout); blocks whose targets are
not completion tokens of the anchor's document carry zero weight. Supervision per kind:

- dflash: slot k = 1 .. W-1 predicts x_{t+k}; weight exp(-(k-1)/gamma); W - 1 proposals a round.
- dspark: slot j = 0 .. W-1 predicts x_{t+1+j}; weight exp(-j/gamma); W proposals a round. The
  Markov head adds `E[prev] @ W2` (E: V x r, W2: r x V, W2 starting at zero) to slot j's logits,
  prev = x_{t+j} (teacher-forced in training; at inference the block is walked serially on the
  sampled tokens).

The loss is a soft cross-entropy to the policy's (stop-gradient) distribution at the predicted
position; dspark adds `l1_weight` times the L1 distance between the two distributions. Each
slot's mean over its valid anchors is weighted by its decay, normalised by the decays' sum.

Shape letters: B batch, S sequence (local), W block size, E width, N taps, H/K heads, D head dim,
V vocabulary, L draft layers, C cache capacity, G proposals per round, R Markov rank.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specdraft.attention import branch_attention, reference
from specdraft.model import chunked
from specdraft.model import policy as pol

Params = dict[str, Any]
KINDS = ("dflash", "dspark")
ANCHOR_RESIDUALS = ("token", "mask")


@dataclasses.dataclass(frozen=True)
class BlockDraftConfig:
  kind: str
  d_model: int
  vocab_size: int
  n_taps: int
  n_layers: int = 1
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  d_ff: int = 384
  block_size: int = 4
  gamma: float = 4.0
  markov_rank: int = 16
  l1_weight: float = 0.0
  mask_token_id: int = -1  # -1: a learned mask embedding; else the policy's row of this id
  qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (context keys too)
  # what the anchor slot's residual stream starts from: "token" (its embedding, as its q/k/v
  # read it) or "mask" (the MASK vector, like every other slot: the token enters through the
  # first layer's q/k/v only, so a tied head does not read the anchor back as itself). "" is
  # the kind's default (`default_anchor_residual`).
  anchor_residual: str = ""
  rope_theta: float = 10000.0
  rope_scaling: pol.RopeScaling | None = None  # the policy's
  norm_eps: float = 1e-6
  init_std: float = 0.02
  dtype: str = "float32"

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"draft kind={self.kind!r} is not a block draft; expected one of {KINDS}")
    if not self.anchor_residual:
      object.__setattr__(self, "anchor_residual", default_anchor_residual(self.kind))
    if self.anchor_residual not in ANCHOR_RESIDUALS:
      raise ValueError(
        f"draft.block.anchor_residual={self.anchor_residual!r}; expected one of {ANCHOR_RESIDUALS}"
        " (or '' for the kind's default)"
      )

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def num_proposals(self) -> int:
    """Tokens proposed per SD round: W - 1 (dflash: slot 0 is the anchor) or W (dspark)."""
    return self.block_size - 1 if self.kind == "dflash" else self.block_size

  @property
  def has_markov(self) -> bool:
    """DSpark with markov_rank > 0 (markov_rank 0: DSpark without its Markov head, the ablation
    that isolates what the head adds to the all-slots-supervised backbone)."""
    return self.kind == "dspark" and self.markov_rank > 0

  @property
  def first_slot(self) -> int:
    """The first supervised slot; slot i (>= first_slot) predicts x_{t + i + 1 - first_slot}."""
    return 1 if self.kind == "dflash" else 0

  @property
  def ttt_steps(self) -> int:
    """Proposals supervised per anchor; their top-1 agreement with the policy is reported as
    ttt_acc_0 .. ttt_acc_{G-1}, the names EAGLE-3's TTT steps use (one per proposal)."""
    return self.num_proposals

  @classmethod
  def from_config(cls, draft_cfg, pcfg: pol.PolicyConfig, num_draft: int = 0) -> BlockDraftConfig:
    """Draft dims default to the policy's where the config leaves them 0; block_size 0 means
    the block that proposes `num_draft` tokens a round (dflash: num_draft + 1, dspark:
    num_draft), so kinds compare at an equal number of proposals."""
    pick = lambda k: draft_cfg[k] if draft_cfg.get(k) else getattr(pcfg, k)
    block = draft_cfg.block
    block_size = block.block_size or block_size_for(draft_cfg.kind, num_draft)
    return cls(
      kind=draft_cfg.kind,
      d_model=pcfg.d_model,
      vocab_size=pcfg.vocab_size,
      n_taps=len(pcfg.taps),
      n_layers=block.n_layers,
      n_heads=pick("n_heads"),
      n_kv_heads=pick("n_kv_heads"),
      head_dim=pick("head_dim"),
      d_ff=pick("d_ff"),
      block_size=block_size,
      gamma=block.gamma,
      markov_rank=block.markov_rank,
      l1_weight=block.l1_weight,
      mask_token_id=int(block.get("mask_token_id", -1)),
      qk_norm=bool(block.get("qk_norm", False)),
      anchor_residual=str(block.get("anchor_residual", "")),
      rope_theta=pcfg.rope_theta,
      rope_scaling=pcfg.rope_scaling,
      norm_eps=pcfg.norm_eps,
      dtype=pcfg.dtype,
    )


def default_anchor_residual(kind: str) -> str:
  """DSpark's anchor slot is supervised (it proposes x_{t+1}): a residual that starts at the
  token's embedding, which a tied head reads back as the token itself, pulls every proposal
  towards repeating it (configs/bench_drafts.py measures the ablation), so DSpark starts it at
  MASK. DFlash's anchor slot proposes nothing, and the public DFlash forward starts it at the
  token."""
  return "mask" if kind == "dspark" else "token"


def block_size_for(kind: str, num_draft: int) -> int:
  """The block that proposes `num_draft` tokens a round."""
  if num_draft < 1:
    raise ValueError(f"num_draft={num_draft}: a block draft needs at least one proposal a round")
  return num_draft + 1 if kind == "dflash" else num_draft


class _Layers(nnx.Module):
  def __init__(self, cfg: BlockDraftConfig, *, rngs: nnx.Rngs):
    L, E, H, K, D, F = (
      cfg.n_layers,
      cfg.d_model,
      cfg.n_heads,
      cfg.n_kv_heads,
      cfg.head_dim,
      cfg.d_ff,
    )
    normal = nnx.initializers.normal(cfg.init_std)
    self.attn_norm = nnx.Param(jnp.ones((L, E)))
    self.wq = nnx.Param(normal(rngs.params(), (L, E, H, D)))
    self.wk = nnx.Param(normal(rngs.params(), (L, E, K, D)))
    self.wv = nnx.Param(normal(rngs.params(), (L, E, K, D)))
    self.wo = nnx.Param(normal(rngs.params(), (L, H, D, E)))
    self.mlp_norm = nnx.Param(jnp.ones((L, E)))
    self.w_gate = nnx.Param(normal(rngs.params(), (L, E, F)))
    self.w_up = nnx.Param(normal(rngs.params(), (L, E, F)))
    self.w_down = nnx.Param(normal(rngs.params(), (L, F, E)))
    if cfg.qk_norm:  # `policy.qkv` applies them where the layer has them
      self.q_norm = nnx.Param(jnp.ones((L, D)))
      self.k_norm = nnx.Param(jnp.ones((L, D)))


class BlockDraft(nnx.Module):
  def __init__(self, cfg: BlockDraftConfig, *, rngs: nnx.Rngs):
    E, N = cfg.d_model, cfg.n_taps
    self.fc = nnx.Param(nnx.initializers.normal((N * E) ** -0.5)(rngs.params(), (N * E, E)))
    self.ctx_norm = nnx.Param(jnp.ones((E,)))
    if cfg.mask_token_id < 0:  # (the char tokenizer has no spare id for MASK)
      self.mask_embed = nnx.Param(nnx.initializers.normal(cfg.init_std)(rngs.params(), (E,)))
    self.layers = _Layers(cfg, rngs=rngs)
    self.final_norm = nnx.Param(jnp.ones((E,)))
    if cfg.has_markov:
      R = cfg.markov_rank
      self.markov_in = nnx.Param(
        nnx.initializers.normal(R**-0.5)(rngs.params(), (cfg.vocab_size, R))
      )
      self.markov_out = nnx.Param(jnp.zeros((R, cfg.vocab_size)))  # starts as DFlash


def init_params(
  cfg: BlockDraftConfig,
  seed: int,
  policy_params: Params | None = None,
  pcfg: pol.PolicyConfig | None = None,
) -> Params:
  """Fresh draft parameters; with the policy given, the final norm starts as its own."""
  params = pol.split_params(BlockDraft(cfg, rngs=nnx.Rngs(seed)))
  if policy_params is not None:
    params["final_norm"] = jnp.asarray(policy_params["final_norm"])
  return params


# ----------------------------------------------------------------------------- the network


def context(dp: Params, taps_NBSE, cfg: BlockDraftConfig):
  """Context features RMSNorm(fc(concat of the tapped layers)) [B, S, E]."""
  N, B, S, E = taps_NBSE.shape
  x = jnp.moveaxis(taps_NBSE, 0, 2).reshape(B, S, N * E).astype(cfg.compute_dtype)
  return pol.rms_norm(x @ dp["fc"].astype(cfg.compute_dtype), dp["ctx_norm"], cfg.norm_eps)


def _mask_vector(dp: Params, cfg: BlockDraftConfig, table):
  return dp["mask_embed"] if cfg.mask_token_id < 0 else table[cfg.mask_token_id]


def block_inputs(dp: Params, cfg: BlockDraftConfig, embed_table, anchor_tokens):
  """Embeddings of the blocks [x_anchor, MASK x (W-1)] at every anchor: [..., W, E]. MASK is the
  draft's learned vector, or the policy's embedding row of `cfg.mask_token_id` (frozen)."""
  dt = cfg.compute_dtype
  table = jax.lax.stop_gradient(embed_table)
  first = jnp.take(table, anchor_tokens, axis=0).astype(dt)
  rest = jnp.broadcast_to(_mask_vector(dp, cfg, table).astype(dt), first.shape)
  W = cfg.block_size
  return jnp.stack([first] + [rest] * (W - 1), axis=-2)


def first_residual(dp: Params, cfg: BlockDraftConfig, embed_table, h_WE):
  """The residual the first layer adds its output to: the block inputs themselves, or with
  `anchor_residual="mask"` the anchor slot's replaced by the MASK vector (its q/k/v still read
  the token)."""
  if cfg.anchor_residual == "token":
    return h_WE
  mask = _mask_vector(dp, cfg, jax.lax.stop_gradient(embed_table)).astype(h_WE.dtype)
  return h_WE.at[..., 0, :].set(jnp.broadcast_to(mask, h_WE[..., 0, :].shape))


def context_kv(lp, ctx_BSE, positions_BS, cfg: BlockDraftConfig):
  """One layer's keys and values of the context (the layer's k norm, then RoPE at the context
  positions). The context features are already normalised: no attention-input norm here."""
  dt = cfg.compute_dtype
  k = jnp.einsum("bse,ekd->bskd", ctx_BSE, lp["wk"].astype(dt))
  v = jnp.einsum("bse,ekd->bskd", ctx_BSE, lp["wv"].astype(dt))
  if "k_norm" in lp:
    k = pol.rms_norm(k, lp["k_norm"], cfg.norm_eps)
  return pol.rope(k, positions_BS, cfg.rope_theta, cfg.rope_scaling), v


def _block_qkv(lp, h_BSWE, positions_BSW, cfg: BlockDraftConfig):
  """The policy layer's q, k, v (`policy.qkv`) of every block entry, rows flattened."""
  B, S, W, E = h_BSWE.shape
  q, k, v = pol.qkv(lp, h_BSWE.reshape(B, S * W, E), positions_BSW.reshape(B, S * W), cfg)
  return tuple(a.reshape(B, S, W, *a.shape[2:]) for a in (q, k, v))


def _finish(lp, h_BSWE, o_BSWHD, cfg: BlockDraftConfig):
  """The policy layer's residual output projection and SwiGLU MLP (`policy.attn_out_and_mlp`)."""
  B, S, W, E = h_BSWE.shape
  o = o_BSWHD.reshape(B, S * W, *o_BSWHD.shape[3:])
  return pol.attn_out_and_mlp(lp, h_BSWE.reshape(B, S * W, E), o, cfg).reshape(h_BSWE.shape)


def block_hidden(dp, cfg, embed_table, taps_NBSE, tokens_BS, positions_BS, *, attend):
  """Draft hidden states of every anchor's block [B, S, W, E] (before the final norm).

  `attend(k_ctx, v_ctx, q_br, k_br, v_br) -> out_br` is the block branch attention on these rows
  (`attend_dense` in natural order, `ShardOps.block_branch` on sequence shards)."""
  ctx = context(dp, taps_NBSE, cfg)
  h = block_inputs(dp, cfg, embed_table, tokens_BS)
  W = cfg.block_size
  blk_pos = positions_BS[:, :, None] + jnp.arange(W, dtype=positions_BS.dtype)
  for layer in range(cfg.n_layers):  # a draft has one or two layers
    lp = jax.tree.map(lambda a: a[layer], dp["layers"])
    k_ctx, v_ctx = context_kv(lp, ctx, positions_BS, cfg)
    q_br, k_br, v_br = _block_qkv(lp, h, blk_pos, cfg)
    res = first_residual(dp, cfg, embed_table, h) if layer == 0 else h
    h = _finish(lp, res, attend(k_ctx, v_ctx, q_br, k_br, v_br), cfg)
  return h


def attend_dense(segment_ids_BS, *, impl: str = "dense", mesh=None, cp_axis: str = "cp"):
  """Block attention through `branch_attention(branch="block")` on natural-order rows (the
  oracle; the context has no queries of its own, so the trunk rows are zeros and unused)."""

  def attend(k_ctx, v_ctx, q_br, k_br, v_br):
    q0 = jnp.zeros_like(q_br[:, :, 0])
    return branch_attention(
      q0, k_ctx, v_ctx, q_br, k_br, v_br, segment_ids_BS, branch="block", impl=impl, mesh=mesh,
      cp_axis=cp_axis,
    )[1]  # fmt: skip

  return attend


def markov_bias(dp, prev_tokens):
  """DSpark's Markov term E[prev] @ W2 (float32 [..., V])."""
  e = jnp.take(dp["markov_in"], prev_tokens, axis=0).astype(jnp.float32)
  return e @ dp["markov_out"].astype(jnp.float32)


def slot_logits(dp, cfg: BlockDraftConfig, head_w_EV, h_E, prev_tokens=None):
  """Logits of block slots from their hidden states (any leading axes) through the policy's
  (stop-gradient) head; dspark adds the Markov term of each slot's previous token (when it has
  the head: markov_rank > 0)."""
  z = pol.rms_norm(h_E, dp["final_norm"], cfg.norm_eps)
  w = jax.lax.stop_gradient(head_w_EV)
  out = jnp.einsum("...e,ev->...v", z, w.astype(z.dtype)).astype(jnp.float32)
  if cfg.has_markov:
    out = out + markov_bias(dp, prev_tokens)
  return out


# ----------------------------------------------------------------------------- the loss


def block_loss_on_shard(
  dp,
  cfg: BlockDraftConfig,
  embed_table,
  head_w_EV,
  taps_NBSE,
  policy_BSX,
  tokens_BS,
  positions_BS,
  segment_ids_BS,
  loss_mask_BS,
  *,
  shift,
  attend,
  total,
  policy_head=None,
  vocab_chunk: int = 0,
):
  """The block draft's loss from global sums (`total` sums over the whole batch, across shards).

  `shift(x, n, fill)` is x[t + n] in the row's global order; `policy_BSX` is what the targets
  are computed from (logits when `policy_head` is None, or the final hidden state with the
  policy's head `policy_head`); vocabulary work runs in sequence chunks of `vocab_chunk`
  tokens."""
  seg = segment_ids_BS
  hs = block_hidden(dp, cfg, embed_table, taps_NBSE, tokens_BS, positions_BS, attend=attend)
  pf = jax.lax.stop_gradient(policy_BSX)
  mask = loss_mask_BS.astype(jnp.float32)
  loss, norm, metrics = 0.0, 0.0, {}
  for g in range(cfg.num_proposals):  # proposal g (0-based) predicts x_{t+1+g}
    slot = cfg.first_slot + g
    w = jnp.where((shift(seg, 1 + g, 0) == seg) & (seg != 0), shift(mask, 1 + g, 0.0), 0.0)
    target = shift(pf, g, 0.0)  # the policy's distribution over x_{t+1+g} lives at t+g
    prev = shift(tokens_BS, g, 0)  # dspark: the slot's previous token, teacher-forced
    ce, l1, agree = _slot_terms(
      dp, cfg, head_w_EV, hs[:, :, slot], target, prev, policy_head, vocab_chunk
    )
    n = jnp.maximum(total(w), 1.0)
    decay = float(np.exp(-g / cfg.gamma))
    term = ce + cfg.l1_weight * l1 if cfg.kind == "dspark" else ce
    metrics[f"ttt_acc_{g}"] = total(agree * w) / n
    loss = loss + decay * total(term * w) / n
    norm += decay
  metrics["draft_loss"] = loss / norm
  return loss / norm, metrics


def _slot_terms(dp, cfg, head_w_EV, h_BSE, target_BSX, prev_BS, policy_head, chunk):
  """Per position: soft cross-entropy, L1 distance and top-1 agreement of one slot's draft
  distribution with the policy's, in sequence chunks (targets: logits when `policy_head` is
  None, else the final hidden state through it)."""
  used = ("final_norm", "markov_in", "markov_out")  # what slot_logits reads of the draft
  params = (policy_head, head_w_EV, {k: dp[k] for k in used if k in dp})

  def per_chunk(params, t, h, prev):
    policy_w, head_w, draft = params
    t = t if policy_w is None else chunked.logits(t, policy_w)
    tl = jax.lax.stop_gradient(t).astype(jnp.float32)
    dl = slot_logits(draft, cfg, head_w, h, prev)
    p = jax.nn.softmax(tl, axis=-1)
    logq = jax.nn.log_softmax(dl, axis=-1)
    ce = -jnp.sum(p * logq, axis=-1)
    l1 = jnp.sum(jnp.abs(jnp.exp(logq) - p), axis=-1)
    return ce, l1, jnp.argmax(dl, -1) == jnp.argmax(tl, -1)

  return chunked.over_chunks(per_chunk, chunk, target_BSX, h_BSE, prev_BS, params=params)


# ----------------------------------------------------------------------------- drafting


class BlockCache(NamedTuple):
  """Each draft layer's keys and values of the context (verified positions 0 .. lengths-1)."""

  k: jax.Array  # [L,B,C,K,D]
  v: jax.Array  # [L,B,C,K,D]
  lengths: jax.Array  # [B]


def init_cache(cfg: BlockDraftConfig, batch: int, capacity: int) -> BlockCache:
  z = jnp.zeros((cfg.n_layers, batch, capacity, cfg.n_kv_heads, cfg.head_dim), cfg.compute_dtype)
  return BlockCache(z, z, jnp.zeros((batch,), jnp.int32))


def write_context(dp, cfg: BlockDraftConfig, cache: BlockCache, taps_NBTE, start_B, lengths_B):
  """Writes the context keys and values of T verified positions start .. start+T-1 (from the
  policy's taps there) into every layer's cache and sets `lengths`. Entries at and past
  `lengths` are stale: never read, overwritten later."""
  ctx = context(dp, taps_NBTE, cfg)
  T = ctx.shape[1]
  positions = start_B[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
  ks, vs = [], []
  for layer in range(cfg.n_layers):
    lp = jax.tree.map(lambda a: a[layer], dp["layers"])
    k, v = context_kv(lp, ctx, positions, cfg)
    ks.append(pol.write_rows(cache.k[layer], k, start_B))
    vs.append(pol.write_rows(cache.v[layer], v, start_B))
  return BlockCache(jnp.stack(ks), jnp.stack(vs), lengths_B.astype(jnp.int32))


def propose_hidden(dp, cfg: BlockDraftConfig, embed_table, cache: BlockCache, anchor_B):
  """One draft pass over each row's block [anchor, MASK x (W-1)] at positions n .. n+W-1
  (n = cache.lengths): the block sees the cached context < n and itself. Returns the block's
  hidden states [B, W, E]."""
  B = anchor_B.shape[0]
  W, C = cfg.block_size, cache.k.shape[2]
  n = cache.lengths
  h = block_inputs(dp, cfg, embed_table, anchor_B)  # [B, W, E]
  pos = n[:, None] + jnp.arange(W, dtype=jnp.int32)[None]
  ctx_mask = jnp.broadcast_to(jnp.arange(C)[None, None] < n[:, None, None], (B, W, C))
  mask = jnp.concatenate([ctx_mask, jnp.ones((B, W, W), bool)], axis=2)
  for layer in range(cfg.n_layers):
    lp = jax.tree.map(lambda a: a[layer], dp["layers"])
    q, k, v = (a[:, 0] for a in _block_qkv(lp, h[:, None], pos[:, None], cfg))
    keys = jnp.concatenate([cache.k[layer], k.astype(cache.k.dtype)], axis=1)
    vals = jnp.concatenate([cache.v[layer], v.astype(cache.v.dtype)], axis=1)
    o, _ = reference.masked_attention(q, keys, vals, mask)
    res = first_residual(dp, cfg, embed_table, h) if layer == 0 else h
    h = _finish(lp, res[:, None], o[:, None], cfg)[:, 0]
  return h
