"""Goals are fixed once: every committed results file's experiment still defines, in its config,
every goal any committed version of that file recorded, at the same op and target, and every goal
carries the date it was fixed (experiments/bench/goals.py)."""

import glob
import json
import os
import subprocess

import pytest

from experiments.bench import goals as goal_lib
from experiments.bench import provenance

ROOT = provenance.repo_root()
RESULTS = sorted(
  os.path.relpath(p, ROOT)
  for name in ("results.json", "plan.json")  # plan.json: compare_layouts --plan
  for p in glob.glob(os.path.join(ROOT, "docs/results/*", name))
)


def _command(path):
  with open(os.path.join(ROOT, path)) as f:
    return json.load(f)["command"]


def test_there_are_results_files_with_history():
  assert len(RESULTS) >= 10
  log = subprocess.run(["git", "log", "--oneline", "-3"], cwd=ROOT, capture_output=True, text=True)
  assert log.returncode == 0 and len(log.stdout.splitlines()) == 3, "needs the git history"


# Experiments whose results judge nothing by design (and why); every other results file's config
# must fix goals.
NO_GOALS = {
  "experiments/project_speedup.py": "a projection under assumptions it records, not a measurement",
}


@pytest.mark.parametrize("path", RESULTS)
def test_every_goal_is_complete_and_dated(path):
  goals = goal_lib.goals_for_command(_command(path))
  exempt = any(script in _command(path) for script in NO_GOALS)
  assert goals or exempt, f"{path}: its config defines no goals"
  for name, goal in goals.items():
    goal_lib.check_goal(name, goal)


@pytest.mark.parametrize("path", RESULTS)
def test_no_recorded_goal_was_moved_or_dropped(path):
  """A goal a committed version of the results file recorded is still in the config, at the op
  and target it had then (a new threshold is a new name)."""
  now = goal_lib.goals_for_command(_command(path))
  for name, versions in goal_lib.recorded_history(path, ROOT).items():
    assert name in now, f"{path}: goal {name!r} (recorded at {versions[0]['commit'][:7]}) is gone"
    for v in versions:
      have = {"op": now[name]["op"], "target": now[name]["target"]}
      assert have == {"op": v["op"], "target": v["target"]}, (
        f"{path}: goal {name!r} was {v['op']} {v['target']} at {v['commit'][:7]}; the config "
        f"now says {have['op']} {have['target']}: a changed threshold needs a new name"
      )


def test_a_moved_goal_is_caught(tmp_path):
  """The check above on a history written here: a results file whose goal's target changed
  between two commits."""

  def git(*a):
    subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

  git("init", "-q")
  git("config", "user.email", "t@t")
  git("config", "user.name", "t")
  path = "docs/results/x/results.json"
  os.makedirs(tmp_path / "docs/results/x")
  for target in (1.15, 1.1, 1.1):
    goal = {"metric": "r", "op": "<=", "target": target, "value": 1.2, "met": False}
    (tmp_path / path).write_text(json.dumps({"goals": {"ratio": goal}, "r": target}))
    git("add", "-A")
    git("commit", "-qm", f"run at {target}", "--allow-empty")
  history = goal_lib.recorded_history(path, str(tmp_path))
  assert [v["target"] for v in history["ratio"]] == [1.15, 1.1]


def test_a_subrun_is_judged_by_its_own_goals_only():
  """compare_layouts' comparison and its --plan share one config: each is judged by its own."""
  base = "python experiments/compare_layouts.py --config=configs/compare_layouts.py"
  plan = goal_lib.goals_for_command(base + " --plan --workdir=x")
  comparison = goal_lib.goals_for_command(base + " --workdir=x")
  assert "wall_time" in plan and "fsdp8_cp8_arguments" in plan
  assert "fsdp8_cp8_arguments" not in comparison and "parity" in comparison
  assert plan["wall_time"]["target"] == 600.0 and comparison["wall_time"]["target"] == 1200.0


def test_later_goals_are_judged_on_the_files_figures_and_missing_ones_not_measured():
  results = {"goals": {"a": {"metric": "x", "op": "<=", "target": 1, "value": 0.5, "met": True}}}
  results.update(x=0.5, y=2.0)
  fixed_now = {
    "a": {"metric": "x", "op": "<=", "target": 1, "fixed": "2026-11-30"},
    "b": {"metric": "y", "op": "<=", "target": 1.5, "fixed": "2026-12-04"},
    "c": {"metric": "z", "op": ">=", "target": 1, "fixed": "2026-12-04", "needs": "arm Z"},
  }
  judged = goal_lib.judged(results, fixed_now)
  assert judged["a"]["met"] is True and "evaluated_after_run" not in judged["a"]
  assert judged["b"]["met"] is False and judged["b"]["evaluated_after_run"]
  assert judged["c"]["met"] is None and judged["c"]["value"] is None
  with pytest.raises(KeyError):  # a goal with a misspelt metric is an error, not "not measured"
    provenance.evaluate_goals({"d": {"metric": "zz", "op": "<=", "target": 1}}, results)
  with pytest.raises(ValueError, match="fixed"):
    goal_lib.check_goal("e", {"metric": "x", "op": "<=", "target": 1, "what": "w"})


def test_a_restored_run_names_its_commit_and_is_refused_once_its_code_changed(tmp_path):
  """`provenance.check_restorable` on a repository written here: a run without its commit, one
  whose code changed since (refused), one where only docs changed (restored)."""

  def git(*a):
    subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

  git("init", "-q")
  git("config", "user.email", "t@t")
  git("config", "user.name", "t")
  (tmp_path / ".gitignore").write_text("runs/\n")
  os.makedirs(tmp_path / "specdraft")
  (tmp_path / "specdraft/x.py").write_text("A = 1\n")
  git("add", "-A")
  git("commit", "-qm", "code")
  run = str(tmp_path / "runs/arm_seed0")
  os.makedirs(run)
  with pytest.raises(ValueError, match="produced_at"):
    provenance.check_restorable(run, cwd=str(tmp_path))
  record = provenance.record_produced(run, cwd=str(tmp_path))
  assert record["commit"] and not record["dirty"]
  (tmp_path / "README.md").write_text("docs only\n")
  git("add", "-A")
  git("commit", "-qm", "docs")
  assert provenance.check_restorable(run, cwd=str(tmp_path))["commit"] == record["commit"]
  (tmp_path / "specdraft/x.py").write_text("A = 2\n")
  git("add", "-A")
  git("commit", "-qm", "code changed")
  with pytest.raises(ValueError, match="changed since"):
    provenance.check_restorable(run, cwd=str(tmp_path))


def test_corrected_interval_bound_covers_the_exact_welch_interval():
  """The two-look restatement's bound on a 97.5% Welch half-width, from the 95% interval only, is
  never below the exact 97.5% half-width computed from the seeds (unequal and equal spreads),
  and is tight within the t ratio's range."""
  import numpy as np
  from scipy import stats

  from experiments.bench import drift

  rng = np.random.default_rng(0)
  for sa, sb in ((0.1, 0.1), (0.05, 0.2), (0.3, 0.01)):
    a, b = rng.normal(0.5, sa, 20), rng.normal(0.5, sb, 20)
    d = drift.diff_stats(a, b)
    va, vb = a.var(ddof=1) / 20, b.var(ddof=1) / 20
    dof = (va + vb) ** 2 / (va**2 / 19 + vb**2 / 19)
    exact = stats.t.ppf(1 - 0.05 / 4, dof) * np.sqrt(va + vb)
    bound = drift.corrected_half_width(d["ci95"], 20, looks=2)
    assert exact <= bound <= exact * 1.25, (exact, bound)


def test_a_figure_is_stale_once_the_code_it_measures_changed(tmp_path):
  """`readme.first_change_since` on a repository written here: fresh after a docs-only commit,
  a change to the renderer and a change to a module the experiment never imports; stale from the
  first commit that changes a module its config imports (through a package and a function-level
  import), and from a config change."""
  from experiments import results_doc as readme

  def git(*a):
    out = subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, text=True)
    return out.stdout.strip()

  def commit(path, text):
    (tmp_path / path).write_text(text)
    git("add", "-A")
    git("commit", "-qm", path)
    return git("rev-parse", "HEAD")

  git("init", "-q")
  git("config", "user.email", "t@t")
  git("config", "user.name", "t")
  os.makedirs(tmp_path / "experiments/bench")
  os.makedirs(tmp_path / "specdraft/decode")
  os.makedirs(tmp_path / "configs")
  for path in (
    "specdraft/__init__.py", "specdraft/decode/__init__.py", "experiments/__init__.py",
    "experiments/bench/__init__.py",
  ):  # fmt: skip
    (tmp_path / path).write_text("")
  # an entry point's benchmark body (experiments/bench/) is measured code like the library's
  (tmp_path / "experiments/e.py").write_text("from experiments.bench import body\n")
  (tmp_path / "experiments/bench/body.py").write_text("from specdraft import x\n")
  (tmp_path / "specdraft/x.py").write_text("A = 1\n")
  (tmp_path / "specdraft/decode/y.py").write_text("def f():\n  from specdraft import x\n")
  (tmp_path / "specdraft/unused.py").write_text("C = 1\n")
  (tmp_path / "configs/exp.py").write_text("from specdraft.decode import y\nB = 1\n")
  results = {
    "commit": commit("README.md", "start\n"),
    "command": "python experiments/e.py --config=configs/exp.py",
  }
  measured = readme.measured_paths(results, str(tmp_path))
  assert {"specdraft/x.py", "specdraft/decode/y.py", "configs/exp.py"} <= set(measured)
  assert {"experiments/e.py", "experiments/bench/body.py"} <= set(measured)
  assert "specdraft/unused.py" not in measured
  for path in ("README.md", "experiments/results_doc.py", "specdraft/unused.py"):
    commit(path, "changed\n")
    assert readme.first_change_since(results, str(tmp_path)) is None, path
  first = commit("specdraft/x.py", "A = 2\n")  # imported only inside a function of y
  commit("configs/exp.py", "from specdraft.decode import y\nB = 2\n")
  assert readme.first_change_since(results, str(tmp_path)) == first
  # a command that times `make run` measures make run's entry point and config
  make_run = {"commit": results["commit"], "command": "python experiments/wall_times.py "
              "--config=configs/wall_times.py:make_run_only --workdir=w"}  # fmt: skip
  paths = readme.measured_paths(make_run, str(tmp_path))
  assert "experiments/train.py" in paths and "configs/default.py" in paths
  ci = {"commit": results["commit"], "command": "python experiments/wall_times.py "
        "--config=configs/wall_times.py --workdir=w"}  # fmt: skip
  assert "tests" in readme.measured_paths(ci, str(tmp_path))


def test_a_change_before_a_move_still_makes_a_figure_stale(tmp_path):
  """The benchmark bodies moved from specdraft/bench to experiments/bench (results_doc.MOVED): a
  results file written before the move, whose body changed and then moved, is stale from the
  change, not from the move (its history is followed under the old path too)."""
  from experiments import results_doc as readme

  def git(*a):
    out = subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, text=True)
    return out.stdout.strip()

  def commit(message):
    git("add", "-A")
    git("commit", "-qm", message)
    return git("rev-parse", "HEAD")

  git("init", "-q")
  git("config", "user.email", "t@t")
  git("config", "user.name", "t")
  for d in ("specdraft/bench", "experiments", "configs"):
    os.makedirs(tmp_path / d)
  for path in ("specdraft/__init__.py", "specdraft/bench/__init__.py", "experiments/__init__.py"):
    (tmp_path / path).write_text("")
  (tmp_path / "specdraft/bench/body.py").write_text("A = 1\n")
  (tmp_path / "configs/exp.py").write_text("B = 1\n")
  (tmp_path / "experiments/e.py").write_text("from specdraft.bench import body\n")
  results = {
    "commit": commit("start"),
    "command": "python experiments/e.py --config=configs/exp.py",
  }
  (tmp_path / "specdraft/bench/body.py").write_text("A = 2\n")
  changed = commit("the body changes")
  git("mv", "specdraft/bench", "experiments/bench")
  (tmp_path / "experiments/e.py").write_text("from experiments.bench import body\n")
  moved = commit("the bodies move")
  assert readme.first_change_since(results, str(tmp_path)) == changed != moved
  assert "specdraft/bench/body.py" in readme.measured_paths(results, str(tmp_path))
