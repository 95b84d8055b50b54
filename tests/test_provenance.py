"""Results files carry their provenance and goals; repository results need a clean tree."""

import json
import os
import subprocess

import pytest

from specdraft.bench import provenance


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
