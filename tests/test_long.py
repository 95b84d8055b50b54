"""Long-context co-training end to end: the frequency and retrieval tasks and `configs/long.py:smoke`
under cp8 and pp2_cp2_dp2."""

import json
import os

import numpy as np
import pytest

from configs import long as long_config
from specdraft.tasks import Frequency, Retrieval
from specdraft.train import loop


def test_retrieval_prompts_answers_and_rewards():
  for hops in (1, 3):
    task = Retrieval(num_records=12, hops=hops)
    rng = np.random.default_rng(hops)
    for _ in range(20):
      ex = task.sample(rng)
      assert len(ex.prompt) + len(ex.answer) <= task.max_length()
      assert len(ex.prompt) <= task.max_prompt_length()
      assert task.reward(ex, ex.answer) == 1.0
      assert task.reward(ex, " " + ex.answer + " ") == 1.0  # surrounding space is ignored
      assert task.reward(ex, ex.answer[:-1]) == 0.0
      assert ex.answer.count(">") == hops - 1
  # the answer is read from the prompt alone: a made-up prompt, solved by hand
  ex = Retrieval(num_records=3, hops=2).solve("abc=def;def=123;xyz=999;?abc:")
  assert ex == "def>123"
  with pytest.raises(ValueError, match="num_records"):
    Retrieval(num_records=0)
  with pytest.raises(ValueError, match="key_len=1 gives 26 keys"):
    Retrieval(num_records=20, key_len=1)


def test_multi_query_retrieval_gives_partial_credit():
  task = Retrieval(num_records=12, queries=4, hops=1)
  rng = np.random.default_rng(0)
  for _ in range(20):
    ex = task.sample(rng)
    queried = ex.prompt.split("?")[1].rstrip(":").split(",")
    assert len(set(queried)) == 4 and len(ex.answer.split(",")) == 4  # distinct keys, in order
    assert len(ex.prompt) + len(ex.answer) <= task.max_length()
    assert len(ex.prompt) <= task.max_prompt_length()
    assert task.reward(ex, ex.answer) == 1.0
    items = ex.answer.split(",")
    assert task.reward(ex, ",".join(items[:2] + ["x", "y"])) == 0.5
    assert task.reward(ex, ",".join(items[:3])) == 0.75  # a missing item counts as wrong
    assert task.reward(ex, ex.answer + ",123") == 0.0  # more items than asked: no credit
  solved = Retrieval(num_records=4, queries=2, hops=2).solve("abc=def;def=1;xyz=abc;?abc,xyz:")
  assert solved == "def>1,abc>def"
  with pytest.raises(ValueError, match="queries"):
    Retrieval(num_records=4, queries=3, hops=2)


def test_retrieval_record_count_range():
  task = Retrieval(num_records=12, min_records=3, queries=2)
  rng = np.random.default_rng(0)
  counts = {task.sample(rng).prompt.count(";") for _ in range(200)}
  assert counts == set(range(3, 13))  # every count in [min_records, num_records] is drawn
  ex = task.sample(rng)
  assert task.reward(ex, task.solve(ex.prompt)) == 1.0
  assert {Retrieval(num_records=5).sample(rng).prompt.count(";") for _ in range(5)} == {5}
  with pytest.raises(ValueError, match="min_records must be 0"):
    Retrieval(num_records=12, min_records=1, queries=2)
  with pytest.raises(ValueError, match="min_records must be 0"):
    Retrieval(num_records=12, min_records=13)
  # the query written like a record's start: the answer continues the copy
  ex = Retrieval(num_records=6, query_end="=").sample(rng)
  key = ex.prompt[ex.prompt.index("?") + 1 : -1]
  assert ex.prompt.endswith("=") and f"{key}={ex.answer};" in ex.prompt
  assert Retrieval(num_records=6, query_end="=").reward(ex, ex.answer) == 1.0
  with pytest.raises(ValueError, match="query_end"):
    Retrieval(num_records=6, query_end="=", queries=2)


def test_frequency_answer_is_the_ranking_of_the_context_counts():
  """The answer lists the top_k symbols by their counts in the prompt (unique: ranks 1..k+1 have
  strictly decreasing counts), the counts follow the Zipf law, and the reward is graded."""
  task = Frequency(length=300, num_symbols=10, top_k=4, alpha=0.5)
  rng = np.random.default_rng(0)
  for _ in range(20):
    ex = task.sample(rng)
    ctx = ex.prompt[:-1]
    assert ex.prompt.endswith("?") and ctx.isalpha() and len(set(ctx)) == 10
    counts = sorted((ctx.count(ch) for ch in set(ctx)), reverse=True)
    assert counts == sorted(task.counts(300), reverse=True)
    top = ex.answer.split(",")
    assert [ctx.count(ch) for ch in top] == counts[:4] and len(set(counts[:5])) == 5
    assert task.solve(ex.prompt) == ex.answer and task.reward(ex, ex.answer) == 1.0
    assert len(ex.prompt) + len(ex.answer) <= task.max_length()
    assert len(ex.prompt) <= task.max_prompt_length()
    wrong = ",".join([top[0], top[2], top[1], top[3]])
    assert task.reward(ex, wrong) == 0.5
    assert task.reward(ex, ",".join(top[:2])) == 0.5
    assert task.reward(ex, ex.answer + ",a") == 0.0  # an extra item
  w = np.arange(1, 11) ** -0.5
  np.testing.assert_array_equal(task.counts(300)[5:], np.floor(300 * w / w.sum())[5:])
  # too short a context for distinct counts: ranks 1..k are raised above the next one
  np.testing.assert_array_equal(
    Frequency(length=10, num_symbols=10, top_k=3).counts(10)[:4], [3, 2, 1, 0]
  )
  assert Frequency(length=10, num_symbols=10, top_k=3).solve("aabaccd?") == "a,c,b"


def test_frequency_label_noise_changes_only_the_reference_answers():
  """Noise replaces about q of the answer's places by another symbol of the context; the prompt
  and the reward (verified from the prompt) are those of the noiseless task."""
  clean = Frequency(length=120, num_symbols=8, top_k=3)
  noisy = Frequency(length=120, num_symbols=8, top_k=3, label_noise=0.4)
  rng, wrong, n = np.random.default_rng(2), 0, 300
  for _ in range(n):
    ex = noisy.sample(rng)
    got, want = ex.answer.split(","), noisy.solve(ex.prompt).split(",")
    assert len(got) == 3 and set(got) <= set(ex.prompt[:-1])
    wrong += sum(g != w for g, w in zip(got, want))
    assert noisy.reward(ex, ",".join(want)) == clean.reward(ex, ",".join(want)) == 1.0
    assert noisy.reward(ex, ex.answer) == pytest.approx(sum(g == w for g, w in zip(got, want)) / 3)
  assert abs(wrong / (3 * n) - 0.4) < 0.05  # 900 places: 5 standard errors is 0.08
  # off by default, and then the stream of examples is the noiseless task's
  a, b = np.random.default_rng(3), np.random.default_rng(3)
  assert [clean.sample(a) for _ in range(5)] == [
    Frequency(length=120, num_symbols=8, top_k=3, label_noise=0.0).sample(b) for _ in range(5)
  ]


def test_frequency_semicolon_answers_are_in_the_data_but_unpaid():
  task = Frequency(length=120, num_symbols=8, top_k=2, semicolon_share=0.3)
  rng = np.random.default_rng(4)
  exs = [task.sample(rng) for _ in range(400)]
  semi = [e for e in exs if ";" in e.answer]
  assert abs(len(semi) / len(exs) - 0.3) < 0.07  # 400 answers: 3 standard errors is 0.07
  for e in exs:
    right = task.solve(e.prompt)
    assert e.answer.replace(";", ",") == right and task.reward(e, right) == 1.0
    assert task.reward(e, right.replace(",", ";")) == 0.0  # the same symbols, the unpaid form
    assert task.format_of(e.answer) == ("semicolon" if e in semi else "comma")


def test_frequency_length_range_and_errors():
  task = Frequency(length=200, min_length=50, num_symbols=8, top_k=3)
  rng = np.random.default_rng(1)
  lengths = {len(task.sample(rng).prompt) for _ in range(40)}
  assert min(lengths) < 120 and max(lengths) > 130 and all(50 <= n <= 210 for n in lengths)
  for kw, field in [
    (dict(num_symbols=1), "num_symbols"),
    (dict(num_symbols=8, top_k=8), "top_k"),
    (dict(alpha=0.0), "alpha"),
    (dict(length=4, num_symbols=8), "length"),
    (dict(length=100, min_length=200), "min_length"),
    (dict(label_noise=1.0), "label_noise"),
    (dict(semicolon_share=-0.1), "semicolon_share"),
  ]:
    with pytest.raises(ValueError, match=f"task.frequency.{field}"):
      Frequency(**kw)
  with pytest.raises(ValueError, match="not a frequency prompt"):
    task.solve("abc=1;?abc:")


# cp8 with the frequency task runs through experiments/long_run.py on two processes
# (tests/test_multihost_entry_points.py)
@pytest.mark.slow  # ~1.5 min; `make test-slow` (and CI) run it
@pytest.mark.parametrize("layout,task", [("pp2_cp2_dp2", "retrieval")])
def test_long_context_smoke_run(tmp_path, layout, task):
  """SFT -> draft distillation -> RL co-training with SD rollouts, every training step on
  sequence shards over cp (under pp2_cp2_dp2 through the pipeline, the objective on the last
  stage's shards)."""
  c = long_config.get_config(f"smoke,layout={layout},task={task}")
  assert c.parallel.name == layout and c.parallel.mesh.cp > 1
  c.data.data_dir = str(tmp_path / "tfds")
  out = str(tmp_path / "run")
  summary = loop.train_and_evaluate(c, out)
  assert summary["task"] == task
  with open(os.path.join(out, "metrics.jsonl")) as f:
    rl = [json.loads(line) for line in f]
  assert [r["step"] for r in rl] == list(range(1, c.rl.steps + 1))
  for r in rl:
    assert np.isfinite(r["loss"]) and np.isfinite(r["draft_loss"])
  assert max(r["accept_len"] for r in rl) > 1.0  # SD rollouts accepted drafted tokens
  assert os.path.exists(os.path.join(out, "plots", "reward.png"))


def test_long_run_reports_each_answer_form_over_the_first_and_last_fifth():
  from experiments.bench import long_run

  comma = [0.5, 0.7, 0.6, 0.6, 0.8, 0.9, 0.8, 0.9, 1.0, 0.9]  # a fifth of 10 steps is 2
  rows = [{"format_share": {"comma": c, "semicolon": 1 - c}} for c in comma]
  rows[-1]["format_share"] = {"comma": 0.9, "semicolon": 0.05, "other": 0.05}
  got = long_run._format_shares(rows)
  assert got["format_share_first"] == pytest.approx({"comma": 0.6, "other": 0.0, "semicolon": 0.4})
  assert got["format_share_last"] == pytest.approx(
    {"comma": 0.95, "other": 0.025, "semicolon": 0.025}
  )
  assert long_run._format_shares([{"reward_mean": 0.1}]) == {}  # tasks without answer forms


def test_the_long_answers_run_times_sd_on_32_new_tokens():
  """`configs/long.py:task=retrieval,queries=8,records=96`: 1024-token rows whose answers run to
  >= 32 new tokens, with goals on the answer length and on SD vs AR; the short-answer learning
  run keeps its own goals only."""
  c = long_config.get_config("task=retrieval,queries=8,records=96")
  assert c.data.seq_len == 1024 and c.decode.max_new_tokens >= 32
  g = c.long_run.goals
  assert g.sd_faster_than_ar.metric == "run.rollout.speedup" and g.sd_faster_than_ar.target == 1.0
  assert g.new_tokens_at_least_32.target == 32
  assert "sd_faster_than_ar" not in long_config.get_config().long_run.goals
