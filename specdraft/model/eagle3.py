"""EAGLE-3 draft: fused policy taps + one decoder layer + its own LM head.

The draft's layer reads `[norm(embed(token)); norm(feature)]` (width 2E) for q, k and v, with a
residual on the feature. The embedding table is the policy's, passed in under stop_gradient (never
updated through the draft). Training uses the training-time test (TTT): step 0 reads the fused
policy taps; step k >= 1 reads the draft's own step k-1 output and the ground truth shifted one
further, attending to step-0 keys s <= t and its own earlier branch entries (branch="ttt").

Shape letters: B batch, S sequence, T new entries, E width, N taps, H/K heads, D head dim,
V vocabulary, C cache capacity.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specdraft.attention import blockwise as bw
from specdraft.attention import branch_attention, reference
from specdraft.model import chunked
from specdraft.model import policy as pol

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class DraftConfig:
  d_model: int
  vocab_size: int
  n_taps: int
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  d_ff: int = 384
  rope_theta: float = 10000.0
  rope_scaling: pol.RopeScaling | None = None  # the policy's
  norm_eps: float = 1e-6
  ttt_steps: int = 7
  ttt_decay: float = 0.8
  init_std: float = 0.02
  dtype: str = "float32"
  # A reduced draft vocabulary: the target token ids the draft's head covers (sorted), or None
  # for the whole target vocabulary. Outside them the draft's probability is exactly zero.
  vocab_ids: tuple[int, ...] | None = None

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def draft_vocab(self) -> int:
    """Rows of the draft's LM head: len(vocab_ids), or the target vocabulary."""
    return self.vocab_size if self.vocab_ids is None else len(self.vocab_ids)

  @classmethod
  def from_config(cls, draft_cfg, pcfg: pol.PolicyConfig, vocab_ids=None) -> DraftConfig:
    """Draft dims default to the policy's where the config leaves them 0. Refuses a config
    whose draft.kind is another kind (the entry points that build EAGLE-3 drafts directly).
    `vocab_ids`: the reduced vocabulary (`frequent_tokens`) when draft.vocab_size > 0."""
    kind = draft_cfg.get("kind", "eagle3")
    if kind != "eagle3":
      raise ValueError(
        f"config.draft.kind={kind!r}: this builds an EAGLE-3 draft only; build a draft of any "
        "kind with specdraft.model.drafts.draft_config"
      )
    pick = lambda k: draft_cfg[k] if draft_cfg.get(k) else getattr(pcfg, k)
    return cls(
      d_model=pcfg.d_model,
      vocab_size=pcfg.vocab_size,
      n_taps=len(pcfg.taps),
      n_heads=pick("n_heads"),
      n_kv_heads=pick("n_kv_heads"),
      head_dim=pick("head_dim"),
      d_ff=pick("d_ff"),
      rope_theta=pcfg.rope_theta,
      rope_scaling=pcfg.rope_scaling,
      norm_eps=pcfg.norm_eps,
      ttt_steps=draft_cfg.ttt_steps,
      ttt_decay=draft_cfg.ttt_decay,
      dtype=pcfg.dtype,
      vocab_ids=_check_vocab_ids(vocab_ids, pcfg.vocab_size),
    )


class Eagle3(nnx.Module):
  def __init__(self, cfg: DraftConfig, *, rngs: nnx.Rngs):
    E, H, K, D, F, N = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff, cfg.n_taps
    normal = nnx.initializers.normal(cfg.init_std)
    self.fc = nnx.Param(nnx.initializers.normal((N * E) ** -0.5)(rngs.params(), (N * E, E)))
    self.embed_norm = nnx.Param(jnp.ones((E,)))
    self.hidden_norm = nnx.Param(jnp.ones((E,)))
    self.wq = nnx.Param(normal(rngs.params(), (2 * E, H, D)))
    self.wk = nnx.Param(normal(rngs.params(), (2 * E, K, D)))
    self.wv = nnx.Param(normal(rngs.params(), (2 * E, K, D)))
    self.wo = nnx.Param(normal(rngs.params(), (H, D, E)))
    self.mlp_norm = nnx.Param(jnp.ones((E,)))
    self.w_gate = nnx.Param(normal(rngs.params(), (E, F)))
    self.w_up = nnx.Param(normal(rngs.params(), (E, F)))
    self.w_down = nnx.Param(normal(rngs.params(), (F, E)))
    self.final_norm = nnx.Param(jnp.ones((E,)))
    self.head = nnx.Param(normal(rngs.params(), (E, cfg.draft_vocab)))


def init_params(
  cfg: DraftConfig,
  seed: int,
  policy_params: Params | None = None,
  pcfg: pol.PolicyConfig | None = None,
) -> Params:
  """Fresh draft parameters; with the policy given, the LM head (its columns of the draft's
  vocabulary) and final norm start as its own."""
  params = pol.split_params(Eagle3(cfg, rngs=nnx.Rngs(seed)))
  if policy_params is not None:
    w = policy_params["embed"].T if pcfg.tie_embeddings else policy_params["head"]
    if cfg.vocab_ids is not None:
      w = w[:, np.asarray(cfg.vocab_ids)]
    params["head"] = jnp.asarray(w, params["head"].dtype)
    params["final_norm"] = jnp.asarray(policy_params["final_norm"])
  return params


def fuse(dp: Params, taps_NBTE, cfg: DraftConfig):
  """Concatenate the tapped layers along features and project to width E."""
  N, B, T, E = taps_NBTE.shape
  x = jnp.moveaxis(taps_NBTE, 0, 2).reshape(B, T, N * E).astype(cfg.compute_dtype)
  return x @ dp["fc"].astype(cfg.compute_dtype)


def _qkv(dp, embed_table, feat_BTE, tokens_BT, positions_BT, cfg: DraftConfig):
  dt = cfg.compute_dtype
  emb = jnp.take(jax.lax.stop_gradient(embed_table), tokens_BT, axis=0).astype(dt)
  x = jnp.concatenate(
    [
      pol.rms_norm(emb, dp["embed_norm"], cfg.norm_eps),
      pol.rms_norm(feat_BTE, dp["hidden_norm"], cfg.norm_eps),
    ],
    axis=-1,
  )
  q = jnp.einsum("bte,ehd->bthd", x, dp["wq"].astype(dt))
  k = jnp.einsum("bte,ekd->btkd", x, dp["wk"].astype(dt))
  v = jnp.einsum("bte,ekd->btkd", x, dp["wv"].astype(dt))
  sc = cfg.rope_scaling
  return (
    pol.rope(q, positions_BT, cfg.rope_theta, sc),
    pol.rope(k, positions_BT, cfg.rope_theta, sc),
    v,
  )


def _finish(dp, feat_BTE, o_BTHD, cfg: DraftConfig):
  """Residual on the feature, then the residual SwiGLU MLP; returns the draft hidden state."""
  dt = cfg.compute_dtype
  h = feat_BTE.astype(dt) + jnp.einsum("bthd,hde->bte", o_BTHD.astype(dt), dp["wo"].astype(dt))
  z = pol.rms_norm(h, dp["mlp_norm"], cfg.norm_eps)
  g = jax.nn.silu(z @ dp["w_gate"].astype(dt)) * (z @ dp["w_up"].astype(dt))
  return h + g @ dp["w_down"].astype(dt)


def head_logits(dp, h_BTE, cfg: DraftConfig):
  """The draft head's logits over its own vocabulary [..., draft_vocab]."""
  z = pol.rms_norm(h_BTE, dp["final_norm"], cfg.norm_eps)
  return jnp.einsum("...e,ev->...v", z, dp["head"].astype(z.dtype)).astype(jnp.float32)


def logits_of(dp, h_BTE, cfg: DraftConfig):
  """The draft's logits over the target vocabulary [..., V]: with a reduced vocabulary, -inf
  outside it, so sampling and rejection see the draft's exact distribution on the target's
  tokens (zero outside its vocabulary)."""
  z = head_logits(dp, h_BTE, cfg)
  if cfg.vocab_ids is None:
    return z
  full = jnp.full(z.shape[:-1] + (cfg.vocab_size,), -jnp.inf, z.dtype)
  return full.at[..., np.asarray(cfg.vocab_ids)].set(z)


def _check_vocab_ids(vocab_ids, vocab_size: int):
  if vocab_ids is None:
    return None
  ids = tuple(int(i) for i in vocab_ids)
  if not ids or list(ids) != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= vocab_size:
    raise ValueError(
      f"draft vocab_ids must be distinct sorted target ids in [0, {vocab_size}); got "
      f"{len(ids)} ids from {ids[:1]} to {ids[-1:]}"
    )
  return ids


def frequent_tokens(token_rows, vocab_size: int, size: int, *, always=()) -> tuple[int, ...]:
  """The `size` most frequent target ids in `token_rows` (iterables of ids; ties to the lower
  id), always including `always` (EOS: a draft must be able to stop), sorted."""
  if not 0 < size <= vocab_size:
    raise ValueError(f"a draft vocabulary of {size} tokens needs 0 < size <= {vocab_size}")
  counts = np.zeros(vocab_size, np.int64)
  for row in token_rows:
    np.add.at(counts, np.asarray(list(row), np.int64), 1)
  keep = [int(t) for t in always]
  for t in np.lexsort((np.arange(vocab_size), -counts)):
    if len(keep) >= size:
      break
    if int(t) not in keep:
      keep.append(int(t))
  return tuple(sorted(keep[:size]))


# ----------------------------------------------------------------------------- training (TTT)


def shift_within_segment(x_BS, segment_ids_BS, n: int, fill=0):
  """x[t + n] where t + n is in t's segment, else `fill` (natural token order)."""
  S = x_BS.shape[1]
  if n == 0:
    return x_BS
  shifted = jnp.concatenate(
    [x_BS[:, n:], jnp.full((x_BS.shape[0], min(n, S)), fill, x_BS.dtype)], axis=1
  )[:, :S]
  seg_sh = jnp.concatenate(
    [segment_ids_BS[:, n:], jnp.zeros((x_BS.shape[0], min(n, S)), segment_ids_BS.dtype)], axis=1
  )[:, :S]
  ok = (seg_sh == segment_ids_BS) & (segment_ids_BS != 0)
  return jnp.where(ok, shifted, fill)


def ttt_targets(tokens_BS, segment_ids_BS, loss_mask_BS, steps: int):
  """Per TTT step k: input tokens x[t+1+k] and weights (x[t+2+k] is a loss token of t's doc).

  Returns (tokens_KBS, weights_KBS). Step k at anchor t is supervised by the policy's
  distribution at position t+1+k.
  """
  toks, ws = [], []
  for k in range(steps):
    toks.append(shift_within_segment(tokens_BS, segment_ids_BS, 1 + k))
    ws.append(shift_within_segment(loss_mask_BS.astype(jnp.float32), segment_ids_BS, 2 + k))
  return jnp.stack(toks), jnp.stack(ws)


def natural_shift(x, n: int, fill=0):
  """x[:, t + n] along axis 1 (natural token order), `fill` past the end."""
  if n == 0:
    return x
  S = x.shape[1]
  pad = jnp.full((x.shape[0], min(n, S)) + x.shape[2:], fill, x.dtype)
  return jnp.concatenate([x[:, n:], pad], axis=1)[:, :S]


def attend_by_merge(trunk, segment_ids_BS):
  """TTT attention in O(K) trunk passes (the training path).

  `trunk(q, k, v) -> (out, lse_BHS)` is packed causal attention over the trunk keys (the ring per
  shard, or tiled at cp = 1). Step k's query row at anchor t sees the trunk keys s <= t and its
  own anchor's branch keys of steps 1..k: one trunk pass for the new row only, merged by
  log-sum-exp with the row-local attention to those k keys (which never leave the rank). Earlier
  steps' rows are never recomputed, so K steps cost K trunk passes, not K (K + 1) / 2.
  Returns attend(q0, k0, v0, qs, ks, vs) for `_ttt_hidden`."""

  def attend(q0, k0, v0, qs, ks, vs):
    if not qs:
      return trunk(q0, k0, v0)[0]
    o_t, lse_t = trunk(qs[-1], k0, v0)
    o_d, lse_d = bw.row_local(qs[-1], jnp.stack(ks, 2), jnp.stack(vs, 2), segment_ids_BS)
    return bw.merge(o_t.astype(jnp.float32), lse_t, o_d, lse_d)[0].astype(q0.dtype)

  return attend


def attend_by_branch(branch_fn):
  """TTT attention through `branch_fn(q0, k0, v0, q_br, k_br, v_br) -> (out, out_br)` (the
  trunk + branch attention of attention/api.py): step k recomputes the trunk rows and every
  earlier branch row, O(K^2) rows in all. The oracle form, kept for the natural-order reference
  losses (`ttt_forward`, `oracles.ttt_loss` with "dense" / "allgather").
  Returns attend(q0, k0, v0, qs, ks, vs) for `_ttt_hidden`."""

  def attend(q0, k0, v0, qs, ks, vs):
    if not qs:
      B, S, H, D = q0.shape
      empty_q = jnp.zeros((B, S, 0, H, D), q0.dtype)
      empty_kv = jnp.zeros((B, S, 0) + k0.shape[2:], k0.dtype)
      return branch_fn(q0, k0, v0, empty_q, empty_kv, empty_kv)[0]
    out_br = branch_fn(q0, k0, v0, jnp.stack(qs, 2), jnp.stack(ks, 2), jnp.stack(vs, 2))[1]
    return out_br[:, :, -1]

  return attend


def _ttt_hidden(
  dp, cfg, embed_table, taps_NBSE, tokens_BS, positions_BS, segment_ids_BS, *, shift, attend
):
  """Draft hidden states of every TTT step [K,B,S,E]; `shift(x, n, fill)` is x[t+n] in global
  order (natural or zigzag); `attend(q0, k0, v0, qs, ks, vs)` the attention output of the newest
  query: q0's over the trunk when `qs` is empty, else the newest branch row qs[-1]'s
  (`attend_by_merge` or `attend_by_branch`)."""
  seg = segment_ids_BS

  def in_doc(n):
    return (shift(seg, n, 0) == seg) & (seg != 0)

  feat = fuse(dp, taps_NBSE, cfg)
  tok = lambda k: jnp.where(in_doc(1 + k), shift(tokens_BS, 1 + k, 0), 0)
  q0, k0, v0 = _qkv(dp, embed_table, feat, tok(0), positions_BS, cfg)
  h = _finish(dp, feat, attend(q0, k0, v0, [], [], []), cfg)
  hs = [h]
  qs, ks, vs = [], [], []
  for k in range(1, cfg.ttt_steps):
    q, kk, v = _qkv(dp, embed_table, h, tok(k), positions_BS + k, cfg)
    qs.append(q)
    ks.append(kk)
    vs.append(v)
    h = _finish(dp, h, attend(q0, k0, v0, qs, ks, vs), cfg)
    hs.append(h)
  return jnp.stack(hs)


def ttt_loss_on_shard(
  dp,
  cfg,
  embed_table,
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
  """The TTT loss from global sums (`total` sums over the whole batch, across shards).

  `policy_BSX` is what the targets are computed from: the policy's logits (X = V) when
  `policy_head` is None, or its final hidden state (X = E) with its LM head `policy_head`
  [E, V]; either way the soft cross-entropy runs in sequence chunks of `vocab_chunk` (0: the
  whole row)."""
  seg = segment_ids_BS
  hs = _ttt_hidden(
    dp, cfg, embed_table, taps_NBSE, tokens_BS, positions_BS, seg, shift=shift, attend=attend
  )
  pf = jax.lax.stop_gradient(policy_BSX)
  mask = loss_mask_BS.astype(jnp.float32)
  # Over the draft's vocabulary: with a reduced one, the target is the policy's distribution
  # restricted to it and renormalised (what a draft limited to those tokens can match).
  draft_logits_of = lambda head, h: head_logits(head, h, cfg)
  ids = None if cfg.vocab_ids is None else np.asarray(cfg.vocab_ids)
  if ids is not None and policy_head is not None:
    # the targets need the policy's logits of the draft's ids only: their columns of the head
    # (every TTT step's targets then cost a [.., E] x [E, draft_vocab] matmul, not E x V)
    policy_head, ids = jnp.take(policy_head, ids, axis=1), None

  def policy_logits_of(w, x):
    z = x if w is None else chunked.logits(x, w)
    return z if ids is None else jnp.take(z, ids, axis=-1)

  # what the chunk loops read besides the chunks (`chunked.over_chunks`)
  params = (policy_head, {k: dp[k] for k in ("final_norm", "head")})
  loss, norm, metrics = 0.0, 0.0, {}
  for k in range(cfg.ttt_steps):
    w = jnp.where((shift(seg, 2 + k, 0) == seg) & (seg != 0), shift(mask, 2 + k, 0.0), 0.0)
    target = shift(pf, 1 + k, 0.0)  # the policy's distribution at t+1+k
    ce, agree = chunked.soft_cross_entropy(
      target, policy_logits_of, hs[k], draft_logits_of, chunk=vocab_chunk, params=params
    )
    n = jnp.maximum(total(w), 1.0)
    metrics[f"ttt_acc_{k}"] = total(agree * w) / n
    loss = loss + cfg.ttt_decay**k * total(ce * w) / n
    norm += cfg.ttt_decay**k
  metrics["draft_loss"] = loss / norm
  return loss / norm, metrics


def ttt_forward(
  dp: Params,
  cfg: DraftConfig,
  embed_table,
  taps_NBSE,
  tokens_BS,
  positions_BS,
  segment_ids_BS,
  *,
  attn_impl: str = "dense",
  mesh=None,
):
  """Draft logits for every TTT step: [K,B,S,V] (step k at anchor t predicts x[t+2+k])."""
  attend = attend_by_branch(
    lambda *a: branch_attention(*a, segment_ids_BS, branch="ttt", impl=attn_impl, mesh=mesh)
  )
  hs = _ttt_hidden(
    dp,
    cfg,
    embed_table,
    taps_NBSE,
    tokens_BS,
    positions_BS,
    segment_ids_BS,
    shift=natural_shift,
    attend=attend,
  )
  return logits_of(dp, hs, cfg)


def shift_within_segment_logits(logits_BSV, segment_ids_BS, n: int):
  """logits[t + n] (rows outside t's segment are zeros; they carry zero weight)."""
  B, S, V = logits_BSV.shape
  pad = jnp.zeros((B, min(n, S), V), logits_BSV.dtype)
  return jnp.concatenate([logits_BSV[:, n:], pad], axis=1)[:, :S]


# ----------------------------------------------------------------------------- drafting


class DraftCache(NamedTuple):
  k: jax.Array  # [B,C,K,D]
  v: jax.Array  # [B,C,K,D]
  lengths: jax.Array  # [B]


def init_cache(cfg: DraftConfig, batch: int, capacity: int) -> DraftCache:
  z = jnp.zeros((batch, capacity, cfg.n_kv_heads, cfg.head_dim), cfg.compute_dtype)
  return DraftCache(z, z, jnp.zeros((batch,), jnp.int32))


def prefill(
  dp: Params, cfg: DraftConfig, embed_table, cache: DraftCache, feat_BTE, tokens_BT, lengths_B
):
  """Writes a right-padded prompt's T entries into an empty cache at 0..T-1.

  The entries attend to each other causally through the tiled attention of the training path, so
  no [B, T, C] mask or score tensor exists however long the prompt (at 8K tokens and 8 rows the
  dense form is gigabytes). Entries at and past `lengths_B` are padding: written, never read
  (later steps overwrite them). Returns (logits_BTV, hidden_BTE, cache with lengths = lengths_B).
  """
  B, T = tokens_BT.shape
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  q, k, v = _qkv(dp, embed_table, feat_BTE, tokens_BT, positions, cfg)
  start = jnp.zeros((B,), jnp.int32)
  ck, cv = pol.write_rows(cache.k, k, start), pol.write_rows(cache.v, v, start)
  valid = (positions < lengths_B[:, None]).astype(jnp.int32)
  o = pol.tiled_attention()(q, k, v, positions, valid)
  h = _finish(dp, feat_BTE, o, cfg)
  return logits_of(dp, h, cfg), h, DraftCache(ck, cv, lengths_B.astype(jnp.int32))


def step_hidden(
  dp: Params, cfg: DraftConfig, embed_table, cache: DraftCache, feat_BTE, tokens_BT, skipped_B=None
):
  """Appends T draft entries (feature, next token) at cache slots lengths..lengths+T-1 and runs
  the layer; returns (hidden_BTE, cache with lengths advanced by T).

  An entry's slot and its position differ by `skipped_B` (default 0): the positions whose entries
  were never written (a decode that ran plain policy steps for a while and kept only the last
  few for the draft, `decode.speculative`). Attention runs over slots (every written entry up to
  the query's own), rotary embeddings over positions = slots + skipped."""
  T = tokens_BT.shape[1]
  C = cache.k.shape[1]
  slots = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
  positions = slots if skipped_B is None else slots + skipped_B[:, None]
  q, k, v = _qkv(dp, embed_table, feat_BTE, tokens_BT, positions, cfg)
  ck = pol.write_rows(cache.k, k, cache.lengths)
  cv = pol.write_rows(cache.v, v, cache.lengths)
  mask = jnp.arange(C)[None, None, :] <= slots[:, :, None]
  o, _ = reference.masked_attention(q, ck, cv, mask)
  return _finish(dp, feat_BTE, o, cfg), DraftCache(ck, cv, cache.lengths + T)


def step(
  dp: Params, cfg: DraftConfig, embed_table, cache: DraftCache, feat_BTE, tokens_BT, skipped_B=None
):
  """`step_hidden` and the draft's logits at every new entry: (logits_BTV, hidden_BTE, cache)."""
  h, cache = step_hidden(dp, cfg, embed_table, cache, feat_BTE, tokens_BT, skipped_B)
  return logits_of(dp, h, cfg), h, cache
