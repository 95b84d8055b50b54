"""The round cost model (decode/cost.py), the adaptive choice of G and the compaction buckets."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from specdraft import config as config_lib
from specdraft.decode import cost, engine, speculative
from specdraft.decode.rejection import rejection_sample
from specdraft.decode.sampling import Sampling
from specdraft.model import drafts, eagle3
from specdraft.model import policy as pol


def _models(n_layers: int = 2):
  c = default.get_config("size=tiny")
  c.model.n_layers, c.model.tap_layers = n_layers, (0,)
  pcfg = pol.PolicyConfig.from_config(c.model, 64)
  dcfg = drafts.draft_config(c.draft, pcfg, 5)
  return pcfg, dcfg


def _compiled_flops(fn, *args) -> float:
  ca = jax.jit(fn).lower(*args).compile().cost_analysis()
  return float((ca[0] if isinstance(ca, list) else ca)["flops"])


@pytest.mark.parametrize("rows,tokens,capacity", [(4, 1, 64), (16, 6, 128)])
def test_counted_flops_match_the_compiled_programs(rows, tokens, capacity):
  """policy_work and draft_work count what XLA compiles (one policy layer: the compiler's count of
  a scanned stack is not per layer; the EAGLE-3 step as it drafts, on its own hidden state)."""
  pcfg, dcfg = _models(n_layers=1)
  params = pol.init_params(pcfg, 0)
  dparams = drafts.init_params(dcfg, 1, params, pcfg)
  tok = jnp.zeros((rows, tokens), jnp.int32)
  got = _compiled_flops(
    lambda c, t: pol.decode(params, pcfg, c, t)[0], pol.init_cache(pcfg, rows, capacity), tok
  )
  assert got == pytest.approx(cost.policy_work(pcfg, rows, tokens, capacity).flops, rel=0.05)
  feats = jnp.zeros((rows, tokens, pcfg.d_model))
  got = _compiled_flops(
    lambda c, f, t: eagle3.step(dparams, dcfg, params["embed"], c, f, t)[0],
    eagle3.init_cache(dcfg, rows, capacity),
    feats,
    tok,
  )
  fuse = 2 * dcfg.n_taps * pcfg.d_model**2 * tokens * rows if tokens > 1 else 0
  want = cost.draft_work(dcfg, rows, tokens, capacity).flops - fuse  # the step alone
  assert got == pytest.approx(want, rel=0.05)


def test_choose_num_draft_by_hand():
  """argmax_G E[a + 1 | G] / seconds(G), from the prior's and the generation's counts."""
  M = 3
  seconds = np.asarray([1.0, 1.2, 1.4, 1.6], np.float32)
  stats = lambda acc, reach: {
    "accept_counts": jnp.asarray(acc, jnp.int32),
    "reach_counts": jnp.asarray(reach, jnp.int32),
  }
  choice = lambda acc, reach: speculative.Choice(
    jnp.asarray(seconds), jnp.asarray(acc, jnp.float32), jnp.asarray(reach, jnp.float32)
  )
  zero = stats([0] * M, [0] * M)
  # every draft accepted: E = 1, 2, 3, 4 over 1, 1.2, 1.4, 1.6 -> G = 3 (2.5 tokens/s)
  assert int(speculative.choose_num_draft(zero, choice([4] * M, [4] * M))) == 3
  # nothing accepted: G = 0
  assert int(speculative.choose_num_draft(zero, choice([0] * M, [4] * M))) == 0
  # alpha = 0.5 at every position: E = 1, 1.5, 1.75, 1.875 -> per second 1, 1.25, 1.25, 1.17;
  # the first of the tied maxima, G = 1
  assert int(speculative.choose_num_draft(zero, choice([2] * M, [4] * M))) == 1
  # the generation's own counts join the prior's: alpha = (12/24, 4/4, 4/4) = (0.5, 1, 1):
  # E = 1, 1.5, 2, 2.5 -> per second 1, 1.25, 1.43, 1.56 -> G = 3
  g = speculative.choose_num_draft(stats([6, 0, 0], [12, 0, 0]), choice([6, 4, 4], [12, 4, 4]))
  assert int(g) == 3


def test_the_fixed_prior_is_recentred_at_the_pooled_rate():
  """An Acceptance's fixed prior follows the pooled rate of all counts: with no counts the choice
  is the prior's; once shallow positions show a high rate, a position never drafted takes that
  rate (and the choice drafts deeper) instead of the prior's, while pseudo counts given as a
  plain pair keep their rates."""
  M = 4
  seconds = jnp.asarray([1.0, 1.3, 1.6, 1.9, 2.2], jnp.float32)
  spec = speculative.Spec(None, None, 8, M, True, None)
  zero = {"accept_counts": jnp.zeros(M, jnp.int32), "reach_counts": jnp.zeros(M, jnp.int32)}
  prior = cost.Acceptance.prior(M, rate=0.6, weight=4.0)
  fresh = speculative.Choice.of(spec, seconds, prior)
  plain = speculative.Choice.of(spec, seconds, (prior.accepted, prior.reached))
  # no counts: the pooled rate is the prior's, the same choice either way (alpha 0.6: G = 1)
  g = [int(speculative.choose_num_draft(zero, c)) for c in (fresh, plain)]
  assert g == [1, 1]
  # rollouts that drafted two deep, accepting 90%: positions 3, 4 were never reached
  seen = prior.updated({"accept_counts": [90, 81, 0, 0], "reach_counts": [100, 90, 0, 0]}, keep=1.0)
  pooled = speculative.Choice.of(spec, seconds, seen)
  pool = float(np.sum(seen.accepted) / np.sum(seen.reached))
  alpha = (seen.accepted - prior.prior_accepted + pool * prior.prior_reached) / seen.reached
  assert alpha[2] == pytest.approx(pool) and pool > 0.8
  want = int(np.argmax([cost.expected_tokens(alpha, G) / seconds[G] for G in range(M + 1)]))
  assert int(speculative.choose_num_draft(zero, pooled)) == want == M
  # the same counts as a plain pair: positions 3, 4 stay at 0.6 and the choice stops at 2
  as_pair = speculative.Choice.of(spec, seconds, (seen.accepted, seen.reached))
  assert int(speculative.choose_num_draft(zero, as_pair)) == 2


def test_choose_num_draft_follows_the_expected_rate():
  """The same choice computed in numpy for many random settings."""
  rng = np.random.default_rng(0)
  for _ in range(50):
    M = int(rng.integers(1, 6))
    seconds = np.sort(rng.uniform(0.5, 3.0, M + 1)).astype(np.float32)
    acc = rng.integers(0, 10, M).astype(np.float32)
    reach = acc + rng.integers(0, 10, M)
    rates = np.where(reach > 0, acc / np.maximum(reach, 1e-9), 0.0)
    want = int(np.argmax([cost.expected_tokens(rates, G) / seconds[G] for G in range(M + 1)]))
    zero = {"accept_counts": jnp.zeros(M, jnp.int32), "reach_counts": jnp.zeros(M, jnp.int32)}
    ch = speculative.Choice(jnp.asarray(seconds), jnp.asarray(acc), jnp.asarray(reach))
    assert int(speculative.choose_num_draft(zero, ch)) == want


def test_acceptance_prior_and_forgetting():
  """Observed counts decay by `keep` per rollout; the prior stays, so a position no round drafted
  lately keeps the prior's rate instead of falling to zero."""
  prior = cost.Acceptance.prior(3, rate=0.5, weight=4.0)
  np.testing.assert_allclose(prior.rates(), [0.5, 0.5, 0.5])
  upd = prior.updated({"accept_counts": [8, 0, 0], "reach_counts": [8, 2, 0]}, keep=0.5)
  np.testing.assert_allclose(upd.accepted, [2 + 8, 2, 2])
  np.testing.assert_allclose(upd.reached, [4 + 8, 4 + 2, 4])
  for _ in range(30):  # thirty rollouts that never draft past position 1
    upd = upd.updated({"accept_counts": [8, 0, 0], "reach_counts": [8, 0, 0]}, keep=0.5)
  np.testing.assert_allclose(upd.rates()[1:], [0.5, 0.5], rtol=1e-6)
  assert upd.rates()[0] == pytest.approx((2 + 16) / (4 + 16), rel=1e-6)
  assert cost.expected_tokens([1.0, 0.5, 0.5], 3) == pytest.approx(1 + 1 + 0.5 + 0.25)


def _synthetic_points(model: cost.CostModel, rows, tokens, capacity=96):
  pts = []
  for b in rows:
    for t in tokens:
      for m in ("policy", "draft"):
        pts.append(dict(model=m, rows=b, tokens=t, capacity=capacity))
    pts.append(dict(model="ar", rows=b, tokens=0, capacity=capacity))
    pts.append(dict(model="sd", rows=b, tokens=max(tokens) - 1, capacity=capacity))
  for p in pts:
    p["seconds"] = cost.predict(model, p)
  return pts


@pytest.mark.parametrize(
  "draft_fixed,threads",
  [((None, None), {}), ((1e-5, 8e-6), {}), ((1e-5, 8e-6), dict(thread_rows=40.0, thread_gain=0.9, overlap=False))],
  ids=["shared_fixed_costs", "draft_fixed_costs", "threads_serial"],
)  # fmt: skip
def test_fit_recovers_a_machine_from_its_own_times(draft_fixed, threads):
  """Times made by a known machine are fitted back within 1% at the fitted points and at rows
  and G never fitted on (the fit is identifiable from a calibration-sized grid), whether the
  draft's fixed costs are the policy's or its own, and for a CPU-like machine whose FLOP rate
  rises with a pass's token rows and whose compute and memory times add up."""
  pcfg, dcfg = _models()
  machine = cost.Machine(2e-4, 3e-5, 3e10, 2e10, 1e-4, 5e8, 4e9, *draft_fixed, **threads)
  truth = cost.CostModel(machine, pcfg, dcfg)
  fitted = cost.CostModel(
    cost.fit(_synthetic_points(truth, (1, 4, 16, 64, 128), (1, 3, 6)), pcfg, dcfg), pcfg, dcfg
  )
  for b in (2, 8, 32, 100):
    for G in range(6):
      assert fitted.round_seconds(b, G, 96) == pytest.approx(
        truth.round_seconds(b, G, 96), rel=0.01
      )
    assert fitted.ar_step_seconds(b, 96) == pytest.approx(truth.ar_step_seconds(b, 96), rel=0.01)
    assert fitted.draft_seconds(b, 1, 96) == pytest.approx(truth.draft_seconds(b, 1, 96), rel=0.01)


def test_a_pass_time_by_hand():
  """The pass form: fixed costs, then compute (its FLOP rate half-way up its threads gain at
  `thread_rows` token rows) and memory time, overlapped (max) or one after the other (sum)."""
  pcfg, _ = _models()
  assert cost.policy_work(pcfg, 4, 3, 48).token_rows == 12
  w = cost.Work(flops=3e9, weight_bytes=2e8, kv_bytes=1e8, layers=2, token_rows=40.0)
  m = cost.Machine(1e-4, 1e-5, 1e10, 1e9, 0.0, 1.0, 1e9, thread_rows=40.0, thread_gain=1.0)
  compute, moved = 3e9 / (1e10 * 1.5), 0.2 + 0.1
  assert m.seconds(w) == pytest.approx(1e-4 + 2e-5 + max(compute, moved), rel=1e-12)
  serial = dataclasses.replace(m, overlap=False)
  assert serial.seconds(w) == pytest.approx(1e-4 + 2e-5 + compute + moved, rel=1e-12)


def test_calibration_is_cached_per_config(tmp_path, monkeypatch):
  """A second calibration of the same configs and grid reads the first one's file (no timing);
  another config is calibrated anew."""
  pcfg, dcfg = _models()
  truth = cost.CostModel(cost.Machine(2e-4, 3e-5, 3e10, 2e10, 1e-4, 5e8, 4e9), pcfg, dcfg)
  calls = []

  def fake_measure(params, dparams, p, d, grid, *, min_s):
    calls.append(p)
    return _synthetic_points(cost.CostModel(truth.machine, p, d), grid.rows, grid.tokens)

  monkeypatch.setattr(cost, "measure", fake_measure)
  grid = cost.Grid(rows=(1, 8, 64), tokens=(1, 6), round_rows=(1, 64), capacity=96)
  m1, rec = cost.calibrate(None, None, pcfg, dcfg, grid=grid, cache_dir=str(tmp_path))
  m2, _ = cost.calibrate(None, None, pcfg, dcfg, grid=grid, cache_dir=str(tmp_path))
  assert len(calls) == 1 and m1.machine == m2.machine and m1.correction is None
  m3, _ = cost.calibrate(None, None, pcfg, dcfg, grid=grid, cache_dir=str(tmp_path), correct=True)
  assert len(calls) == 1 and m3.machine == m1.machine  # read back, corrected by its own points
  assert m3.correction.rows == grid.rows and m3.correction.G == (0, 5)
  assert max(abs(p["rel_error"]) for p in rec["points"]) < 0.02
  (path,) = [f for f in os.listdir(tmp_path) if f.endswith(".json")]
  assert json.load(open(tmp_path / path))["machine"] == dataclasses.asdict(m1.machine)
  cost.calibrate(None, None, dataclasses.replace(pcfg, n_layers=3), dcfg, grid=grid,
                 cache_dir=str(tmp_path))  # fmt: skip
  assert len(calls) == 2


def test_the_bench_pairs_rounds_timed_twice():
  """bench_cost's repeatability diagnostic pairs each full-depth AR step / SD round of the
  calibration with the validation's timing of the same (kind, rows, G, capacity), by hand."""
  from experiments.bench import cost_model

  cal = [
    dict(model="ar", rows=4, tokens=0, capacity=41, seconds=2.0),
    dict(model="ar", rows=4, tokens=0, capacity=41, seconds=1.0, layers=1),  # shallower policy
    dict(model="sd", rows=4, tokens=2, capacity=45, seconds=4.0),
    dict(model="policy", rows=4, tokens=1, capacity=48, seconds=1.0),
    dict(model="sd", rows=8, tokens=2, capacity=45, seconds=4.0),  # not timed again
  ]
  rounds = [
    dict(model="ar", rows=4, tokens=0, capacity=41, seconds=2.5),
    dict(model="sd", rows=4, tokens=2, capacity=45, seconds=3.0),
    dict(model="sd", rows=4, tokens=5, capacity=48, seconds=9.0),
  ]
  pairs = cost_model.repeat_pairs(cal, rounds)
  assert [(p["model"], p["rows"], p["tokens"]) for p in pairs] == [("ar", 4, 0), ("sd", 4, 2)]
  assert [p["rel_diff"] for p in pairs] == pytest.approx([0.25, -0.25])
  assert cost_model._max_abs(pairs) == pytest.approx(0.25)
  assert np.isnan(cost_model._max_abs([]))


def test_the_bench_metronome_reads_the_hosts_drift_by_hand():
  """bench_cost's Metronome: one fixed pass per tick, in order, labelled; drift = largest over
  smallest - 1 (nan before two ticks); the table shows the ticks and the drift."""
  from experiments.bench import cost_model

  times = iter([1.0, 1.3, 1.1])
  m = cost_model.Metronome(lambda: next(times))
  assert np.isnan(m.drift())
  assert m.tick("start") == 1.0
  assert np.isnan(m.drift())
  m.tick("a: calibrated")
  m.tick("a: validated")
  assert [t["label"] for t in m.ticks] == ["start", "a: calibrated", "a: validated"]
  assert [t["seconds"] for t in m.ticks] == [1.0, 1.3, 1.1]
  assert all(b["at_s"] >= a["at_s"] for a, b in zip(m.ticks, m.ticks[1:]))
  assert m.drift() == pytest.approx(0.3)
  text = cost_model.table({"sizes": {}, "metrics": {"host_drift": m.drift()}, "metronome": m.ticks})
  assert "+30.0%" in text and "| a: calibrated |" in text and "1300.000" in text


def test_the_bench_splits_corrected_errors_at_and_between_timed_rounds():
  """bench_cost's corrected prediction of a validated round: the calibration's measurement at a
  (rows, G) it timed (so the error there is the host's repeatability), the fit scaled by the
  interpolated level between them, the fit alone for a fixed loop's SD round at G = 0."""
  from experiments.bench import cost_model

  pcfg, dcfg = _models()
  model = cost.CostModel(cost.Machine(2e-4, 3e-5, 3e10, 2e10, 1e-4, 5e8, 4e9), pcfg, dcfg)
  level = lambda b, G: 0.2 * np.log2(b) + 0.1 * G  # noqa: E731
  cal = _round_points(model, level, (1, 16), (0, 2))
  rounds = _round_points(model, level, (1, 4, 16), (0, 1, 2))
  rounds.append(dict(model="sd", rows=4, tokens=0, capacity=96))
  for p in rounds:
    p["predicted"] = cost.predict(model, p)
    p["seconds"] = p["seconds"] * 1.1 if "seconds" in p else p["predicted"] * 1.3
    p["rel_error"] = p["predicted"] / p["seconds"] - 1.0
  out = cost_model.corrected_errors(model, cal, rounds)
  timed = [(p["rows"], p["tokens"]) for p in rounds if p["timed_for_fit"]]
  assert timed == [(1, 0), (1, 2), (16, 0), (16, 2)]
  # the level is linear in G and log rows, so the correction is exact between: every corrected
  # error is the 10% the validation's timing added, except the G = 0 SD round's (the fit's)
  assert out["max_abs_corrected_at_timed"] == pytest.approx(1 - 1 / 1.1, abs=1e-9)
  assert out["max_abs_corrected_between"] == pytest.approx(1 - 1 / 1.3, abs=1e-9)
  sd0 = rounds[-1]
  assert sd0["predicted_corrected"] == sd0["predicted"] and not sd0["timed_for_fit"]
  assert all(abs(abs(p["rel_error_corrected"]) - (1 - 1 / 1.1)) < 1e-9 for p in rounds[:-1])


def test_the_rollout_bench_reports_its_control_and_the_planned_arm():
  """bench_rollout:auto's per-batch row: the control arm (the largest fixed G's program timed as a
  second arm) over that arm, which is not a candidate for the best fixed G; auto_stage over the
  fixed arm at the G its plan chose for every stage, and no such ratio for a mixed plan."""
  from experiments.bench import rollout

  rates = {"ar": 10.0, 1: 12.0, 2: 15.0, "auto": 14.0, "auto_stage": 13.5, "control": 18.0}
  samples = {
    k: [dict(tokens_per_s=r * f, tokens=40, policy_passes_per_token=0.5) for f in (0.9, 1.0, 1.2)]
    for k, r in rates.items()
  }
  row = rollout._adaptive_row(8, samples, {k: 1.0 for k in rates}, (1, 2))
  assert row["best_fixed"] == 2 and row["control_over_same"] == pytest.approx(18.0 / 15.0)
  assert row["auto_stage_over_best_fixed"] == pytest.approx(13.5 / 15.0)
  row["stage_plan"] = {"8": 1, "4": 1}
  assert rollout._over_planned(row) == pytest.approx(13.5 / 12.0)
  row["stage_plan"] = {"8": 0, "4": 0}
  assert rollout._over_planned(row) == pytest.approx(13.5 / 10.0)  # G = 0: against the AR arm
  row["stage_plan"] = {"8": 2, "4": 1}
  assert rollout._over_planned(row) is None


def test_buckets_by_hand():
  assert engine.buckets(64) == [64, 32, 16, 8, 4, 2, 1]
  assert engine.buckets(64, 4) == [64, 32, 16, 8, 4]
  assert engine.buckets(12, 4) == [12, 8, 4]
  assert engine.buckets(8, 8) == [8]
  assert engine.buckets(1) == [1]
  assert engine.buckets(100, 16) == [100, 64, 32, 16]


@pytest.mark.parametrize(
  "field,value,match",
  [
    ("speculation", "sometimes", "decode.speculation"),
    ("min_rows", 0, "decode.min_rows"),
    ("catch_up_window", 0, "decode.catch_up_window"),
    ("prior_rate", 1.5, "decode.prior_rate"),
    ("prior_keep", 2.0, "prior_keep"),
    ("cost_outlier", -0.1, "decode.cost_outlier"),
    ("cost_outlier", float("nan"), "decode.cost_outlier"),
    ("price_keep", 1.5, "decode.price_prior_rounds/price_keep"),
    ("price_prior_rounds", -1.0, "decode.price_prior_rounds/price_keep"),
    ("price_prior_rounds", float("inf"), "decode.price_prior_rounds/price_keep"),
  ],
)
def test_decoding_settings_are_validated_before_any_work(field, value, match):
  c = default.get_config("smoke")
  c.decode[field] = value
  with pytest.raises(ValueError, match=match):
    config_lib.validate(c)


def test_the_shallow_policy_of_a_calibration_carries_the_draft():
  """The calibration's second depth taps as many distinct layers as the draft fuses, so SD rounds
  run on it with the same draft (and a policy too shallow for that has no shallow SD rounds)."""
  c = default.get_config("size=tiny")
  c.model.n_layers = 6
  pcfg = pol.PolicyConfig.from_config(c.model, 64)
  dcfg = drafts.draft_config(c.draft, pcfg, 3)
  params = pol.init_params(pcfg, 0)
  dparams = drafts.init_params(dcfg, 1, params, pcfg)
  sparams, scfg = cost.shallow_policy(params, pcfg, 3, n_taps=len(pcfg.taps))
  assert scfg.n_layers == 3 and len(set(scfg.taps)) == len(pcfg.taps) == dcfg.n_taps
  assert jax.tree.leaves(sparams["layers"])[0].shape[0] == 3
  assert cost.shallow_policy(params, pcfg, 2, n_taps=3) is None
  (ar, sd) = cost.time_rounds(
    sparams, dparams, scfg, dcfg, rows=(2,), num_drafts=(2,), prompt_len=4, new_tokens=6,
    repeats=1,
  )  # fmt: skip
  assert (ar["model"], sd["model"], sd["tokens"]) == ("ar", "sd", 2)
  assert 0 < ar["seconds"] < 1 and 0 < sd["seconds"] < 1


def _round_points(model: cost.CostModel, level, rows, Gs, capacity=96, kind=None):
  """Timed rounds whose seconds are the model's times exp(level(rows, G)), with `predicted`."""
  pts = []
  for b in rows:
    for G in Gs:
      m = kind or ("ar" if G == 0 else "sd")
      p = dict(model=m, rows=b, tokens=G, capacity=capacity)
      p["predicted"] = cost.predict(model, p)
      p["seconds"] = p["predicted"] * float(np.exp(level(b, G)))
      pts.append(p)
  return pts


def test_the_correction_prices_rounds_as_the_calibration_timed_them():
  """At a timed (rows, G) a corrected round is the measurement; between timed points the model's
  shape scaled by the measurements' level, interpolated linearly in G and in log rows; beyond
  them held flat. Shallow points are not used; the adaptive loop's own rounds, when timed, are
  used instead of the fixed loop's; a row count missing a G is left out."""
  pcfg, dcfg = _models()
  model = cost.CostModel(cost.Machine(2e-4, 3e-5, 3e10, 2e10, 1e-4, 5e8, 4e9), pcfg, dcfg)
  level = lambda b, G: 0.1 * np.log2(b) + 0.05 * G - 0.02 * G * np.log2(b)  # noqa: E731
  pts = _round_points(model, level, (1, 16, 64), (0, 2, 5))
  pts += [dict(p, layers=1, seconds=9 * p["seconds"]) for p in pts]  # a shallow policy: ignored
  pts += _round_points(model, lambda b, G: 5.0, (4,), (0, 2))  # no G = 5 at 4 rows: left out
  k = cost.Correction.from_points(pts, pcfg.n_layers)
  assert k.rows == (1, 16, 64) and k.G == (0, 2, 5)
  for b in (1, 16, 64):
    for G in (0, 2, 5):
      assert k.factor(b, G) == pytest.approx(np.exp(level(b, G)), rel=1e-9)
  # between: linear in G at a timed row count, linear in log rows at a timed G
  mid_G = 0.5 * (level(16, 0) + level(16, 2))
  assert k.factor(16, 1) == pytest.approx(np.exp(mid_G), rel=1e-9)
  mid_rows = 0.5 * (level(1, 5) + level(16, 5))  # 4 rows: half-way from 1 to 16 in log rows
  assert k.factor(4, 5) == pytest.approx(np.exp(mid_rows), rel=1e-9)
  assert k.factor(256, 7) == pytest.approx(np.exp(level(64, 5)), rel=1e-9)  # flat beyond
  corrected = dataclasses.replace(model, correction=k)
  for b in (1, 4, 16, 100):
    want = [model.round_seconds(b, G, 96) * k.factor(b, G) for G in range(6)]
    np.testing.assert_allclose(corrected.round_seconds_all(b, 5, 96), want, rtol=1e-6)
    np.testing.assert_allclose(
      model.round_seconds_all(b, 5, 96), [model.round_seconds(b, G, 96) for G in range(6)],
      rtol=1e-6,
    )  # fmt: skip
  for p in pts[:9]:
    assert cost.predict_corrected(corrected, p) == pytest.approx(p["seconds"], rel=1e-9)
  # the adaptive loop's rounds at every G take over from the fixed loop's
  auto = _round_points(model, lambda b, G: 0.3 * G, (1, 64), range(6), kind="auto")
  k2 = cost.Correction.from_points(pts + auto, pcfg.n_layers)
  assert k2.rows == (1, 64) and k2.G == tuple(range(6))
  assert k2.factor(8, 4) == pytest.approx(np.exp(1.2), rel=1e-9)
  # a G chosen per stage runs the fixed loop: its correction stays the AR steps' and SD rounds'
  assert cost.Correction.from_points(pts + auto, pcfg.n_layers, every="stage") == k
  assert cost.Correction.from_points(pts[9:18], pcfg.n_layers) is None  # shallow only
  # ... and where the fixed loop's own G = 0 round was timed (Grid.stage), that is its G = 0
  # column, the AR step kept for a plain G = 0; a G chosen per round leaves that round out
  zero = _round_points(model, lambda b, G: 0.4 + 0.01 * b, (1, 16, 64), (0,), kind="sd")
  k3 = cost.Correction.from_points(pts + zero, pcfg.n_layers, every="stage")
  assert k3.rows == (1, 16, 64) and k3.G == (0, 2, 5)
  for b in (1, 16, 64):
    assert k3.factor(b, 0) == pytest.approx(np.exp(0.4 + 0.01 * b), rel=1e-9)
    assert k3.factor(b, 0, plain=True) == pytest.approx(np.exp(level(b, 0)), rel=1e-9)
    assert k3.factor(b, 5, plain=True) == pytest.approx(np.exp(level(b, 5)), rel=1e-9)
  staged = dataclasses.replace(model, correction=k3)
  for plain in (True, False):
    rs = staged.round_seconds_all(16, 5, 96, plain=plain)
    want = model.round_seconds(16, 0, 96, plain=plain) * k3.factor(16, 0, plain=plain)
    assert rs[0] == pytest.approx(want, rel=1e-6)
  assert cost.Correction.from_points(pts + zero, pcfg.n_layers) == k


def test_the_correction_moves_the_choice_to_the_timed_best_G():
  """A fit that prices a deep round too cheaply at large batches chooses it; the correction by
  rounds timed there (G = 5 half again as dear as the fit says) moves the choice to G = 3, the
  one with the most expected tokens per measured second (the case bench_rollout:auto met at 64
  rows: G5/G3 timed 1.48x, fitted 1.21x)."""
  pcfg, dcfg = _models()
  machine = cost.Machine(2e-2, 3e-5, 3e10, 2e10, 1e-4, 5e8, 4e9, 1e-6, 1e-7)  # a dear pass
  model = cost.CostModel(machine, pcfg, dcfg)
  b, M = 64, 5
  rs = model.round_seconds_all(b, M, 96)
  spec = speculative.Spec(pcfg, dcfg, 16, M, True, Sampling(1.0, 0, 1.0))
  prior = cost.Acceptance.prior(M, rate=0.9, weight=100.0)
  no_counts = {"accept_counts": jnp.zeros((M,)), "reach_counts": jnp.zeros((M,))}
  expected = np.asarray([cost.expected_tokens(prior.rates(), G) for G in range(M + 1)])
  # the level that makes G = 5 the model's choice and G = 3 the measurement's
  level = lambda _, G: np.log(1.0 + 0.2 * max(G - 3, 0))  # noqa: E731
  timed = rs * np.exp([level(b, G) for G in range(M + 1)])
  assert np.argmax(expected / rs) == 5 and np.argmax(expected / timed) == 3
  pts = _round_points(model, level, (16, 64), range(M + 1), kind="auto")
  corrected = dataclasses.replace(model, correction=cost.Correction.from_points(pts, pcfg.n_layers))
  pick = lambda m: int(
    speculative.choose_num_draft(  # noqa: E731
      no_counts, speculative.Choice.of(spec, m.round_seconds_all(b, M, 96), prior)
    )
  )
  assert pick(model) == 5 and pick(corrected) == 3


def test_theil_sen_by_hand():
  """The median of pairwise slopes, then the median intercept: a line through most points whatever
  one wild point does; points at one x give a flat line at their median."""
  assert cost.theil_sen([1, 2, 3], [1.0, 3.0, 5.0]) == pytest.approx((2.0, -1.0))
  # six of the ten pairwise slopes are 0 (among x = 1..4), the four with x = 5 are 2 to 8
  assert cost.theil_sen([1, 2, 3, 4, 5], [0.0, 0.0, 0.0, 0.0, 8.0]) == pytest.approx((0.0, 0.0))
  assert cost.theil_sen([2, 2], [1.0, 3.0]) == pytest.approx((0.0, 2.0))


def test_a_timing_outlier_is_priced_by_its_row_counts_line():
  """With `outlier`, a timed SD round further than that (log ratio) from the Theil-Sen line of its
  row count's rounds at G >= 1 is priced by the line; the rest keep their measurement
  (a bend within `outlier` survives), G = 0 is kept whatever it is, and the replaced measurements
  are recorded. An outlier at the end of four drafted rounds is found, and only it; with three
  nothing is replaced (the line through three is the one through both ends). The choice of G that the outlier
  moved moves back: a G = 1 round timed 30% fast at 64 rows made G = 1 the choice where its
  neighbours' level makes a deeper G the best."""
  pcfg, dcfg = _models()
  model = cost.CostModel(cost.Machine(2e-2, 3e-5, 3e10, 2e10, 1e-4, 5e8, 4e9), pcfg, dcfg)
  M = 5
  bend = {1: 0.0, 2: 0.02, 3: 0.0, 4: 0.05, 5: 0.0}  # a real bend, within the threshold
  # deep rounds cheaper than the fit says (a falling line), G = 1 at 64 rows timed 30% fast
  level = lambda b, G: (
    0.5 if G == 0 else 0.1 - 0.12 * G + bend[G] - (0.35 if (b, G) == (64, 1) else 0.0)
  )  # noqa: E501,E731
  pts = _round_points(model, level, (16, 64), range(M + 1))
  pts += _round_points(model, lambda b, G: 0.9 * G, (4,), (0, 1, 2))  # two drafted: no line
  raw = cost.Correction.from_points(pts, pcfg.n_layers)
  k = cost.Correction.from_points(pts, pcfg.n_layers, outlier=0.1)
  assert raw.rows == k.rows == (16, 64) and raw.replaced == ()
  assert [(r, G) for r, G, _ in k.replaced] == [(64, 1)]
  assert k.replaced[0][2] == pytest.approx(level(64, 1))
  for b in (16, 64):
    for G in range(M + 1):
      if (b, G) != (64, 1):
        assert k.factor(b, G) == pytest.approx(np.exp(level(b, G)), rel=1e-9)
  # near the level without the outlier (-0.02), within the threshold; the measurement was 0.35 off
  assert abs(np.log(k.factor(64, 1)) - (-0.02 + bend[1])) < 0.1
  end = lambda b, G: [0.0, 0.0, 0.0, 0.0, -0.31][G]  # noqa: E731
  four = cost.Correction.from_points(
    _round_points(model, end, (4,), range(5)), pcfg.n_layers, outlier=0.1
  )
  assert [(r, G) for r, G, _ in four.replaced] == [(4, 4)]
  assert [np.log(four.factor(4, G)) for G in range(4)] == pytest.approx([0.0] * 4, abs=1e-9)
  assert -0.2 < np.log(four.factor(4, 4)) < 0.0  # the line's, which the outlier pulls a little
  three_end = lambda b, G: [0.0, 0.0, 0.0, -0.31][G]  # noqa: E731
  three = cost.Correction.from_points(
    _round_points(model, three_end, (4,), range(4)), pcfg.n_layers, outlier=0.1
  )
  assert three.replaced == () and three.factor(4, 3) == pytest.approx(np.exp(-0.31), rel=1e-9)
  assert cost.Correction.from_points(pts, pcfg.n_layers, outlier=0.0) == raw
  with pytest.raises(ValueError, match="outlier"):
    cost.Correction.from_points(pts, pcfg.n_layers, outlier=-1.0)
  # the choice: expected tokens per second at 64 rows
  prior = cost.Acceptance.prior(M, rate=0.9, weight=100.0)
  spec = speculative.Spec(pcfg, dcfg, 16, M, True, Sampling(1.0, 0, 1.0))
  no_counts = {"accept_counts": jnp.zeros((M,)), "reach_counts": jnp.zeros((M,))}
  pick = lambda fix: int(
    speculative.choose_num_draft(  # noqa: E731
      no_counts,
      speculative.Choice.of(
        spec, dataclasses.replace(model, correction=fix).round_seconds_all(64, M, 96), prior
      ),
    )
  )
  timed_best = lambda fix: int(
    np.argmax(  # noqa: E731
      [cost.expected_tokens(prior.rates(), G) for G in range(M + 1)]
      / dataclasses.replace(model, correction=fix).round_seconds_all(64, M, 96)
    )
  )
  assert pick(raw) == 1 and pick(k) == timed_best(k) != 1


def test_the_adaptive_loop_is_timed_at_each_forced_G():
  """The calibration's adaptive rounds: a forced choice runs every round at its G (the loop's own
  counts of rounds per G), and each G of the loop is timed at each row count."""
  pcfg, dcfg = _models()
  params = pol.init_params(pcfg, 0)
  dparams = drafts.init_params(dcfg, 1, params, pcfg)
  free = dataclasses.replace(pcfg, eos_id=-1, stop_ids=())
  spec = speculative.Spec(free, dcfg, 8, 3, True, Sampling(1.0, 0, 1.0))
  prompts, lengths = jnp.ones((2, 4), jnp.int32), jnp.full((2,), 4, jnp.int32)
  carry = engine.init_jit(params, dparams, prompts, lengths, jax.random.key(0), spec=spec)
  for G in (0, 2):
    out = engine.run_jit(
      params, dparams, carry, cost.forced_choice(spec, G), jnp.int32(0), spec=spec,
      sampler=rejection_sample,
    )  # fmt: skip
    counts = np.asarray(out["stats"]["num_draft_counts"])
    assert counts[G] > 0 and counts.sum() == counts[G], (G, counts)
  pts = cost.time_adaptive_rounds(
    params, dparams, pcfg, dcfg, rows=(1, 2), num_draft=2, prompt_len=4, new_tokens=6,
    repeats=1,
  )  # fmt: skip
  assert [(p["model"], p["rows"], p["tokens"]) for p in pts] == [
    ("auto", b, G) for b in (1, 2) for G in range(3)
  ]
  assert all(0 < p["seconds"] < 1 for p in pts)


def test_auto_every_is_validated_before_any_work(tmp_path):
  """decode.auto_every (G chosen per round or per stage) is checked when a run's context is
  built, before the task, the data or any compile."""
  from specdraft.train import phases

  c = default.get_config("smoke")
  c.parallel.devices = 1
  c.decode.auto_every = "often"
  with pytest.raises(ValueError, match=r"config.decode.auto_every='often' is invalid: expected"):
    phases.Context(c, str(tmp_path))
  assert not os.listdir(tmp_path)
  with pytest.raises(ValueError, match=r"every='often': expected one of \('round', 'stage'\)"):
    cost.Correction.from_points([], 2, every="often")
  # a G per stage is auto G's: with a fixed G it is refused, not ignored
  c.decode.auto_every, c.decode.speculation = "stage", "fixed"
  with pytest.raises(ValueError, match=r"auto_every='stage' is invalid: .*speculation='auto'"):
    phases.Context(c, str(tmp_path))
  # both knobs are in the default config, so a command line can set them
  d = default.get_config().decode
  assert (d.auto_every, d.cost_correction) == ("round", True)
  d.update_from_flattened_dict({"auto_every": "stage"})
  assert d.auto_every == "stage"


def test_the_fixed_loop_is_timed_as_a_stage_runs_it():
  """Grid.stage's points: the fixed loop's rounds at every G = 0..max(round_G), each with buffers
  sized by the largest G, as a stage of G chosen per stage runs it (G = 0: its draft taking in the
  emitted token); without it the loop at G = 0 is still sized by the largest G and every other G
  by its own."""
  assert cost.Grid(round_G=(2, 5), stage=True).full_depth_G() == (0, 1, 2, 3, 4, 5)
  assert cost.Grid(round_G=(2, 5), stage=True).full_depth_G(has_draft=False) == (2, 5)
  assert cost.Grid(round_G=(2, 5)).full_depth_G() == (2, 5)
  pcfg, dcfg = _models()
  params = pol.init_params(pcfg, 0)
  dparams = drafts.init_params(dcfg, 1, params, pcfg)
  kw = dict(rows=(2,), prompt_len=4, new_tokens=6, repeats=1)
  staged = cost.time_rounds(params, dparams, pcfg, dcfg, num_drafts=(0, 1, 3), stage=True, **kw)
  assert [(p["model"], p["tokens"], p["capacity"]) for p in staged] == [
    ("ar", 0, 10),
    ("sd", 0, 15),
    ("sd", 1, 15),
    ("sd", 3, 15),
  ]
  assert all(0 < p["seconds"] < 1 for p in staged)
  own = cost.time_rounds(params, dparams, pcfg, dcfg, num_drafts=(0, 1), **kw)
  assert [(p["model"], p["tokens"], p["capacity"]) for p in own] == [
    ("ar", 0, 10),
    ("sd", 0, 13),
    ("sd", 1, 13),
  ]
  with pytest.raises(ValueError, match="needs a G > 0"):
    cost.time_rounds(params, dparams, pcfg, dcfg, num_drafts=(0,), **kw)


def test_stage_prices_by_hand():
  """StagePrices: the pooled measured / priced seconds of a (rows, G) shrunk toward 1 by
  prior_rounds pseudo rounds at the priced seconds of a round; every entry's evidence is kept at
  `keep` per rollout (so one no plan runs again fades back to 1); stages that compiled, ran no
  round or carry no price are left out; a plain G = 0 stage is its own entry."""
  p = cost.StagePrices(prior_rounds=4.0, keep=0.5)
  assert p.factor(8, 2) == 1.0 and p.summary() == {}
  # 4 rounds priced at 0.5 s each (2 s), measured 6 s: (6 + 4 * 0.5) / (2 + 4 * 0.5)
  rec = dict(rows=8, G=2, plain=False, rounds=4, seconds=6.0, priced=2.0, compiled=False)
  q = p.updated([rec])
  assert q.factor(8, 2) == pytest.approx((6 + 2) / (2 + 2))
  assert q.factor(8, 1) == 1.0 and q.factor(4, 2) == 1.0  # only what ran is observed
  # a second rollout at the same (rows, G): the first's evidence kept at weight 0.5
  r = q.updated([dict(rec, seconds=3.0)])
  measured, priced, rounds = 0.5 * 6 + 3, 0.5 * 2 + 2, 0.5 * 4 + 4
  unit = priced / rounds
  assert r.factor(8, 2) == pytest.approx((measured + 4 * unit) / (priced + 4 * unit))
  # rollouts that do not run it: its evidence fades, the factor returns toward 1
  faded = q
  for _ in range(3):
    faded = faded.updated([])
  assert 1.0 < faded.factor(8, 2) < q.factor(8, 2)
  m, pr = 6 * 0.5**3, 2 * 0.5**3
  assert faded.factor(8, 2) == pytest.approx((m + 4 * 0.5) / (pr + 4 * 0.5))
  # ignored: a compile inside the stage, no round, no price (G chosen per round), the prefill
  # and a step down
  skip = [dict(rec, compiled=True), dict(rec, rounds=0), dict(rec, priced=None, G=None)]
  skip.append(dict(rec, rounds=0, G=None, priced=None, prefill=True))
  skip.append(dict(rec, rounds=0, G=None, priced=None, step_down=True))  # between two stages
  assert p.updated(skip).table == ()
  # a plain G = 0 stage (the draft left behind) and a G = 0 stage whose draft takes in the token
  z = p.updated([dict(rec, G=0, plain=True, seconds=1.0)])
  assert z.factor(8, 0, plain=True) == pytest.approx((1 + 2) / (2 + 2))
  assert z.factor(8, 0) == 1.0
  assert z.summary() == {"8:0p": 0.75}
  np.testing.assert_allclose(z.factors(8, 3, plain=True), [0.75, 1, 1, 1])
  hash(z)  # the stage plan is memoised on it
