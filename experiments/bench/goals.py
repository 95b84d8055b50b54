"""Goal discipline: a goal is fixed once, with its date, and never moved.

A goal lives in an experiment's config (`metric`, `op`, `target`, `what`, `fixed`: the date it was
fixed, before any run it judges). A changed threshold is a new named goal beside the old one; a
goal is never deleted, so every run is judged against every goal ever fixed for its experiment.
A goal whose metric a run may legitimately lack (an optional arm) says so in `needs`, and is then
reported as not measured rather than met or missed.

This module reads the goals back: from a config (`config_goals`), from a results file's command
(`goals_for_command`), and from the git history of a results file (`recorded_history`), which
`tests/test_goal_discipline.py` holds the configs to.
"""

from __future__ import annotations

import datetime
import importlib
import json
import re
import subprocess
from collections.abc import Mapping
from typing import Any

from experiments.bench import provenance

_CONFIG = re.compile(r"--config=configs/(\w+)\.py(?::(\S+))?")


def config_goals(config, *, within: str | None = None, skip: tuple[str, ...] = ()) -> dict:
  """Every goal of a config: the union of all its `goals` mappings, at any depth. Where two
  mappings define different goals of one name, the shallower keeps the name and the deeper one's
  is qualified by the key above it. `within`: only the goals under a key of that name (a run that
  one config's subtree drives, e.g. compare_layouts' `--plan` under `compare.plan`); `skip`: none
  under keys of these names."""
  found: list[tuple[int, str, str, dict]] = []

  def walk(node, path):
    node = node.to_dict() if hasattr(node, "to_dict") else node
    if not isinstance(node, Mapping):
      return
    for key, value in node.items():
      value = value.to_dict() if hasattr(value, "to_dict") else value
      if key in skip:
        continue
      if key == "goals" and isinstance(value, Mapping):
        if within is not None and within not in path:
          continue
        for name, goal in value.items():
          found.append((len(path), path[-1] if path else "", name, dict(goal)))
      else:
        walk(value, (*path, key))

  walk(config, ())
  out: dict[str, dict] = {}
  for _, parent, name, goal in sorted(found, key=lambda f: f[0]):
    if name in out and out[name] != goal:
      name = f"{parent}.{name}"
    if name in out and out[name] != goal:
      raise ValueError(f"goal {name!r} is defined twice, differently")
    out[name] = goal
  return out


def config_for_command(command: str):
  """The config a results file's command ran (`--config=configs/<name>.py[:arg]`), as the code
  defines it now."""
  m = _CONFIG.search(command)
  if m is None:
    raise ValueError(f"no --config=configs/<name>.py in command {command!r}")
  module = importlib.import_module(f"configs.{m.group(1)}")
  return module.get_config(m.group(2))


# Runs that a subtree of their experiment's config drives, named by the flag that selects them
# ({flag: subtree key}): their results are judged by that subtree's goals only, and the
# experiment's other runs by every goal outside it.
SUBRUNS = {"--plan": "plan"}


def goals_for_command(command: str) -> dict[str, dict]:
  """The goals of the run `command` made, as its config defines them now."""
  config = config_for_command(command)
  args = command.split()
  for flag, key in SUBRUNS.items():
    if flag in args:
      return config_goals(config, within=key)
  return config_goals(config, skip=tuple(SUBRUNS.values()))


def check_goal(name: str, goal: Mapping[str, Any]) -> None:
  """A goal's required fields: metric, op, target, what, and `fixed` as YYYY-MM-DD."""
  for field in ("metric", "op", "target", "what", "fixed"):
    if field not in goal:
      raise ValueError(f"goal {name!r} has no {field!r} field (every goal needs {field})")
  if goal["op"] not in provenance.OPS:
    raise ValueError(f"goal {name!r}: op={goal['op']!r}; valid: {sorted(provenance.OPS)}")
  try:
    datetime.date.fromisoformat(goal["fixed"])
  except (TypeError, ValueError):
    raise ValueError(f"goal {name!r}: fixed={goal['fixed']!r} is not a YYYY-MM-DD date") from None


def recorded_history(path: str, root: str | None = None) -> dict[str, list[dict]]:
  """{goal name: [{op, target, commit}, ...]}: every distinct (op, target) a goal of that name had
  in any committed version of the results file at `path` (relative to the repository), oldest
  first. Empty without git history."""
  root = root or provenance.repo_root()
  log = subprocess.run(
    ["git", "log", "--format=%H", "--", path], cwd=root, capture_output=True, text=True
  )
  out: dict[str, list[dict]] = {}
  for commit in reversed(log.stdout.split()):
    shown = subprocess.run(
      ["git", "show", f"{commit}:{path}"], cwd=root, capture_output=True, text=True
    )
    if shown.returncode != 0:
      continue
    try:
      goals = json.loads(shown.stdout).get("goals") or {}
    except json.JSONDecodeError:
      continue
    for name, goal in goals.items():
      if not isinstance(goal, Mapping):  # the first files recorded only pass/fail per name
        continue
      seen = out.setdefault(name, [])
      key = {"op": goal.get("op"), "target": goal.get("target")}
      if not seen or {k: seen[-1][k] for k in key} != key:
        seen.append({**key, "commit": commit})
  return out


def judged(results: Mapping[str, Any], goals: Mapping[str, Mapping[str, Any]]) -> dict:
  """The results file's own evaluated goals, plus every goal of `goals` (the config's now) that it
  does not record, evaluated on its figures (`evaluated_after_run`: the goal was fixed after the
  run wrote the file, or was missing from it)."""
  out = dict(results.get("goals") or {})
  later = {name: g for name, g in goals.items() if name not in out}
  for name, g in provenance.evaluate_goals(later, results, missing_ok=True).items():
    out[name] = {**g, "evaluated_after_run": True}
  return out
