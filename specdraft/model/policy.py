"""Decoder-only policy LM (Llama / Qwen family) with taps and a KV cache.

Flax NNX defines and initialises the parameters; everything that runs under jit works on the
plain parameter pytree (`split_params`), through pure functions. Decoder layers are stacked
along a leading layer axis: `run_layers` runs any contiguous slice of them with `lax.scan`
(a pipeline stage is such a slice).

Shape letters: B batch, S sequence, T new tokens, E model width, H query heads, K kv heads,
D head dim, F MLP width, V vocabulary, L layers, N taps, C cache capacity.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from specdraft.attention import reference, ring

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """RoPE frequency scaling for context extension (the rule of `rope_inv_freq`):

  - linear: every frequency divided by `factor` (position interpolation);
  - llama3: wavelengths longer than original / low_freq_factor divided by `factor`, shorter than
    original / high_freq_factor kept, and the band between blended smoothly;
  - yarn: per-dimension blend of interpolated (/factor) and original frequencies over the
    correction range set by `beta_fast` / `beta_slow` rotations at the original length, and
    cos/sin multiplied by `attention_factor` (so attention logits by its square).
  `original_max_position_embeddings` is the pretraining length (llama3, yarn)."""

  kind: str
  factor: float
  original_max_position_embeddings: int = 0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float = 1.0
  truncate: bool = True

  KINDS = ("linear", "llama3", "yarn")

  def __post_init__(self):
    if self.kind not in self.KINDS:
      raise ValueError(f"rope scaling kind={self.kind!r}; expected one of {self.KINDS}")
    if not self.factor > 0:
      raise ValueError(f"rope scaling factor={self.factor!r}; expected > 0")
    if self.kind != "linear" and self.original_max_position_embeddings <= 0:
      raise ValueError(
        f"rope scaling {self.kind} needs original_max_position_embeddings > 0, got "
        f"{self.original_max_position_embeddings!r}"
      )
    if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
      raise ValueError(
        f"rope scaling llama3: high_freq_factor={self.high_freq_factor} must exceed "
        f"low_freq_factor={self.low_freq_factor}"
      )


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
  """The D/2 inverse frequencies of RoPE (float64, static) under `scaling` (None: plain)."""
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  if scaling is None:
    return inv
  f = scaling.factor
  if scaling.kind == "linear":
    return inv / f
  orig = scaling.original_max_position_embeddings
  if scaling.kind == "llama3":
    lo, hi = scaling.low_freq_factor, scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = np.clip((orig / wavelen - lo) / (hi - lo), 0.0, 1.0)  # 0: long waves, 1: short
    return (1 - smooth) * inv / f + smooth * inv
  # yarn: dimension d completes orig / (2 pi base^(2d/D)) rotations over the original length;
  # dims with more than beta_fast rotations keep their frequency, fewer than beta_slow are
  # interpolated, and a linear ramp between
  dim_of = lambda rot: head_dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(theta))
  lo, hi = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
  if scaling.truncate:
    lo, hi = math.floor(lo), math.ceil(hi)
  lo, hi = max(lo, 0), min(hi, head_dim - 1)
  hi = hi + 0.001 if lo == hi else hi
  ramp = np.clip((np.arange(head_dim // 2, dtype=np.float64) - lo) / (hi - lo), 0.0, 1.0)
  keep = 1.0 - ramp  # weight of the original frequency
  return inv / f * (1 - keep) + inv * keep


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  vocab_size: int
  d_model: int = 128
  n_layers: int = 4
  n_heads: int = 4
  n_kv_heads: int = 2
  head_dim: int = 32
  d_ff: int = 384
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None  # None: plain RoPE
  norm_eps: float = 1e-6
  tie_embeddings: bool = True
  qkv_bias: bool = False  # q/k/v projection biases (Qwen2)
  qk_norm: bool = False  # RMSNorm of each q and k head before RoPE (Qwen3)
  tap_layers: tuple[int, ...] | None = None
  init_std: float = 0.02
  dtype: str = "float32"
  eos_id: int = 2  # the token that ends a generation (the character tokenizer's EOS by default)
  stop_ids: tuple[int, ...] = ()  # more tokens that end one (a checkpoint's other EOS ids)

  @property
  def taps(self) -> tuple[int, ...]:
    """Tap layers (0-indexed layer outputs); EAGLE-3's default (1, L//2-1, L-4)."""
    if self.tap_layers is not None:
      return tuple(int(t) for t in self.tap_layers)
    return default_tap_layers(self.n_layers)

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @classmethod
  def from_config(cls, model_cfg, vocab_size: int) -> PolicyConfig:
    fields = {f.name for f in dataclasses.fields(cls)} - {"vocab_size"}
    kw = {k: model_cfg[k] for k in fields if k in model_cfg}
    if kw.get("tap_layers") is not None:
      kw["tap_layers"] = tuple(kw["tap_layers"])
    return cls(vocab_size=vocab_size, **kw)


def is_stop(cfg: PolicyConfig, tokens):
  """Whether each token ends a generation: `cfg.eos_id` or one of `cfg.stop_ids`."""
  out = tokens == cfg.eos_id
  for t in cfg.stop_ids:
    out = out | (tokens == t)
  return out


def default_tap_layers(n_layers: int) -> tuple[int, ...]:
  """EAGLE-3's tap layers; for very shallow models they are clamped into range and deduplicated."""
  raw = (1, n_layers // 2 - 1, n_layers - 4)
  return tuple(sorted({min(max(t, 0), n_layers - 1) for t in raw}))


class StackedLayers(nnx.Module):
  """All decoder layers' weights, stacked on a leading layer axis."""

  def __init__(self, cfg: PolicyConfig, *, rngs: nnx.Rngs):
    L, E, H, K, D, F = (
      cfg.n_layers,
      cfg.d_model,
      cfg.n_heads,
      cfg.n_kv_heads,
      cfg.head_dim,
      cfg.d_ff,
    )
    normal = nnx.initializers.normal(cfg.init_std)
    out_std = cfg.init_std / (2 * L) ** 0.5  # residual-branch outputs scaled down with depth
    self.attn_norm = nnx.Param(jnp.ones((L, E)))
    self.wq = nnx.Param(normal(rngs.params(), (L, E, H, D)))
    self.wk = nnx.Param(normal(rngs.params(), (L, E, K, D)))
    self.wv = nnx.Param(normal(rngs.params(), (L, E, K, D)))
    self.wo = nnx.Param(nnx.initializers.normal(out_std)(rngs.params(), (L, H, D, E)))
    if cfg.qkv_bias:
      self.bq = nnx.Param(jnp.zeros((L, H, D)))
      self.bk = nnx.Param(jnp.zeros((L, K, D)))
      self.bv = nnx.Param(jnp.zeros((L, K, D)))
    if cfg.qk_norm:
      self.q_norm = nnx.Param(jnp.ones((L, D)))
      self.k_norm = nnx.Param(jnp.ones((L, D)))
    self.mlp_norm = nnx.Param(jnp.ones((L, E)))
    self.w_gate = nnx.Param(normal(rngs.params(), (L, E, F)))
    self.w_up = nnx.Param(normal(rngs.params(), (L, E, F)))
    self.w_down = nnx.Param(nnx.initializers.normal(out_std)(rngs.params(), (L, F, E)))


class Policy(nnx.Module):
  """Parameter container; `__call__` is a convenience for notebooks (jit uses `forward`)."""

  def __init__(self, cfg: PolicyConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    # std 1/sqrt(E) keeps tied-head logits O(1) at init.
    self.embed = nnx.Param(
      nnx.initializers.normal(cfg.d_model**-0.5)(rngs.params(), (cfg.vocab_size, cfg.d_model))
    )
    self.layers = StackedLayers(cfg, rngs=rngs)
    self.final_norm = nnx.Param(jnp.ones((cfg.d_model,)))
    if not cfg.tie_embeddings:
      self.head = nnx.Param(
        nnx.initializers.normal(cfg.init_std)(rngs.params(), (cfg.d_model, cfg.vocab_size))
      )

  def __call__(self, tokens, positions=None, segment_ids=None):
    return forward(split_params(self), self.cfg, tokens, positions, segment_ids)


def split_params(model: nnx.Module) -> Params:
  """The model's parameters as a plain nested dict of arrays (the jit-boundary pytree)."""
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def init_params(cfg: PolicyConfig, seed: int) -> Params:
  return split_params(Policy(cfg, rngs=nnx.Rngs(seed)))


def param_logical_axes(params: Params) -> Params:
  """Logical axis names of every policy parameter (mapped onto the mesh by layout rules)."""
  names = {
    "embed": ("vocab", "embed"),
    "final_norm": ("embed",),
    "head": ("embed", "vocab"),
    "attn_norm": ("layers", "embed"),
    "mlp_norm": ("layers", "embed"),
    "wq": ("layers", "embed", "heads", "head_dim"),
    "wk": ("layers", "embed", "kv_heads", "head_dim"),
    "wv": ("layers", "embed", "kv_heads", "head_dim"),
    "wo": ("layers", "heads", "head_dim", "embed"),
    "bq": ("layers", "heads", "head_dim"),
    "bk": ("layers", "kv_heads", "head_dim"),
    "bv": ("layers", "kv_heads", "head_dim"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
  }
  return jax.tree_util.tree_map_with_path(lambda p, _: names[p[-1].key], params)


# ----------------------------------------------------------------------------- building blocks


def rms_norm(x, scale, eps):
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * scale.astype(jnp.float32)).astype(x.dtype)


def rope(x_BTHD, positions_BT, theta, scaling: RopeScaling | None = None):
  """Rotary embedding (half-split convention) at caller-supplied positions, with the
  frequencies of `scaling` (`rope_inv_freq`; None: plain RoPE)."""
  D = x_BTHD.shape[-1]
  if scaling is None:  # computed in float32 as it always was: plain runs stay bit-identical
    freqs = theta ** (-jnp.arange(0, D // 2, dtype=jnp.float32) * 2.0 / D)
  else:
    freqs = jnp.asarray(rope_inv_freq(D, theta, scaling), jnp.float32)
  ang = positions_BT.astype(jnp.float32)[..., None] * freqs  # [B,T,D/2]
  sin, cos = jnp.sin(ang)[:, :, None, :], jnp.cos(ang)[:, :, None, :]
  if scaling is not None and scaling.attention_factor != 1.0:
    sin, cos = sin * scaling.attention_factor, cos * scaling.attention_factor
  x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BTHD.dtype)


def qkv(lp, x_BTE, positions_BT, cfg: PolicyConfig):
  """One layer's projected, RoPE-rotated q, k and v (drafts reuse this). Layers with q/k/v
  biases (Qwen2) add them; layers with q/k norms (Qwen3) RMS-normalise each head of q and k
  before RoPE."""
  dt = cfg.compute_dtype
  h = rms_norm(x_BTE, lp["attn_norm"], cfg.norm_eps)
  q = jnp.einsum("bte,ehd->bthd", h, lp["wq"].astype(dt))
  k = jnp.einsum("bte,ekd->btkd", h, lp["wk"].astype(dt))
  v = jnp.einsum("bte,ekd->btkd", h, lp["wv"].astype(dt))
  if "bq" in lp:
    q, k, v = q + lp["bq"].astype(dt), k + lp["bk"].astype(dt), v + lp["bv"].astype(dt)
  if "q_norm" in lp:
    q, k = rms_norm(q, lp["q_norm"], cfg.norm_eps), rms_norm(k, lp["k_norm"], cfg.norm_eps)
  sc = cfg.rope_scaling
  return rope(q, positions_BT, cfg.rope_theta, sc), rope(k, positions_BT, cfg.rope_theta, sc), v


def attn_out_and_mlp(lp, x_BTE, o_BTHD, cfg: PolicyConfig):
  """Residual attention output projection followed by the residual SwiGLU MLP."""
  dt = cfg.compute_dtype
  x = x_BTE + jnp.einsum("bthd,hde->bte", o_BTHD.astype(dt), lp["wo"].astype(dt))
  h = rms_norm(x, lp["mlp_norm"], cfg.norm_eps)
  g = jnp.einsum("bte,ef->btf", h, lp["w_gate"].astype(dt))
  u = jnp.einsum("bte,ef->btf", h, lp["w_up"].astype(dt))
  return x + jnp.einsum("btf,fe->bte", jax.nn.silu(g) * u, lp["w_down"].astype(dt))


class KVCache(NamedTuple):
  """Fixed-capacity cache. Entries at index >= lengths[b] are stale and never attended to."""

  k: jax.Array  # [L,B,C,K,D]
  v: jax.Array  # [L,B,C,K,D]
  lengths: jax.Array  # [B] int32

  @property
  def capacity(self) -> int:
    return self.k.shape[2]


def init_cache(cfg: PolicyConfig, batch: int, capacity: int) -> KVCache:
  shape = (cfg.n_layers, batch, capacity, cfg.n_kv_heads, cfg.head_dim)
  z = jnp.zeros(shape, cfg.compute_dtype)
  return KVCache(z, z, jnp.zeros((batch,), jnp.int32))


def write_rows(cache_BCKD, new_BTKD, start_B):
  return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, (s, 0, 0)))(
    cache_BCKD, new_BTKD.astype(cache_BCKD.dtype), start_B
  )


# ----------------------------------------------------------------------------- layer stacks


def tiled_attention(*, tile: int = 512):
  """Packed causal attention as tiles with an online softmax (the ring at cp = 1): memory
  O(tile^2) per head instead of a [B, T, S] mask and score tensor.
  Returns attend(q, k, v, positions, segment_ids)."""
  return lambda q, k, v, pos, seg: ring.trunk_attention_shard(
    q, k, v, seg.astype(jnp.int32), pos.astype(jnp.int32), tile=tile
  )


def dense_attention(q, k, v, positions_BT, segment_ids_BT):
  """The float32 oracle: every score under an explicit [B, T, S] mask (tests only)."""
  mask_BTS = reference.causal_mask(positions_BT, positions_BT, segment_ids_BT, segment_ids_BT)
  return reference.masked_attention(q, k, v, mask_BTS)[0].astype(q.dtype)


def _training_layer(cfg: PolicyConfig, positions_BT, attend, constrain=None):
  """Scan body of one layer over whole rows: xs = (layer params, positions, segment ids).
  `constrain` (`parallel.mesh.activation_constraint`) pins the residual stream's sharding on the
  way in and out."""
  pin = constrain or (lambda x: x)

  def body(x, xs):
    lp, pos, seg = xs
    x = pin(x)
    q, k, v = qkv(lp, x, positions_BT, cfg)
    return pin(attn_out_and_mlp(lp, x, attend(q, k, v, pos, seg), cfg)), None

  return body


def _prefill_layer(cfg: PolicyConfig, positions_BT, attend):
  """Scan body of one layer over a prompt written into an empty cache: xs = (layer params,
  positions, segment ids, k, v); the prompt attends to itself through `attend`."""

  def body(x, xs):
    lp, pos, seg, ck, cv = xs
    q, k, v = qkv(lp, x, positions_BT, cfg)
    start = jnp.zeros((x.shape[0],), jnp.int32)
    ck, cv = write_rows(ck, k, start), write_rows(cv, v, start)
    return attn_out_and_mlp(lp, x, attend(q, k, v, pos, seg), cfg), (ck, cv)

  return body


def _cached_layer(cfg: PolicyConfig, positions_BT, cache, T: int):
  """Scan body of one layer over T new tokens and the whole KV cache: carry = (x, k, v) with the
  cache's [L, B, C, K, D] arrays, xs = (layer params, layer index). Each layer scatters only its T
  new rows per row into the carried cache (in place) and reads its own [B, C, K, D] slice to
  attend; scanning per-layer caches as inputs and outputs would instead write every entry of
  every layer on every step, which at long capacity dominates a decode step."""
  _, _, lengths = cache
  B, C = lengths.shape[0], cache[0].shape[2]
  q_idx = lengths[:, None] + jnp.arange(T)[None, :]  # [B, T] cache slots of the new tokens
  mask_BTC = jnp.arange(C)[None, None, :] <= q_idx[:, :, None]
  rows = jnp.arange(B)[:, None]

  def body(carry, xs):
    x, k_all, v_all = carry
    lp, layer = xs
    q, k, v = qkv(lp, x, positions_BT, cfg)
    k_all = k_all.at[layer, rows, q_idx].set(k.astype(k_all.dtype), mode="drop")
    v_all = v_all.at[layer, rows, q_idx].set(v.astype(v_all.dtype), mode="drop")
    o, _ = reference.masked_attention(q, k_all[layer], v_all[layer], mask_BTC)
    return (attn_out_and_mlp(lp, x, o, cfg), k_all, v_all), None

  return body


def slice_layers(layers: Params, start: int, stop: int) -> Params:
  return jax.tree.map(lambda a: a[start:stop], layers)


def run_layers(
  layers: Params,
  x_BTE,
  cfg: PolicyConfig,
  *,
  positions_BT,
  segment_ids_BT=None,
  cache: tuple[jax.Array, jax.Array, jax.Array] | None = None,
  tap_at: tuple[int, ...] = (),
  attend=None,
  remat: bool = False,
  constrain=None,
):
  """Runs a contiguous stack of layers (leading axis of `layers`) with `lax.scan`.

  Without a cache: packed causal attention by (positions, segment ids), computed by
  `attend(q, k, v, positions, segment_ids) -> out` (default `tiled_attention()`: flash-style
  tiles, no [B, T, S] mask; a context-parallel step passes the per-shard ring;
  `dense_attention` is the oracle). Positions and segment ids enter every layer as scanned
  inputs, not as loop constants: differentiating a scan hoists whatever depends only on its
  constants out of the loop, and the attention's per-tile masks would then be precomputed for
  every tile pair at once (O(S^2) memory). `remat` rematerialises each layer in the backward pass
  (only the layer inputs are saved). `constrain` (training only; None: none) pins the residual
  stream's sharding at every layer boundary (`parallel.mesh.activation_constraint`).
  With `cache = (k_LBCKD, v_LBCKD, lengths_B)`: the T new tokens are written at
  lengths..lengths+T-1 and attend to cache entries j <= lengths + i. With a cache and `attend`
  (prefill: lengths are 0), the new tokens attend to each other through `attend` and their keys
  and values are written at 0..T-1.
  `tap_at` are local layer indices whose outputs are returned. The scan is split at those layers
  so no per-layer hidden states are kept beyond the taps.
  Returns (x, taps_NBTE or None, (new_k, new_v) or None).
  """
  n = jax.tree.leaves(layers)[0].shape[0]
  if any(not 0 <= t < n for t in tap_at):
    raise ValueError(f"tap_at {tap_at} out of range for a stack of {n} layers")
  if segment_ids_BT is None:
    segment_ids_BT = jnp.ones(positions_BT.shape, jnp.int32)
  decode = cache is not None and attend is None
  if decode:
    body = _cached_layer(cfg, positions_BT, cache, x_BTE.shape[1])
  elif cache is None:
    body = _training_layer(cfg, positions_BT, attend or tiled_attention(), constrain)
  else:
    body = _prefill_layer(cfg, positions_BT, attend)
  if remat:
    body = jax.checkpoint(body)
  carry = (x_BTE, cache[0], cache[1]) if decode else x_BTE
  x, taps, new_k, new_v, start = x_BTE, [], [], [], 0
  for stop in sorted(set(t + 1 for t in tap_at) | {n}):  # one scan per run of untapped layers
    seg_layers = slice_layers(layers, start, stop)
    if decode:
      xs = (seg_layers, jnp.arange(start, stop))
    else:
      per_layer = lambda a: jnp.broadcast_to(a, (stop - start,) + a.shape)
      xs = (seg_layers, per_layer(positions_BT), per_layer(segment_ids_BT))
      if cache is not None:
        xs += (cache[0][start:stop], cache[1][start:stop])
    carry, kv = jax.lax.scan(body, carry, xs)
    x = carry[0] if decode else carry
    if kv is not None:  # prefill: the layers' cache slices
      new_k.append(kv[0])
      new_v.append(kv[1])
    if stop - 1 in tap_at:
      taps.append(x)
    start = stop
  taps_out = jnp.stack(taps) if taps else None
  if decode:
    kv_out = carry[1:]
  else:
    kv_out = None if cache is None else (jnp.concatenate(new_k), jnp.concatenate(new_v))
  return x, taps_out, kv_out


def embed(params: Params, tokens_BT, cfg: PolicyConfig):
  return jnp.take(params["embed"], tokens_BT, axis=0).astype(cfg.compute_dtype)


def final_hidden(params: Params, x_BTE, cfg: PolicyConfig):
  """The final norm: the last layer's output -> the hidden state the LM head reads."""
  return rms_norm(x_BTE, params["final_norm"], cfg.norm_eps)


def head(params: Params, x_BTE, cfg: PolicyConfig):
  """Final norm and LM head; returns (normed hidden, float32 logits)."""
  h = final_hidden(params, x_BTE, cfg)
  w = head_weight(params, cfg)
  return h, jnp.einsum("bte,ev->btv", h, w.astype(h.dtype)).astype(jnp.float32)


class Taps(NamedTuple):
  """Tapped features: the outputs of the tap layers and the final (normed) hidden state."""

  layers: jax.Array  # [N,B,S,E]
  final: jax.Array  # [B,S,E]


ATTENTIONS = ("tiled", "dense")


def hidden(
  params: Params,
  cfg: PolicyConfig,
  tokens_BS,
  positions_BS,
  segment_ids_BS,
  *,
  attend=None,
  attention: str = "tiled",
  remat: bool = False,
  constrain=None,
):
  """The policy trunk over packed rows: (final normed hidden h_BSE, tapped layers x_NBSE).

  `attend(q, k, v, positions, segment_ids)` overrides the attention (a context-parallel shard
  passes the ring); otherwise `attention` is "tiled" (flash-style, the training path) or
  "dense" (the oracle). `constrain` pins the residual stream's sharding (`run_layers`)."""
  if attend is None:
    if attention not in ATTENTIONS:
      raise ValueError(f"attention={attention!r} is invalid; expected one of {ATTENTIONS}")
    attend = tiled_attention() if attention == "tiled" else dense_attention
  x = embed(params, tokens_BS, cfg)
  x, taps, _ = run_layers(
    params["layers"],
    x,
    cfg,
    positions_BT=positions_BS,
    segment_ids_BT=segment_ids_BS,
    tap_at=cfg.taps,
    attend=attend,
    remat=remat,
    constrain=constrain,
  )
  return final_hidden(params, x, cfg), taps


def head_weight(params: Params, cfg: PolicyConfig):
  """The LM head [E, V] (the embedding's transpose when tied)."""
  return params["embed"].T if cfg.tie_embeddings else params["head"]


def forward(
  params: Params,
  cfg: PolicyConfig,
  tokens_BS,
  positions_BS=None,
  segment_ids_BS=None,
  *,
  stop_tap_gradient: bool = True,
  attention: str = "tiled",
):
  """Full-sequence forward over packed rows. Returns (logits_BSV float32, Taps).

  Taps are `stop_gradient`-ed before they leave the policy unless `stop_tap_gradient=False`
  (only for the negative-control tests). `attention`: "tiled" (default) or "dense" (the oracle).
  """
  B, S = tokens_BS.shape
  if positions_BS is None:
    positions_BS = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  if segment_ids_BS is None:
    segment_ids_BS = jnp.ones((B, S), jnp.int32)
  h, taps = hidden(params, cfg, tokens_BS, positions_BS, segment_ids_BS, attention=attention)
  logits = jnp.einsum("bte,ev->btv", h, head_weight(params, cfg).astype(h.dtype))
  out = Taps(taps, h)
  if stop_tap_gradient:
    out = jax.lax.stop_gradient(out)
  return logits.astype(jnp.float32), out


def decode(params: Params, cfg: PolicyConfig, cache: KVCache, tokens_BT):
  """Feeds T new tokens per row at positions lengths..lengths+T-1 of the cache.

  Returns (logits_BTV float32, Taps over the T tokens, cache with lengths advanced by T).
  A caller that accepts fewer tokens rolls back by setting `lengths` (stale entries are
  masked by position and overwritten later).
  """
  T = tokens_BT.shape[1]
  positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
  x = embed(params, tokens_BT, cfg)
  x, taps, (k, v) = run_layers(
    params["layers"],
    x,
    cfg,
    positions_BT=positions,
    cache=(cache.k, cache.v, cache.lengths),
    tap_at=cfg.taps,
  )
  h, logits = head(params, x, cfg)
  return logits, jax.lax.stop_gradient(Taps(taps, h)), KVCache(k, v, cache.lengths + T)


def prefill(params: Params, cfg: PolicyConfig, cache: KVCache, prompt_BS, prompt_lengths_B):
  """Writes right-padded prompts into an empty cache.

  The prompt attends to itself with the tiled attention of the training path (no [B, S, C] mask
  or score tensor, however long the prompt); its keys and values are written at 0..S-1.
  Returns (logits_BSV, Taps, cache) with `cache.lengths = prompt_lengths`; the next-token
  distribution of row b is `logits[b, prompt_lengths[b] - 1]`.
  """
  B, S = prompt_BS.shape
  positions = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  valid = (positions < prompt_lengths_B[:, None]).astype(jnp.int32)
  x = embed(params, prompt_BS, cfg)
  zeros = jnp.zeros_like(cache.lengths)
  x, taps, (k, v) = run_layers(
    params["layers"],
    x,
    cfg,
    positions_BT=positions,
    segment_ids_BT=valid,
    cache=(cache.k, cache.v, zeros),
    tap_at=cfg.taps,
    attend=tiled_attention(),
  )
  h, logits = head(params, x, cfg)
  lengths = prompt_lengths_B.astype(jnp.int32)
  return logits, jax.lax.stop_gradient(Taps(taps, h)), KVCache(k, v, lengths)
