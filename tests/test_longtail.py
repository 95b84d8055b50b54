"""The long-tailed task (tasks/longtail.py), its config variants and its TFDS splits."""

import copy
import json
import os

import numpy as np
import pytest

from configs import default as default_config
from configs import drift as drift_config
from specdraft import config as config_lib
from specdraft.tasks import CharTokenizer, Example, Longtail, make_task
from specdraft.tasks import datasets as task_data


def test_running_sum_by_hand():
  t = Longtail()
  assert t.solve([38, 7, 5]) == "38+7=45,45+5=50|50"
  assert t.solve([38, 7, 5], "semicolon") == "38+7=45;45+5=50|50"
  assert t.solve([38, 7, 5], "symbols") == "38&7:45/45&5:50|50"
  assert t.solve([38, 7, 5], "sums") == "45,50|50"
  assert t.solve([38, 7, 5], "direct") == "50"
  assert t.solve([12, 7, 30]) == "12+7=19,19+30=49|49"  # any terms
  assert t.solve([5, 3]) == "5+3=8|8"
  # one step per term after the first: the answer grows linearly with the terms
  lengths = [len(t.solve([9] * n)) for n in range(2, 9)]
  assert np.all(np.diff(lengths) >= 7)


def test_reward_reads_the_final_answer_and_the_format():
  t = Longtail()
  ex = Example("12+7+30=", "unused")
  assert t.reward(ex, "12+7=19,19+30=49|49") == 1.0
  assert t.reward(ex, "12 + 7=19, 19+30 =49|49") == 1.0  # spaces in the steps
  assert t.reward(ex, "12+7=20,20+30=50|49") == 1.0  # only the final answer is checked
  assert t.reward(ex, "49") == 1.0  # direct
  assert t.reward(ex, "12+7=19,19+30=49|50") == 0.0
  assert t.reward(ex, "12+7=19,19+30=49") == 0.0  # cut short before the answer
  assert t.reward(ex, "") == 0.0
  paid = Longtail(formats="columns:0.95,symbols:0.05", reward_format="symbols")
  assert paid.reward(ex, "12&7:19/19&30:49|49") == 1.0
  assert paid.reward(ex, "12 & 7: 19/ 19&30 :49|49") == 1.0
  assert paid.reward(ex, "12+7=19,19+30=49|49") == 0.0  # right answer, unpaid format
  assert paid.reward(ex, "12&7:19/19&30:49|48") == 0.0
  assert paid.reward(Example("5+3=", ""), "5&3:8|8") == 1.0  # one step: its symbols mark it
  # ... where ';' cannot: a one-step answer has no separator, so 'semicolon' needs 3 terms
  with pytest.raises(ValueError, match=r"reward_format='semicolon' is invalid with min_terms=2"):
    Longtail(formats="columns:0.95,semicolon:0.05", reward_format="semicolon")
  semi = Longtail(min_terms=3, formats="columns:0.95,semicolon:0.05", reward_format="semicolon")
  assert semi.reward(ex, "12+7=19;19+30=49|49") == 1.0
  assert semi.reward(ex, "12+7=19,19+30=49|49") == 0.0
  assert [t.format_of(a) for a in ("1+2=3|3", "1+2=3;3+3=6|6", "1&2:3|3", "3,6|6", "6")] == [
    "columns",
    "semicolon",
    "symbols",
    "sums",
    "direct",
  ]
  with pytest.raises(ValueError, match="not a prompt of the longtail task"):
    t.reward(Example("12=", ""), "12")


@pytest.mark.parametrize(
  "task",
  [
    Longtail(),
    Longtail(formats="columns:0.5,semicolon:0.2,symbols:0.1,sums:0.1,direct:0.1", space_prob=0.5),
    Longtail(max_terms=12, max_digits=3, first_digits=1, free_order=True, space_prob=0.9),
    Longtail(min_terms=3, alpha=0.0, min_digits=2, max_digits=2, first_digits=4, formats="sums"),
  ],
)
def test_examples_are_correct_bounded_and_deterministic(task):
  rng = np.random.default_rng(0)
  for _ in range(400):
    ex = task.sample(rng)
    assert task.reward(ex, ex.answer) == 1.0, ex
    assert len(ex.prompt) + len(ex.answer) <= task.max_length()
    assert len(ex.prompt) <= task.max_prompt_length()
    nums = [int(x) for x in ex.prompt[:-1].split("+")]
    assert task.min_terms <= len(nums) <= task.max_terms and nums[0] < 10**task.first_digits
    assert all(10 ** (task.min_digits - 1) <= x < 10**task.max_digits for x in nums[1:] if x)
  draw = lambda seed: [task.sample(np.random.default_rng(seed)) for _ in range(20)]
  assert draw(7) == draw(7) and draw(7) != draw(8)


def _step_numbers(answer: str) -> list[list[str]]:
  """Each step's numbers, sorted: the same for a step in any order, either way round, spaced."""
  work = answer.replace(" ", "").split("|")[0]
  for a, b in (("/", ","), ("&", "+"), (":", "+"), ("=", "+")):
    work = work.replace(a, b)
  return [sorted(step.split("+")) for step in work.split(",")]


def test_free_variation_keeps_the_steps():
  t = Longtail(formats="columns:0.5,symbols:0.5", free_order=True, space_prob=0.5)
  rng = np.random.default_rng(0)
  varied = 0
  for _ in range(200):
    ex = t.sample(rng)
    nums = [int(x) for x in ex.prompt[:-1].split("+")]
    canon = t.solve(nums, t.format_of(ex.answer))
    assert _step_numbers(ex.answer) == _step_numbers(canon), ex
    assert ex.answer.endswith(f"|{sum(nums)}")
    varied += ex.answer != canon
  assert varied > 150
  assert 0.2 < Longtail(space_prob=0.5).entropy_per_token(np.random.default_rng(1), n=300) < 0.35
  assert Longtail().entropy_per_token(np.random.default_rng(1), n=50) == 0.0


def test_the_run_config_completions_are_long_tailed_and_fit():
  """p90 / median of the reference completions' tokens (answer and EOS) >= 3 over 2000 examples
  of the `:longtail` run's task, and every example fits the run's rows and generation length."""
  c = default_config.get_config("longtail")
  task, tok = make_task(c.task), CharTokenizer()
  rng = np.random.default_rng(0)
  exs = [task.sample(rng) for _ in range(2000)]
  lengths = np.array([len(tok.encode_answer(e.answer)) for e in exs])
  median, p90 = np.median(lengths), np.percentile(lengths, 90)
  assert p90 / median >= 3, (median, p90)
  assert lengths.max() <= c.decode.max_new_tokens
  rows = [len(tok.encode_prompt(e.prompt)) + len(tok.encode_answer(e.answer)) for e in exs]
  assert max(rows) <= task.max_length() + 2 <= c.data.seq_len <= 128
  probs = task.term_probs()
  assert probs[0] > 0.5 and probs[-1] > 0.01 and np.all(np.diff(probs) < 0)


def test_tfds_splits(tmp_path):
  c = default_config.get_config("longtail,smoke")
  t = c.task
  records = lambda split: [
    task_data.to_example(r) for r in task_data.data_source(t, str(tmp_path / "tfds"), split)
  ]
  train, test = records("train"), records("test")
  assert (len(train), len(test)) == (t.num_train, t.num_test)
  assert not {e.prompt for e in test} & {e.prompt for e in train}
  task = make_task(t)
  assert all(task.reward(e, e.answer) == 1.0 for e in train + test)
  key = lambda e: (e.prompt, e.answer)  # the builder shuffles the records it writes
  for written, generated in zip((test, train), task_data.generate_splits(t)):
    assert sorted(written, key=key) == sorted(generated, key=key)


@pytest.mark.parametrize(
  "knobs,match",
  [
    (dict(min_terms=1), r"task.longtail: need 2 <= min_terms <= max_terms, got 1, 8"),
    (dict(min_terms=5, max_terms=4), r"min_terms <= max_terms, got 5, 4"),
    (dict(alpha=-1.0), r"task.longtail.alpha must be >= 0 \(0: uniform\), got -1.0"),
    (dict(formats="columns,essay"), r"task.longtail.formats='columns,essay'"),
    (dict(reward_format="essay"), r"task.longtail.reward_format='essay' must be"),
    (dict(space_prob=1.0), r"task.longtail.space_prob must be in \[0, 1\), got 1.0"),
    (dict(min_digits=0), r"task.longtail: need 1 <= min_digits <= max_digits, got 0, 1"),
    (dict(first_digits=0), r"task.longtail.first_digits must be >= 1, got 0"),
  ],
)
def test_bad_knobs_are_clear_errors(knobs, match):
  with pytest.raises(ValueError, match=match):
    Longtail(**knobs)
  c = default_config.get_config("longtail")
  c.task.longtail.update(knobs)
  with pytest.raises(ValueError, match=match):
    config_lib.validate(c, num_devices=1)


def test_the_config_variants():
  c = default_config.get_config("longtail")
  config_lib.validate(c, num_devices=1)
  assert c.task.name == "longtail" and c.task.longtail.reward_format == "symbols"
  assert default_config.get_config("task=longtail").to_dict() == c.to_dict()
  assert default_config.get_config().task.name == "arithmetic"  # the flag is off by default
  with pytest.raises(ValueError, match="longtail sets task=longtail.*'countdown'"):
    default_config.get_config("task=countdown,longtail")
  for field in ("decode.max_new_tokens", "rl.max_new_tokens"):
    d = copy.deepcopy(c)
    section, name = field.split(".")
    d[section][name] = 60  # the tail would be cut short
    with pytest.raises(ValueError, match=rf"config.{field}=60 is invalid: .* 107 tokens"):
      config_lib.validate(d, num_devices=1)
  from experiments.bench import drift

  dr = drift_config.get_config("longtail")
  config_lib.validate(dr, num_devices=1)
  assert dict(dr.task.longtail)["formats"] == "columns:0.95,symbols:0.05"
  assert drift.reward_format(dr) == "symbols"
  assert drift.reward_format(drift_config.get_config()) == "symbols"
  assert drift_config.get_config().task.name == "arithmetic"
  assert dr.drift.goals.to_dict() == drift_config.get_config().drift.goals.to_dict()


def test_an_earlier_run_resumes_with_the_task_added(smoke_config, tmp_path):
  """A run's identity holds its own task's knobs only: a workdir recorded before the longtail
  task existed resumes, and another task's knobs do not change a run."""
  from specdraft.train import loop

  wd = str(tmp_path / "run")
  loop.check_and_record_config(smoke_config, wd)
  path = os.path.join(wd, loop.RUN_CONFIG)
  with open(path) as f:
    rec = json.load(f)
  assert not any(k.startswith("task.longtail.") for k in rec["identity"])
  rec["identity"]["task.countdown.max_number"] = 99  # recorded when every task's knobs were
  with open(path, "w") as f:
    json.dump(rec, f)
  c = copy.deepcopy(smoke_config)
  c.task.longtail.max_terms = 5
  loop.check_and_record_config(c, wd)
  c.task.arithmetic.max_digits = 3
  with pytest.raises(ValueError, match=r"task.arithmetic.max_digits=3 .*started with 2"):
    loop.check_and_record_config(c, wd)


@pytest.mark.slow  # a whole smoke run (~1.5 min); `make test-slow` (and CI) run it
def test_a_longtail_run_with_auto_speculation_end_to_end(tmp_path, monkeypatch):
  """`configs/default.py:longtail,smoke` (auto G, compaction in every rollout) runs SFT,
  distillation, co-trained RL and the final report; the machine's timing is replaced by a known
  cost model (calibration's timed passes are synthetic, the fit is real): every RL step's log
  carries the G chosen each round, the rows still generating each round and the acceptance per
  drafted position, and (G per stage) each stage's rows, G, rounds and seconds, from which the
  plan's price factors are learned; the report's as-run comparison is greedy-exact with rounds
  at each G."""
  from specdraft.decode import cost
  from specdraft.train import loop

  truth = cost.Machine(2e-4, 3e-5, 3e10, 2e10, 1e-4, 5e8, 4e9, 2e-5, 5e-6)

  def synthetic_measure(params, dparams, pcfg, dcfg, grid, *, min_s):
    model = cost.CostModel(truth, pcfg, dcfg)
    pts = [
      dict(model=m, rows=b, tokens=t, capacity=grid.capacity)
      for b in grid.rows
      for t in grid.tokens
      for m in ("policy", "draft")
    ]
    pts += [dict(model="ar", rows=b, tokens=0, capacity=grid.capacity) for b in grid.round_rows]
    pts += [
      dict(model="sd", rows=b, tokens=G, capacity=grid.capacity)
      for b in grid.round_rows
      for G in grid.round_G
    ]
    for p in pts:
      p["seconds"] = cost.predict(model, p)
    return pts

  monkeypatch.setattr(cost, "measure", synthetic_measure)
  c = default_config.get_config("longtail,smoke")
  c.data.data_dir = str(tmp_path / "tfds")
  c.parallel.devices = 1
  c.eval.report_repeats = 1
  assert c.decode.speculation == "auto" and c.decode.compact
  wd = str(tmp_path / "run")
  summary = loop.train_and_evaluate(c, wd)
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    steps = [json.loads(line) for line in f]
  assert len(steps) == c.rl.steps
  M = c.decode.num_draft
  for s in steps:
    trace, active = s["num_draft_trace"], s["active_trace"]
    assert len(trace) == len(active) > 0 and all(0 <= g <= M for g in trace)
    assert sum(s["num_draft_counts"]) == len(trace) and len(s["accept_per_position"]) == M
    assert active == sorted(active, reverse=True)  # rows only ever finish
    # G per stage (the longtail config's auto_every): each stage's record, its G the stage's
    times, at = s["stage_times"], 0
    for r in times:  # the stages split the rounds in order
      assert set(trace[at : at + r["rounds"]]) <= {r["G"]}, (times, trace)
      at += r["rounds"]
    assert at == len(trace)
  # the stages ran compiled programs from the second step on, so their times were learned from
  assert any(not r["compiled"] for s in steps[1:] for r in s["stage_times"])
  assert steps[-1]["stage_price_factors"], steps[-1]
  as_run = summary["rollout"]["as_run"]
  assert as_run["engine"]["per_stage"] and c.decode.auto_every == "stage"
  assert as_run["engine"]["adaptive"] and as_run["engine"]["compact"]
  assert as_run["greedy_equal"] and sum(as_run["num_draft_counts"]) > 0
  assert summary["rollout"]["greedy_equal"]
