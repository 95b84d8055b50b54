"""One block of packed, masked attention as fused Pallas kernels: forward (out, lse) and backward
(dq, dk, dv from dout, dlse, out, lse), with the mask and interface of `blockwise.blk`.

A query row attends a key row when both are in the same document (segment id, 0 = padding) and
  k_pos + strict <= q_pos
(`strict` 1 for block-branch queries, else 0), exactly as `blockwise.block_mask`. Empty rows give
(0, -inf) and zero gradient.

The kernels are FlashAttention-2 shaped: a program per (batch, query head, query tile) walks the
key tiles with an online softmax in float32 (the backward's dq kernel walks them again; its
dk/dv kernel runs a program per (batch, kv head, key tile) over every query tile of the heads
of that group). Matrix products take the inputs' dtype and accumulate in float32. A tile pair
that no (query, key) pair can see is skipped from bounds alone: its documents do not overlap or
its earliest live key is after its latest live query. Positions may restart per document, so
the bounds are conservative (a skipped tile is always empty; a computed one may be empty too).

Backends (`KernelSettings.backend`): `interpret` (Pallas interpret mode, CPU tests), `triton`
(GPU; tiles must be powers of two >= 16) and `mosaic` (TPU; a program holds its key block, or
its group's query block, whole in VMEM, so blocks are bounded by VMEM: the ring's per-step
blocks, not a whole 128K row). `auto` picks by `jax.default_backend()`.

Shape letters: B batch, T query rows, S key rows, H query heads, K kv heads, Q = H // K query
heads per kv head, D head dim; tq, tk tile rows. Inside the kernels heads come before rows
([B, H, T, D]) so a tile is the trailing (rows, D) block that every backend wants.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from specdraft.attention.blockwise import Rows, tile_size

_MASKED = -1e30
_FAR = 2**30  # beyond any position or segment id
BACKENDS = ("auto", "interpret", "triton", "mosaic")
OUT_DTYPES = ("float32", "input")
# Tile defaults per backend (rows of queries, rows of keys): Triton wants 64-128 rows for a
# tensor-core tile at head dim 128; Mosaic wants multiples of 128 and larger tiles to fill the
# MXU; interpret mode on CPU is fastest with few, large tiles.
DEFAULT_TILES = {"interpret": (128, 128), "triton": (64, 64), "mosaic": (256, 512)}


@dataclasses.dataclass(frozen=True)
class KernelSettings:
  """How the kernel runs: tile sizes (0 = the backend's default), backend, Triton launch
  settings and the dtype of `out` (`float32`, as the XLA tiles give, or `input`)."""

  block_q: int = 0
  block_k: int = 0
  backend: str = "auto"
  num_warps: int = 4
  num_stages: int = 2
  out_dtype: str = "float32"

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"attention kernel backend={self.backend!r}: valid are {BACKENDS}")
    if self.out_dtype not in OUT_DTYPES:
      raise ValueError(f"attention kernel out_dtype={self.out_dtype!r}: valid are {OUT_DTYPES}")
    for name in ("block_q", "block_k"):
      if getattr(self, name) < 0:
        raise ValueError(f"attention kernel {name}={getattr(self, name)}: must be >= 0")
    for name in ("num_warps", "num_stages"):
      if getattr(self, name) < 1:
        raise ValueError(f"attention kernel {name}={getattr(self, name)}: must be >= 1")

  def tiles(self, backend: str) -> tuple[int, int]:
    dq, dk = DEFAULT_TILES[backend]
    return self.block_q or dq, self.block_k or dk


def resolve_backend(backend: str = "auto") -> str:
  """`auto` -> the kernel language of the default JAX backend."""
  if backend != "auto":
    if backend not in BACKENDS:
      raise ValueError(f"attention kernel backend={backend!r}: valid are {BACKENDS}")
    return backend
  platform = jax.default_backend()
  by_platform = {"cpu": "interpret", "gpu": "triton", "cuda": "triton", "tpu": "mosaic"}
  if platform not in by_platform:
    raise ValueError(f"no attention kernel for platform {platform!r}: set backend explicitly")
  return by_platform[platform]


# ----------------------------------------------------------------------------------------------
# Tile visibility and masks (shared by the three kernels)


def _query_bounds(qpos, qseg, qstr):
  """Scalars of a query tile ((tq, 1) columns): latest visible key position, segment range."""
  live = qseg != 0
  last = jnp.max(jnp.where(live, qpos - qstr, -_FAR))
  return last, jnp.min(jnp.where(live, qseg, _FAR)), jnp.max(jnp.where(live, qseg, -_FAR))


def _key_bounds(kpos, kseg):
  """Scalars of a key tile ((1, tk) rows): earliest live position, segment range."""
  live = kseg != 0
  first = jnp.min(jnp.where(live, kpos, _FAR))
  return first, jnp.min(jnp.where(live, kseg, _FAR)), jnp.max(jnp.where(live, kseg, -_FAR))


def _tile_live(qb, kb):
  """Whether some (query, key) pair of the two tiles may be visible (never False when one is)."""
  q_last, q_lo, q_hi = qb
  k_first, k_lo, k_hi = kb
  return (k_first <= q_last) & (k_lo <= q_hi) & (q_lo <= k_hi)


def _mask(qpos, qseg, qstr, kpos, kseg):
  """(tq, 1) query columns x (1, tk) key rows -> (tq, tk) visibility."""
  return (qseg == kseg) & (qseg != 0) & (kpos + qstr <= qpos)


def _dot_t(a, b):
  """a (m, d) . b (n, d)^T -> (m, n) float32."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):
  """a (m, n) . b (n, d) -> (m, d) float32."""
  return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _t_dot(a, b):
  """a (m, n)^T . b (m, d) -> (n, d) float32."""
  return jax.lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


# ----------------------------------------------------------------------------------------------
# Kernels


def _fwd_kernel(
  q_ref,
  k_ref,
  v_ref,
  qpos_ref,
  qseg_ref,
  qstr_ref,
  kpos_ref,
  kseg_ref,
  o_ref,
  lse_ref,
  *,
  tk,
  scale,
):
  tq, D = q_ref.shape
  nk = k_ref.shape[0] // tk
  q = q_ref[...]
  qpos, qseg, qstr = qpos_ref[...], qseg_ref[...], qstr_ref[...]
  qb = _query_bounds(qpos, qseg, qstr)

  def body(j, carry):
    start = pl.multiple_of(j * tk, tk)
    kpos, kseg = kpos_ref[:, pl.ds(start, tk)], kseg_ref[:, pl.ds(start, tk)]

    def compute(carry):
      m, l, acc = carry
      k, v = k_ref[pl.ds(start, tk), :], v_ref[pl.ds(start, tk), :]
      mask = _mask(qpos, qseg, qstr, kpos, kseg)
      s = jnp.where(mask, _dot_t(q, k) * scale, _MASKED)
      m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
      p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
      corr = jnp.exp(m - m_new)
      l = l * corr + jnp.sum(p, axis=1, keepdims=True)
      acc = acc * corr + _dot(p.astype(v.dtype), v)
      return m_new, l, acc

    live = _tile_live(qb, _key_bounds(kpos, kseg))
    return jax.lax.cond(live, compute, lambda c: c, carry)

  init = (
    jnp.full((tq, 1), _MASKED, jnp.float32),
    jnp.zeros((tq, 1), jnp.float32),
    jnp.zeros((tq, D), jnp.float32),
  )
  m, l, acc = jax.lax.fori_loop(0, nk, body, init)
  ok = l > 0
  safe = jnp.where(ok, l, 1.0)
  o_ref[...] = (acc / safe).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(ok, m + jnp.log(safe), -jnp.inf)


def _dq_kernel(
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, qseg_ref, qstr_ref, kpos_ref,
  kseg_ref, dq_ref, *, tk, scale,
):  # fmt: skip
  tq, D = q_ref.shape
  nk = k_ref.shape[0] // tk
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  lse = jnp.where(lse == -jnp.inf, 0.0, lse)  # such rows see no key: every p below is 0
  qpos, qseg, qstr = qpos_ref[...], qseg_ref[...], qstr_ref[...]
  qb = _query_bounds(qpos, qseg, qstr)

  def body(j, dq):
    start = pl.multiple_of(j * tk, tk)
    kpos, kseg = kpos_ref[:, pl.ds(start, tk)], kseg_ref[:, pl.ds(start, tk)]

    def compute(dq):
      k, v = k_ref[pl.ds(start, tk), :], v_ref[pl.ds(start, tk), :]
      mask = _mask(qpos, qseg, qstr, kpos, kseg)
      p = jnp.where(mask, jnp.exp(_dot_t(q, k) * scale - lse), 0.0)
      ds = p * (_dot_t(do, v) - delta)
      return dq + _dot(ds.astype(k.dtype), k)

    return jax.lax.cond(_tile_live(qb, _key_bounds(kpos, kseg)), compute, lambda c: c, dq)

  dq = jax.lax.fori_loop(0, nk, body, jnp.zeros((tq, D), jnp.float32))
  dq_ref[...] = dq * scale


def _dkv_kernel(
  q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, qseg_ref, qstr_ref, kpos_ref,
  kseg_ref, dk_ref, dv_ref, *, tq, scale,
):  # fmt: skip
  # q_ref, do_ref: (Q * T, D), lse_ref, delta_ref: (Q * T, 1): the group's heads one after
  # another, so query tile n is rows n * tq of head n // nq at rows (n % nq) * tq of the row
  # metadata.
  tk, D = k_ref.shape
  T = qpos_ref.shape[0]
  nq = T // tq
  n_tiles = q_ref.shape[0] // tq
  k, v = k_ref[...], v_ref[...]
  kpos, kseg = kpos_ref[...], kseg_ref[...]
  kb = _key_bounds(kpos, kseg)

  def body(n, carry):
    row = pl.multiple_of(jax.lax.rem(n, nq) * tq, tq)  # n >= 0: no sign handling
    qpos, qseg = qpos_ref[pl.ds(row, tq), :], qseg_ref[pl.ds(row, tq), :]
    qstr = qstr_ref[pl.ds(row, tq), :]

    def compute(carry):
      dk, dv = carry
      at = pl.multiple_of(n * tq, tq)
      q, do = q_ref[pl.ds(at, tq), :], do_ref[pl.ds(at, tq), :]
      lse, delta = lse_ref[pl.ds(at, tq), :], delta_ref[pl.ds(at, tq), :]
      lse = jnp.where(lse == -jnp.inf, 0.0, lse)
      mask = _mask(qpos, qseg, qstr, kpos, kseg)
      p = jnp.where(mask, jnp.exp(_dot_t(q, k) * scale - lse), 0.0)
      dv = dv + _t_dot(p.astype(do.dtype), do)
      ds = p * (_dot_t(do, v) - delta)
      dk = dk + _t_dot(ds.astype(q.dtype), q)
      return dk, dv

    live = _tile_live(_query_bounds(qpos, qseg, qstr), kb)
    return jax.lax.cond(live, compute, lambda c: c, carry)

  zeros = jnp.zeros((tk, D), jnp.float32)
  dk, dv = jax.lax.fori_loop(0, n_tiles, body, (zeros, zeros))
  dk_ref[...] = dk * scale
  dv_ref[...] = dv


# ----------------------------------------------------------------------------------------------
# pallas_call wrappers


def _call_args(backend: str, settings: KernelSettings, n_grid: int) -> dict:
  if backend == "interpret":
    return {"interpret": True}
  if backend == "triton":
    from jax.experimental.pallas import triton as plgpu

    return {"compiler_params": plgpu.CompilerParams(settings.num_warps, settings.num_stages)}
  from jax.experimental.pallas import tpu as pltpu

  return {"compiler_params": pltpu.CompilerParams(dimension_semantics=("parallel",) * n_grid)}


def _plan(q_BTHD, k_BSKD, settings: KernelSettings):
  """(backend, tq, tk) with the shapes checked; errors name the field and the valid values."""
  B, T, H, D = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  if H % K:
    raise ValueError(f"query heads H={H} must be a multiple of kv heads K={K}")
  backend = resolve_backend(settings.backend)
  want_q, want_k = settings.tiles(backend)
  tq, tk = tile_size(T, want_q), tile_size(S, want_k)
  if backend == "triton":
    for name, t, n, want in (("block_q", tq, T, want_q), ("block_k", tk, S, want_k)):
      if t < 16 or t & (t - 1):
        raise ValueError(
          f"attention kernel {name}={want}: the tile of {n} rows would be {t}; Triton needs a "
          "power of two >= 16 that divides the rows (pad the rows or choose another block)"
        )
    if D < 16 or D & (D - 1):
      raise ValueError(f"head dim D={D}: Triton tiles need a power of two >= 16")
  return backend, tq, tk


def _meta(rows: Rows):
  """Query metadata as (B, T, 1) columns and key metadata as (B, 1, S) rows."""
  strict = rows.strict if rows.strict is not None else jnp.zeros_like(rows.pos)
  col = lambda x: x.astype(jnp.int32)[:, :, None]
  return col(rows.pos), col(rows.seg), col(strict)


def _key_meta(rows: Rows):
  row = lambda x: x.astype(jnp.int32)[:, None, :]
  return row(rows.pos), row(rows.seg)


def block_attention_fwd(q_BTHD, k_BSKD, v_BSKD, qr: Rows, kr: Rows, settings: KernelSettings):
  """(out_BTHD in float32 or the input dtype, lse_BHT float32)."""
  B, T, H, D = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  Q = H // K
  backend, tq, tk = _plan(q_BTHD, k_BSKD, settings)
  out_dtype = jnp.float32 if settings.out_dtype == "float32" else q_BTHD.dtype
  q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q_BTHD, k_BSKD, v_BSKD))  # heads before rows
  qcols = _meta(qr)
  krows = _key_meta(kr)
  q_spec = pl.BlockSpec((None, None, tq, D), lambda b, h, i: (b, h, i, 0))
  kv_spec = pl.BlockSpec((None, None, S, D), lambda b, h, i: (b, jax.lax.div(h, Q), 0, 0))
  col_spec = pl.BlockSpec((None, tq, 1), lambda b, h, i: (b, i, 0))
  row_spec = pl.BlockSpec((None, 1, S), lambda b, h, i: (b, 0, 0))
  out, lse = pl.pallas_call(
    functools.partial(_fwd_kernel, tk=tk, scale=D**-0.5),
    grid=(B, H, T // tq),
    in_specs=[q_spec, kv_spec, kv_spec, col_spec, col_spec, col_spec, row_spec, row_spec],
    out_specs=[q_spec, pl.BlockSpec((None, None, tq, 1), lambda b, h, i: (b, h, i, 0))],
    out_shape=[
      jax.ShapeDtypeStruct((B, H, T, D), out_dtype),
      jax.ShapeDtypeStruct((B, H, T, 1), jnp.float32),
    ],
    name="attention_block_fwd",
    **_call_args(backend, settings, 3),
  )(q, k, v, *qcols, *krows)
  return jnp.swapaxes(out, 1, 2), lse[..., 0]


def block_attention_bwd(
  q_BTHD, k_BSKD, v_BSKD, qr: Rows, kr: Rows, out_BTHD, lse_BHT, dout_BTHD, dlse_BHT,
  settings: KernelSettings,
):  # fmt: skip
  """(dq, dk, dv) in the inputs' dtypes from the cotangents of (out, lse).

  With delta = rowsum(dout * out) - dlse, a score's cotangent is p * (dp - delta): lse's own
  cotangent enters only through delta (d lse / d s = p), which is how the ring's merge and the
  LSE merge with the branch block pass gradient through lse."""
  B, T, H, D = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  Q = H // K
  backend, tq, tk = _plan(q_BTHD, k_BSKD, settings)
  dtype = q_BTHD.dtype
  delta = jnp.sum(dout_BTHD.astype(jnp.float32) * out_BTHD.astype(jnp.float32), axis=-1)
  delta_BHT = jnp.swapaxes(delta, 1, 2) - dlse_BHT.astype(jnp.float32)
  q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q_BTHD, k_BSKD, v_BSKD))
  do = jnp.swapaxes(dout_BTHD, 1, 2).astype(dtype)
  lse, delta_col = lse_BHT[..., None], delta_BHT[..., None]
  qcols = _meta(qr)
  krows = _key_meta(kr)
  scale = D**-0.5

  # dq: a program per (batch, query head, query tile) over the key tiles
  q_spec = pl.BlockSpec((None, None, tq, D), lambda b, h, i: (b, h, i, 0))
  col1 = pl.BlockSpec((None, None, tq, 1), lambda b, h, i: (b, h, i, 0))
  kv_spec = pl.BlockSpec((None, None, S, D), lambda b, h, i: (b, jax.lax.div(h, Q), 0, 0))
  col_spec = pl.BlockSpec((None, tq, 1), lambda b, h, i: (b, i, 0))
  row_spec = pl.BlockSpec((None, 1, S), lambda b, h, i: (b, 0, 0))
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, tk=tk, scale=scale),
    grid=(B, H, T // tq),
    in_specs=[q_spec, kv_spec, kv_spec, q_spec, col1, col1, col_spec, col_spec, col_spec]
    + [row_spec, row_spec],
    out_specs=q_spec,
    out_shape=jax.ShapeDtypeStruct((B, H, T, D), jnp.float32),
    name="attention_block_dq",
    **_call_args(backend, settings, 3),
  )(q, k, v, do, lse, delta_col, *qcols, *krows)

  # dk, dv: a program per (batch, kv head, key tile) over the group's query tiles
  group = lambda x: x.reshape(B, K, Q * T, x.shape[-1])  # head h = kv * Q + g
  g_spec = lambda w: pl.BlockSpec((None, None, Q * T, w), lambda b, kv, j: (b, kv, 0, 0))
  k_spec = pl.BlockSpec((None, None, tk, D), lambda b, kv, j: (b, kv, j, 0))
  qcol_spec = pl.BlockSpec((None, T, 1), lambda b, kv, j: (b, 0, 0))
  krow_spec = pl.BlockSpec((None, 1, tk), lambda b, kv, j: (b, 0, j))
  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, tq=tq, scale=scale),
    grid=(B, K, S // tk),
    in_specs=[g_spec(D), k_spec, k_spec, g_spec(D), g_spec(1), g_spec(1)]
    + [qcol_spec, qcol_spec, qcol_spec, krow_spec, krow_spec],
    out_specs=[k_spec, k_spec],
    out_shape=[jax.ShapeDtypeStruct((B, K, S, D), jnp.float32)] * 2,
    name="attention_block_dkv",
    **_call_args(backend, settings, 3),
  )(group(q), k, v, group(do), group(lse), group(delta_col), *qcols, *krows)
  back = lambda x, like: jnp.swapaxes(x, 1, 2).astype(like.dtype)
  return back(dq, q_BTHD), back(dk, k_BSKD), back(dv, v_BSKD)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attend(q, k, v, qr, kr, settings):
  return block_attention_fwd(q, k, v, qr, kr, settings)


def _attend_fwd(q, k, v, qr, kr, settings):
  out, lse = block_attention_fwd(q, k, v, qr, kr, settings)
  return (out, lse), (q, k, v, qr, kr, out, lse)


def _attend_bwd(settings, res, cotangents):
  q, k, v, qr, kr, out, lse = res
  dout, dlse = cotangents
  dq, dk, dv = block_attention_bwd(q, k, v, qr, kr, out, lse, dout, dlse, settings)
  no_grad = jax.tree.map(lambda _: None, (qr, kr))
  return (dq, dk, dv, *no_grad)


_attend.defvjp(_attend_fwd, _attend_bwd)


def block_attention(
  q_BTHD,
  k_BSKD,
  v_BSKD,
  qr: Rows,
  kr: Rows,
  *,
  tile_q: int | None = None,
  tile_k: int | None = None,
  settings: KernelSettings | None = None,
):
  """Masked attention of a query block against a key block: (out_BTHD, lse_BHT float32), as
  `blockwise.blk` computes it (same arguments; `tile_q`/`tile_k` override the settings' tiles),
  differentiable through both outputs with the backward in Pallas."""
  settings = settings or KernelSettings()
  if tile_q is not None or tile_k is not None:
    settings = dataclasses.replace(
      settings, block_q=tile_q or settings.block_q, block_k=tile_k or settings.block_k
    )
  return _attend(q_BTHD, k_BSKD, v_BSKD, qr, kr, settings)
