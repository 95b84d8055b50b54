"""One block of packed, masked attention as fused Pallas kernels: forward (out, lse) and backward
(dq, dk, dv from dout, dlse, out, lse), with the mask and interface of `blockwise.blk`.

A query row attends a key row when both are in the same document (segment id, 0 = padding) and
  k_pos + strict <= q_pos
(`strict` 1 for block-branch queries, else 0), exactly as `blockwise.block_mask`. Empty rows give
(0, -inf) and zero gradient.

The kernels are FlashAttention-2 shaped: a program per (batch, query head, query tile) walks the
key tiles with an online softmax in float32 (the backward's dq kernel walks them again; its
dk/dv kernel runs a program per (batch, kv head, key tile) over every query tile of the heads
of that group). Matrix products take the inputs' dtype and accumulate in float32. Which tiles
a program walks is decided before the kernels, from tile bounds (`tile_ranges`): a pair whose
documents do not overlap, or whose earliest live key is after the latest live query, cannot hold
a visible pair, and each program's loop runs from its first to its last possibly-live tile, so
tiles in the future or in other documents are never loaded. The loops hold no branch (a
conditional around loads would keep Triton from pipelining them); a dead tile inside the span
is computed under its empty mask, and the first run of tiles visible whole (below the causal
diagonal) is computed with no mask.

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
  vmem_limit_bytes: int = 64 * 2**20  # Mosaic's scoped VMEM (physical: 128 MiB on v5p/v6e)

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"attention kernel backend={self.backend!r}: valid are {BACKENDS}")
    if self.out_dtype not in OUT_DTYPES:
      raise ValueError(f"attention kernel out_dtype={self.out_dtype!r}: valid are {OUT_DTYPES}")
    for name in ("block_q", "block_k"):
      if getattr(self, name) < 0:
        raise ValueError(f"attention kernel {name}={getattr(self, name)}: must be >= 0")
    for name in ("num_warps", "num_stages", "vmem_limit_bytes"):
      if getattr(self, name) < 1:
        raise ValueError(f"attention kernel {name}={getattr(self, name)}: must be >= 1")

  @classmethod
  def from_config(cls, attention_cfg) -> KernelSettings | None:
    """The settings of the config's `attention` section: None for `kernel = xla` (the XLA
    tiles), else the fused block's backend, tiles and Triton launch settings."""
    if attention_cfg is None or attention_cfg.kernel == "xla":
      return None
    a = attention_cfg
    return cls(
      block_q=int(a.block_q),
      block_k=int(a.block_k),
      backend=str(a.backend),
      num_warps=int(a.num_warps),
      num_stages=int(a.num_stages),
    )

  def row_multiple(self) -> int:
    """What a row's local length must be a multiple of for this backend's tiles to divide it:
    1 in interpret mode (any divisor serves), else the larger tile (Triton and Mosaic tiles are
    fixed powers of two; `sequence.zigzag_order(multiple=)` pads training rows to it)."""
    backend = resolve_backend(self.backend)
    return 1 if backend == "interpret" else max(self.tiles(backend))

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
# Tile ranges: which tile pairs are computed


def _tile_bounds(rows: Rows, t: int, query: bool):
  """Per tile of t rows ([B, n] each): for query tiles the latest key position any live row may
  see (position less strictness), for key tiles the earliest live position; and the range of
  live segment ids."""
  B, N = rows.pos.shape
  split = lambda x: x.astype(jnp.int32).reshape(B, N // t, t)
  pos, seg = split(rows.pos), split(rows.seg)
  live = seg != 0
  if query:
    strict = split(rows.strict) if rows.strict is not None else 0
    edge = jnp.max(jnp.where(live, pos - strict, -_FAR), axis=-1)
  else:
    edge = jnp.min(jnp.where(live, pos, _FAR), axis=-1)
  lo = jnp.min(jnp.where(live, seg, _FAR), axis=-1)
  hi = jnp.max(jnp.where(live, seg, -_FAR), axis=-1)
  return edge, lo, hi


def live_tiles(qr: Rows, kr: Rows, tq: int, tk: int):
  """[B, nq, nk]: whether a (query tile, key tile) pair may hold a visible pair, from bounds
  alone: the tiles' documents overlap and the earliest live key is not after the latest live
  query. Never False where a pair is visible (positions may restart per document, so it may be
  True where none is; the mask inside the kernel keeps the result exact)."""
  q_last, q_lo, q_hi = (x[:, :, None] for x in _tile_bounds(qr, tq, query=True))
  k_first, k_lo, k_hi = (x[:, None, :] for x in _tile_bounds(kr, tk, query=False))
  return (k_first <= q_last) & (k_lo <= q_hi) & (q_lo <= k_hi)


def full_tiles(qr: Rows, kr: Rows, tq: int, tk: int):
  """[B, nq, nk]: whether every (query, key) pair of the two tiles is visible: both tiles hold
  one document and no padding, and the latest key is at or before the earliest query (less its
  strictness). Such tiles need no mask."""

  def one_doc(rows, t):
    B, N = rows.pos.shape
    seg = rows.seg.astype(jnp.int32).reshape(B, N // t, t)
    return jnp.all(seg == seg[..., :1], axis=-1) & (seg[..., 0] != 0), seg[..., 0]

  B, T = qr.pos.shape
  strict = qr.strict if qr.strict is not None else 0
  q_one, q_seg = one_doc(qr, tq)
  k_one, k_seg = one_doc(kr, tk)
  q_first = jnp.min((qr.pos - strict).astype(jnp.int32).reshape(B, T // tq, tq), axis=-1)
  k_last = jnp.max(kr.pos.astype(jnp.int32).reshape(B, -1, tk), axis=-1)
  return (
    q_one[:, :, None]
    & k_one[:, None, :]
    & (q_seg[:, :, None] == k_seg[:, None, :])
    & (k_last[:, None, :] <= q_first[:, :, None])
  )


def _spans(live, full):
  """[..., n] -> four [...] int32 bounds lo <= a <= e <= hi: the tiles [lo, hi) from the first
  to the last live one, of which [a, e) is the first run of full tiles (unmasked)."""
  n = live.shape[-1]
  idx = jnp.arange(n, dtype=jnp.int32)
  any_live, any_full = jnp.any(live, axis=-1), jnp.any(full, axis=-1)
  lo = jnp.where(any_live, jnp.argmax(live, axis=-1), 0)
  hi = jnp.where(any_live, n - jnp.argmax(live[..., ::-1], axis=-1), 0)
  a = jnp.where(any_full, jnp.argmax(full, axis=-1), lo)
  after = ~full & (idx >= a[..., None])
  e = jnp.where(any_full, jnp.where(jnp.any(after, -1), jnp.argmax(after, axis=-1), n), lo)
  return tuple(x.astype(jnp.int32) for x in (lo, a, e, hi))


def tile_ranges(qr: Rows, kr: Rows, tq: int, tk: int):
  """The loops' bounds: for each query tile the key tiles its programs walk (forward and dq),
  and for each key tile the query tiles its dk/dv program walks; each as (lo, a, e, hi), [B, nq]
  and [B, nk]: tiles [lo, hi) from the first to the last possibly-live one, of which [a, e) are
  visible whole and computed without a mask. Tiles outside [lo, hi) (in the future, in other
  documents) are never loaded; a dead tile inside is computed under its (empty) mask."""
  live = live_tiles(qr, kr, tq, tk)
  full = full_tiles(qr, kr, tq, tk) & live
  return _spans(live, full), _spans(jnp.swapaxes(live, 1, 2), jnp.swapaxes(full, 1, 2))


def _walk(refs, b, i, step, init):
  """step(masked, j, carry) over the tiles of (lo, a, e, hi) at [b, i]: masked outside [a, e)."""
  lo, a, e, hi = (r[b, i] for r in refs)
  carry = jax.lax.fori_loop(lo, a, functools.partial(step, True), init)
  carry = jax.lax.fori_loop(a, e, functools.partial(step, False), carry)
  return jax.lax.fori_loop(e, hi, functools.partial(step, True), carry)


def _mask(qpos, qseg, qstr, kpos, kseg):
  """(tq, 1) query columns x (1, tk) key rows -> (tq, tk) visibility."""
  return (qseg == kseg) & (qseg != 0) & (kpos + qstr <= qpos)


def _where(mask, x, other):
  return x if mask is None else jnp.where(mask, x, other)


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
# Kernels. Each walks its tiles (`tile_ranges`, read as scalars at its program ids): masked
# from lo to a and from e to hi, unmasked from a to e.


def _fwd_kernel(
  lo_ref, a_ref, e_ref, hi_ref, q_ref, k_ref, v_ref, qpos_ref, qseg_ref, qstr_ref, kpos_ref, kseg_ref, o_ref,
  lse_ref, *, tk, scale,
):  # fmt: skip
  b, i = pl.program_id(0), pl.program_id(2)
  tq, D = q_ref.shape
  q = q_ref[...]
  qpos, qseg, qstr = qpos_ref[...], qseg_ref[...], qstr_ref[...]

  def body(masked, j, carry):
    m, l, acc = carry
    k, v, mask = _key_tile(j, tk, k_ref, v_ref, kpos_ref, kseg_ref, (qpos, qseg, qstr), masked)
    s = _where(mask, _dot_t(q, k) * scale, _MASKED)
    m_new = jnp.maximum(m, jnp.max(s, axis=1, keepdims=True))
    p = _where(mask, jnp.exp(s - m_new), 0.0)
    corr = jnp.exp(m - m_new)
    l = l * corr + jnp.sum(p, axis=1, keepdims=True)
    acc = acc * corr + _dot(p.astype(v.dtype), v)
    return m_new, l, acc

  init = (
    jnp.full((tq, 1), _MASKED, jnp.float32),
    jnp.zeros((tq, 1), jnp.float32),
    jnp.zeros((tq, D), jnp.float32),
  )
  m, l, acc = _walk((lo_ref, a_ref, e_ref, hi_ref), b, i, body, init)
  ok = l > 0
  safe = jnp.where(ok, l, 1.0)
  o_ref[...] = (acc / safe).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(ok, m + jnp.log(safe), -jnp.inf)


def _key_tile(j, tk, k_ref, v_ref, kpos_ref, kseg_ref, qcols, masked: bool):
  """Key tile j of a whole key block: (k, v, its mask against the query columns, or None for a
  tile visible whole)."""
  rows = pl.ds(pl.multiple_of(j * tk, tk), tk)
  mask = _mask(*qcols, kpos_ref[:, rows], kseg_ref[:, rows]) if masked else None
  return k_ref[rows, :], v_ref[rows, :], mask


def _probs(q, k, lse, mask, scale):
  """Recomputed probabilities of a tile; rows with lse = -inf see no key (every p is 0)."""
  lse = jnp.where(lse == -jnp.inf, 0.0, lse)
  return _where(mask, jnp.exp(_dot_t(q, k) * scale - lse), 0.0)


def _dq_kernel(
  lo_ref, a_ref, e_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, qseg_ref, qstr_ref,
  kpos_ref, kseg_ref, dq_ref, *, tk, scale,
):  # fmt: skip
  b, i = pl.program_id(0), pl.program_id(2)
  tq, D = q_ref.shape
  q, do = q_ref[...], do_ref[...]
  lse, delta = lse_ref[...], delta_ref[...]
  qpos, qseg, qstr = qpos_ref[...], qseg_ref[...], qstr_ref[...]

  def body(masked, j, dq):
    k, v, mask = _key_tile(j, tk, k_ref, v_ref, kpos_ref, kseg_ref, (qpos, qseg, qstr), masked)
    p = _probs(q, k, lse, mask, scale)
    ds = p * (_dot_t(do, v) - delta)
    return dq + _dot(ds.astype(k.dtype), k)

  dq = _walk((lo_ref, a_ref, e_ref, hi_ref), b, i, body, jnp.zeros((tq, D), jnp.float32))
  dq_ref[...] = dq * scale


def _dkv_kernel(
  lo_ref, a_ref, e_ref, hi_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, qpos_ref, qseg_ref, qstr_ref,
  kpos_ref, kseg_ref, dk_ref, dv_ref, *, tq, scale, groups,
):  # fmt: skip
  # q_ref, do_ref: (Q * T, D), lse_ref, delta_ref: (Q * T, 1): the group's heads one after
  # another (head g's query tile i at rows g * T + i * tq); the row metadata is shared.
  b, j = pl.program_id(0), pl.program_id(2)
  tk, D = k_ref.shape
  T = qpos_ref.shape[0]
  k, v = k_ref[...], v_ref[...]
  kpos, kseg = kpos_ref[...], kseg_ref[...]

  def head(g, carry):
    def body(masked, i, carry):
      dk, dv = carry
      row = pl.multiple_of(i * tq, tq)
      at = pl.multiple_of(g * T + i * tq, tq)
      rows = pl.ds(row, tq)
      mask = None
      if masked:
        mask = _mask(qpos_ref[rows, :], qseg_ref[rows, :], qstr_ref[rows, :], kpos, kseg)
      q, do = q_ref[pl.ds(at, tq), :], do_ref[pl.ds(at, tq), :]
      p = _probs(q, k, lse_ref[pl.ds(at, tq), :], mask, scale)
      dv = dv + _t_dot(p.astype(do.dtype), do)
      ds = p * (_dot_t(do, v) - delta_ref[pl.ds(at, tq), :])
      dk = dk + _t_dot(ds.astype(q.dtype), q)
      return dk, dv

    return _walk((lo_ref, a_ref, e_ref, hi_ref), b, j, body, carry)

  zeros = jnp.zeros((tk, D), jnp.float32)
  dk, dv = zeros, zeros
  for g in range(groups):  # the query heads sharing this kv head (static: GQA groups are small)
    dk, dv = head(g, (dk, dv))
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

  params = pltpu.CompilerParams(
    dimension_semantics=("parallel",) * n_grid, vmem_limit_bytes=settings.vmem_limit_bytes
  )
  return {"compiler_params": params}


def _scalars_spec(backend: str):
  """The tile ranges, whole, where a kernel reads scalars (SMEM on TPU)."""
  if backend == "mosaic":
    from jax.experimental.pallas import tpu as pltpu

    return pl.BlockSpec(memory_space=pltpu.SMEM)
  return pl.BlockSpec()


def _vmem_bytes(T, S, D, Q, tq, tk, itemsize) -> dict:
  """Per-program VMEM of each kernel's blocks on TPU, double-buffered, with (n, 1) columns and
  (1, n) rows padded to Mosaic's (8, 128) tiles. Arithmetic, not measured."""
  col = lambda n: -(-n // 8) * 8 * 128 * 4
  row = lambda n: 8 * -(-n // 128) * 128 * 4
  fwd = tq * D * (itemsize + 4) + 2 * S * D * itemsize + 4 * col(tq) + 2 * row(S)
  dq = 2 * tq * D * itemsize + 2 * S * D * itemsize + 5 * col(tq) + 2 * row(S) + tq * D * 4
  dkv = 2 * Q * T * D * itemsize + 2 * col(Q * T) + 3 * col(T) + 2 * tk * D * itemsize
  dkv += 2 * row(tk) + 2 * tk * D * 4
  return {"forward": 2 * fwd, "dq": 2 * dq, "dkv": 2 * dkv}


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
  if backend == "mosaic":
    if tk % 128 and tk != S:
      raise ValueError(
        f"attention kernel block_k={want_k}: the tile of {S} key rows would be {tk}; Mosaic "
        "needs a multiple of 128 (or every key row in one tile)"
      )
    sublane = 8 * 4 // jnp.dtype(q_BTHD.dtype).itemsize
    if tq % sublane and tq != T:
      raise ValueError(
        f"attention kernel block_q={want_q}: the tile of {T} query rows would be {tq}; Mosaic "
        f"needs a multiple of {sublane} for {jnp.dtype(q_BTHD.dtype).name} (or one tile)"
      )
    need = _vmem_bytes(T, S, D, H // K, tq, tk, jnp.dtype(q_BTHD.dtype).itemsize)
    over = {k: v for k, v in need.items() if v > settings.vmem_limit_bytes}
    if over:
      raise ValueError(
        f"attention kernel on TPU: {T} query rows x {S} key rows need "
        f"{ {k: f'{v / 2**20:.1f} MiB' for k, v in over.items()} } of VMEM per program, over "
        f"vmem_limit_bytes={settings.vmem_limit_bytes} (a program holds its key block, or its "
        "group's query block, whole): attend in smaller blocks (the ring's per-step blocks)"
      )
  return backend, tq, tk


def _meta(rows: Rows):
  """Query metadata as (B, T, 1) columns."""
  strict = rows.strict if rows.strict is not None else jnp.zeros_like(rows.pos)
  col = lambda x: x.astype(jnp.int32)[:, :, None]
  return col(rows.pos), col(rows.seg), col(strict)


def _key_meta(rows: Rows):
  """Key metadata as (B, 1, S) rows."""
  row = lambda x: x.astype(jnp.int32)[:, None, :]
  return row(rows.pos), row(rows.seg)


def block_attention_fwd(q_BTHD, k_BSKD, v_BSKD, qr: Rows, kr: Rows, settings: KernelSettings):
  """(out_BTHD in float32 or the input dtype, lse_BHT float32)."""
  B, T, H, D = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  Q = H // K
  backend, tq, tk = _plan(q_BTHD, k_BSKD, settings)
  out_dtype = jnp.float32 if settings.out_dtype == "float32" else q_BTHD.dtype
  key_spans, _ = tile_ranges(qr, kr, tq, tk)
  q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q_BTHD, k_BSKD, v_BSKD))  # heads before rows
  scalars = _scalars_spec(backend)
  q_spec = pl.BlockSpec((None, None, tq, D), lambda b, h, i: (b, h, i, 0))
  kv_spec = pl.BlockSpec((None, None, S, D), lambda b, h, i: (b, jax.lax.div(h, Q), 0, 0))
  col_spec = pl.BlockSpec((None, tq, 1), lambda b, h, i: (b, i, 0))
  row_spec = pl.BlockSpec((None, 1, S), lambda b, h, i: (b, 0, 0))
  out, lse = pl.pallas_call(
    functools.partial(_fwd_kernel, tk=tk, scale=D**-0.5),
    grid=(B, H, T // tq),
    in_specs=[scalars] * 4
    + [q_spec, kv_spec, kv_spec]
    + [col_spec, col_spec, col_spec, row_spec, row_spec],
    out_specs=[q_spec, pl.BlockSpec((None, None, tq, 1), lambda b, h, i: (b, h, i, 0))],
    out_shape=[
      jax.ShapeDtypeStruct((B, H, T, D), out_dtype),
      jax.ShapeDtypeStruct((B, H, T, 1), jnp.float32),
    ],
    name="attention_block_fwd",
    **_call_args(backend, settings, 3),
  )(*key_spans, q, k, v, *_meta(qr), *_key_meta(kr))
  return jnp.swapaxes(out, 1, 2), lse[..., 0]


def block_attention_bwd(
  q_BTHD, k_BSKD, v_BSKD, qr: Rows, kr: Rows, out_BTHD, lse_BHT, dout_BTHD, dlse_BHT,
  settings: KernelSettings, grad_dtype=None,
):  # fmt: skip
  """(dq, dk, dv) in the inputs' dtypes (or `grad_dtype`, e.g. float32 for a ring that sums
  them over steps) from the cotangents of (out, lse). `out` and `lse` may be those of attention
  over more keys than this block (a ring's final result): the gradient of this block's share is
  then exact, as the softmax over all keys factorises through lse.

  With delta = rowsum(dout * out) - dlse, a score's cotangent is p * (dp - delta): lse's own
  cotangent enters only through delta (d lse / d s = p), which is how the ring's merge and the
  LSE merge with the branch block pass gradient through lse."""
  B, T, H, D = q_BTHD.shape
  S, K = k_BSKD.shape[1], k_BSKD.shape[2]
  Q = H // K
  backend, tq, tk = _plan(q_BTHD, k_BSKD, settings)
  dtype = q_BTHD.dtype
  key_spans, query_spans = tile_ranges(qr, kr, tq, tk)
  delta = jnp.sum(dout_BTHD.astype(jnp.float32) * out_BTHD.astype(jnp.float32), axis=-1)
  delta_BHT = jnp.swapaxes(delta, 1, 2) - dlse_BHT.astype(jnp.float32)
  q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q_BTHD, k_BSKD, v_BSKD))
  do = jnp.swapaxes(dout_BTHD, 1, 2).astype(dtype)
  lse, delta_col = lse_BHT[..., None], delta_BHT[..., None]
  qcols, krows = _meta(qr), _key_meta(kr)
  scale = D**-0.5
  scalars = _scalars_spec(backend)

  # dq: a program per (batch, query head, query tile) over its key tiles
  q_spec = pl.BlockSpec((None, None, tq, D), lambda b, h, i: (b, h, i, 0))
  col1 = pl.BlockSpec((None, None, tq, 1), lambda b, h, i: (b, h, i, 0))
  kv_spec = pl.BlockSpec((None, None, S, D), lambda b, h, i: (b, jax.lax.div(h, Q), 0, 0))
  col_spec = pl.BlockSpec((None, tq, 1), lambda b, h, i: (b, i, 0))
  row_spec = pl.BlockSpec((None, 1, S), lambda b, h, i: (b, 0, 0))
  dq = pl.pallas_call(
    functools.partial(_dq_kernel, tk=tk, scale=scale),
    grid=(B, H, T // tq),
    in_specs=[scalars] * 4
    + [q_spec, kv_spec, kv_spec, q_spec, col1, col1]
    + [col_spec, col_spec, col_spec, row_spec, row_spec],
    out_specs=q_spec,
    out_shape=jax.ShapeDtypeStruct((B, H, T, D), jnp.float32),
    name="attention_block_dq",
    **_call_args(backend, settings, 3),
  )(*key_spans, q, k, v, do, lse, delta_col, *qcols, *krows)

  # dk, dv: a program per (batch, kv head, key tile) over the group's query tiles
  group = lambda x: x.reshape(B, K, Q * T, x.shape[-1])  # head h = kv * Q + g
  g_spec = lambda w: pl.BlockSpec((None, None, Q * T, w), lambda b, kv, j: (b, kv, 0, 0))
  k_spec = pl.BlockSpec((None, None, tk, D), lambda b, kv, j: (b, kv, j, 0))
  qcol_spec = pl.BlockSpec((None, T, 1), lambda b, kv, j: (b, 0, 0))
  krow_spec = pl.BlockSpec((None, 1, tk), lambda b, kv, j: (b, 0, j))
  dk, dv = pl.pallas_call(
    functools.partial(_dkv_kernel, tq=tq, scale=scale, groups=Q),
    grid=(B, K, S // tk),
    in_specs=[scalars] * 4
    + [g_spec(D), k_spec, k_spec, g_spec(D), g_spec(1), g_spec(1)]
    + [qcol_spec, qcol_spec, qcol_spec, krow_spec, krow_spec],
    out_specs=[k_spec, k_spec],
    out_shape=[jax.ShapeDtypeStruct((B, K, S, D), jnp.float32)] * 2,
    name="attention_block_dkv",
    **_call_args(backend, settings, 3),
  )(*query_spans, group(q), k, v, group(do), group(lse), group(delta_col), *qcols, *krows)
  back = lambda x, like: jnp.swapaxes(x, 1, 2).astype(grad_dtype or like.dtype)
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
