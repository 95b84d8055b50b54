"""Greedy SD == greedy AR token for token, fast enough for the everyday suite.

A tiny random policy and a draft distilled from it in-test for a few dozen steps, so that greedy
drafts are partly accepted: the test asserts that drafts were both accepted and rejected, that rows
stop at EOS at different lengths and that some rows run to the end, so it cannot pass vacuously.
(tests/test_trained_sd.py checks the same on a policy trained on the task, in the slow suite.)
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from specdraft.decode import autoregressive, speculative
from specdraft.decode.sampling import join_prompt_completion
from specdraft.model import dflash, drafts, eagle3
from specdraft.model import policy as pol
from specdraft.tasks.tokenizer import EOS
from specdraft.train import draft as draft_lib
from specdraft.train import sequence
from specdraft.train.spec import StepSpec

V, N = 16, 14  # vocabulary, new tokens per row


def _draft_config(kind, pcfg):
  if kind == "eagle3":
    return eagle3.DraftConfig(
      d_model=32,
      vocab_size=V,
      n_taps=len(pcfg.taps),
      n_heads=2,
      n_kv_heads=1,
      head_dim=16,
      d_ff=64,
      ttt_steps=3,
    )
  # block drafts: 4 proposals a round (dflash: block of 5, slot 0 is the anchor; dspark: 4)
  return dflash.BlockDraftConfig(
    kind=kind,
    d_model=32,
    vocab_size=V,
    n_taps=len(pcfg.taps),
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    d_ff=64,
    block_size=5 if kind == "dflash" else 4,
    markov_rank=8,
  )


def _policy_and_prompts():
  """A tiny random policy with decided greedy choices, prompts of different lengths and its
  greedy AR rows (the reference every greedy test compares with)."""
  pcfg = pol.PolicyConfig(
    vocab_size=V,
    d_model=32,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    d_ff=64,
    init_std=0.3,  # spread-out logits: clear greedy choices that depend on the context
  )
  params = pol.init_params(pcfg, 0)
  params["embed"] = params["embed"].at[EOS].multiply(1.3)  # EOS wins in some contexts
  rng = np.random.default_rng(0)
  B, P = 12, 6
  lengths = rng.integers(2, P + 1, B).astype(np.int32)  # prompts of different lengths
  prompts = np.where(np.arange(P)[None] < lengths[:, None], rng.integers(3, V, (B, P)), 0)
  prompts[:, 0] = 1  # BOS
  prompts, lengths = jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths)
  ar = autoregressive.generate(
    params, pcfg, prompts, lengths, jax.random.key(0), max_new_tokens=N, temperature=0.0
  )
  return pcfg, params, prompts, lengths, ar


@pytest.fixture(scope="module")
def policy_setup():
  return _policy_and_prompts()


# DSpark's run (the DFlash path plus its Markov head) is in `make test-slow`; CI runs both suites.
@pytest.fixture(
  scope="module", params=["eagle3", "dflash", pytest.param("dspark", marks=pytest.mark.slow)]
)
def setup(request):
  pcfg, params, prompts, lengths, ar = _policy_and_prompts()
  dcfg = _draft_config(request.param, pcfg)
  # Distil the draft on the policy's own greedy rows (the TTT targets are the policy's logits).
  batch = join_prompt_completion(prompts, lengths, ar)
  batch["loss_mask"] = batch["segment_ids"].astype(jnp.float32)
  dparams = drafts.init_params(dcfg, 1, params, pcfg)
  tx = optax.adam(1e-2)
  st = {"step": 0, "params": dparams, "opt_state": tx.init(dparams)}
  laid = sequence.zigzag_order(batch, 1)
  spec = StepSpec.of(pcfg, dcfg, tx=tx)
  step = jax.jit(lambda s: draft_lib.draft_train_step(s, params, laid, spec))
  for _ in range(40):
    st, _ = step(st)
  return pcfg, dcfg, params, st["params"], prompts, lengths, ar, batch


def test_greedy_ar_rows_are_decided_and_varied(setup):
  """The precondition: every greedy choice wins by a margin float32 reordering cannot close (so
  SD's verification pass must pick the same tokens on any CPU), and rows end differently."""
  pcfg, _, params, _, prompts, lengths, ar, batch = setup
  logits, _ = pol.forward(params, pcfg, batch["tokens"], batch["positions"], batch["segment_ids"])
  top2 = jax.lax.top_k(logits, 2)[0]
  margin = np.asarray(top2[..., 0] - top2[..., 1])
  # position t predicts token t + 1: the completion's tokens are predicted at plen-1 .. plen+n-2
  for b in range(len(lengths)):
    p, n = int(lengths[b]), int(ar.lengths[b])
    assert margin[b, p - 1 : p + n - 1].min() > 1e-3, (b, margin[b, p - 1 : p + n - 1].min())
  toks, n = np.asarray(ar.tokens), np.asarray(ar.lengths)
  ended = np.array([EOS in t for t in toks])
  assert ended.any() and (~ended).any(), n  # some rows stop at EOS, some run to N
  assert len(set(n[ended].tolist())) > 1, n  # ... at different lengths


@pytest.mark.parametrize("G", [1, 2, 4])
def test_greedy_sd_equals_greedy_ar_token_for_token(setup, G):
  pcfg, dcfg, params, dparams, prompts, lengths, ar, _ = setup
  sd = speculative.generate(
    params,
    dparams,
    pcfg,
    dcfg,
    prompts,
    lengths,
    jax.random.key(0),
    max_new_tokens=N,
    temperature=0.0,
    num_draft=G,
  )
  np.testing.assert_array_equal(np.asarray(sd.tokens), np.asarray(ar.tokens))
  np.testing.assert_array_equal(np.asarray(sd.lengths), np.asarray(ar.lengths))
  # Log-probs: the verification pass (G + 1 positions at once) and one-token decoding sum in
  # different orders, so only a tolerance that float32 reordering cannot break (scaled with the
  # value, with a floor near 0); tokens above are exact.
  np.testing.assert_allclose(sd.logprobs, ar.logprobs, rtol=1e-4, atol=1e-4)
  st = jax.device_get(sd.stats)
  assert st["accept_counts"][0] > 0, st  # some drafts accepted ...
  assert st["accept_counts"][0] < st["reach_counts"][0], st  # ... and some rejected
  assert st["policy_passes"] < int(ar.stats["policy_passes"]), st


def test_rows_stop_at_the_policys_own_eos_id(setup):
  """`PolicyConfig.eos_id` (a pretrained tokenizer's EOS): AR and SD rows stop at that token, not
  at the character tokenizer's, and greedy SD still equals greedy AR token for token."""
  pcfg, dcfg, params, dparams, prompts, lengths, ar, _ = setup
  toks = np.asarray(ar.tokens)
  # the token the rows write most before their end, other than EOS: it ends them early now
  inside = np.concatenate([t[: max(int(n) - 1, 0)] for t, n in zip(toks, np.asarray(ar.lengths))])
  counts = np.bincount(inside[inside != EOS], minlength=V)
  stop = int(np.argmax(counts))
  cfg = dataclasses.replace(pcfg, eos_id=stop)
  gen = dict(max_new_tokens=N, temperature=0.0)
  ar2 = autoregressive.generate(params, cfg, prompts, lengths, jax.random.key(0), **gen)
  sd2 = speculative.generate(
    params, dparams, cfg, dcfg, prompts, lengths, jax.random.key(0), num_draft=2, **gen
  )
  n2 = np.asarray(ar2.lengths)
  for row, n_old, n_new, t_new in zip(toks, np.asarray(ar.lengths), n2, np.asarray(ar2.tokens)):
    hits = np.flatnonzero(row[:n_old] == stop)
    if len(hits):  # the same greedy row, cut at its first `stop`
      assert n_new == hits[0] + 1 and (t_new[:n_new] == row[:n_new]).all()
    else:  # the old EOS no longer stops it: the same row, then on
      assert n_new >= n_old and (t_new[:n_old] == row[:n_old]).all()
  assert (n2 < np.asarray(ar.lengths)).any()  # the new stop token ended some rows earlier
  np.testing.assert_array_equal(np.asarray(sd2.tokens), np.asarray(ar2.tokens))
  np.testing.assert_array_equal(np.asarray(sd2.lengths), n2)
  # `stop_ids` (a checkpoint's other EOS ids): the rows stop at EOS or at `stop`, whichever first
  cfg3 = dataclasses.replace(pcfg, stop_ids=(stop,))
  ar3 = autoregressive.generate(params, cfg3, prompts, lengths, jax.random.key(0), **gen)
  sd3 = speculative.generate(
    params, dparams, cfg3, dcfg, prompts, lengths, jax.random.key(0), num_draft=2, **gen
  )
  for row, n_old, n_new in zip(toks, np.asarray(ar.lengths), np.asarray(ar3.lengths)):
    hits = np.flatnonzero(row[:n_old] == stop)
    assert n_new == (hits[0] + 1 if len(hits) else n_old)
  np.testing.assert_array_equal(np.asarray(sd3.tokens), np.asarray(ar3.tokens))
  np.testing.assert_array_equal(np.asarray(sd3.lengths), np.asarray(ar3.lengths))


def _adaptive_choice(M: int, slope: float):
  """round_seconds growing linearly in G: with the confident prior of `_PRIOR` the first rounds
  draft G_max, and the draft's real acceptance then moves the choice (the tests assert that
  several G were chosen)."""
  return np.asarray([1.0 + slope * g for g in range(M + 1)], np.float32)


def _prior(M: int):
  from specdraft.decode import cost

  return cost.Acceptance.prior(M, rate=0.97, weight=1.0)


def _flat_cost(pcfg, dcfg, slope: float):
  """A cost model whose round seconds do not depend on the rows (so every bucket chooses alike:
  compaction then leaves even an adaptive run's sampled tokens unchanged)."""
  from specdraft.decode import cost

  class Flat(cost.CostModel):
    def round_seconds_all(self, rows, num_draft_max, capacity, plain=True):
      return _adaptive_choice(num_draft_max, slope)

  return Flat(cost.Machine(1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0), pcfg, dcfg)


def _priced_cost(pcfg, dcfg, prices: dict, plain_zero: dict | None = None):
  """A cost model whose round seconds at G = 0..3 are `prices[rows]` (None: every row count);
  a plain G = 0 step (no later stage drafts) costs `plain_zero[rows]` where given."""
  from specdraft.decode import cost

  class Priced(cost.CostModel):
    def round_seconds_all(self, rows, num_draft_max, capacity, plain=True):
      rs = np.asarray(prices.get(rows, prices.get(None)), np.float32)
      if plain and plain_zero and rows in plain_zero:
        rs = np.concatenate([np.float32([plain_zero[rows]]), rs[1:]])
      return rs

  return Priced(cost.Machine(1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0), pcfg, dcfg)


def test_compacted_ar_keeps_greedy_and_sampled_tokens(policy_setup):
  """AR through the engine (finished rows compacted into buckets 12, 8, 4): greedy gives the AR
  tokens exactly with fewer row-passes; sampled gives every row the tokens of the single loop."""
  from specdraft.decode import engine

  pcfg, params, prompts, lengths, ar = policy_setup
  run = lambda t, compact, key: engine.generate(
    params, None, pcfg, None, prompts, lengths, key, max_new_tokens=N, temperature=t,
    num_draft=0, compact=compact, min_rows=4,
  )  # fmt: skip
  gen = run(0.0, True, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(gen.tokens), np.asarray(ar.tokens))
  np.testing.assert_array_equal(np.asarray(gen.lengths), np.asarray(ar.lengths))
  st = jax.device_get(gen.stats)
  assert st["row_passes"] < st["policy_passes"] * len(lengths), st
  a, b = run(1.0, True, jax.random.key(5)), run(1.0, False, jax.random.key(5))
  ref = autoregressive.generate(
    params, pcfg, prompts, lengths, jax.random.key(5), max_new_tokens=N, temperature=1.0
  )
  for g in (a, b):
    np.testing.assert_array_equal(np.asarray(g.tokens), np.asarray(ref.tokens))
    np.testing.assert_array_equal(np.asarray(g.lengths), np.asarray(ref.lengths))
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(ref.logprobs), rtol=1e-5, atol=1e-6)
  assert len(set(np.asarray(a.lengths).tolist())) > 1  # rows ended at different steps


def test_every_stage_compiles_what_any_later_call_runs(policy_setup):
  """`every_stage` (a benchmark's warm-up) runs and compiles every bucket's stage and the end of a
  rollout from every bucket (a later call whose rows all finish early ends from there), with the
  same output; later calls with other keys compile nothing. (Two new tokens: every row finishes
  in the first stage, so a plain call compiles no later stage and ends from the first bucket.)"""
  from specdraft.decode import engine

  pcfg, params, prompts, lengths, ar = policy_setup
  kw = dict(max_new_tokens=2, num_draft=0, compact=True, min_rows=1)  # buckets 12, 8, .., 1
  run = lambda key, t, every: engine.generate(
    params, None, pcfg, None, prompts, lengths, key, temperature=t, every_stage=every, **kw
  )
  stages = engine._next_stage._cache_size()
  plain = run(jax.random.key(0), 0.0, False)
  assert engine._next_stage._cache_size() == stages
  ends = engine._end._cache_size()
  warm = run(jax.random.key(0), 0.0, True)
  n = len(engine.buckets(len(lengths), 1))
  assert engine._next_stage._cache_size() - stages == n - 1
  assert engine._end._cache_size() - ends == n - 1  # every bucket's but the first's (plain's)
  np.testing.assert_array_equal(np.asarray(warm.tokens), np.asarray(plain.tokens))
  np.testing.assert_array_equal(np.asarray(warm.tokens), np.asarray(ar.tokens)[:, :2])
  before = engine._next_stage._cache_size(), engine._end._cache_size()
  for seed in range(3):
    run(jax.random.key(seed), 0.0, False)
  assert (engine._next_stage._cache_size(), engine._end._cache_size()) == before


@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_compaction_and_adaptive_g_keep_greedy_ar_tokens(setup, mode):
  """Greedy decoding through the engine (finished rows compacted into power-of-two buckets; with
  `adaptive`, G in 0..3 chosen per round) gives the AR tokens exactly."""
  from specdraft.decode import engine

  pcfg, dcfg, params, dparams, prompts, lengths, ar, _ = setup
  kw = dict(max_new_tokens=N, temperature=0.0, compact=True, min_rows=4)  # buckets 12, 8, 4
  gen = engine.generate(
    params,
    dparams,
    pcfg,
    dcfg,
    prompts,
    lengths,
    jax.random.key(0),
    num_draft=3,
    adaptive=mode == "adaptive",
    cost=_flat_cost(pcfg, dcfg, 0.3),
    prior=_prior(3),
    **kw,
  )
  np.testing.assert_array_equal(np.asarray(gen.tokens), np.asarray(ar.tokens))
  np.testing.assert_array_equal(np.asarray(gen.lengths), np.asarray(ar.lengths))
  st = jax.device_get(gen.stats)
  # compaction ran: fewer row-passes than full-batch passes (rows end at different lengths)
  assert st["row_passes"] < st["policy_passes"] * len(lengths), st
  if mode == "adaptive":
    assert np.count_nonzero(st["num_draft_counts"]) >= 2, st["num_draft_counts"]
    trace = st["num_draft_trace"][: st["rounds"]]
    assert (trace >= 0).all() and np.bincount(trace, minlength=4).tolist() == st[
      "num_draft_counts"
    ].tolist()


@pytest.mark.parametrize("mode", ["fixed", "adaptive"])
def test_compaction_keeps_every_rows_sampled_tokens(setup, mode):
  """Sampled decoding: the same key gives every row the same tokens with and without compaction
  (each row draws from its own key), and the engine without compaction is `generate` itself."""
  from specdraft.decode import engine

  pcfg, dcfg, params, dparams, prompts, lengths, _, _ = setup
  G = 3
  kw = dict(max_new_tokens=N, temperature=1.0, num_draft=G, adaptive=mode == "adaptive", min_rows=4)
  kw.update(cost=_flat_cost(pcfg, dcfg, 0.3), prior=_prior(G))
  run = lambda compact: engine.generate(
    params, dparams, pcfg, dcfg, prompts, lengths, jax.random.key(5), compact=compact, **kw
  )
  a, b = run(True), run(False)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.lengths), np.asarray(b.lengths))
  np.testing.assert_allclose(np.asarray(a.logprobs), np.asarray(b.logprobs), rtol=1e-5, atol=1e-6)
  assert len(set(np.asarray(a.lengths).tolist())) > 1  # rows ended at different rounds
  if mode == "fixed":
    ref = speculative.generate(
      params,
      dparams,
      pcfg,
      dcfg,
      prompts,
      lengths,
      jax.random.key(5),
      max_new_tokens=N,
      temperature=1.0,
      num_draft=G,
    )
    np.testing.assert_array_equal(np.asarray(b.tokens), np.asarray(ref.tokens))


def _staged_greedy_is_ar(setup, cost, prior) -> dict:
  """Greedy decoding with G chosen per stage (buckets 12, 8, 4) gives AR's tokens and lengths
  exactly; returns its stats."""
  from specdraft.decode import engine

  pcfg, dcfg, params, dparams, prompts, lengths, ar, _ = setup
  gen = engine.generate(
    params, dparams, pcfg, dcfg, prompts, lengths, jax.random.key(0), max_new_tokens=N,
    temperature=0.0, num_draft=3, adaptive=True, per_stage=True, cost=cost, prior=prior,
    compact=True, min_rows=4,
  )  # fmt: skip
  np.testing.assert_array_equal(np.asarray(gen.tokens), np.asarray(ar.tokens))
  np.testing.assert_array_equal(np.asarray(gen.lengths), np.asarray(ar.lengths))
  return jax.device_get(gen.stats)


def test_g_per_stage_keeps_greedy_ar_tokens_across_every_g(setup):
  """auto_every = stage: the host plans one G per bucket (here 0 at 12 rows, 3 at 8, 1 at 4) and
  each stage runs a fixed loop at it on the carry the last stage left (buffers sized by G_max;
  through a G = 0 stage the draft takes in every token, so it drafts in step afterwards): greedy
  output is AR's token for token, every round ran at its stage's planned G, and the draft's
  proposals after the G = 0 stage are accepted about as often as a fixed loop's."""
  from specdraft.decode import engine

  pcfg, dcfg, params, dparams, prompts, lengths, ar, _ = setup
  # deeper rounds cost more the more rows ride in them (with `_prior`'s rate 0.97)
  prices = {12: [1, 5, 9, 13], 8: [1, 1.1, 1.2, 1.3], 4: [1, 1.5, 10, 10]}
  cost, prior = _priced_cost(pcfg, dcfg, prices), _prior(3)
  spec = speculative.Spec(pcfg, dcfg, N, 3, True, None)
  assert engine.stage_plan(cost, prior, [12, 8, 4], spec, 99) == {12: 0, 8: 3, 4: 1}
  st = _staged_greedy_is_ar(setup, cost, prior)
  trace = st["num_draft_trace"][: st["rounds"]]
  # every round ran its stage's planned G: a stage runs while more rows generate than the next
  # bucket holds
  active = st["active_trace"][: st["rounds"]]
  planned = np.where(active > 8, 0, np.where(active > 4, 3, 1))
  np.testing.assert_array_equal(trace, planned)
  assert st["num_draft_counts"][0] > 0 and st["num_draft_counts"][3] > 0, st["num_draft_counts"]
  # the draft is in step after the G = 0 stage: its first proposals are accepted about as often
  # as a fixed G = 3 loop's over the whole rollout (a draft left behind would propose for the
  # wrong positions and be accepted about never)
  fixed = jax.device_get(
    engine.generate(
      params, dparams, pcfg, dcfg, prompts, lengths, jax.random.key(0), max_new_tokens=N,
      temperature=0.0, num_draft=3, compact=True, min_rows=4,
    ).stats
  )  # fmt: skip
  rate = lambda s: s["accept_counts"][0] / max(s["reach_counts"][0], 1)
  assert rate(fixed) > 0.2 and rate(st) > 0.5 * rate(fixed), (rate(st), rate(fixed))


def test_g_per_stage_leaves_the_draft_behind_once_no_stage_drafts_again(setup):
  """A G = 0 stage after which no stage drafts is priced as a plain step (planned from the
  smallest bucket up: here 4 and 8 rows choose G = 0 only at the plain price, 12 rows G = 3) and
  runs as one (`Spec.stage_plain`: the draft's cache and next logits are left as they were, no
  draft pass counted); greedy output is still AR's token for token."""
  from specdraft.decode import engine
  from specdraft.decode.sampling import Sampling

  pcfg, dcfg, params, dparams, prompts, lengths, ar, _ = setup
  prices = {12: [1, 1.1, 1.2, 1.3], 8: [2, 1.5, 10, 10], 4: [2, 1.5, 10, 10]}
  prior = _prior(3)
  spec = speculative.Spec(pcfg, dcfg, N, 3, True, None)
  with_draft = engine.stage_plan(_priced_cost(pcfg, dcfg, prices), prior, [12, 8, 4], spec, 99)
  assert with_draft == {12: 3, 8: 1, 4: 1}, with_draft  # G = 0 at a draft pass's price loses
  cost = _priced_cost(pcfg, dcfg, prices, plain_zero={8: 0.5, 4: 0.5, 12: 0.5})
  plan = engine.stage_plan(cost, prior, [12, 8, 4], spec, 99)
  assert plan == {12: 3, 8: 0, 4: 0}, plan
  assert engine.plain_stages(plan) == {8, 4}
  assert engine.plain_stages({12: 0, 8: 3, 4: 0}) == {4}
  st = _staged_greedy_is_ar(setup, cost, prior)
  assert st["num_draft_counts"][0] > 0 and st["num_draft_counts"][3] > 0, st["num_draft_counts"]
  # one round of a plain stage on a fresh carry: the draft's state is untouched (a block draft's
  # G = 0 round runs no draft pass in any case: the same round either way)
  fixed = speculative.Spec(pcfg, dcfg, N, 3, False, Sampling(0.0, 0, 1.0), stage_G=0)
  carry = jax.jit(lambda *a: speculative.init(*a, spec=fixed))(
    params, dparams, prompts, lengths, jax.random.key(0)
  )
  step = lambda sp: jax.jit(  # noqa: E731
    lambda c: speculative.one_round(params, dparams, c, G=0, spec=sp)
  )(carry)
  plain, kept = step(fixed._replace(stage_plain=True)), step(fixed)
  np.testing.assert_array_equal(np.asarray(plain["out"]), np.asarray(kept["out"]))
  draft_state = lambda c: jax.tree.leaves((c["dcache"], c["q_logits"], c["h"]))  # noqa: E731
  if drafts.is_block(dcfg):
    same = lambda c: {k: v for k, v in c.items() if k != "key"}  # noqa: E731 (keys: typed)
    for a, b in zip(jax.tree.leaves(same(plain)), jax.tree.leaves(same(kept))):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jnp.array_equal(jax.random.key_data(plain["key"]), jax.random.key_data(kept["key"]))
  else:
    for a, b in zip(draft_state(plain), draft_state(carry)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    passes = lambda c: int(c["stats"]["draft_passes"])  # noqa: E731
    assert passes(plain) == passes(carry) and passes(kept) == passes(carry) + 1
    assert not np.array_equal(np.asarray(kept["q_logits"]), np.asarray(carry["q_logits"]))
  with pytest.raises(ValueError, match="only a G = 0 stage skips the draft"):
    speculative.run(
      params, dparams, carry, None, jnp.int32(0), spec=fixed._replace(stage_G=2, stage_plain=True)
    )


def test_g_per_stage_is_the_fixed_loop_at_the_planned_g(setup):
  """With prices that do not depend on the rows every stage plans the same G, and the sampled
  output is the fixed-G loop's at that G, token for token (same keys, same rounds; only the
  buffers are sized by G_max), with and without compaction."""
  from specdraft.decode import engine

  pcfg, dcfg, params, dparams, prompts, lengths, _, _ = setup
  cost, prior = _priced_cost(pcfg, dcfg, {None: [1, 1.5, 2, 10]}), _prior(3)
  plan = engine.stage_plan(
    cost, prior, [12, 8, 4], speculative.Spec(pcfg, dcfg, N, 3, True, None), 99
  )
  assert plan == {12: 2, 8: 2, 4: 2}, plan  # below G_max: the buffers are larger than G's loop's
  G = 2
  ref = speculative.generate(
    params, dparams, pcfg, dcfg, prompts, lengths, jax.random.key(5), max_new_tokens=N,
    temperature=1.0, num_draft=G,
  )  # fmt: skip
  for compact in (True, False):
    gen = engine.generate(
      params, dparams, pcfg, dcfg, prompts, lengths, jax.random.key(5), max_new_tokens=N,
      temperature=1.0, num_draft=3, adaptive=True, per_stage=True, cost=cost, prior=prior,
      compact=compact, min_rows=4,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(gen.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(
      np.asarray(gen.logprobs), np.asarray(ref.logprobs), rtol=1e-5, atol=1e-6
    )
    assert jax.device_get(gen.stats)["num_draft_counts"].tolist()[G] == int(gen.stats["rounds"])


def test_stage_timings_and_prices_learned_from_them(setup):
  """engine.generate(timings=): the prefill's record (timed apart), then one per stage run, in
  order, each stage after the first preceded by its step down's (timed apart too: no rounds, no
  price), with its bucket, planned G, its own rounds (the rounds the trace shows at that G),
  wall seconds, whether the call compiled (the first call does, a second with other keys not)
  and the seconds its plan priced the rounds at. Fed to StagePrices, a stage that cost far more
  than its price moves the next plan off its G; the output stays the fixed loop's at whatever G
  is planned (greedy: AR's tokens; sampled: the same tokens timed or not)."""
  from specdraft.decode import cost as cost_lib
  from specdraft.decode import engine

  pcfg, dcfg, params, dparams, prompts, lengths, ar, _ = setup
  cost, prior = _priced_cost(pcfg, dcfg, {None: [1, 1.5, 2, 10]}), _prior(3)
  spec = speculative.Spec(pcfg, dcfg, N, 3, True, None)
  run = lambda key, **kw: engine.generate(  # noqa: E731
    params, dparams, pcfg, dcfg, prompts, lengths, key, max_new_tokens=N, temperature=1.0,
    num_draft=3, adaptive=True, per_stage=True, cost=cost, prior=prior, compact=True,
    min_rows=4, **kw,
  )  # fmt: skip
  first = []
  run(jax.random.key(1), timings=first)  # the timed path's programs compile here ...
  assert first[0]["prefill"] and first[0]["compiled"] and first[1]["compiled"], first
  timings = []
  gen = run(jax.random.key(2), timings=timings)  # ... so this call compiles none
  untimed = run(jax.random.key(2))
  np.testing.assert_array_equal(np.asarray(gen.tokens), np.asarray(untimed.tokens))
  st = jax.device_get(gen.stats)
  pre, stages = timings[0], _stages(timings)
  assert pre["prefill"] and pre["rounds"] == 0 and pre["priced"] is None and pre["seconds"] > 0
  assert not pre["step_down"] and all(not r["prefill"] for r in timings[1:])
  assert [r["rows"] for r in stages] == [12, 8, 4][: len(stages)] and len(stages) >= 2
  assert all(r["G"] == 2 and not r["compiled"] and r["seconds"] > 0 for r in stages)
  assert not pre["compiled"]
  # stage, step down, stage, ...: each step down into the bucket of the stage after it
  kinds = [r["step_down"] for r in timings[1:]]
  assert kinds == [i % 2 == 1 for i in range(len(kinds))] and not kinds[-1], timings
  for down, nxt in zip(timings[2::2], timings[3::2]):
    assert down["rows"] == nxt["rows"] and down["rounds"] == 0 and down["priced"] is None
    assert down["G"] is None and down["seconds"] > 0 and not down["compiled"]
  assert sum(r["rounds"] for r in stages) == int(st["rounds"])
  assert all(r["priced"] == pytest.approx(r["rounds"] * 2.0) for r in stages)
  # the 8-row stage took three times its price: the next plan drafts G = 1 there, not 2
  plan = lambda prices: engine.stage_plan(cost, prior, [12, 8, 4], spec, 99, prices)  # noqa: E731
  slow = dict(stages[1], seconds=240.0, rounds=40, priced=80.0)
  prices = cost_lib.StagePrices(prior_rounds=4.0, keep=0.7).updated([slow])
  assert plan(None) == {12: 2, 8: 2, 4: 2}
  assert plan(prices) == {12: 2, 8: 1, 4: 2}
  # a rollout of that plan: each stage's record has its own G and exactly the rounds the trace
  # shows at it, in order
  mixed = []
  gen = run(jax.random.key(3), prices=prices, timings=mixed)
  st = jax.device_get(gen.stats)
  trace, at = st["num_draft_trace"][: st["rounds"]].tolist(), 0
  assert [r["G"] for r in _stages(mixed)] == [2, 1, 2][: len(_stages(mixed))]
  assert len(_stages(mixed)) >= 2
  for r in _stages(mixed):
    assert r["rounds"] > 0 and trace[at : at + r["rounds"]] == [r["G"]] * r["rounds"], mixed
    at += r["rounds"]
  assert at == len(trace)
  greedy = engine.generate(
    params, dparams, pcfg, dcfg, prompts, lengths, jax.random.key(0), max_new_tokens=N,
    temperature=0.0, num_draft=3, adaptive=True, per_stage=True, cost=cost, prior=prior,
    compact=True, min_rows=4, prices=prices,
  )  # fmt: skip
  np.testing.assert_array_equal(np.asarray(greedy.tokens), np.asarray(ar.tokens))
  # AR through the engine records its stages too (G = 0, no plan, no price)
  ar_times = []
  engine.generate(
    params, None, pcfg, None, prompts, lengths, jax.random.key(2), max_new_tokens=N,
    temperature=1.0, num_draft=0, compact=True, min_rows=4, timings=ar_times,
  )  # fmt: skip
  assert ar_times[0]["prefill"] and len(ar_times) >= 2
  assert all(r["G"] == 0 and r["priced"] is None for r in _stages(ar_times))
  assert sum(r["step_down"] for r in ar_times) == len(_stages(ar_times)) - 1


def _stages(timings: list[dict]) -> list[dict]:
  """The stages' records among engine.generate's timings (not the prefill, not a step down)."""
  return [r for r in timings if not (r["prefill"] or r["step_down"])]


def _scheduled(setup, schedule, *, window: int, record=None):
  """Greedy rounds at the G of `schedule` in turn (repeated until every row is done) on an
  adaptive carry, so G = 0 rounds are plain policy steps that leave an EAGLE-3 draft behind.
  `record(carry)` sees the carry after every round. Returns (Generation, last carry, the G of
  every round run)."""
  from specdraft.decode.sampling import Sampling

  pcfg, dcfg, params, dparams, prompts, lengths, _, _ = setup
  spec = speculative.Spec(pcfg, dcfg, N, max(schedule), True, Sampling(0.0, 0, 1.0), window)
  carry = jax.jit(lambda *a: speculative.init(*a, spec=spec))(
    params, dparams, prompts, lengths, jax.random.key(0)
  )
  rounds = {
    G: jax.jit(lambda c, G=G: speculative.one_round(params, dparams, c, G=G, spec=spec))
    for G in set(schedule)
  }
  ran = []
  while not bool(carry["done"].all()):
    ran.append(schedule[len(ran) % len(schedule)])
    carry = rounds[ran[-1]](carry)
    if record:
      record(carry)
    assert len(ran) < 10 * N
  return speculative.finish(carry, spec), carry, np.asarray(ran)


# G = 0 streaks longer than the window (entries skipped), single drafting rounds between them
_SCHEDULE = [0, 0, 0, 0, 0, 3, 1, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 3, 3]


def test_any_schedule_of_g_keeps_greedy_ar_tokens(setup):
  """Rounds at any G in any order give the AR tokens exactly, with G = 0 streaks longer than the
  draft's catch-up window (EAGLE-3: every row's draft slots + skipped + pending = the policy's
  length after every round, entries were skipped, and drafts after the streaks are accepted)."""
  pcfg, dcfg, _, _, _, _, ar, _ = setup
  skipped = []

  def record(c):
    if "pend_len" in c:
      total = c["dcache"].lengths + c["skipped"] + c["pend_len"]
      np.testing.assert_array_equal(np.asarray(total), np.asarray(c["pcache"].lengths))
      skipped.append(int(c["skipped"].max()))

  gen, _, ran = _scheduled(setup, _SCHEDULE, window=3, record=record)
  np.testing.assert_array_equal(np.asarray(gen.tokens), np.asarray(ar.tokens))
  np.testing.assert_array_equal(np.asarray(gen.lengths), np.asarray(ar.lengths))
  st = jax.device_get(gen.stats)
  assert (ran == 0).sum() > 5 and (ran > 0).sum() > 2, ran
  assert st["accept_counts"][0] > 0, st
  if not drafts.is_block(dcfg):
    assert max(skipped) > 0, skipped  # the window was exceeded
    # plain steps ran no draft pass: the prefill, each drafting round's G passes and at most one
    # take-in before it
    assert st["draft_passes"] <= 1 + ran.sum() + (ran > 0).sum(), (st["draft_passes"], ran)


@pytest.mark.parametrize("setup", ["eagle3"], indirect=True)
def test_plain_steps_leave_the_draft_as_drafting_rounds_would(setup):
  """EAGLE-3 with a window no G = 0 streak exceeds: after plain steps and the draft's take-in, its
  cache holds the same entries (feature, next token, position) as when every round drafts. With a
  streak of 6 and a window of 3, the 3 oldest positions are left out and every later entry is
  the drafting run's at its position (slot + 3)."""
  _, lazy, _ = _scheduled(setup, [0, 0, 0, 2, 0, 1, 0, 0, 2], window=4)
  _, eager, _ = _scheduled(setup, [2], window=4)
  assert int(lazy["skipped"].max()) == 0
  n = np.minimum(np.asarray(lazy["dcache"].lengths), np.asarray(eager["dcache"].lengths))
  assert n.min() > 0
  for b in range(len(n)):
    for name in ("k", "v"):
      a = np.asarray(getattr(lazy["dcache"], name)[b, : n[b]])
      e = np.asarray(getattr(eager["dcache"], name)[b, : n[b]])
      np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-4 * np.abs(e).max())

  pcfg, dcfg, params, dparams, prompts, lengths, ar, _ = setup
  _, holes, _ = _scheduled(setup, [0] * 6 + [2] * 20, window=3)
  skipped = np.asarray(holes["skipped"])
  assert (skipped == 3).sum() >= 3, skipped  # rows still generating after the streak
  for b in np.flatnonzero(skipped == 3):
    p, m = int(lengths[b]), min(int(holes["dcache"].lengths[b]), int(n[b]) - 3)
    assert m > p, (p, m)
    a = np.asarray(holes["dcache"].k[b, p:m])
    e = np.asarray(eager["dcache"].k[b, p + 3 : m + 3])
    np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-4 * np.abs(e).max())


def test_a_g0_stage_keeps_the_eagle3_draft_where_a_prefill_would_put_it():
  """After k fixed-loop rounds at G = 0 (a stage that a drafting stage follows) the EAGLE-3
  draft's next proposal logits and hidden state are those a prefill over the prompt and the k
  tokens emitted so far computes: it took in every token, in step. A plain stage
  (`Spec.stage_plain`), which leaves the draft behind, does not match (the check can fail)."""
  from specdraft.decode.sampling import Sampling

  pcfg, params, prompts, lengths, _ = _policy_and_prompts()
  dcfg = _draft_config("eagle3", pcfg)
  dparams = drafts.init_params(dcfg, 1, params, pcfg)
  greedy, k = Sampling(0.0, 0, 1.0), 3
  stage = speculative.Spec(pcfg, dcfg, N, 3, False, greedy, stage_G=0)
  init = jax.jit(lambda p, n, sp: speculative.init(params, dparams, p, n, jax.random.key(0), spec=sp),
                 static_argnums=2)  # fmt: skip

  def after_k_rounds(spec):
    carry = init(prompts, lengths, spec)
    one = jax.jit(lambda c: speculative.one_round(params, dparams, c, G=0, spec=spec))
    for _ in range(k):
      carry = one(carry)
    return jax.device_get(carry)

  kept = after_k_rounds(stage)
  live = ~kept["done"] & (kept["out_len"] == k + 1)  # rows that emitted every token so far
  assert live.sum() >= 6, kept["out_len"]
  # the oracle's prompt: each row's prompt followed by the first k tokens it emitted
  lens = np.asarray(lengths)
  longer = np.zeros((prompts.shape[0], prompts.shape[1] + k), np.int32)
  for b in range(longer.shape[0]):
    longer[b, : lens[b]] = np.asarray(prompts)[b, : lens[b]]
    longer[b, lens[b] : lens[b] + k] = kept["out"][b, :k]
  ref = jax.device_get(init(jnp.asarray(longer), jnp.asarray(lens + k), stage))
  np.testing.assert_array_equal(kept["c"][live], ref["c"][live])
  np.testing.assert_array_equal(kept["out"][live, k], ref["c"][live])
  for name in ("q_logits", "h"):
    np.testing.assert_allclose(kept[name][live], ref[name][live], rtol=1e-4, atol=1e-4)
  behind = after_k_rounds(stage._replace(stage_plain=True))
  assert np.abs(behind["q_logits"][live] - ref["q_logits"][live]).max() > 1e-2
