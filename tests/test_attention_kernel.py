"""The Pallas attention block (attention/kernels): values and gradients against the dense oracle
in interpret mode, for both branch kinds and the mask edge cases; the tile-skipping bounds;
bf16 inputs with float32 accumulation; the Triton and Mosaic lowerings; clear errors."""

import functools

import _tolerance as tol
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdraft.attention import reference
from specdraft.attention.blockwise import Rows, blk, block_mask
from specdraft.attention.kernels import KernelSettings, block_attention, flash, resolve_backend

INTERPRET = KernelSettings(block_q=8, block_k=8, backend="interpret")

# Query rows 16..47 of two packed rows of 48 keys. Row 0: a length-1 document at key 20, a
# document straddling tiles (21..37), another to the end, and the last 3 queries padding. Row 1:
# many short documents, key padding from 40 on, and a query document (7) no key belongs to.
KEY_SEGS = np.array(
  [
    [1] * 20 + [2] + [3] * 17 + [4] * 10,
    sum(([s] * n for s, n in [(1, 5), (2, 1), (3, 9), (4, 3), (5, 12), (6, 10)]), []) + [0] * 8,
  ]
)


def _positions(seg):
  """Positions restarting at 0 in each document (as packed rows carry them)."""
  pos = np.zeros_like(seg)
  for b in range(seg.shape[0]):
    for i in range(1, seg.shape[1]):
      pos[b, i] = pos[b, i - 1] + 1 if seg[b, i] == seg[b, i - 1] else 0
  return pos


def case(seed, strict_kind, H=4, K=2, D=16, dtype=jnp.float32):
  """(q, k, v, query rows, key rows): queries are the keys' rows 16..47 (so some see keys of
  their own tile, some only earlier tiles), with strictness 0 (trunk, TTT) or 1 (block branch)
  or mixed per row."""
  kseg = KEY_SEGS
  kpos = _positions(kseg)
  qseg, qpos = kseg[:, 16:].copy(), kpos[:, 16:].copy()
  qseg[0, -3:] = 0
  qseg[1, 0:2] = 7
  rng = np.random.default_rng(seed)
  strict = {"trunk": 0, "block": 1}.get(strict_kind)
  qstr = rng.integers(0, 2, qseg.shape) if strict is None else np.full(qseg.shape, strict)
  B, T, S = 2, qseg.shape[1], kseg.shape[1]
  n = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32).astype(dtype)
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  qr = Rows(i32(qpos), i32(qseg), i32(qstr))
  return n(B, T, H, D), n(B, S, K, D), n(B, S, K, D), qr, Rows(i32(kpos), i32(kseg))


def oracle(q, k, v, qr, kr):
  return reference.masked_attention(q, k, v, block_mask(qr, kr))


def value_and_grads(fn, q, k, v, qr, kr):
  """Outputs and gradients of a loss that uses both out and lse (lse's cotangent is what the
  ring's and the branch block's merges send back)."""
  rng = np.random.default_rng(1)
  w_out = jnp.asarray(rng.normal(size=q.shape), jnp.float32)
  w_lse = jnp.asarray(rng.normal(size=(q.shape[0], q.shape[2], q.shape[1])), jnp.float32)

  def loss(q, k, v):
    out, lse = fn(q, k, v, qr, kr)
    finite = jnp.where(jnp.isfinite(lse), lse, 0.0)
    return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(jnp.sin(finite) * w_lse), (out, lse)

  (_, outs), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return outs, grads


def assert_outputs_close(got, want, atol):
  (o1, l1), (o2, l2) = got, want
  np.testing.assert_allclose(np.asarray(o1, np.float32), np.asarray(o2), atol=atol, rtol=0)
  empty = np.isinf(np.asarray(l2))
  assert empty.any() and (~empty).any()  # the case has rows with and without visible keys
  np.testing.assert_array_equal(np.isinf(np.asarray(l1)), empty)
  np.testing.assert_allclose(np.asarray(l1)[~empty], np.asarray(l2)[~empty], atol=atol, rtol=0)


@pytest.mark.parametrize("strict_kind", ["trunk", "block", "mixed"])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (4, 1)], ids=["gqa", "mha", "mqa"])
def test_kernel_equals_the_oracle_in_value_and_gradient(strict_kind, heads):
  H, K = heads
  xs = case(0, strict_kind, H=H, K=K)
  kernel = functools.partial(block_attention, settings=INTERPRET)
  got, g_got = value_and_grads(kernel, *xs)
  want, g_want = value_and_grads(oracle, *xs)
  assert_outputs_close(got, want, atol=1e-5)
  tol.assert_grads_close(g_got, g_want, rtol=1e-5, err=f"{strict_kind} H={H} K={K}")


def test_kernel_equals_the_xla_tiles_at_every_tile_shape():
  """The same function as `blk` whatever the tiles (a tile per row, tiles across documents, one
  tile for the whole block)."""
  xs = case(2, "mixed")
  want, g_want = value_and_grads(functools.partial(blk, tile_q=8, tile_k=16), *xs)
  for tq, tk in [(1, 4), (16, 8), (32, 48)]:
    fn = functools.partial(block_attention, tile_q=tq, tile_k=tk, settings=INTERPRET)
    got, g_got = value_and_grads(fn, *xs)
    assert_outputs_close(got, want, atol=1e-5)
    tol.assert_grads_close(g_got, g_want, rtol=1e-5, err=f"tiles {tq}x{tk}")


@pytest.mark.parametrize("strict_kind", ["trunk", "block", "mixed"])
def test_unmasked_tiles_equal_the_oracle(strict_kind):
  """Long documents, so most walked tiles are visible whole and run without a mask."""
  q, k, v, qr, kr = case(8, strict_kind)
  seg = jnp.asarray(np.repeat([[1, 2]], 2, axis=0).repeat([40, 8], axis=1), jnp.int32)
  pos = jnp.asarray(_positions(np.asarray(seg)), jnp.int32)
  kr = Rows(pos, seg)
  qr = qr._replace(pos=pos[:, 16:], seg=seg[:, 16:])
  (_, a, e, _), (_, qa, qe, _) = flash.tile_ranges(qr, kr, 8, 8)
  assert int(jnp.sum(e - a)) > 0 and int(jnp.sum(qe - qa)) > 0
  got, g_got = value_and_grads(
    functools.partial(block_attention, settings=INTERPRET), q, k, v, qr, kr
  )
  want, g_want = value_and_grads(oracle, q, k, v, qr, kr)
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=1e-5)
  tol.assert_grads_close(g_got, g_want, rtol=1e-5, err=strict_kind)


def test_rows_without_keys_get_zero_output_and_zero_gradient():
  q, k, v, qr, kr = case(3, "trunk")
  qr = qr._replace(seg=jnp.zeros_like(qr.seg))  # every query is padding
  (out, lse), (dq, dk, dv) = value_and_grads(
    functools.partial(block_attention, settings=INTERPRET), q, k, v, qr, kr
  )
  assert np.all(np.asarray(out) == 0) and np.all(np.isneginf(np.asarray(lse)))
  for g in (dq, dk, dv):
    assert np.all(np.asarray(g) == 0)


def test_bf16_inputs_accumulate_in_float32():
  """bf16 inputs: products in bf16, sums in float32. Against the float32 oracle on the same
  (rounded) inputs the kernel stays within bf16 operand rounding, and the output can be float32
  or bf16; a kernel that summed in bf16 over 48 keys would be an order of magnitude further
  off (checked below by summing the oracle's probabilities times values in bf16)."""
  q, k, v, qr, kr = case(4, "mixed", dtype=jnp.bfloat16)
  got, g_got = value_and_grads(
    functools.partial(block_attention, settings=INTERPRET), q, k, v, qr, kr
  )
  up = lambda x: x.astype(jnp.float32)
  want, g_want = value_and_grads(oracle, up(q), up(k), up(v), qr, kr)
  assert got[0].dtype == jnp.float32 and got[1].dtype == jnp.float32
  err = float(jnp.linalg.norm(got[0] - want[0]) / jnp.linalg.norm(want[0]))
  assert err < 1e-2, err
  for g, w, x in zip(g_got, g_want, (q, k, v)):
    assert g.dtype == x.dtype
    assert float(jnp.linalg.norm(up(g) - w) / jnp.linalg.norm(w)) < 2e-2
  # a bf16 running sum of the same terms (the control): visibly worse than the kernel
  mask = block_mask(qr, kr)
  p, _ = reference.masked_softmax(
    jnp.einsum("btkqd,bskd->bkqts", up(q).reshape(2, 32, 2, 2, 16), up(k)) * 16**-0.5,
    mask[:, None, None],
  )
  terms = jnp.einsum("bkqts,bskd->bkqtsd", p, up(v)).astype(jnp.bfloat16)
  bf16_sum = jax.lax.reduce(terms, jnp.bfloat16(0), jax.lax.add, (4,))
  bf16_out = jnp.moveaxis(bf16_sum, 3, 1).reshape(want[0].shape)
  control = float(jnp.linalg.norm(up(bf16_out) - want[0]) / jnp.linalg.norm(want[0]))
  assert control > 2 * err, (control, err)
  as_input = KernelSettings(8, 8, backend="interpret", out_dtype="input")
  (out_bf16, _), g_bf16 = value_and_grads(
    functools.partial(block_attention, settings=as_input), q, k, v, qr, kr
  )
  assert out_bf16.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(out_bf16), np.asarray(got[0].astype(jnp.bfloat16)))
  for g, w in zip(g_bf16, g_want):
    assert float(jnp.linalg.norm(up(g) - w) / jnp.linalg.norm(w)) < 2e-2


def test_tile_bounds_never_skip_a_visible_pair_and_skip_what_causality_rules_out():
  rng = np.random.default_rng(5)
  skipped = 0
  for _ in range(100):  # random packed rows in tiles of 4: soundness (a skipped pair is empty)
    pos, seg = rng.integers(0, 24, (2, 2, 16)), rng.integers(0, 4, (2, 2, 16))
    qr = Rows(jnp.asarray(pos[0]), jnp.asarray(seg[0]), jnp.asarray(rng.integers(0, 2, (2, 16))))
    kr = Rows(jnp.asarray(pos[1]), jnp.asarray(seg[1]))
    live = np.asarray(flash.live_tiles(qr, kr, 4, 4))
    full = np.asarray(flash.full_tiles(qr, kr, 4, 4))
    visible = np.asarray(block_mask(qr, kr)).reshape(2, 4, 4, 4, 4)
    assert not np.any(visible.any(axis=(2, 4)) & ~live)
    assert not np.any(full & ~visible.all(axis=(2, 4)))  # unmasked tiles are visible whole
    skipped += int(np.sum(~live))
  assert skipped > 100  # the random tiles do exercise skipping
  whole = 0
  for _ in range(100):  # one document, keys mostly before queries: tiles visible whole are common
    qr = Rows(
      jnp.asarray(rng.integers(6, 12, (2, 16))), jnp.ones((2, 16), jnp.int32),
      jnp.asarray(rng.integers(0, 2, (2, 16))),
    )  # fmt: skip
    kr = Rows(jnp.asarray(rng.integers(0, 8, (2, 16))), jnp.ones((2, 16), jnp.int32))
    full = np.asarray(flash.full_tiles(qr, kr, 4, 4))
    visible = np.asarray(block_mask(qr, kr)).reshape(2, 4, 4, 4, 4).all(axis=(2, 4))
    assert not np.any(full & ~visible)
    whole += int(np.sum(full))
  assert whole > 100
  # one causal document of 64 rows in tiles of 8: each query tile walks key tiles 0..i (36 of
  # the 64 pairs); two documents side by side walk only their own (20); a query tile of padding
  # walks none; the dk/dv programs walk the transposed spans
  # walks none. Tiles below the diagonal are visible whole and run unmasked (28 and 12 pairs).
  pos = jnp.arange(64)[None]
  for segs, want, unmasked in [(np.ones(64), 36, 28), (np.repeat([1, 2], 32), 20, 12)]:
    rows = Rows(pos, jnp.asarray(segs, jnp.int32)[None])
    (lo, a, e, hi), (qlo, qa, qe, qhi) = flash.tile_ranges(rows, rows, 8, 8)
    assert int(jnp.sum(hi - lo)) == want and int(jnp.sum(qhi - qlo)) == want
    assert int(jnp.sum(e - a)) == unmasked and int(jnp.sum(qe - qa)) == unmasked
    assert bool(jnp.all((lo <= a) & (a <= e) & (e <= hi)))
  pad = Rows(pos, jnp.asarray(np.r_[np.ones(56), np.zeros(8)], jnp.int32)[None])
  (lo, _, _, hi), _ = flash.tile_ranges(pad, pad, 8, 8)
  assert int(lo[0, -1]) == int(hi[0, -1]) == 0


def test_tiles_outside_the_ranges_are_never_loaded():
  """NaN in tiles no program may walk (keys after every query, a query tile of padding) leaves
  every output and gradient finite and equal to the oracle's on clean inputs: the kernels never
  load them (a loaded NaN would survive the mask through the products)."""
  rng = np.random.default_rng(6)
  pos = jnp.arange(64, dtype=jnp.int32)[None].repeat(2, 0)
  kr = Rows(pos, jnp.ones_like(pos))
  qseg = jnp.asarray(np.r_[np.ones(24), np.zeros(8)], jnp.int32)[None].repeat(2, 0)
  qr = Rows(pos[:, :32], qseg, jnp.zeros_like(qseg))
  n = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  q, k, v = n(2, 32, 4, 16), n(2, 64, 2, 16), n(2, 64, 2, 16)
  poison = lambda x, rows: x.at[:, rows].set(jnp.nan)
  got, g_got = value_and_grads(
    functools.partial(block_attention, settings=INTERPRET),
    poison(q, slice(24, 32)), poison(k, slice(32, 64)), poison(v, slice(32, 64)), qr, kr,
  )  # fmt: skip
  want, g_want = value_and_grads(oracle, q, k, v, qr, kr)
  assert_outputs_close(got, want, atol=1e-5)
  tol.assert_grads_close(g_got, g_want, rtol=1e-5)


def _export(backend, platform, D=128, T=256, S=512, tiles=None):
  B, H, K = 1, 4, 2
  settings = KernelSettings(*(tiles or (0, 0)), backend=backend)

  def step(q, k, v, qp, qs, qt, kp, ks):
    def loss(q, k, v):
      out, lse = block_attention(q, k, v, Rows(qp, qs, qt), Rows(kp, ks), settings=settings)
      return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)

  sd = jax.ShapeDtypeStruct
  args = [sd((B, T, H, D), jnp.bfloat16)] + [sd((B, S, K, D), jnp.bfloat16)] * 2
  args += [sd((B, T), jnp.int32)] * 3 + [sd((B, S), jnp.int32)] * 2
  checks = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  return jax.export.export(jax.jit(step), platforms=[platform], disabled_checks=checks)(*args)


@pytest.mark.parametrize("backend, platform, target, T, S", [
  ("triton", "cuda", "__gpu$xla.gpu.triton", 256, 512),
  ("triton", "cuda", "__gpu$xla.gpu.triton", 4096, 4096),  # the benchmark's smallest size
  ("mosaic", "tpu", "tpu_custom_call", 256, 512),
  ("mosaic", "tpu", "tpu_custom_call", 2048, 2048),
  ("mosaic", "tpu", "tpu_custom_call", 64, 64),  # the benchmark's exactness check: one tile
])  # fmt: skip
def test_forward_and_backward_lower_for_gpu_and_tpu(backend, platform, target, T, S):
  """The three kernels lower to Triton (GPU) and Mosaic (TPU) at the backend's default tiles
  for head dim 128 in bf16 (the lowering runs here; compiling them needs the chip)."""
  text = _export(backend, platform, T=T, S=S).mlir_module()
  assert text.count(target) == 3  # forward, dq, dk/dv


def test_bad_settings_fail_before_compiling():
  with pytest.raises(ValueError, match="backend='cuda'"):
    KernelSettings(backend="cuda")
  with pytest.raises(ValueError, match="out_dtype='half'"):
    KernelSettings(out_dtype="half")
  with pytest.raises(ValueError, match="block_k=-8"):
    KernelSettings(block_k=-8)
  with pytest.raises(ValueError, match="block_q=48: the tile of 48 rows would be 48"):
    _export("triton", "cuda", T=48, tiles=(48, 64))
  with pytest.raises(ValueError, match="head dim D=24"):
    _export("triton", "cuda", D=24)
  with pytest.raises(ValueError, match="block_k=64: the tile of 192 key rows would be 64"):
    _export("mosaic", "tpu", T=192, S=192, tiles=(64, 64))
  with pytest.raises(ValueError, match="block_q=4: .* a multiple of 16 for bfloat16"):
    _export("mosaic", "tpu", T=256, S=256, tiles=(4, 128))
  with pytest.raises(ValueError, match=r"32768 query rows x 32768 key rows need .*dkv"):
    _export("mosaic", "tpu", T=32768, S=32768)
  q, k, v, qr, kr = case(0, "trunk", H=3, K=2)
  with pytest.raises(ValueError, match="H=3 must be a multiple of kv heads K=2"):
    block_attention(q, k, v, qr, kr, settings=INTERPRET)
  assert resolve_backend("auto") == "interpret"  # the tests run on CPU


def test_benchmark_smoke_reports_exactness_and_leaves_timing_goals_unmeasured(tmp_path):
  """The benchmark's CPU run: the exactness goal is judged, the accelerator goals are reported
  as not measured, and a full (non-smoke) run is refused on CPU before any work."""
  from configs import bench_kernel
  from experiments.bench import kernel

  with pytest.raises(ValueError, match="only as a smoke test"):
    kernel.run(bench_kernel.get_config(), str(tmp_path / "full"))
  config = bench_kernel.get_config("smoke,repeats=1")
  config.bench.seq_lens = (64,)
  results = kernel.run(config, str(tmp_path / "smoke"))
  goals = results["goals"]
  assert goals["exact_fp32"]["met"] is True and goals["exact_fp32"]["value"] < 1e-5
  assert goals["forward_half_of_peak"]["met"] is None
  assert results["smoke_only"] and results["peak_flops"] is None
  (row,) = results["by_seq_len"]
  assert row["pallas"]["forward_time"] > 0 and row["dot_product_attention"]["forward_time"] > 0
  assert row["flops"]["forward"] == 4 * 1 * 4 * 64 * 64 * 65 / 2
  assert (tmp_path / "smoke" / "table.md").exists()
