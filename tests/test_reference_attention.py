"""The oracle against hand computation and an independent per-query numpy loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdraft.attention import branch_attention, branch_attention_dense, causal_attention


def _rand(key, shape):
  return jax.random.normal(key, shape, jnp.float32)


def make_inputs(seed, B=2, S=9, W=3, H=4, K=2, D=8, segments=None):
  ks = jax.random.split(jax.random.key(seed), 6)
  q, k, v = _rand(ks[0], (B, S, H, D)), _rand(ks[1], (B, S, K, D)), _rand(ks[2], (B, S, K, D))
  qb, kb, vb = (
    _rand(ks[3], (B, S, W, H, D)),
    _rand(ks[4], (B, S, W, K, D)),
    _rand(ks[5], (B, S, W, K, D)),
  )
  if segments is None:
    segments = np.array([[1, 1, 1, 2, 2, 3, 3, 3, 0], [1, 1, 1, 1, 1, 2, 2, 0, 0]][:B])
  return q, k, v, qb, kb, vb, jnp.asarray(segments[:, :S], jnp.int32)


def loop_oracle(q, k, v, qb, kb, vb, seg, branch):
  """Per-query softmax over an explicit list of visible keys (float64 numpy)."""
  q, k, v, qb, kb, vb, seg = (
    np.asarray(x, np.float64) if x.dtype != np.int32 else np.asarray(x)
    for x in (q, k, v, qb, kb, vb, seg)
  )
  B, S, H, D = q.shape
  W, K = qb.shape[2], k.shape[2]
  G = H // K
  out, out_br = np.zeros_like(q), np.zeros_like(qb)

  def attend(qv, keys, vals):
    if not keys:
      return np.zeros(D)
    s = np.array([qv @ kk for kk in keys]) / np.sqrt(D)
    p = np.exp(s - s.max())
    p /= p.sum()
    return (p[:, None] * np.array(vals)).sum(0)

  for b in range(B):
    for t in range(S):
      if seg[b, t] == 0:
        continue
      same = [s for s in range(S) if seg[b, s] == seg[b, t]]
      for h in range(H):
        kh = h // G
        out[b, t, h] = attend(
          q[b, t, h], [k[b, s, kh] for s in same if s <= t], [v[b, s, kh] for s in same if s <= t]
        )
        for j in range(W):
          ts = [s for s in same if (s <= t if branch == "ttt" else s < t)]
          bs = [i for i in range(W) if (i <= j if branch == "ttt" else True)]
          keys = [k[b, s, kh] for s in ts] + [kb[b, t, i, kh] for i in bs]
          vals = [v[b, s, kh] for s in ts] + [vb[b, t, i, kh] for i in bs]
          out_br[b, t, j, h] = attend(qb[b, t, j, h], keys, vals)
  return out, out_br


@pytest.mark.parametrize("branch", ["ttt", "block"])
def test_matches_loop_oracle(branch):
  inputs = make_inputs(0)
  out, out_br = branch_attention(*inputs, branch=branch)
  ref, ref_br = loop_oracle(*inputs, branch)
  np.testing.assert_allclose(out, ref, atol=1e-5)
  np.testing.assert_allclose(out_br, ref_br, atol=1e-5)


def test_hand_computed_case():
  # One head, D=1, S=2, W=1, one document. Scores are q*k/sqrt(1).
  q = jnp.array([0.0, 1.0]).reshape(1, 2, 1, 1)
  k = jnp.array([1.0, 2.0]).reshape(1, 2, 1, 1)
  v = jnp.array([10.0, 20.0]).reshape(1, 2, 1, 1)
  qb = jnp.array([1.0, 0.0]).reshape(1, 2, 1, 1, 1)
  kb = jnp.array([3.0, 5.0]).reshape(1, 2, 1, 1, 1)
  vb = jnp.array([30.0, 50.0]).reshape(1, 2, 1, 1, 1)
  seg = jnp.ones((1, 2), jnp.int32)
  out, out_br = branch_attention(q, k, v, qb, kb, vb, seg, branch="ttt")
  # t=0 sees only s=0 -> 10. t=1: scores (1, 2) -> softmax weights (1, e) / (1 + e).
  e = np.e
  np.testing.assert_allclose(out[0, :, 0, 0], [10.0, (10 + 20 * e) / (1 + e)], rtol=1e-6)
  # branch (0, 0): q=1 over trunk s=0 (score 1) and own key (score 3).
  w = np.exp([1.0, 3.0])
  np.testing.assert_allclose(out_br[0, 0, 0, 0, 0], (10 * w[0] + 30 * w[1]) / w.sum(), rtol=1e-6)
  # branch (1, 0): q=0 -> uniform over trunk s=0,1 and own key.
  np.testing.assert_allclose(out_br[0, 1, 0, 0, 0], (10 + 20 + 50) / 3, rtol=1e-6)
  # block: branch (0, 0) sees no trunk key (s < 0) -> only its own key.
  _, out_blk = branch_attention(q, k, v, qb, kb, vb, seg, branch="block")
  np.testing.assert_allclose(out_blk[0, 0, 0, 0, 0], 30.0, rtol=1e-6)


@pytest.mark.parametrize("branch", ["ttt", "block"])
def test_padding_rows_zero_and_nan_free_gradients(branch):
  inputs = make_inputs(1)
  seg = inputs[-1]

  def loss(*xs):
    out, out_br = branch_attention(*xs, seg, branch=branch)
    return jnp.sum(out**2) + jnp.sum(jnp.sin(out_br))

  out, out_br = branch_attention(*inputs, branch=branch)
  pad = np.asarray(seg) == 0
  assert np.all(np.asarray(out)[pad] == 0) and np.all(np.asarray(out_br)[pad] == 0)
  grads = jax.grad(loss, argnums=range(6))(*inputs[:6])
  for g in grads:
    assert np.all(np.isfinite(g))
    assert np.all(np.asarray(g)[pad] == 0)


@pytest.mark.parametrize("branch", ["ttt", "block"])
def test_isolation(branch):
  q, k, v, qb, kb, vb, seg = make_inputs(2)
  base, base_br = branch_attention(q, k, v, qb, kb, vb, seg, branch=branch)
  # Row 0, document 1 occupies positions 0..2. Perturb document 2 (positions 3, 4).
  k2, v2 = k.at[0, 3:5].add(5.0), v.at[0, 3:5].add(5.0)
  kb2 = kb.at[0, 3:5].add(5.0)
  out, out_br = branch_attention(q, k2, v2, qb, kb2, vb, seg, branch=branch)
  np.testing.assert_array_equal(out[0, :3], base[0, :3])
  np.testing.assert_array_equal(out_br[0, :3], base_br[0, :3])
  np.testing.assert_array_equal(out[0, 5:], base[0, 5:])
  # A future trunk position (2) leaves rows 0..1 unchanged (trunk and branch).
  out, out_br = branch_attention(
    q, k.at[0, 2].add(3.0), v.at[0, 2].add(3.0), qb, kb, vb, seg, branch=branch
  )
  np.testing.assert_array_equal(out[0, :2], base[0, :2])
  np.testing.assert_array_equal(out_br[0, :2], base_br[0, :2])
  assert not np.allclose(out[0, 2], base[0, 2])
  # Another branch (anchor 1) does not affect branch anchored at 0 or any trunk row.
  out, out_br = branch_attention(
    q, k, v, qb, kb.at[0, 1].add(3.0), vb.at[0, 1].add(3.0), seg, branch=branch
  )
  np.testing.assert_array_equal(out, base)
  np.testing.assert_array_equal(out_br[0, 0], base_br[0, 0])
  np.testing.assert_array_equal(out_br[0, 2:], base_br[0, 2:])
  # ttt: a later branch entry (j=2) does not affect earlier ones (j<2) of the same anchor.
  out, out_br = branch_attention(
    q, k, v, qb, kb.at[0, 1, 2].add(3.0), vb.at[0, 1, 2].add(3.0), seg, branch=branch
  )
  if branch == "ttt":
    np.testing.assert_array_equal(out_br[0, 1, :2], base_br[0, 1, :2])
  else:
    assert not np.allclose(out_br[0, 1, 0], base_br[0, 1, 0])


def test_gqa_equals_repeated_kv_heads():
  q, k, v, qb, kb, vb, seg = make_inputs(3, H=4, K=2)
  out, out_br = branch_attention(q, k, v, qb, kb, vb, seg, branch="ttt")
  rep = lambda x: jnp.repeat(x, 2, axis=-2)
  out2, out_br2 = branch_attention(q, rep(k), rep(v), qb, rep(kb), rep(vb), seg, branch="ttt")
  np.testing.assert_allclose(out, out2, atol=1e-6)
  np.testing.assert_allclose(out_br, out_br2, atol=1e-6)


def test_trunk_equals_causal_attention_and_lse():
  q, k, v, qb, kb, vb, seg = make_inputs(4)
  out, _, lse, _ = branch_attention_dense(q, k, v, qb, kb, vb, seg, branch="ttt")
  np.testing.assert_allclose(out, causal_attention(q, k, v, seg), atol=1e-6)
  assert np.all(np.isneginf(np.asarray(lse)[0, :, 8]))  # padding row has lse = -inf
  assert np.all(np.isfinite(np.asarray(lse)[0, :, :8]))


def test_bad_shapes_are_clear_errors():
  q, k, v, qb, kb, vb, seg = make_inputs(5)
  with pytest.raises(ValueError, match="branch='diag'"):
    branch_attention(q, k, v, qb, kb, vb, seg, branch="diag")
  with pytest.raises(ValueError, match="multiple of kv heads"):
    branch_attention(q[:, :, :3], k, v, qb[:, :, :, :3], kb, vb, seg, branch="ttt")
  with pytest.raises(ValueError, match="segment_ids"):
    branch_attention(q, k, v, qb, kb, vb, seg[:, :4], branch="ttt")
  with pytest.raises(ValueError, match="impl='flash'"):
    branch_attention(q, k, v, qb, kb, vb, seg, branch="ttt", impl="flash")


def test_mask_picture_reads_the_oracles_visibility(tmp_path):
  """The docs' mask picture (bench/masks.py) is read off the oracle: spot checks by hand on a
  row of two documents [1, 1, 1, 1, 2, 2, 2] with W = 3."""
  from experiments.bench import masks

  S, W = 7, 3
  shown = masks.plot(str(tmp_path / "masks.png"))
  assert (tmp_path / "masks.png").stat().st_size > 0
  trunk, ttt, block = shown["trunk"], shown["ttt"], shown["block"]
  want_trunk = np.array([[s <= t and (s < 4) == (t < 4) for s in range(S)] for t in range(S)])
  np.testing.assert_array_equal(trunk, want_trunk)
  row = lambda t, j: t * W + j
  br = lambda t, i: S + t * W + i
  # TTT (t=5, j=1): trunk 4, 5 (its document, s <= t) and its own entries 0, 1
  assert set(np.flatnonzero(ttt[row(5, 1)])) == {4, 5, br(5, 0), br(5, 1)}
  # block (t=5, j=1): trunk 4 only (s < t) and its whole block
  assert set(np.flatnonzero(block[row(5, 1)])) == {4, br(5, 0), br(5, 1), br(5, 2)}
  # a block anchored at a document's first token sees no trunk key at all
  assert set(np.flatnonzero(block[row(4, 0)])) == {br(4, 0), br(4, 1), br(4, 2)}
