"""Times the README's commands (`.ci/run`'s steps, `make run`) in clean clones of HEAD.

A clean clone has no `.venv`, so every run builds its environment as CI does. Results are written
with their provenance (command, commit, date, machine) by `provenance.write_results`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time

from experiments.bench import provenance

_SUMMARY_RE = re.compile(r"=+ (.*) in [\d.]+s")


def pytest_counts(output: str) -> dict[str, int]:
  """Counts from pytest's closing line, e.g. '== 120 passed, 3 deselected in 600.1s =='."""
  lines = [m.group(1) for m in _SUMMARY_RE.finditer(output)]
  counts: dict[str, int] = {}
  if lines:
    for part in lines[-1].split(","):
      num, _, what = part.strip().partition(" ")
      if num.isdigit():
        counts[what.strip()] = int(num)
  return counts


def _run_step(clone: str, step: str | list[str], env: dict, log) -> tuple[float, bool, str]:
  """`make <step>` (a target, or a target with its variables) in `clone`, timed."""
  args = [step] if isinstance(step, str) else list(step)
  t0 = time.perf_counter()
  proc = subprocess.run(
    ["make", *args], cwd=clone, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  seconds = time.perf_counter() - t0
  log.write(f"\n===== make {' '.join(args)}: rc={proc.returncode} {seconds:.1f}s\n{proc.stdout}")
  log.flush()
  return seconds, proc.returncode == 0, proc.stdout


def ci_run(repo: str, steps, logs: str, index: int, smoke_pytest: str = "") -> tuple[dict, str]:
  """One clean clone, `.ci/run`'s steps timed one by one; returns (row, clone dir)."""
  clone = tempfile.mkdtemp(prefix=f"specdraft-ci{index}-")
  subprocess.run(["git", "clone", "-q", repo, clone], check=True)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["CI"] = "true"
  if smoke_pytest:
    # Plumbing check only: one small test file in place of the suites.
    with open(os.path.join(clone, "Makefile"), "a") as f:
      f.write(f"\nsmoke-test: $(STAMP)\n\t$(BIN)/python -m pytest {smoke_pytest}\n")
    steps = [s if s not in ("test", "test-slow") else "smoke-test" for s in steps]
    steps = list(dict.fromkeys(steps))
  row: dict = {"clone": clone, "passed": True, "tests_passed": 0, "tests_failed": 0}
  with open(os.path.join(logs, f"ci_run_{index}.log"), "w") as log:
    for step in steps:
      seconds, ok, out = _run_step(clone, step, env, log)
      row[f"{step.replace('-', '_')}_s"] = round(seconds, 1)
      counts = pytest_counts(out)
      row["tests_passed"] += counts.get("passed", 0)
      row["tests_failed"] += counts.get("failed", 0) + counts.get("errors", 0)
      if not ok:
        row["passed"] = False
        row["failed_step"] = step
        break
  row["total_s"] = round(sum(v for k, v in row.items() if k.endswith("_s")), 1)
  return row, clone


def time_make_run(
  clone: str, logs: str, config_arg: str = "", run_name: str = "default"
) -> tuple[float, dict | None]:
  """`make run` timed in `clone` (with CONFIG=configs/default.py:<config_arg> when given); its
  run's summary.json."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  step = ["run", f"RUN_NAME={run_name}"]
  if config_arg:
    step.append(f"CONFIG=configs/default.py:{config_arg}")
  with open(os.path.join(logs, "make_run.log"), "w") as log:
    seconds, ok, _ = _run_step(clone, step, env, log)
  path = os.path.join(clone, "runs", run_name, "summary.json")
  summary = None
  if ok and os.path.exists(path):
    with open(path) as f:
      summary = json.load(f)
  return round(seconds, 1), summary


def run(config, workdir: str) -> dict:
  provenance.check_workdir(workdir)
  repo = provenance.repo_root()
  # The logs stay outside the work tree: results.json must be the run's first write there (a
  # results file records `git status` as it was when it was written).
  logs = tempfile.mkdtemp(prefix="specdraft-wall-times-logs-")
  print(f"logs: {logs}", flush=True)
  rows, clones = [], []
  for i in range(config.runs):
    row, clone = ci_run(repo, list(config.steps), logs, i, config.smoke_pytest)
    rows.append(row)
    clones.append(clone)
    print(json.dumps(row), flush=True)
  payload: dict = {
    "steps": list(config.steps),
    "ci_runs": [{k: v for k, v in r.items() if k != "clone"} for r in rows],
    "all_passed": all(r["passed"] for r in rows),
    "max_test_s": max(r.get("test_s", r.get("smoke_test_s", 0.0)) for r in rows),
    "max_total_s": max(r["total_s"] for r in rows),
  }
  if config.make_run:
    payload["make_run_s"], payload["make_run_summary"] = time_make_run(
      clones[-1], logs, config.get("make_run_config", ""), config.get("make_run_name", "default")
    )
    if config.get("make_run_config"):
      payload["make_run_command"] = (
        f"make run CONFIG=configs/default.py:{config.make_run_config} "
        f"RUN_NAME={config.make_run_name}"
      )
    summary = payload["make_run_summary"] or {}
    first, last = summary.get("reward_first"), summary.get("reward_last")
    payload["make_run_reward_gain"] = None if first is None or last is None else last - first
    print(f"make run: {payload['make_run_s']} s", flush=True)
  out = provenance.write_results(workdir, payload, goals=provenance.goals_from_config(config.goals))
  print(provenance.goals_table(out["goals"]), flush=True)
  for clone in clones:
    shutil.rmtree(clone, ignore_errors=True)
  return out
