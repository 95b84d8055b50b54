"""Results files carry their provenance and goals; repository results need a clean tree."""

import json
import os
import subprocess

import pytest

from experiments.bench import provenance


def test_goals_evaluated_against_measured_values():
  goals = {
    "speed": {"metric": "ratio", "op": "<=", "target": 1.03, "what": "overhead"},
    "tau": {"metric": "tau.start", "op": ">=", "target": 3.5},
  }
  out = provenance.evaluate_goals(goals, {"ratio": 1.05, "tau": {"start": 3.6}})
  assert out["speed"]["met"] is False and out["speed"]["value"] == 1.05
  assert out["tau"]["met"] is True
  with pytest.raises(KeyError, match="tau.end"):
    provenance.evaluate_goals({"x": {"metric": "tau.end", "op": "<", "target": 1}}, {"tau": {}})
  with pytest.raises(ValueError, match="op='~'"):
    provenance.evaluate_goals({"x": {"metric": "r", "op": "~", "target": 1}}, {"r": 1})
  nan = provenance.evaluate_goals(
    {"x": {"metric": "r", "op": "<=", "target": 1}}, {"r": float("nan")}
  )
  assert nan["x"]["met"] is False


def test_results_file_has_provenance_at_top_level(tmp_path):
  out = provenance.write_results(
    str(tmp_path), {"ratio": 0.9}, goals={"g": {"metric": "ratio", "op": "<", "target": 1}}
  )
  on_disk = json.loads((tmp_path / "results.json").read_text())
  assert on_disk == json.loads(json.dumps(out))
  for key in provenance.HEADER_KEYS:
    assert key in on_disk, key
  assert on_disk["command"].startswith("python ")
  assert on_disk["goals"]["g"]["met"] is True
  with pytest.raises(ValueError, match="commit"):
    provenance.write_results(str(tmp_path), {"commit": "x"})


def _git(repo, *args):
  subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True)


def test_repository_results_refused_from_a_dirty_tree(tmp_path, monkeypatch):
  repo = tmp_path / "repo"
  (repo / "docs" / "results").mkdir(parents=True)
  (repo / "a.txt").write_text("a")
  _git(repo, "init", "-q")
  _git(repo, "add", "a.txt")
  _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
  monkeypatch.setattr(provenance, "repo_root", lambda: str(repo))
  results = str(repo / "docs" / "results" / "bench")
  provenance.check_workdir(results)  # clean: accepted
  (repo / "a.txt").write_text("changed")
  with pytest.raises(RuntimeError, match="uncommitted"):
    provenance.check_workdir(results)
  with pytest.raises(RuntimeError, match="uncommitted"):
    provenance.write_results(results, {"x": 1})
  assert not os.path.exists(os.path.join(results, "results.json"))
  provenance.check_workdir(str(tmp_path / "elsewhere"))  # outside docs/results: accepted


def test_run_outputs_inside_the_workdir_do_not_count_as_dirty(tmp_path, monkeypatch):
  repo = tmp_path / "repo"
  (repo / "docs" / "results" / "bench").mkdir(parents=True)
  (repo / "docs" / "results" / "bench" / "old.json").write_text("{}")
  (repo / "a.txt").write_text("a")
  _git(repo, "init", "-q")
  _git(repo, "add", ".")
  _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
  monkeypatch.setattr(provenance, "repo_root", lambda: str(repo))
  results = str(repo / "docs" / "results" / "bench")
  provenance.check_workdir(results)
  (repo / "docs" / "results" / "bench" / "plot.png").write_text("a plot written by the run")
  (repo / "docs" / "results" / "bench" / "old.json").write_text('{"rewritten": 1}')
  out = provenance.write_results(results, {"x": 1})  # the run's own outputs: accepted
  assert out["dirty"] is False  # `dirty` means changes outside the run's own outputs
  (repo / "docs" / "results" / "other.json").write_text("{}")  # outside the workdir: refused
  with pytest.raises(RuntimeError, match="uncommitted"):
    provenance.write_results(results, {"x": 1})


def test_drift_seed_statistics_use_the_sample_std_and_a_t_interval():
  from experiments.bench import drift

  s = drift.seed_stats([1.0, 2.0, 3.0])
  assert s["mean"] == 2.0 and s["std"] == pytest.approx(1.0)  # ddof=1 (ddof=0 gives 0.816)
  half = 4.302652729911275 / 3**0.5  # t(0.975, dof=2) * std / sqrt(n)
  assert s["ci95"] == pytest.approx([2.0 - half, 2.0 + half])
  assert drift.seed_stats([0.5])["ci95"] is None
  d = drift.diff_stats([1.0, 2.0, 3.0], [1.5, 2.5, 3.5])
  assert d["diff"] == pytest.approx(0.5) and d["zero_in_ci95"] is True
  far = drift.diff_stats([1.0, 1.1, 0.9], [5.0, 5.1, 4.9])
  assert far["zero_in_ci95"] is False and far["ci95"][0] > 0


def test_drift_summary_timings_threshold_and_speed_by_hand():
  """Synthetic runs with known figures: A rolls out in 2 s and trains in 1 s per step, C in 1 s
  and 1.5 s; step 1 (compile) is slow and must not count."""
  import ml_collections

  from experiments.bench import drift

  def rec(reward, ro, tr, tau=1.0):
    return dict(
      reward_mean=reward,
      rollout_seconds=ro,
      train_seconds=tr,
      accept_len=tau,
      entropy=0.4,
      format_share={"semicolon": reward},
    )

  steps, seeds = 8, 2
  runs = {}
  for s in range(seeds):
    rewards = [0.1, 0.2, 0.3, 0.5, 0.6, 0.7, 0.7, 0.7]  # trailing mean of 3 >= 0.5 from step 6
    runs[("none", s)] = [rec(r + 0.02 * s, 2.0, 1.0) for r in rewards]
    runs[("cotrained", s)] = [rec(r + 0.01 * s, 1.0, 1.5, tau=3.0) for r in rewards]
    runs[("cotrained_dflash", s)] = [
      rec(r, 0.5, 2.0, tau=2.0 - 0.1 * i) for i, r in enumerate(rewards)
    ]
    runs[("none", s)][0]["rollout_seconds"] = 60.0  # compiles
    runs[("cotrained", s)][0]["train_seconds"] = 60.0
  config = ml_collections.ConfigDict(
    dict(
      rl=dict(steps=steps),
      task=dict(arithmetic=dict(reward_format="semicolon")),
      drift=dict(
        arms=("none", "cotrained", "cotrained_dflash"),
        seeds=seeds,
        reward_threshold=0.5,
        threshold_window=3,
      ),
    )
  )
  out = drift.summarise(runs, config)
  a, c = out["arms"]["none"], out["arms"]["cotrained"]
  assert a["seconds"] == dict(rollout_s=2.0, train_s=1.0, step_s=3.0, rollout_share=2 / 3)
  assert c["seconds"]["step_s"] == 2.5
  # reached at step 6 (index 5): 6 steps of 3 s for A, the first counted at the median
  assert a["time_to_reward"]["per_seed"] == [18.0, 18.0]
  assert c["time_to_reward"]["seconds_mean"] == 15.0
  sp = out["speed"]
  assert sp["rollout_speedup_C_over_A"] == 2.0 and sp["cotrain_overhead"] == 1.5
  assert sp["step_ratio_C_over_A"] == pytest.approx(2.5 / 3.0)
  assert sp["predicted_step_ratio"] == pytest.approx((1 / 3) * 1.5 + (2 / 3) / 2.0)
  assert c["tau_last_over_first"] == 1.0 and a["rollout_s_last_over_first"] == 1.0
  # D (a co-trained DFlash arm): every SD arm's speed over A, and its tau over windows of 1 step
  assert out["speed_over_A"]["cotrained_dflash"] == dict(rollout_speedup=4.0, step_ratio=2.5 / 3)
  assert out["speed_over_A"]["cotrained"]["rollout_speedup"] == 2.0
  assert out["arms"]["cotrained_dflash"]["tau_last_over_first"] == pytest.approx(1.3 / 2.0)
  d = out["reward_C_minus_A"]
  assert d["diff"] == pytest.approx(-0.005) and 0 < d["welch_p"] <= 1
  assert d["ci95_abs_max"] == pytest.approx(max(abs(x) for x in d["ci95"]))
  never = drift.time_to_reward(runs, "none", seeds, threshold=0.9, window=3)
  assert never["per_seed"] == [None, None] and never["seconds_mean"] is None
  from experiments import results_doc as readme

  out["resumed_runs"] = ["none_seed0", "none_seed1"]
  text = readme.drift(out, "docs/results/drift")
  assert "2 of the arm runs (A: AR rollouts) were found complete" in text
  assert "rollouts 2.00× faster" in text and "r = 0.67" in text and "Welch test p" in text
  assert "| A: AR rollouts | 2.00 | 1.00 | 3.00 | 67% |" in text
  assert "| D: SD, co-trained DFlash |" in text
  assert text.startswith("### Drift: does a co-trained draft")
  assert readme.drift(out, "docs/results/x", "More seeds?").startswith("### More seeds?\n")


def test_drift_counts_an_arm_run_as_resumed_only_when_its_log_has_every_step(tmp_path):
  from experiments.bench import drift

  assert not drift._complete_rl_run(str(tmp_path), 3)  # no log yet
  (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n')
  assert not drift._complete_rl_run(str(tmp_path), 3)  # killed after 2 of 3 steps
  (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n')
  assert drift._complete_rl_run(str(tmp_path), 3)


def test_drift_arms_name_a_rollout_draft_and_optionally_a_draft_kind():
  from experiments.bench import drift

  assert drift.parse_arm("cotrained", "eagle3") == ("cotrained", "eagle3")
  assert drift.parse_arm("cotrained_dflash", "eagle3") == ("cotrained", "dflash")
  assert drift.parse_arm("fixed_dspark", "eagle3") == ("fixed", "dspark")
  for bad in ("cotrained_medusa", "sd", "none_dflash"):
    with pytest.raises(ValueError, match=r"config\.drift\.arms has '" + bad):
      drift.parse_arm(bad, "eagle3")


def test_every_drift_goal_reads_an_arm_its_config_runs():
  """A goal on an arm the config does not run would fail after an hour of runs, unless it says
  what it `needs` (then it is reported as not measured): B's goals under `:equivalence` (A and C
  only, for more seeds), D's without `:dflash`."""
  from configs import drift as drift_config

  for arg in (None, "dflash", "equivalence,seeds=20", "equivalence,dflash"):
    c = drift_config.get_config(arg)
    for name, goal in c.drift.goals.items():
      metric = goal["metric"]
      if metric.startswith("arms."):
        assert metric.split(".")[1] in c.drift.arms or goal.get("needs"), (arg, name)
      elif metric.startswith(("speed.", "reward_C_minus_A.")):
        assert {"none", "cotrained"} <= set(c.drift.arms), (arg, name)
  c = drift_config.get_config("equivalence,seeds=20")
  assert c.drift.arms == ("none", "cotrained") and c.drift.seeds == 20
  assert "fixed_tau_fell" in drift_config.get_config(None).drift.goals


def test_readme_sections_cite_file_command_commit_and_say_which_goals_missed(tmp_path):
  from experiments import results_doc as readme

  def row(k, cotrain_s, bound):
    return {
      "policy_layers": 12,
      "ttt_steps": k,
      "rl_only_s": 1.0,
      "cotrain_s": cotrain_s,
      "draft_alone_s": 0.5,
      "ratio": cotrain_s,
      "flop_bound": bound,
      "ratio_over_bound": cotrain_s / bound,
      "extra_over_draft_alone": (cotrain_s - 1.0) / 0.5,
    }

  rows = [row(1, 1.087, 1.1), row(7, 1.823, 1.5)]
  payload = {
    "d_model": 128,
    "batch_size": 64,
    "seq_len": 64,
    "repeats": 7,
    "rows": rows,
    "by_case": {f"L12_K{r['ttt_steps']}": r for r in rows},
  }
  goals = {
    f"L12_K{k}_bound": {"metric": f"by_case.L12_K{k}.ratio_over_bound", "op": "<=", "target": 1.1}
    for k in (1, 7)
  }
  out = provenance.write_results(
    str(tmp_path / "docs" / "results" / "bench_step"), payload, goals=goals, command=["x.py"]
  )
  doc = tmp_path / "docs" / "results.md"
  doc.write_text("a\n<!-- results:begin -->\nstale\n<!-- results:end -->\nb\n")
  assert readme.update(str(tmp_path), check=True) is False
  assert readme.update(str(tmp_path)) is False and readme.update(str(tmp_path), check=True)
  text = doc.read_text()
  assert text.startswith("a\n<!-- results:begin -->\n") and text.endswith(
    "<!-- results:end -->\nb\n"
  )
  block = readme.split(text)[1]
  assert "`docs/results/bench_step/results.json`" in block and "`python x.py`" in block
  assert out["commit"][:12] in block
  assert "| 12 | 7 | 1000 | 1823 | 500 | 1.82 | 1.50 | 1.22 | 1.65 |" in block
  assert "1 of 2 met; missed: `L12_K7_bound`" in block


def test_readme_measured_section_is_generated_from_the_results_files():
  """Every figure in docs/results.md is rendered from the results file it cites."""
  from experiments import results_doc as readme

  root = provenance.repo_root()
  with open(os.path.join(root, readme.DOC)) as f:
    block = readme.split(f.read())[1]
  assert block == readme.render(root), "run: python experiments/readme_tables.py"


def test_every_results_file_carries_provenance_and_no_hand_note():
  root = os.path.join(provenance.repo_root(), "docs", "results")
  paths = [
    os.path.join(d, f) for d, _, files in os.walk(root) for f in files if f.endswith(".json")
  ]
  assert paths, "no results files under docs/results"
  for path in paths:
    with open(path) as f:
      r = json.load(f)
    for key in (*provenance.HEADER_KEYS, "goals"):
      assert key in r, f"{path}: no {key!r}"
    assert "note" not in r, f"{path}: hand-written note"
    assert r["dirty"] is False and len(r["commit"]) == 40, path
    for name, g in r["goals"].items():
      assert {"metric", "op", "target", "value"} <= set(g), name
      if g["met"] is None:  # not measured: only a goal that says what it needs, with no value
        assert g.get("needs") and g["value"] is None, (path, name)
      else:
        assert isinstance(g["met"], bool), (path, name)


def test_a_commit_during_the_run_is_refused(tmp_path, monkeypatch):
  repo = tmp_path / "repo"
  (repo / "docs" / "results").mkdir(parents=True)
  (repo / "a.txt").write_text("a")
  _git(repo, "init", "-q")
  _git(repo, "add", "a.txt")
  _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
  monkeypatch.setattr(provenance, "repo_root", lambda: str(repo))
  monkeypatch.setattr(provenance, "_STARTED", {})
  results = str(repo / "docs" / "results" / "bench")
  provenance.check_workdir(results)  # the run starts at the first commit
  (repo / "a.txt").write_text("b")
  _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "second")
  with pytest.raises(RuntimeError, match="HEAD moved"):
    provenance.write_results(results, {"x": 1})


def test_make_run_only_goals_read_the_run_summary_and_render(tmp_path):
  """configs/wall_times.py:make_run_only: the goals are fixed on the summary `make run` writes
  (speedup, reward after SFT, its gain, entropy) and the README section shows the run's table."""
  from configs import wall_times
  from experiments import results_doc as readme

  c = wall_times.get_config("make_run_only")
  assert c.runs == 1 and list(c.steps) == ["venv"] and c.make_run
  summary = {
    "task": "arithmetic",
    "rollout_draft": "cotrained",
    "reward_first": 0.2,
    "reward_last": 0.5,
    "entropy_first": 0.35,
    "entropy_last": 0.3,
    "rollout": {
      "speedup": 1.4,
      "tau": 3.1,
      "temperature": 1.0,
      "num_draft": 5,
      "sd_policy_passes_per_token": 0.32,
      "ar_policy_passes_per_token": 1.0,
      "greedy_equal": True,
    },
  }
  payload = {"make_run_s": 1100.0, "make_run_summary": summary, "make_run_reward_gain": 0.3}
  out = provenance.write_results(
    str(tmp_path / "docs" / "results" / "make_run"),
    payload,
    goals=provenance.goals_from_config(c.goals),
    command=["wall_times.py"],
  )
  met = {k: g["met"] for k, g in out["goals"].items()}
  assert met == {
    "make_run": True,
    "sd_speedup": False,
    "reward_after_sft": True,
    "reward_rises": True,
    "entropy": True,
  }
  text = readme.make_run(out)
  assert "18.3 min" in text and "rollout speedup" in text
