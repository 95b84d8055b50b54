"""Speculative decoding: TTT alignment, train/inference consistency of the draft, and
losslessness (exact enumeration, chi-square, greedy equality, end-to-end two-sample test)."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specdraft import oracles
from specdraft.decode import autoregressive, rejection, speculative
from specdraft.decode.sampling import Sampling, join_prompt_completion, logprob_at, probs_at
from specdraft.model import eagle3
from specdraft.model import policy as pol
from specdraft.train.spec import StepSpec


def small_models(V=16, L=4, std=0.02, seed=0, ttt_steps=4):
  pcfg = pol.PolicyConfig(
    vocab_size=V,
    d_model=32,
    n_layers=L,
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    d_ff=64,
    init_std=std,
  )
  dcfg = eagle3.DraftConfig(
    d_model=32,
    vocab_size=V,
    n_taps=len(pcfg.taps),
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    d_ff=64,
    ttt_steps=ttt_steps,
    init_std=std,
  )
  params = pol.init_params(pcfg, seed)
  params["embed"] = params["embed"] * 3.0  # sharper, more varied distributions
  dparams = eagle3.init_params(dcfg, seed + 1, params, pcfg)
  return pcfg, dcfg, params, dparams


# ----------------------------------------------------------------------------- TTT


def test_ttt_inputs_and_targets_by_hand():
  tokens = jnp.array([[10, 11, 12, 13, 14, 15, 16]])
  seg = jnp.array([[1, 1, 1, 1, 1, 2, 2]])
  mask = jnp.array([[0, 0, 1, 1, 1, 1, 1]], jnp.float32)
  toks, w = eagle3.ttt_targets(tokens, seg, mask, 3)
  # step k at anchor t reads token t+1+k (same document, else 0)
  np.testing.assert_array_equal(toks[0, 0], [11, 12, 13, 14, 0, 16, 0])
  np.testing.assert_array_equal(toks[1, 0], [12, 13, 14, 0, 0, 0, 0])
  np.testing.assert_array_equal(toks[2, 0], [13, 14, 0, 0, 0, 0, 0])
  # ... and is weighted by token t+2+k being a loss token of the same document
  np.testing.assert_array_equal(w[0, 0], [1, 1, 1, 0, 0, 0, 0])
  np.testing.assert_array_equal(w[1, 0], [1, 1, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(w[2, 0], [1, 0, 0, 0, 0, 0, 0])
  # the policy distribution that supervises step k at anchor t is the one at t+1+k
  logits = jax.nn.one_hot(jnp.arange(7), 7)[None] * 10.0
  tgt = eagle3.shift_within_segment_logits(logits, seg, 2)
  assert int(jnp.argmax(tgt[0, 0])) == 2 and int(jnp.argmax(tgt[0, 3])) == 5


def test_ttt_branches_equal_autoregressive_drafting():
  """TTT step k at anchor t == drafting k steps after t with the draft's KV cache."""
  pcfg, dcfg, params, dparams = small_models(ttt_steps=4)
  S = 10
  tokens = jax.random.randint(jax.random.key(1), (1, S), 3, 16)
  seg = jnp.ones((1, S), jnp.int32)
  pos = jnp.arange(S)[None]
  _, taps = jax.jit(pol.forward, static_argnums=1)(params, pcfg, tokens)
  logits = jax.jit(eagle3.ttt_forward, static_argnums=1)(
    dparams, dcfg, params["embed"], taps.layers, tokens, pos, seg
  )
  feats = eagle3.fuse(dparams, taps.layers, dcfg)
  step = jax.jit(lambda c, f, t: eagle3.step(dparams, dcfg, params["embed"], c, f, t))
  for t in (0, 3, 5):
    cache = eagle3.init_cache(dcfg, 1, 32)
    lg, h, cache = step(cache, feats[:, : t + 1], tokens[:, 1 : t + 2])
    np.testing.assert_allclose(lg[0, t], logits[0, 0, t], atol=2e-5)
    h = h[:, t : t + 1]
    for k in range(1, 4):
      lg, h, cache = step(cache, h, tokens[:, t + 1 + k : t + 2 + k])
      np.testing.assert_allclose(lg[0, 0], logits[k, 0, t], atol=2e-5)


def test_draft_prefill_equals_cached_steps_on_padded_prompts():
  """The tiled prefill (no [B, T, C] mask) == the dense cached step, on right-padded rows of
  different lengths, including what it writes into the cache at the valid entries."""
  pcfg, dcfg, params, dparams = small_models()
  B, T, C = 3, 12, 20
  tokens = jax.random.randint(jax.random.key(3), (B, T), 3, 16)
  lengths = jnp.array([12, 7, 1], jnp.int32)
  _, taps = jax.jit(pol.forward, static_argnums=1)(params, pcfg, tokens)
  feats = eagle3.fuse(dparams, taps.layers, dcfg)
  cache = eagle3.init_cache(dcfg, B, C)
  lg, h, pc = eagle3.prefill(dparams, dcfg, params["embed"], cache, feats, tokens, lengths)
  lg_ref, h_ref, sc = eagle3.step(dparams, dcfg, params["embed"], cache, feats, tokens)
  np.testing.assert_array_equal(pc.lengths, lengths)
  for b, n in enumerate(np.asarray(lengths)):
    np.testing.assert_allclose(lg[b, :n], lg_ref[b, :n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h[b, :n], h_ref[b, :n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pc.k[b, :n], sc.k[b, :n], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(pc.v[b, :n], sc.v[b, :n], rtol=1e-6, atol=1e-6)
  # the next step reads the prefilled cache as it would read the stepped one
  nxt = tokens[:, :1]
  a = eagle3.step(dparams, dcfg, params["embed"], pc, h[:, :1], nxt)[0]
  b_ = eagle3.step(dparams, dcfg, params["embed"], sc._replace(lengths=lengths), h[:, :1], nxt)[0]
  np.testing.assert_allclose(a, b_, rtol=1e-5, atol=1e-5)


def test_sd_prefill_holds_no_quadratic_buffer():
  """SD over a 2048-token prompt compiles without any S^2-element array: the policy's and the
  draft's prefill attend in tiles. Negative control: the draft's dense cached step over the same
  prompt materialises one (what ran out of memory at 8K-token prompts)."""
  import _hlo

  pcfg, dcfg, params, dparams = small_models()
  S = 2048
  prompts = jnp.ones((1, S), jnp.int32)
  lengths = jnp.array([S], jnp.int32)
  gen = jax.jit(
    lambda p, d, pr, ln: (
      speculative.generate(
        p, d, pcfg, dcfg, pr, ln, jax.random.key(0), max_new_tokens=4, temperature=1.0, num_draft=2
      ).tokens
    )
  )
  assert (
    _hlo.largest_array(gen.lower(params, dparams, prompts, lengths).compile().as_text()) < S * S
  )
  feats = jnp.zeros((1, S, dcfg.d_model), jnp.float32)
  dense = jax.jit(lambda c, f, t: eagle3.step(dparams, dcfg, params["embed"], c, f, t)[0]).lower(
    eagle3.init_cache(dcfg, 1, S + 8), feats, prompts
  )
  assert _hlo.largest_array(dense.compile().as_text()) >= S * S


def test_ttt_loss_decreases_and_ignores_policy_gradient():
  from specdraft.train import draft as draft_lib

  pcfg, dcfg, params, dparams = small_models()
  tokens = jax.random.randint(jax.random.key(2), (2, 12), 3, 16)
  batch = {
    "tokens": tokens,
    "positions": jnp.broadcast_to(jnp.arange(12), (2, 12)),
    "segment_ids": jnp.ones((2, 12), jnp.int32),
    "loss_mask": jnp.ones((2, 12)),
  }
  g_policy = jax.jit(jax.grad(lambda p: oracles.distill_loss(dparams, p, pcfg, dcfg, batch)[0]))(
    params
  )
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(g_policy))
  import optax

  tx = optax.adam(3e-3)
  st = {"step": 0, "params": dparams, "opt_state": tx.init(dparams)}
  spec = StepSpec.of(pcfg, dcfg, tx=tx)
  f = jax.jit(lambda s: draft_lib.draft_train_step(s, params, batch, spec))
  first = None
  for _ in range(30):
    st, m = f(st)
    first = first if first is not None else float(m["draft_loss"])
  assert float(m["draft_loss"]) < 0.7 * first


# ----------------------------------------------------------------------------- rejection sampling


def _tables(V, G, seed, overlap=0.6):
  rng = np.random.default_rng(seed)
  p = rng.dirichlet(np.ones(V), size=G + 1)
  q = overlap * p[:G] + (1 - overlap) * rng.dirichlet(np.ones(V), size=G)
  return p, q


def broken_rejection_sample(key, draft_tokens, draft_probs, target_probs):
  """The classic bug: after a rejection, resample from p instead of the residual."""
  B, G = draft_tokens.shape
  tokens, n = rejection.rejection_sample(key, draft_tokens, draft_probs, target_probs)
  fixed = jax.random.categorical(jax.random.fold_in(key, 7), jnp.log(target_probs[:, :G]))
  idx = jnp.arange(G + 1)[None]
  wrong = jnp.concatenate([fixed, tokens[:, G:]], axis=1)
  return jnp.where((idx == n[:, None]) & (n[:, None] < G), wrong, tokens), n


def _chi2_per_position(sampler, V=6, G=3, B=120_000, seed=0):
  p, q = _tables(V, G, seed)
  k1, k2 = jax.random.split(jax.random.key(seed))
  x = jax.random.categorical(k1, jnp.log(jnp.asarray(q, jnp.float32)), shape=(B, G))
  toks, n = jax.jit(sampler)(
    k2,
    x,
    jnp.broadcast_to(jnp.asarray(q, jnp.float32), (B, G, V)),
    jnp.broadcast_to(jnp.asarray(p, jnp.float32), (B, G + 1, V)),
  )
  toks, n = np.asarray(toks), np.asarray(n)
  pvals = []
  for i in range(G + 1):
    reached = n >= i
    counts = np.bincount(toks[reached, i], minlength=V)
    pvals.append(stats.chisquare(counts, p[i] * reached.sum()).pvalue)
    assert reached.sum() > 2000  # every position is reached often enough to test
  return pvals


def test_rejection_sample_chi_square_per_position():
  pvals = _chi2_per_position(rejection.rejection_sample)
  assert min(pvals) > 1e-4, pvals


def test_chi_square_has_power_against_the_classic_bug():
  pvals = _chi2_per_position(broken_rejection_sample)
  assert min(pvals) < 1e-8, pvals


def test_rejection_sample_output_format():
  V, G, B = 5, 4, 64
  p, q = _tables(V, G, 1)
  x = jax.random.categorical(jax.random.key(0), jnp.log(jnp.asarray(q)), shape=(B, G))
  toks, n = rejection.rejection_sample(
    jax.random.key(1), x, jnp.broadcast_to(q, (B, G, V)), jnp.broadcast_to(p, (B, G + 1, V))
  )
  toks, n, x = np.asarray(toks), np.asarray(n), np.asarray(x)
  assert toks.dtype == np.int32 and toks.shape == (B, G + 1)
  for b in range(B):
    np.testing.assert_array_equal(toks[b, : n[b]], x[b, : n[b]])
    assert 0 <= toks[b, n[b]] < V
    assert np.all(toks[b, n[b] + 1 :] == -1)


def test_deterministic_draft_is_greedy_exact():
  """With one-hot targets and a deterministic draft, the output is the target's argmax chain."""
  V, G, B = 7, 3, 32
  rng = np.random.default_rng(0)
  target = rng.integers(0, V, (B, G + 1))
  draft = np.where(rng.random((B, G)) < 0.6, target[:, :G], (target[:, :G] + 1) % V)
  toks, n = rejection.rejection_sample(
    jax.random.key(0), jnp.asarray(draft, jnp.int32), None, jax.nn.one_hot(target, V)
  )
  for b in range(B):
    m = 0
    while m < G and draft[b, m] == target[b, m]:
      m += 1
    assert int(n[b]) == m
    np.testing.assert_array_equal(np.asarray(toks[b, : m + 1]), target[b, : m + 1])


def _table(prefix, V, salt):
  rng = np.random.default_rng([salt, len(prefix)] + list(prefix))
  return rng.dirichlet(np.ones(V) * 0.7)


@pytest.mark.parametrize("deterministic", [False, True])
def test_exact_enumeration_of_sd_output_distribution(deterministic):
  """The whole multi-round SD process, computed exactly in float64 from the implementation's
  acceptance probabilities and final distributions, equals the target's distribution."""
  V, G, H = 3, 2, 4
  p_of = lambda s: _table(s, V, 1)
  q_of = lambda s: np.eye(V)[int(np.argmax(_table(s, V, 2)))] if deterministic else _table(s, V, 2)

  with jax.enable_x64(True):

    def round_outcomes(s):
      """[(emitted tuple, prob)] of one SD round from prefix s."""
      out = []
      for x in itertools.product(range(V), repeat=G):
        qs = [q_of(s + x[:i]) for i in range(G)]
        px = np.prod([qs[i][x[i]] for i in range(G)])
        if px == 0:
          continue
        ps = np.stack([p_of(s + x[:i]) for i in range(G + 1)])
        args = (
          jnp.asarray([x], jnp.int32),
          None if deterministic else jnp.asarray([qs]),
          jnp.asarray([ps]),
        )
        alpha = np.asarray(rejection.acceptance_probs(*args))[0]
        final = np.asarray(rejection.final_distributions(*args))[0]
        assert alpha.dtype == np.float64
        reach = 1.0
        for n in range(G + 1):
          stop = (1 - alpha[n]) if n < G else 1.0
          for y in range(V):
            pr = px * reach * stop * final[n, y]
            if pr > 0:
              out.append((x[:n] + (y,), pr))
          if n < G:
            reach *= alpha[n]
      return out

    dist = {}

    def run(s, pr):
      if len(s) >= H:
        dist[s[:H]] = dist.get(s[:H], 0.0) + pr
        return
      for em, pe in round_outcomes(s):
        run(s + em, pr * pe)

    run((), 1.0)
  target = {}
  for y in itertools.product(range(V), repeat=H):
    target[y] = np.prod([p_of(y[:i])[y[i]] for i in range(H)])
  assert abs(sum(dist.values()) - 1) < 1e-12
  for y in target:
    assert abs(dist.get(y, 0.0) - target[y]) < 1e-12, (y, dist.get(y), target[y])


# ----------------------------------------------------------------------------- generation


def test_sd_logprobs_match_recompute_and_format():
  pcfg, dcfg, params, dparams = small_models(V=16)
  prompts = jnp.array([[1, 5, 6, 7], [1, 8, 0, 0], [1, 9, 10, 0]], jnp.int32)
  lengths = jnp.array([4, 2, 3], jnp.int32)
  gen = speculative.generate(
    params,
    dparams,
    pcfg,
    dcfg,
    prompts,
    lengths,
    jax.random.key(3),
    max_new_tokens=9,
    temperature=1.0,
    num_draft=3,
  )
  batch = join_prompt_completion(prompts, lengths, gen)
  logits, _ = pol.forward(params, pcfg, batch["tokens"], batch["positions"], batch["segment_ids"])
  lp = jax.nn.log_softmax(logits, -1)
  for b in range(3):
    n, P = int(gen.lengths[b]), int(lengths[b])
    assert 1 <= n <= 9
    for i in range(n):
      tok = int(gen.tokens[b, i])
      # the verification pass and the full forward sum in different orders: a float32-safe
      # tolerance on the value (the token itself is exact)
      np.testing.assert_allclose(gen.logprobs[b, i], lp[b, P + i - 1, tok], rtol=1e-4, atol=1e-4)
    assert np.all(np.asarray(gen.tokens[b, n:]) == 0) and np.all(
      np.asarray(gen.logprobs[b, n:]) == 0
    )
  st = jax.device_get(gen.stats)
  assert st["row_rounds"] > 0 and np.all(st["accept_counts"] <= st["reach_counts"])


def _histogram(tokens):
  keys, counts = np.unique(np.asarray(tokens), axis=0, return_counts=True)
  return {tuple(k): c for k, c in zip(keys.tolist(), counts)}


def _two_sample_pvalue(a, b, min_expected=5):
  ha, hb = _histogram(a), _histogram(b)
  cats = sorted(set(ha) | set(hb))
  table = np.array([[ha.get(c, 0) for c in cats], [hb.get(c, 0) for c in cats]], float)
  big = table.sum(0) >= 2 * min_expected
  table = np.concatenate([table[:, big], table[:, ~big].sum(1, keepdims=True)], axis=1)
  table = table[:, table.sum(0) > 0]
  return stats.chi2_contingency(table).pvalue


@pytest.fixture(scope="module")
def two_sample_setup():
  V = 6
  pcfg = pol.PolicyConfig(
    vocab_size=V,
    d_model=32,
    n_layers=4,
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    d_ff=64,
    init_std=0.3,
    tie_embeddings=False,
  )
  dcfg = eagle3.DraftConfig(
    d_model=32,
    vocab_size=V,
    n_taps=len(pcfg.taps),
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    d_ff=64,
    ttt_steps=2,
    init_std=0.3,
  )
  params = pol.init_params(pcfg, 4)
  # A spread-out policy and a draft that is related to it but clearly different.
  params["head"] = jax.random.normal(jax.random.key(9), params["head"].shape) * 0.3
  dparams = eagle3.init_params(dcfg, 5, params, pcfg)
  dparams["head"] = params["head"] + 0.3 * jax.random.normal(
    jax.random.key(10), params["head"].shape
  )
  B = 30_000
  prompts = jnp.broadcast_to(jnp.array([1, 4, 5], jnp.int32), (B, 3))
  lengths = jnp.full((B,), 3, jnp.int32)
  ar = autoregressive.generate(
    params, pcfg, prompts, lengths, jax.random.key(0), max_new_tokens=3, temperature=1.0
  )
  return pcfg, dcfg, params, dparams, prompts, lengths, ar


def test_sd_and_ar_sample_the_same_distribution(two_sample_setup):
  pcfg, dcfg, params, dparams, prompts, lengths, ar = two_sample_setup
  sd = speculative.generate(
    params,
    dparams,
    pcfg,
    dcfg,
    prompts,
    lengths,
    jax.random.key(1),
    max_new_tokens=3,
    temperature=1.0,
    num_draft=2,
  )
  st = jax.device_get(sd.stats)
  rate = st["accept_counts"][0] / st["reach_counts"][0]
  assert 0.1 < rate < 0.95  # both acceptances and rejections are exercised
  assert _two_sample_pvalue(ar.tokens, sd.tokens) > 1e-3


def test_two_sample_test_has_power_against_a_broken_sampler(two_sample_setup):
  pcfg, dcfg, params, dparams, prompts, lengths, ar = two_sample_setup
  bad = speculative.generate(
    params,
    dparams,
    pcfg,
    dcfg,
    prompts,
    lengths,
    jax.random.key(1),
    max_new_tokens=3,
    temperature=1.0,
    num_draft=2,
    sampler=broken_rejection_sample,
  )
  assert _two_sample_pvalue(ar.tokens, bad.tokens) < 1e-6


def test_plain_steps_then_drafting_sample_the_same_distribution(two_sample_setup):
  """Adaptive G's rounds in a fixed order: two plain steps (G = 0, the EAGLE-3 draft left
  behind, a window of 1 so one entry is skipped), then the draft's take-in and a G = 2 round:
  the sampled 4-token completions follow the AR distribution (and the two-sample test has power
  against the broken sampler in the same schedule)."""
  pcfg, dcfg, params, dparams, prompts, lengths, _ = two_sample_setup
  N = 4
  ar = autoregressive.generate(
    params, pcfg, prompts, lengths, jax.random.key(0), max_new_tokens=N, temperature=1.0
  )
  spec = speculative.Spec(pcfg, dcfg, N, 2, True, Sampling(1.0, 0, 1.0), window=1)

  @functools.partial(jax.jit, static_argnames="sampler")
  def scheduled(key, sampler):
    c = speculative.init(params, dparams, prompts, lengths, key, spec=spec)
    for G in (0, 0, 2):
      c = speculative.one_round(params, dparams, c, G=G, spec=spec, sampler=sampler)
    return c

  c = scheduled(jax.random.key(1), rejection.rejection_sample)
  assert bool(c["done"].all()) and float((c["skipped"] == 1).mean()) > 0.5  # some rows end early
  gen = speculative.finish(c, spec)
  st = jax.device_get(gen.stats)
  assert 0.1 < st["accept_counts"][0] / st["reach_counts"][0] < 0.95
  assert _two_sample_pvalue(ar.tokens, gen.tokens) > 1e-3
  bad = speculative.finish(scheduled(jax.random.key(1), broken_rejection_sample), spec)
  assert _two_sample_pvalue(ar.tokens, bad.tokens) < 1e-6


# ----------------------------------------------------------------------------- sampling settings

SETTINGS = [
  Sampling(0.7, 0, 1.0),  # temperature only
  Sampling(1.0, 3, 1.0),  # top-k
  Sampling(1.0, 0, 0.8),  # top-p
  Sampling(1.3, 4, 0.9),  # all three
]
# `make test` runs the setting with all three knobs; `make test-slow` (and CI) each knob alone
SETTING_PARAMS = [pytest.param(s, marks=pytest.mark.slow) for s in SETTINGS[:3]] + [SETTINGS[3]]


def test_processed_logits_by_hand():
  logits = jnp.log(jnp.array([0.5, 0.3, 0.15, 0.05]))
  keep = lambda *a: np.asarray(probs_at(logits, *a)) > 0
  np.testing.assert_array_equal(keep(1.0, 2), [1, 1, 0, 0])
  np.testing.assert_array_equal(keep(1.0, 0, 0.7), [1, 1, 0, 0])  # mass before 0.15 is 0.8
  np.testing.assert_array_equal(keep(1.0, 0, 0.5), [1, 0, 0, 0])  # mass before 0.3 is 0.5
  np.testing.assert_array_equal(keep(1.0, 3, 0.95), [1, 1, 1, 0])
  np.testing.assert_allclose(probs_at(logits, 1.0, 2), [0.625, 0.375, 0, 0], rtol=1e-6)
  # temperature first: at T = 2 the probabilities flatten before top-p reads them
  flat = np.sqrt([0.5, 0.3, 0.15, 0.05])
  np.testing.assert_allclose(probs_at(logits, 2.0), flat / flat.sum(), rtol=1e-6)
  # ties at the cut are kept, so the set never depends on the order of equal logits
  np.testing.assert_array_equal(np.asarray(probs_at(jnp.zeros(4), 1.0, 2)) > 0, [1, 1, 1, 1])
  # the behaviour log-prob is of the distribution sampled
  lp = logprob_at(logits[None], jnp.array([1]), 1.0, 2)
  np.testing.assert_allclose(lp, [np.log(0.375)], rtol=1e-6)


@pytest.mark.parametrize("setting", SETTING_PARAMS, ids=lambda s: f"T{s[0]}_k{s[1]}_p{s[2]}")
def test_sd_and_ar_sample_the_same_truncated_distribution(two_sample_setup, setting):
  """Losslessness under each sampling setting: SD rows and AR rows are one distribution, and
  that distribution is not the untruncated one at temperature 1 (the setting took effect)."""
  pcfg, dcfg, params, dparams, prompts, lengths, ar_t1 = two_sample_setup
  prompts, lengths = prompts[:12_000], lengths[:12_000]  # 4 settings: fewer rows each
  kw = dict(max_new_tokens=3, temperature=setting[0], top_k=setting[1], top_p=setting[2])
  ar = autoregressive.generate(params, pcfg, prompts, lengths, jax.random.key(2), **kw)
  sd = speculative.generate(
    params, dparams, pcfg, dcfg, prompts, lengths, jax.random.key(3), num_draft=2, **kw
  )
  assert _two_sample_pvalue(ar.tokens, sd.tokens) > 1e-3
  assert _two_sample_pvalue(ar.tokens, ar_t1.tokens) < 1e-6
  assert_behaviour_logprobs(params, pcfg, prompts, lengths, sd, setting)
  assert np.all(np.isfinite(np.asarray(sd.logprobs)))


def assert_behaviour_logprobs(params, pcfg, prompts, lengths, gen, setting, rows=64):
  """The first `rows` rows' behaviour log-probs (3-token prompts, 3 new tokens) are of the
  sampled distribution, recomputed from a full forward."""
  few = gen._replace(
    tokens=gen.tokens[:rows], logprobs=gen.logprobs[:rows], lengths=gen.lengths[:rows]
  )
  batch = join_prompt_completion(prompts[:rows], lengths[:rows], few)
  logits, _ = pol.forward(params, pcfg, batch["tokens"], batch["positions"], batch["segment_ids"])
  want = logprob_at(logits[:, 2:5], gen.tokens[:rows], *setting)
  valid = np.arange(3)[None] < np.asarray(gen.lengths[:rows])[:, None]
  got = np.asarray(gen.logprobs[:rows])
  np.testing.assert_allclose(got[valid], np.asarray(want)[valid], rtol=1e-4, atol=1e-4)


def test_training_logprobs_use_the_rollout_distribution():
  """The RL loss's log pi (sequence.next_token_scores, vocabulary in chunks) is the rollouts'
  behaviour distribution: the ratio is exactly what was sampled, with finite gradients."""
  from specdraft.train import sequence

  pcfg, _, params, _ = small_models(V=16)
  tokens = jax.random.randint(jax.random.key(4), (2, 12), 3, 16)
  pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
  seg = jnp.ones((2, 12), jnp.int32)
  logits, _ = pol.forward(params, pcfg, tokens, pos, seg)
  nxt = jnp.concatenate([tokens[:, 1:], tokens[:, :1]], 1)
  for setting in SETTINGS:
    h, _ = pol.hidden(params, pcfg, tokens, pos, seg)
    lp, ent, _ = sequence.next_token_scores(params, pcfg, h, nxt, vocab_chunk=4, sampling=setting)
    want = logprob_at(logits, nxt, *setting)
    fin = np.asarray(want) > -1e3  # tokens outside the kept set: MASKED, finite
    np.testing.assert_allclose(np.asarray(lp)[fin], np.asarray(want)[fin], rtol=1e-5, atol=1e-5)
    assert np.all(np.isfinite(np.asarray(lp))) and np.all(np.isfinite(np.asarray(ent)))
    g = jax.grad(
      lambda th: jnp.sum(
        jnp.where(
          fin,
          sequence.next_token_scores(th, pcfg, h, nxt, vocab_chunk=4, sampling=setting)[0],
          0.0,
        )
      )
    )(params)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(g))


def test_num_draft_sweep_times_every_g_against_one_baseline():
  """The G sweep decodes exactly as direct SD calls at each G (same keys), shares one AR
  baseline, and names the fastest G."""
  from specdraft.decode.compare import decoding_figures, sweep_num_draft

  pcfg, dcfg, params, dparams = small_models()
  prompts = jnp.asarray(np.random.default_rng(0).integers(3, 16, (4, 5)), jnp.int32)
  lengths = jnp.asarray([5, 3, 4, 2], jnp.int32)
  out = sweep_num_draft(
    params, dparams, pcfg, dcfg, prompts, lengths,
    max_new_tokens=12, num_drafts=(1, 3), temperature=1.0, repeats=2, seed=7,
  )  # fmt: skip
  assert out["num_drafts"] == [1, 3] and set(out["by_num_draft"]) == {"1", "3"}
  ar_rates = {r["ar_tokens_per_s"] for r in out["by_num_draft"].values()}
  assert len(ar_rates) == 1  # one AR baseline for every G
  for G in (1, 3):
    r = out["by_num_draft"][str(G)]
    assert r["num_draft"] == G and len(r["speedup_per_repeat"]) == 2
    assert 1.0 <= r["tau"] <= G + 1 and len(r["accept_per_position"]) == G
    direct = [
      decoding_figures(
        speculative.generate(
          params, dparams, pcfg, dcfg, prompts, lengths, jax.random.key(7 + 1 + rep),
          max_new_tokens=12, temperature=1.0, num_draft=G,
        )
      )["tau"]
      for rep in range(2)
    ]  # fmt: skip
    assert r["tau"] == pytest.approx(float(np.median(direct)))
  best = max(out["by_num_draft"].values(), key=lambda r: r["speedup"])
  assert out["best_num_draft"] == best["num_draft"] and out["best_speedup"] == best["speedup"]


def test_timing_repeats_short_calls_to_a_minimum_time():
  """With min_seconds a sample repeats its call (same key, same tokens) until the calls add up
  to that time, and its rate counts every call's tokens; bad settings fail before any call."""
  from specdraft.decode.compare import time_side_by_side

  pcfg, _, params, _ = small_models()
  prompts = jnp.asarray(np.random.default_rng(0).integers(3, 16, (2, 4)), jnp.int32)
  lengths = jnp.asarray([4, 2], jnp.int32)
  calls = []

  def ar(key, t):
    calls.append(1)
    return autoregressive.generate(
      params, pcfg, prompts, lengths, key, temperature=t, max_new_tokens=6
    )

  _, one = time_side_by_side({"ar": ar}, temperature=1.0, repeats=2)
  assert [s["calls"] for s in one["ar"]] == [1, 1] and len(calls) == 3
  _, many = time_side_by_side({"ar": ar}, temperature=1.0, repeats=1, min_seconds=0.2)
  (s,) = many["ar"]
  assert s["calls"] > 1 and s["tokens"] == one["ar"][0]["tokens"]
  assert s["tokens_per_s"] * 0.2 <= s["tokens"] * s["calls"] * (1 + 1e-9)
  with pytest.raises(ValueError, match="min_seconds=-1"):
    time_side_by_side({"ar": ar}, temperature=1.0, repeats=1, min_seconds=-1.0)
  with pytest.raises(ValueError, match="repeats=0"):
    time_side_by_side({"ar": ar}, temperature=1.0, repeats=0)
