"""The entry points other than train.py that join a multi-process run, run for real on 2 local
processes x 4 devices (gloo collectives between them): the long-context run (cp8, process 0
reporting) and the drift experiment (its arms and tau measurements as on 1 process x 8). A module
of its own, so that the slow suite's workers share the multi-process runs."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _multiprocess import assert_same, read_jsonl, run_on_two_processes

from specdraft.tasks import datasets as task_data

# The long-context run's entry point joins a multi-process run too (cp8 over 2 processes x 4
# devices); it replaces an in-process cp8 smoke run of the same config (tests/test_long.py).
# Shortened: every phase runs, checkpoints and evaluates.
LONG_SMOKE = {
  "sft.steps": 2,
  "eval.every": 2,
  "checkpoint.every": 2,
  "draft.pretrain_steps": 3,
  "rl.steps": 2,
}


@pytest.mark.slow
def test_the_long_run_entry_point_runs_on_two_processes_and_process_0_reports(tmp_path):
  from configs import long as long_config

  spec = "smoke,layout=cp8,task=frequency"
  d = str(tmp_path / "tfds")
  task_data.prepare(long_config.get_config(spec).task, d)  # once, before any process
  results = str(tmp_path / "results")
  out = run_on_two_processes("long_run.py", "long.py", spec, d, results, LONG_SMOKE)
  rl = read_jsonl(os.path.join(results, "run", "metrics.jsonl"))  # the run beside its results
  steps = LONG_SMOKE["rl.steps"]
  assert [r["step"] for r in rl] == list(range(1, steps + 1))  # one writer: no line twice
  for r in rl:
    assert np.isfinite(r["loss"]) and np.isfinite(r["draft_loss"])
  assert max(r["accept_len"] for r in rl) > 1.0  # SD rollouts accepted drafted tokens
  with open(os.path.join(results, "results.json")) as f:
    written = json.load(f)
  assert written["measured"]["cp"] == 8 and written["measured"]["rl_steps_run"] == steps
  assert "reward.png" in written["plots"]
  # process 0 reports (the measured figures as JSON), process 1 only trains
  assert "[p0] {" in out and "[p1] {" not in out


# The drift experiment's entry point joins a multi-process run: its arms (the RL runs) and its tau
# measurements (SD generations on the held-out prompts, rows over both processes) give what one
# process gives, and process 0 alone writes the results. Arms A and C (`:equivalence`): B differs
# from C only in a draft left untrained.
DRIFT_SMOKE = {
  "sft.steps": 4,
  "draft.pretrain_steps": 2,
  "rl.steps": 3,
  "eval.every": 4,
  "decode.max_new_tokens": 8,
}


@pytest.mark.slow
def test_the_drift_entry_point_runs_on_two_processes_as_on_one(tmp_path):
  from configs import drift as drift_config
  from experiments.bench import drift

  spec = "smoke,layout=dp8,equivalence"
  d = str(tmp_path / "tfds")
  task_data.prepare(drift_config.get_config(spec).task, d)  # once, before any process
  c = drift_config.get_config(spec)
  c.data.data_dir = d
  for key, value in DRIFT_SMOKE.items():
    section, field = key.split(".")
    c[section][field] = value
  one = str(tmp_path / "one")
  drift.run(c, one)  # 1 process x 8 devices, in this process
  two = str(tmp_path / "two")
  out = run_on_two_processes("drift.py", "drift.py", spec, d, two, DRIFT_SMOKE)
  for arm in c.drift.arms:
    run = os.path.join("runs", f"{arm}_seed0", "metrics.jsonl")
    ref = read_jsonl(os.path.join(one, run))
    assert [r["step"] for r in ref] == [1, 2, 3], arm
    assert_same(ref, read_jsonl(os.path.join(two, run)), arm)  # one writer: no line twice either
  with open(os.path.join(one, "results.json")) as f:
    ref = json.load(f)
  with open(os.path.join(two, "results.json")) as f:
    got = json.load(f)
  assert_same(ref["tau_start_by_kind"], got["tau_start_by_kind"], "tau_start_by_kind")
  assert c.drift.arms == ("none", "cotrained")
  for arm in ("cotrained",):
    for k in ("tau_first", "tau_last", "tau_end", "reward_first"):
      assert_same(ref["arms"][arm][k], got["arms"][arm][k], f"arms.{arm}.{k}")
  assert set(got["goals"]) == set(ref["goals"])
  # process 0 reports (the goals table), process 1 only runs its part of every arm
  assert "[p0] " in out and "reward" in out and out.count("seed 0: reward") == len(c.drift.arms)
