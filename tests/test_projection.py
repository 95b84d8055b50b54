"""The speedup projection (experiments/bench/projection.py): its fluid rollout worked by hand, the
G it chooses, compaction, the run's tail profile, and the smoke config end to end."""

import json
import math
import os

import numpy as np
import pytest

from configs import project_speedup
from experiments.bench import projection
from specdraft.decode import cost, engine


@pytest.fixture(scope="module")
def config():
  return project_speedup.get_config("smoke")


@pytest.fixture(scope="module")
def models(config):
  pcfg = projection.policy_config(config.project.policy)
  return pcfg, projection.draft_config(config.project.draft, pcfg)


def _round_only(models, round_s=1.0):
  """A machine whose every AR step and SD round costs round_s, whatever its rows and G."""
  m = cost.Machine(0.0, 0.0, math.inf, math.inf, round_s, math.inf, math.inf)
  return cost.CostModel(m, *models)


def test_by_hand_all_accepted(models):
  # rows of 1, 1, 1 and 8 tokens; buckets 4, 2, 1. AR: one step at 4 rows, seven at 1 row.
  # SD at G = 4, everything accepted: 5 tokens a round; one round at 4 rows (the short rows
  # finish), then one at 1 row (5 -> 10 >= 8).
  sim = projection.simulate(
    _round_only(models), [1, 1, 1, 8], [1.0] * 4, prompt_len=0, max_new_tokens=8
  )
  assert sim["ar_seconds"] == 8.0 and sim["sd_seconds"] == 2.0 and sim["speedup"] == 4.0
  by = sim["by_bucket"]
  assert [by[b]["G"] for b in (4, 2, 1)] == [4, 4, 4]
  assert [by[b]["ar_steps"] for b in (4, 2, 1)] == [1, 0, 7]
  assert [by[b]["sd_rounds"] for b in (4, 2, 1)] == [1, 0, 1]
  assert sim["tokens"] == 11.0 and sim["sd_tokens_per_s"] == 5.5


def test_nothing_accepted_drafts_nothing(config, models):
  """With every rate 0 the engine's rule picks G = 0 at every bucket; SD then runs AR's steps
  (an EAGLE-3 draft does not run in a plain step), over a cache longer by G_max + 2 = 7 entries
  (5% here) only: a speedup within 2% below 1."""
  p = config.project
  model = cost.CostModel(projection.machine_for(p.hardware.h100_sxm, p.efficiency), *models)
  lengths = projection.lognormal_lengths(16, 40.0, 0.9, 128)
  sim = projection.simulate(model, lengths, [0.0] * 5, prompt_len=0, max_new_tokens=128)
  cap = 128 + 5 + 2
  overhead = 0.0
  for b, e in sim["by_bucket"].items():
    assert e["G"] == 0 and e["expected_tokens"] == 1.0 and e["sd_rounds"] == e["ar_steps"]
    assert e["round_seconds"] == pytest.approx(model.ar_step_seconds(b, cap), rel=1e-12)
    overhead += e["sd_rounds"] * (e["round_seconds"] - e["ar_step_seconds"])
  assert sim["sd_seconds"] - sim["ar_seconds"] == pytest.approx(overhead, rel=1e-9)
  assert 0.98 < sim["speedup"] <= 1.0


def test_buckets_shrink_as_rows_finish(models):
  lengths = np.asarray([1, 2, 3, 5, 8, 13, 21, 34, 55])
  sim = projection.simulate(_round_only(models), lengths, [1.0], prompt_len=0, max_new_tokens=64)
  sizes = engine.buckets(9)
  assert sizes == [9, 8, 4, 2, 1]
  # step s runs at the smallest bucket holding the rows with more than s tokens to go
  want = {b: 0 for b in sizes}
  seq = [projection.bucket_of(int(np.sum(lengths > s)), sizes) for s in range(55)]
  for b in seq:
    want[b] += 1
  assert seq == sorted(seq, reverse=True)
  assert {b: e["ar_steps"] for b, e in sim["by_bucket"].items()} == want
  assert want == {9: 1, 8: 7, 4: 13, 2: 13, 1: 21}  # 9 rows; then 8..5, 4..3, 2, 1


def test_tail_profile_and_replay(models):
  """An AR run's active trace gives back its rows' lengths; replaying its steps costs what the
  fluid AR arm costs."""
  model = cost.CostModel(cost.Machine(1e-5, 2e-6, 1e10, 1e11, 3e-5, 1e9, 1e11), *models)
  decoded = np.asarray([0, 3, 3, 7, 12, 30])
  trace = [int(np.sum(decoded > s)) for s in range(decoded.max())]
  np.testing.assert_array_equal(projection.rounds_alive(trace, 6), decoded)
  lengths = projection.trace_lengths(trace, None, [], 6, mean_length=1 + decoded.mean())
  np.testing.assert_allclose(lengths, decoded + 1.0)
  sim = projection.simulate(model, decoded, [0.5], prompt_len=0, max_new_tokens=30)
  rep = projection.replay(model, trace, None, capacity=30, sizes=engine.buckets(6))
  assert rep == pytest.approx(sim["ar_seconds"], rel=1e-12)


def test_measured_rates_mark_unreached_positions():
  steps = [
    dict(accept_per_position=[0.8, 0.0, 0.0], num_draft_counts=[1, 5, 0, 0]),
    dict(accept_per_position=[0.6, 0.5, 0.0], num_draft_counts=[0, 2, 3, 0]),
  ]
  rates, measured = projection.measured_rates(steps, "zero")
  np.testing.assert_allclose(rates, [0.7, 0.5, 0.0])
  assert measured == [True, True, False]
  np.testing.assert_allclose(projection.measured_rates(steps, "last")[0], [0.7, 0.5, 0.5])


def test_smoke_end_to_end(config, tmp_path):
  out = projection.run(config, str(tmp_path))
  with open(os.path.join(tmp_path, "results.json")) as f:
    written = json.load(f)
  assert written["goals"] == {} and written["commit"] and "assumptions" in written
  assert set(written["hardware"]) == {"h100_sxm", "h200_sxm", "tpu_v5p"}
  for h in out["hardware"].values():
    assert h["rollout"]["speedup"] > 1.0 and 1.0 < h["rl_step_speedup"] < h["rollout"]["speedup"]
    assert h["source"]
  assert os.path.exists(os.path.join(tmp_path, "table.md"))


def test_decode_bytes_counts_the_cache_once():
  """The HBM a rollout holds is each model's weights plus its cache held once: for the 8B
  Llama-like policy, 128 KiB of keys and values per cached token (32 layers x 8 KV heads x 128 x
  2 x bf16); the pass traffic the cost model prices (the scan reads the carried cache once per
  layer) is 32 times that and must not be counted as held."""
  p = project_speedup.get_config().project
  pcfg = projection.policy_config(p.policy)
  dcfg = projection.draft_config(p.draft, pcfg)
  rows, cap = 64, 4614
  assert projection.cache_bytes(pcfg, rows, cap) == rows * cap * 32 * 2 * 8 * 128 * 2
  assert projection.cache_bytes(dcfg, rows, cap) == rows * cap * 1 * 2 * 8 * 128 * 2
  weights = sum(
    w.weight_bytes for w in (cost.policy_work(pcfg, 1, 1, 1), cost.draft_work(dcfg, 1, 1, 1))
  )
  assert 15e9 < cost.policy_work(pcfg, 1, 1, 1).weight_bytes < 17e9  # 8B parameters in bf16
  need = projection.decode_bytes(pcfg, dcfg, rows, cap)
  assert need == pytest.approx(weights + 33 * rows * cap * 2 * 8 * 128 * 2, rel=1e-12)
  assert need < 80e9  # fits an H100 at 64 rows of 4.6K tokens
  assert cost.policy_work(pcfg, rows, 1, cap).kv_bytes == 32 * projection.cache_bytes(
    pcfg, rows, cap
  )
