"""Context parallelism: zigzag order, blockwise primitives, ring and all-gather branch attention
against the dense oracle, in value and gradient, on 8 simulated devices."""

import _tolerance as tol
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from specdraft import oracles
from specdraft.attention import blockwise as bw
from specdraft.attention import branch_attention, reference
from specdraft.attention.api import context_parallel
from specdraft.parallel import zigzag


def cp_mesh(cp):
  return jax.make_mesh((cp,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:cp])


def inputs(seed, segments, W=3, H=4, K=2, D=8, dtype=jnp.float32):
  seg = jnp.asarray(segments, jnp.int32)
  B, S = seg.shape
  ks = jax.random.split(jax.random.key(seed), 6)
  n = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(dtype)
  return (
    n(ks[0], (B, S, H, D)),
    n(ks[1], (B, S, K, D)),
    n(ks[2], (B, S, K, D)),
    n(ks[3], (B, S, W, H, D)),
    n(ks[4], (B, S, W, K, D)),
    n(ks[5], (B, S, W, K, D)),
    seg,
  )


# Row 0: a length-1 document, documents straddling chunks and ranks, tail padding (13 real
# tokens: at cp=4 rank 0's second chunk is all padding). Row 1: many short documents.
SEGS = np.array(
  [
    [1, 2, 2, 2, 2, 2, 3, 4, 4, 4, 4, 4, 4, 0, 0, 0],
    [1, 1, 2, 3, 3, 3, 4, 5, 5, 6, 6, 6, 6, 6, 7, 7],
  ]
)


def value_and_grads(fn, xs, branch):
  """Outputs and gradients of a fixed nonlinear loss, from one jitted program."""
  seg = xs[-1]

  def loss(*a):
    out, out_br = fn(*a, seg, branch=branch)
    value = jnp.sum(jnp.sin(out.astype(jnp.float32))) + jnp.sum(
      jnp.cos(out_br.astype(jnp.float32)) * out_br.astype(jnp.float32)
    )
    return value, (out, out_br)

  (_, outs), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(
    *xs[:6]
  )
  return outs, grads


def dense(*a, branch):
  return branch_attention(*a, branch=branch)


def cp_impl(impl, cp, **kw):
  mesh = cp_mesh(cp)
  return lambda *a, branch: context_parallel(*a, branch=branch, impl=impl, mesh=mesh, **kw)


def assert_close(a, b, tol):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.all(np.isfinite(x))
    np.testing.assert_allclose(x, y, atol=tol, rtol=tol)


# ----------------------------------------------------------------------------- layout


@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_zigzag_permutation(cp):
  S = 4 * cp
  perm = zigzag.permutation(S, cp)
  c = S // (2 * cp)
  for r in range(cp):
    local = perm[r * 2 * c : (r + 1) * 2 * c]
    np.testing.assert_array_equal(local[:c] // c, r)
    np.testing.assert_array_equal(local[c:] // c, 2 * cp - 1 - r)
  x = jnp.arange(2 * S).reshape(2, S)
  np.testing.assert_array_equal(zigzag.from_zigzag(zigzag.to_zigzag(x, cp), cp), x)
  with pytest.raises(ValueError, match="not divisible by 2\\*cp"):
    zigzag.permutation(S + 1, cp)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_document_permutation_cuts_every_document_into_2cp_chunks(cp):
  lengths = [2 * cp, 6 * cp, 4 * cp]
  perm = zigzag.document_permutation(lengths, cp)
  np.testing.assert_array_equal(np.sort(perm), np.arange(sum(lengths)))
  starts = np.r_[0, np.cumsum(lengths)[:-1]]
  L = len(perm) // cp
  for r in range(cp):
    local = perm[r * L : (r + 1) * L]
    first, second = local[: L // 2], local[L // 2 :]
    # chunk r of every document (in document order), then chunk 2cp-1-r of every document
    for half, j in ((first, r), (second, 2 * cp - 1 - r)):
      want = [s + j * (n // (2 * cp)) + np.arange(n // (2 * cp)) for s, n in zip(starts, lengths)]
      np.testing.assert_array_equal(half, np.concatenate(want))
  # one document: the row zigzag
  np.testing.assert_array_equal(
    zigzag.document_permutation([8 * cp], cp), zigzag.permutation(8 * cp, cp)
  )
  np.testing.assert_array_equal(zigzag.document_lengths([1, 1, 2, 0, 0, 0, 3]), [2, 1, 3, 1])
  with pytest.raises(ValueError, match="not positive multiples of 2\\*cp"):
    zigzag.document_permutation([2 * cp, 2 * cp + 1], cp)


@pytest.mark.parametrize("cp,n", [(1, 1), (2, 1), (4, 1), (8, 1), (4, 2), (4, 3), (2, 7)])
def test_zigzag_shift_matches_global_shift_elementwise(cp, n):
  S = 4 * cp
  B = 2
  x = jnp.arange(B * S, dtype=jnp.int32).reshape(B, S) + 100
  seg = jnp.asarray(np.repeat(np.arange(1, S // 3 + 2), 3)[:S][None].repeat(B, 0))
  mesh = cp_mesh(cp)
  spec = P(None, "cp")
  shift = jax.shard_map(
    lambda a, s: (
      zigzag.shift_local(a, n, axis_name="cp", cp=cp, fill=-1),
      zigzag.shift_local(s, n, axis_name="cp", cp=cp, fill=0),
    ),
    mesh=mesh,
    in_specs=(spec, spec),
    out_specs=(spec, spec),
    check_vma=False,
  )
  xs, ss = shift(zigzag.to_zigzag(x, cp), zigzag.to_zigzag(seg, cp))
  xs, ss = zigzag.from_zigzag(xs, cp), zigzag.from_zigzag(ss, cp)
  want = np.concatenate([np.asarray(x)[:, n:], np.full((B, n), -1)], axis=1)[:, :S]
  np.testing.assert_array_equal(xs, want)
  # masked at document boundaries: valid only where the shifted segment is the same
  want_seg = np.concatenate([np.asarray(seg)[:, n:], np.zeros((B, n), int)], axis=1)[:, :S]
  np.testing.assert_array_equal(ss, want_seg)


# ----------------------------------------------------------------------------- primitives


def test_tiled_block_equals_dense_block_with_empty_rows():
  q, k, v, *_ = inputs(0, SEGS)
  pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
  qr = bw.Rows(pos, jnp.asarray(SEGS), jnp.asarray(np.tile([0, 1], (2, 8))))
  kr = bw.Rows(pos, jnp.asarray(SEGS))
  want = reference.masked_attention(q, k, v, bw.block_mask(qr, kr))
  for tq, tk in ((16, 16), (4, 8), (2, 2)):
    out, lse = bw.blk(q, k, v, qr, kr, tile_q=tq, tile_k=tk)
    np.testing.assert_allclose(out, want[0], atol=1e-6)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want[1]))
    assert np.isinf(np.asarray(lse)).any()  # padding rows and strict first tokens are empty


def test_merge_is_exact_and_nan_free():
  q, k, v, *_ = inputs(1, SEGS)
  pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
  qr, kr = bw.Rows(pos, jnp.asarray(SEGS)), bw.Rows(pos, jnp.asarray(SEGS))
  full = bw.blk(q, k, v, qr, kr)
  a = bw.blk(q, k[:, :7], v[:, :7], qr, bw.Rows(pos[:, :7], kr.seg[:, :7]))
  b = bw.blk(q, k[:, 7:], v[:, 7:], qr, bw.Rows(pos[:, 7:], kr.seg[:, 7:]))
  out, lse = bw.merge(*a, *b)
  np.testing.assert_allclose(out, full[0], atol=1e-6)
  np.testing.assert_allclose(
    np.where(np.isinf(lse), 0, lse), np.where(np.isinf(full[1]), 0, full[1]), atol=1e-5
  )
  # huge LSE values do not overflow; (0, -inf) is the identity; gradients stay finite
  big = (a[0], a[1] + 1e4)
  o2, l2 = bw.merge(*big, jnp.zeros_like(a[0]), jnp.full_like(a[1], -jnp.inf))
  np.testing.assert_allclose(o2, a[0], atol=1e-6)
  g = jax.grad(lambda x: jnp.sum(bw.merge(a[0], x, b[0], b[1])[0]))(a[1])
  assert np.all(np.isfinite(g))


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("branch", ["ttt", "block"])
@pytest.mark.parametrize("cp", [1, 2, 4, 8])
def test_ring_matches_oracle_value_and_gradient(cp, branch):
  xs = inputs(cp, SEGS)
  want = value_and_grads(dense, xs, branch)
  got = value_and_grads(cp_impl("ring", cp), xs, branch)
  assert_close(got, want, 2e-5)


@pytest.mark.parametrize("branch", ["ttt", "block"])
@pytest.mark.parametrize("cp", [2, 8])
def test_allgather_matches_oracle(cp, branch):
  xs = inputs(10 + cp, SEGS)
  assert_close(
    value_and_grads(cp_impl("allgather", cp), xs, branch), value_and_grads(dense, xs, branch), 2e-5
  )


@pytest.mark.parametrize("impl", ["ring", "allgather"])
@pytest.mark.parametrize("branch", ["ttt", "block"])
def test_document_order_matches_oracle(branch, impl):
  """Packed rows in the per-document order (documents and padding runs of 8 = 2cp tokens at
  cp = 4); rows with different documents get different permutations."""
  segs = np.array(
    [[1] * 8 + [2] * 24 + [3] * 16 + [0] * 8, [1] * 16 + [2] * 8 + [3] * 8 + [4] * 24]
  )
  xs = inputs(40, segs)
  got = value_and_grads(cp_impl(impl, 4, tile=4, order="document"), xs, branch)
  assert_close(got, value_and_grads(dense, xs, branch), 2e-5)


@pytest.mark.parametrize("branch", ["ttt", "block"])
def test_custom_vjp_equals_autodiff_through_the_ring(branch):
  xs = inputs(20, SEGS)
  custom = value_and_grads(cp_impl("ring", 4, tile=2), xs, branch)
  auto = value_and_grads(cp_impl("ring", 4, custom_grad=False), xs, branch)
  assert_close(custom, auto, 1e-5)


@pytest.mark.parametrize("cp", [1, 4])
def test_trunk_lse_value_and_gradient(cp):
  """The trunk ring's log-sum-exp output (what a TTT step merges its own branch keys with):
  value against the dense oracle, and a loss reading both out and lse differentiated by the
  custom backward (the lse cotangent enters as delta - dlse) == autodiff through the ring."""
  from specdraft.attention import ring

  q, k, v, *_, seg = inputs(50, SEGS, W=0)
  B, S = seg.shape
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  lay = lambda x: zigzag.to_zigzag(x, cp, 1)
  mesh = cp_mesh(cp)

  def loss(custom, q, k, v):
    def shard(q, k, v, seg, pos):
      out, lse = ring.trunk_attention_shard(
        q, k, v, seg, pos, axis_name="cp", cp=cp, tile=2, return_lse=True, custom_grad=custom
      )
      lse_ok = jnp.where(jnp.isfinite(lse), lse, 0.0)
      part = jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(lse_ok) * lse_ok)
      return jax.lax.psum(part, "cp"), out, lse

    spec = P(None, "cp")
    fn = jax.shard_map(
      shard,
      mesh=mesh,
      in_specs=(spec,) * 5,
      out_specs=(P(), spec, P(None, None, "cp")),
      check_vma=False,
    )
    value, out, lse = fn(lay(q), lay(k), lay(v), lay(seg), lay(pos))
    return value, (out, lse)

  run = lambda custom: jax.jit(
    jax.value_and_grad(lambda *a: loss(custom, *a), argnums=(0, 1, 2), has_aux=True)
  )(q, k, v)
  (_, (out, lse)), g_custom = run(True)
  _, g_auto = run(False)
  want_out, want_lse = reference.masked_attention(
    q, k, v, reference.causal_mask(pos, pos, seg, seg)
  )
  np.testing.assert_allclose(out, lay(want_out), atol=2e-5, rtol=2e-5)
  np.testing.assert_array_equal(
    np.isfinite(lse), np.isfinite(lay(want_lse.swapaxes(1, 2)).swapaxes(1, 2))
  )
  fin = np.isfinite(lse)
  np.testing.assert_allclose(
    np.asarray(lse)[fin], np.asarray(lay(want_lse.swapaxes(1, 2)).swapaxes(1, 2))[fin], atol=2e-5
  )
  tol.assert_grads_close(g_custom, g_auto, rtol=1e-5)
  assert float(jnp.abs(g_custom[0]).max()) > 0


def test_bf16_inputs_accumulate_in_fp32():
  xs = inputs(30, SEGS, dtype=jnp.bfloat16)
  x32 = tuple(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in xs)
  got = value_and_grads(cp_impl("ring", 4), xs, "ttt")
  want = value_and_grads(dense, x32, "ttt")
  assert got[0][0].dtype == jnp.bfloat16
  assert_close(got, want, 5e-2)


def _merged_in_bf16(q, k, v, chunks: int):
  """Causal attention over key chunks merged by log-sum-exp with the running output and lse
  stored in bf16 between chunks: the accumulation bug the test below must catch."""
  B, S, H, D = q.shape
  K = k.shape[2]
  qf = q.astype(jnp.float32).reshape(B, S, K, H // K, D)
  pos = jnp.arange(S)
  o = m = None
  for c in range(chunks):
    sl = slice(c * S // chunks, (c + 1) * S // chunks)
    s = jnp.einsum("bskgd,btkd->bskgt", qf, k[:, sl].astype(jnp.float32)) / np.sqrt(D)
    s = jnp.where((pos[:, None] >= pos[sl][None, :])[None, :, None, None, :], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, -1)
    p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - lse[..., None]), 0.0)
    oc = jnp.einsum("bskgt,btkd->bskgd", p, v[:, sl].astype(jnp.float32))
    lse = jnp.where(jnp.isfinite(lse), lse, -1e30)
    if o is None:
      o, m = oc, lse
    else:
      new = jnp.logaddexp(m, lse)
      o = o * jnp.exp(m - new)[..., None] + oc * jnp.exp(lse - new)[..., None]
      m = new
    o, m = (x.astype(jnp.bfloat16).astype(jnp.float32) for x in (o, m))
  return o.reshape(B, S, H, D)


def test_bf16_ring_output_is_the_rounded_fp32_result():
  """bf16 inputs over a long row (S = 1024, cp = 4) with near-uniform attention over values far
  from 0 (every output averages hundreds of them): the ring's bf16 output is the fp32 oracle's on
  the same inputs within 1.5 x 2^-8 of its magnitude (correct rounding is within 1.0), while the
  same merge kept in bf16 between its 4 chunks is off by more (the negative control)."""
  S = 1024
  seg = np.ones((1, S), np.int32)
  q, k, v, qb, kb, vb, seg = inputs(30, seg, dtype=jnp.bfloat16)
  q, v = (q * 0.05).astype(jnp.bfloat16), (v + 4.0).astype(jnp.bfloat16)
  xs = (q, k, v, qb, kb, vb)
  x32 = tuple(x.astype(jnp.float32) for x in xs)
  ring = jax.jit(lambda *a: cp_impl("ring", 4)(*a, seg, branch="ttt"))(*xs)
  want = jax.jit(lambda *a: dense(*a, seg, branch="ttt"))(*x32)

  def err(got, ref):  # in units of 2^-8 |ref|
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(got - ref) / (np.abs(ref) * 2.0**-8)))

  assert ring[0].dtype == jnp.bfloat16
  assert err(ring[0], want[0]) <= 1.5 and err(ring[1], want[1]) <= 1.5
  assert err(jax.jit(lambda *a: _merged_in_bf16(*a, 4))(q, k, v), want[0]) > 1.5


def test_no_branch_entries_and_unpadded_lengths():
  xs = inputs(40, SEGS[:, :13], W=0)  # S=13 is padded to 16 internally
  assert_close(
    value_and_grads(cp_impl("ring", 4), xs, "ttt"), value_and_grads(dense, xs, "ttt"), 2e-5
  )


@pytest.mark.parametrize("branch", ["ttt", "block"])
def test_padding_is_exactly_zero_and_isolated(branch):
  xs = inputs(50, SEGS)
  fn = cp_impl("ring", 4)
  seg = xs[-1]
  (out, out_br), grads = value_and_grads(fn, xs, branch)
  pad = np.asarray(seg) == 0
  assert np.all(np.asarray(out)[pad] == 0) and np.all(np.asarray(out_br)[pad] == 0)
  for g in grads:
    assert np.all(np.asarray(g)[pad] == 0)
  # mutating document 4 of row 0 (positions 7..12) leaves documents 1..3 unchanged
  q, k, v, qb, kb, vb, _ = xs
  moved = jax.jit(lambda *a: fn(*a, seg, branch=branch))(
    q,
    k.at[0, 7:13].add(3.0),
    v.at[0, 7:13].add(3.0),
    qb,
    kb.at[0, 7:13].add(3.0),
    vb,
  )
  np.testing.assert_allclose(moved[0][0, :7], out[0, :7], atol=1e-6)
  np.testing.assert_allclose(moved[1][0, :7], out_br[0, :7], atol=1e-6)
  assert not np.allclose(moved[0][0, 8], out[0, 8])


def test_collective_permutes_carry_trunk_sized_buffers_only():
  """Trunk K/V (+ positions, segment ids) and their gradient accumulators travel; branch-sized
  buffers (a W axis) never enter a collective."""
  B, S, W, H, K, D, cp = 2, 16, 3, 4, 2, 8, 4
  xs = inputs(60, SEGS, W=W, H=H, K=K, D=D)
  fn = cp_impl("ring", cp)
  loss = lambda *a: jnp.sum(jnp.sin(fn(*a, xs[-1], branch="ttt")[1]))
  hlo = jax.jit(jax.grad(loss, argnums=range(6))).lower(*xs[:6]).compile().as_text()
  import re

  shapes = re.findall(r"= \(?([a-z0-9\[\]{},: ]+?)\)? collective-permute\(", hlo)
  shapes += re.findall(r"= \(([^=]*?)\) collective-permute-start\(", hlo)
  assert shapes, "no collective-permute in the ring program"
  L = S // cp
  allowed = {f"[{B},{L},{K},{D}]", f"[{B},{L}]"}
  for sh in shapes:
    for dims in re.findall(r"\[[0-9,]*\]", sh):
      assert dims in allowed, (dims, sh)


def test_bad_inputs_are_clear_errors():
  xs = inputs(70, SEGS)
  with pytest.raises(ValueError, match="needs a mesh"):
    branch_attention(*xs, branch="ttt", impl="ring")
  from specdraft.attention import ring

  with pytest.raises(ValueError, match="two equal zigzag chunks"):
    ring.ring_attention_shard(
      *(x[:, :5] for x in xs[:6]), xs[-1][:, :5], xs[-1][:, :5], branch="ttt", axis_name="cp", cp=1
    )


# ----------------------------------------------------------------------------- integration


def test_ttt_draft_loss_and_grads_under_cp_equal_single_device():
  """The EAGLE-3 TTT loss through the ring (cp=4 inside a cp4_dp2 layout) == the cp=1 run."""
  from configs import default as default_config
  from specdraft.model import eagle3
  from specdraft.model import policy as pol
  from specdraft.parallel import mesh as mesh_lib

  c = default_config.get_config("smoke,layout=cp4_dp2")
  pcfg = pol.PolicyConfig.from_config(c.model, 99)
  dcfg = eagle3.DraftConfig.from_config(c.draft, pcfg)
  params = pol.init_params(pcfg, 0)
  dparams = eagle3.init_params(dcfg, 1, params, pcfg)
  rng = np.random.default_rng(0)
  B, S = 2, 22  # padded to 24 for cp=4 inside the op
  seg = np.ones((B, S), np.int32)
  seg[0, 9:] = 2
  seg[1, 17:] = 0
  pos = np.concatenate([np.arange(9), np.arange(S - 9)])[None].repeat(B, 0) * (seg > 0)
  batch = {
    "tokens": jnp.asarray(rng.integers(3, 99, (B, S)), jnp.int32),
    "positions": jnp.asarray(pos, jnp.int32),
    "segment_ids": jnp.asarray(seg),
    "loss_mask": jnp.asarray(seg > 0, jnp.float32),
  }
  mesh = mesh_lib.make_mesh(c.parallel)

  def run(impl):
    f = lambda d: oracles.distill_loss(d, params, pcfg, dcfg, batch, attn_impl=impl, mesh=mesh)
    return jax.jit(jax.value_and_grad(f, has_aux=True))(dparams)

  (l1, m1), g1 = run("dense")
  (l4, m4), g4 = run("ring")
  np.testing.assert_allclose(l4, l1, rtol=1e-5)
  assert set(m4) == set(m1)
  tol.assert_grads_close(g4, g1, rtol=1e-4)
  with pytest.raises(ValueError, match="impl='ring' needs a mesh"):
    oracles.distill_loss(dparams, params, pcfg, dcfg, batch, attn_impl="ring")
