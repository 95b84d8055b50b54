"""Provenance for every results file: what ran, from which commit, when, on what, against which
goals (fixed in the config before the run).

Every benchmark and experiment writes its results through `write_results`, which puts at the top
level of the JSON object:

  command   the exact command line (interpreter, script, flags)
  commit    `git rev-parse HEAD` at run time, and `dirty` (uncommitted changes present outside the
            run's own outputs in its workdir)
  date      UTC, ISO 8601
  versions  python, jax, jaxlib; `backend`, `devices`, `cpu_count`, `cpu` (processor model)
  loadavg   the machine's 1/5/15-minute load averages when the file is written (other work on a
            2-core machine slows wall-clock figures; ratios measured side by side less so)
  goals     the goals as fixed in the config *before* the run, each with its measured value and
            pass/fail (`evaluate_goals`)

Results destined for the repository (anything under docs/results/) may only be written from a
clean work tree: `check_workdir` refuses a dirty one before the run starts, and `write_results`
refuses again at the end, so a committed figure always names a commit that produced it.

A goal is config data: `{"metric": "<key into the measured dict>", "op": "<=", "target": 1.03,
"what": "a sentence"}`; `op` is one of `<=`, `<`, `>=`, `>`, `==`.
"""

from __future__ import annotations

import datetime
import json
import math
import operator
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt, "==": operator.eq}
HEADER_KEYS = (
  "command",
  "commit",
  "dirty",
  "date",
  "python",
  "jax",
  "jaxlib",
  "backend",
  "devices",
  "cpu_count",
  "cpu",
)


def repo_root() -> str:
  return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _git(*args: str, cwd: str | None = None) -> str | None:
  try:
    out = subprocess.run(
      ["git", *args], cwd=cwd or repo_root(), capture_output=True, text=True, check=True
    )
  except (OSError, subprocess.CalledProcessError):
    return None
  return out.stdout.strip()


def git_commit(cwd: str | None = None) -> str | None:
  return _git("rev-parse", "HEAD", cwd=cwd)


def git_dirty(cwd: str | None = None, exclude: str | None = None) -> bool:
  """True when tracked files differ from HEAD or untracked, non-ignored files exist.

  `exclude`: a directory whose changes do not count (a run's own outputs, written before its
  results file)."""
  args = ["status", "--porcelain"]
  if exclude is not None:
    rel = os.path.relpath(os.path.realpath(exclude), os.path.realpath(cwd or repo_root()))
    args += ["--", ".", f":(exclude){rel}"]
  status = _git(*args, cwd=cwd)
  return status is None or bool(status)


def is_repo_results_dir(workdir: str) -> bool:
  """Whether `workdir` lies under <repo>/docs/results (figures that the docs quote)."""
  results = os.path.realpath(os.path.join(repo_root(), "docs", "results"))
  path = os.path.realpath(workdir)
  return path == results or path.startswith(results + os.sep)


# What a run's figures depend on: a restored run is refused once any of these changed since the
# commit that produced it.
CODE_PATHS = ("specdraft", "configs", "experiments", "pyproject.toml")
PRODUCED_AT = "produced_at.json"


def record_produced(run_dir: str, cwd: str | None = None) -> dict:
  """Writes run_dir/produced_at.json: the commit (and whether the tree was dirty) whose code just
  produced the run there, so that a later experiment may restore it (`check_restorable`)."""
  record = {
    "commit": git_commit(cwd),
    "dirty": git_dirty(cwd, exclude=run_dir),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
  }
  os.makedirs(run_dir, exist_ok=True)
  path = os.path.join(run_dir, PRODUCED_AT)
  with open(path + ".tmp", "w") as f:
    json.dump(record, f)
  os.replace(path + ".tmp", path)
  return record


def check_restorable(run_dir: str, cwd: str | None = None) -> dict:
  """The produced_at record of a finished run that an experiment is about to reuse instead of
  running again; refuses (ValueError) a run that does not say which commit produced it, one
  produced from a dirty tree, and one whose code (CODE_PATHS) changed since that commit."""
  path = os.path.join(run_dir, PRODUCED_AT)
  if not os.path.exists(path):
    raise ValueError(
      f"{run_dir} holds a finished run but no {PRODUCED_AT} (the commit that produced it): its "
      "figures cannot be attributed to this code. Delete the directory to run it again."
    )
  with open(path) as f:
    record = json.load(f)
  if record.get("dirty") or not record.get("commit"):
    raise ValueError(f"{run_dir} was produced from an uncommitted tree ({record}); run it again")
  changed = _git("diff", "--name-only", record["commit"], "HEAD", "--", *CODE_PATHS, cwd=cwd)
  if changed is None:
    raise ValueError(f"{run_dir}: its commit {record['commit']} is not in this repository")
  if changed:
    files = changed.split()
    raise ValueError(
      f"{run_dir} was produced at {record['commit'][:12]}, and the code it depends on changed "
      f"since ({len(files)} files, e.g. {', '.join(files[:3])}): restoring it would report "
      "figures this code did not produce. Delete the directory to run it again."
    )
  return record


# HEAD when each run's workdir was checked at its start: the commit a results file names must be
# the one whose code ran, so a commit made during the run is refused at the end.
_STARTED: dict[str, str | None] = {}


def run_dir_for(workdir: str, default_sub: str) -> str:
  """Where an experiment's own runs (checkpoints, logs) go: runs/<name> at the repository root
  when `workdir` is a committed results directory (docs/results/<name>), else workdir/<sub>."""
  if is_repo_results_dir(workdir):
    return os.path.join(repo_root(), "runs", os.path.basename(workdir.rstrip("/")))
  return os.path.join(workdir, default_sub)


def check_workdir(workdir: str, *, own_outputs_written: bool = False) -> None:
  """Refuses, before any work, to write repository results from an uncommitted tree.

  With `own_outputs_written` (the check at the end of a run) changes inside `workdir` itself,
  the run's own outputs, are allowed; everything else must still equal HEAD, and HEAD must be
  the commit it was at the start of the run."""
  exclude = workdir if own_outputs_written else None
  if not is_repo_results_dir(workdir):
    return
  if git_dirty(exclude=exclude):
    raise RuntimeError(
      f"--workdir={workdir} is under docs/results, but the work tree has uncommitted changes "
      "(git status --porcelain is not empty). Commit first (results must name the commit that "
      "produced them), or write to a directory outside docs/results."
    )
  key, head = os.path.realpath(workdir), git_commit()
  start = _STARTED.setdefault(key, head)
  if own_outputs_written and start != head:
    raise RuntimeError(
      f"HEAD moved from {start} to {head} while the run wrote {workdir}: its results would "
      "name a commit whose code did not run. Run it again from a tree nobody commits to."
    )


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def header(command: list[str] | None = None, *, workdir: str | None = None) -> dict[str, Any]:
  """The provenance fields (see module docstring); jax is imported lazily. `dirty` ignores the
  run's own outputs inside `workdir` (logs and checkpoints written before the results file)."""
  import jax
  import jaxlib

  argv = sys.argv if command is None else command
  return {
    "command": shlex.join(["python", *argv]),
    "commit": git_commit(),
    "dirty": git_dirty(exclude=workdir),
    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    "python": platform.python_version(),
    "jax": jax.__version__,
    "jaxlib": jaxlib.__version__,
    "backend": jax.default_backend(),
    "devices": jax.device_count(),
    "cpu_count": os.cpu_count(),
    "cpu": _cpu_model(),
    "loadavg": [round(x, 2) for x in os.getloadavg()],
  }


def _lookup(measured: Mapping[str, Any], key: str):
  """`a.b.c` walks nested mappings."""
  value: Any = measured
  for part in key.split("."):
    if not isinstance(value, Mapping) or part not in value:
      raise KeyError(f"goal metric {key!r}: {part!r} is not in the measured results")
    value = value[part]
  return value


def evaluate_goals(
  goals: Mapping[str, Mapping[str, Any]], measured: Mapping[str, Any], *, missing_ok: bool = False
) -> dict:
  """Each goal (as fixed in the config) with its measured value and `met` (bool).

  A metric absent from `measured` is an error (a misspelt goal), unless the goal says what it
  `needs` (an optional arm or case a run may leave out) or `missing_ok`: then the goal is
  reported with value None and `met` None (not measured), never as met or missed."""
  out = {}
  for name, goal in goals.items():
    goal = dict(goal)
    op = goal.get("op")
    if op not in OPS:
      raise ValueError(f"goal {name!r}: op={op!r} is invalid; valid ops: {sorted(OPS)}")
    try:
      value = _lookup(measured, goal["metric"])
    except KeyError:
      if not (missing_ok or goal.get("needs")):
        raise
      out[name] = {**goal, "value": None, "met": None}
      continue
    met = value is not None and not (isinstance(value, float) and math.isnan(value))
    met = bool(met and OPS[op](value, goal["target"]))
    out[name] = {**goal, "value": value, "met": met}
  return out


def goals_from_config(goals) -> dict:
  """A ConfigDict/dict of goals as plain dicts (so they serialise as fixed before the run)."""
  if goals is None:
    return {}
  if hasattr(goals, "to_dict"):
    goals = goals.to_dict()
  return {k: dict(v) for k, v in goals.items()}


def write_results(
  workdir: str,
  payload: Mapping[str, Any],
  *,
  goals: Mapping[str, Mapping[str, Any]] | None = None,
  measured: Mapping[str, Any] | None = None,
  filename: str = "results.json",
  command: list[str] | None = None,
) -> dict:
  """Writes `{header..., goals, **payload}` to workdir/filename; returns the object written.

  `goals` are evaluated against `measured` (default: the payload). Refuses a dirty tree when
  `workdir` is under docs/results (changes inside `workdir`, the run's own outputs, excepted).
  """
  check_workdir(workdir, own_outputs_written=True)
  clash = set(payload) & set((*HEADER_KEYS, "loadavg", "goals"))
  if clash:
    raise ValueError(f"results payload may not set provenance keys {sorted(clash)}")
  out = header(command, workdir=workdir)
  out["goals"] = evaluate_goals(goals or {}, payload if measured is None else measured)
  out.update(payload)
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, filename)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(out, f, indent=2, default=_jsonable)
    f.write("\n")
  os.replace(tmp, path)
  return out


def publish(workdir: str, results: Mapping[str, Any], goals, *, table, plot, plot_name: str):
  """Writes results.json (with provenance and the evaluated goals), table.md and the plot; prints
  the table and the goals. Returns the object written."""
  results = write_results(workdir, results, goals=goals_from_config(goals))
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(table(results) + "\n")
  plot(results, os.path.join(workdir, plot_name))
  print(table(results))
  print(goals_table(results["goals"]))
  return results


def _jsonable(x):
  try:
    import numpy as np

    if isinstance(x, np.generic):
      return x.item()
    if isinstance(x, np.ndarray):
      return x.tolist()
  except ImportError:
    pass
  if isinstance(x, tuple | set):
    return list(x)
  raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def goals_table(goals: Mapping[str, Mapping[str, Any]]) -> str:
  """A markdown table of goals: what, target, measured, met."""
  lines = ["| goal | target | measured | met |", "|---|---|---|---|"]
  for name, g in goals.items():
    v = g["value"]
    v = f"{v:.4g}" if isinstance(v, float) else v
    what = g.get("what", name)
    met = "not measured" if g["met"] is None else "yes" if g["met"] else "NO"
    lines.append(f"| {what} | {g['op']} {g['target']} | {v} | {met} |")
  return "\n".join(lines)
