import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specdraft.model import policy as pol

# Jitted once per shape: eager calls re-trace and re-compile the layer scan every time.
forward = jax.jit(pol.forward, static_argnums=1, static_argnames="stop_tap_gradient")
prefill = jax.jit(pol.prefill, static_argnums=1)
decode = jax.jit(pol.decode, static_argnums=1)
run_layers = jax.jit(pol.run_layers, static_argnums=2)


@pytest.fixture(scope="module")
def setup():
  cfg = pol.PolicyConfig(
    vocab_size=32, d_model=32, n_layers=6, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64
  )
  params = pol.init_params(cfg, 0)
  # Perturb norms so that tests do not pass by symmetry of ones.
  params = jax.tree.map(lambda x: x, params)
  params["final_norm"] = params["final_norm"] + 0.1 * jnp.arange(32) / 32
  return cfg, params


def test_default_taps():
  assert pol.default_tap_layers(32) == (1, 15, 28)
  assert pol.PolicyConfig(vocab_size=8, n_layers=12).taps == (1, 5, 8)
  assert pol.PolicyConfig(vocab_size=8, n_layers=12, tap_layers=(0, 11)).taps == (0, 11)


def test_shapes_and_taps(setup):
  cfg, params = setup
  toks = jax.random.randint(jax.random.key(0), (2, 11), 0, 32)
  logits, taps = forward(params, cfg, toks)
  chex.assert_shape(logits, (2, 11, 32))
  chex.assert_shape(taps.layers, (len(cfg.taps), 2, 11, 32))
  chex.assert_shape(taps.final, (2, 11, 32))
  # Taps are exactly the outputs of those layers: run slices by hand.
  x = pol.embed(params, toks, cfg)
  pos = jnp.broadcast_to(jnp.arange(11), (2, 11))
  seg = jnp.ones((2, 11), jnp.int32)
  start = 0
  for i, t in enumerate(cfg.taps):
    x, _, _ = run_layers(
      pol.slice_layers(params["layers"], start, t + 1), x, cfg, positions_BT=pos, segment_ids_BT=seg
    )
    np.testing.assert_allclose(taps.layers[i], x, atol=1e-5)
    start = t + 1


def test_layer_slices_compose(setup):
  """Any contiguous split of the stack (a pipeline) gives the full stack's output."""
  cfg, params = setup
  toks = jax.random.randint(jax.random.key(1), (2, 7), 0, 32)
  pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
  seg = jnp.ones((2, 7), jnp.int32)
  x0 = pol.embed(params, toks, cfg)
  full, _, _ = run_layers(params["layers"], x0, cfg, positions_BT=pos, segment_ids_BT=seg)
  for cuts in [(0, 3, 6), (0, 1, 2, 4, 6), (0, 6)]:
    x = x0
    for a, b in zip(cuts[:-1], cuts[1:]):
      x, _, _ = run_layers(
        pol.slice_layers(params["layers"], a, b), x, cfg, positions_BT=pos, segment_ids_BT=seg
      )
    np.testing.assert_allclose(x, full, atol=1e-5)


def test_incremental_decode_reproduces_forward(setup):
  cfg, params = setup
  toks = jax.random.randint(jax.random.key(2), (3, 12), 0, 32)
  logits, taps = forward(params, cfg, toks)
  plen = jnp.array([4, 1, 7])
  P = 7
  prompt = jnp.where(jnp.arange(P)[None] < plen[:, None], toks[:, :P], 0)
  cache = pol.init_cache(cfg, 3, 16)
  pl_logits, _, cache = prefill(params, cfg, cache, prompt, plen)
  for b in range(3):
    n = int(plen[b])
    np.testing.assert_allclose(pl_logits[b, :n], logits[b, :n], atol=1e-5)
  # Feed each row's continuation one token at a time; rows are at different lengths.
  step = lambda c, t: decode(params, cfg, c, t)
  got = [[] for _ in range(3)]
  for i in range(5):
    nxt = toks[jnp.arange(3), plen + i][:, None]
    lg, tp, cache = step(cache, nxt)
    for b in range(3):
      got[b].append(lg[b, 0])
      np.testing.assert_allclose(tp.final[b, 0], taps.final[b, int(plen[b]) + i], atol=1e-5)
  for b in range(3):
    n = int(plen[b])
    np.testing.assert_allclose(np.stack(got[b]), logits[b, n : n + 5], atol=1e-5)
  np.testing.assert_array_equal(cache.lengths, plen + 5)


def test_multi_token_decode_and_rollback(setup):
  """Feeding 3 tokens at once, then rolling back by 2, then continuing, matches forward."""
  cfg, params = setup
  toks = jax.random.randint(jax.random.key(3), (2, 10), 0, 32)
  logits, _ = forward(params, cfg, toks)
  cache = pol.init_cache(cfg, 2, 16)
  _, _, cache = prefill(params, cfg, cache, toks[:, :4], jnp.array([4, 4]))
  wrong = jnp.array([[5, 6, 7], [8, 9, 10]])
  lg, _, cache = decode(params, cfg, cache, jnp.concatenate([toks[:, 4:5], wrong[:, :2]], 1))
  np.testing.assert_allclose(lg[:, 0], logits[:, 4], atol=1e-5)
  cache = cache._replace(lengths=jnp.array([5, 5]))  # keep only the first of the three
  lg, _, cache = decode(params, cfg, cache, toks[:, 5:8])
  np.testing.assert_allclose(lg, logits[:, 5:8], atol=1e-5)


def test_packed_rows_equal_separate_documents(setup):
  cfg, params = setup
  a = jax.random.randint(jax.random.key(4), (1, 5), 0, 32)
  b = jax.random.randint(jax.random.key(5), (1, 4), 0, 32)
  packed = jnp.concatenate([a, b, jnp.zeros((1, 2), jnp.int32)], 1)
  seg = jnp.array([[1] * 5 + [2] * 4 + [0] * 2])
  pos = jnp.array([list(range(5)) + list(range(4)) + [0, 0]])
  lp, _ = forward(params, cfg, packed, pos, seg)
  la, _ = forward(params, cfg, a)
  lb, _ = forward(params, cfg, b)
  np.testing.assert_allclose(lp[0, :5], la[0], atol=1e-5)
  np.testing.assert_allclose(lp[0, 5:9], lb[0], atol=1e-5)


def test_taps_carry_no_gradient(setup):
  cfg, params = setup
  toks = jax.random.randint(jax.random.key(6), (1, 6), 0, 32)

  def tap_loss(p, stop):
    _, taps = forward(p, cfg, toks, stop_tap_gradient=stop)
    return jnp.sum(taps.layers**2) + jnp.sum(taps.final**2)

  g = jax.jit(jax.grad(tap_loss), static_argnums=1)(params, True)
  assert all(float(jnp.abs(x).max()) == 0.0 for x in jax.tree.leaves(g))
  g = jax.jit(jax.grad(tap_loss), static_argnums=1)(
    params, False
  )  # negative control: the test can fail
  assert max(float(jnp.abs(x).max()) for x in jax.tree.leaves(g)) > 0


def test_untied_head_and_bf16(setup):
  cfg = pol.PolicyConfig(
    vocab_size=32,
    d_model=32,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    d_ff=64,
    tie_embeddings=False,
    dtype="bfloat16",
  )
  params = pol.init_params(cfg, 1)
  assert params["head"].shape == (32, 32)
  logits, taps = forward(params, cfg, jnp.ones((1, 5), jnp.int32))
  assert logits.dtype == jnp.float32 and taps.final.dtype == jnp.bfloat16
  assert np.all(np.isfinite(logits))


def test_nnx_module_call_matches_pure_forward(setup):
  from flax import nnx

  cfg, _ = setup
  model = pol.Policy(cfg, rngs=nnx.Rngs(3))
  toks = jnp.arange(6)[None] % 32
  a, _ = model(toks)
  b, _ = pol.forward(pol.split_params(model), cfg, toks)
  np.testing.assert_array_equal(a, b)


def test_prefill_of_a_long_prompt_has_no_prompt_squared_array():
  """Prefill attends through the tiled attention: no [B, P, C] mask or score tensor at P = 2048
  (the cached decoding step keeps its [B, T, C] mask for its few new tokens)."""
  from _hlo import largest_array

  cfg = pol.PolicyConfig(
    vocab_size=99, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16
  )
  params = pol.init_params(cfg, 0)
  P = 2048
  cache = pol.init_cache(cfg, 1, P + 8)
  prompt = jnp.ones((1, P), jnp.int32)
  text = prefill.lower(params, cfg, cache, prompt, jnp.array([P - 5])).compile().as_text()
  assert largest_array(text) < P * P
  # negative control: feeding the prompt through the cached decoding step builds the mask
  dec = jax.jit(pol.decode, static_argnums=1).lower(params, cfg, cache, prompt).compile()
  assert largest_array(dec.as_text()) >= P * P


def test_a_decoding_step_writes_only_its_new_cache_rows():
  """The cache rides in the layer scan's carry and each layer scatters its T new rows into it:
  a step's scratch memory is a fraction of the cache (a per-layer slice to attend over), not a
  second copy of it as when every layer's cache was a scanned input and output. The rows written
  are exactly lengths..lengths+T-1, also at a row whose last slot is the cache's last."""
  cfg = pol.PolicyConfig(
    vocab_size=64, d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=16
  )
  params = pol.init_params(cfg, 0)
  C, T = 4096, 3
  cache = pol.init_cache(cfg, 2, C)
  step = jax.jit(lambda p, c, t: pol.decode(p, cfg, c, t)[2])
  tokens = jnp.ones((2, T), jnp.int32)
  mem = step.lower(params, cache, tokens).compile().memory_analysis()
  assert mem.temp_size_in_bytes < 0.5 * (cache.k.nbytes + cache.v.nbytes), mem
  lengths = jnp.array([5, C - T], jnp.int32)
  new = step(params, cache._replace(lengths=lengths), tokens)
  written = np.asarray(jnp.any(new.k != 0, axis=(3, 4)))  # [L, B, C]
  for b, start in enumerate(np.asarray(lengths)):
    want = np.zeros(C, bool)
    want[start : start + T] = True
    np.testing.assert_array_equal(written[:, b], np.broadcast_to(want, (cfg.n_layers, C)))
  np.testing.assert_array_equal(np.asarray(new.lengths), np.asarray(lengths) + T)
