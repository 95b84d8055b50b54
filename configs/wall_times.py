"""Wall times of the README's commands on this machine, measured from clean clones.

Run:   python experiments/wall_times.py --config=configs/wall_times.py --workdir=docs/results/wall_times
Smoke: python experiments/wall_times.py --config=configs/wall_times.py:smoke --workdir=/tmp/wall_times
`make run` alone (one clean clone, its environment built first and not counted):
       python experiments/wall_times.py --config=configs/wall_times.py:make_run_only \
         --workdir=docs/results/make_run
`make run` on the long-tailed task (CONFIG=configs/default.py:longtail), the same way:
       python experiments/wall_times.py --config=configs/wall_times.py:make_run_longtail \
         --workdir=docs/results/make_run_longtail

Each CI run clones HEAD into a fresh directory and runs the steps of `.ci/run` one by one
(`make venv`, `make lint`, `make test`, `make test-slow`), timing each; `make run` is then timed
once in the last clone. The goals are the CI budget the project holds itself to.
"""

from __future__ import annotations

import ml_collections

from specdraft.config import parse_arg


def get_config(arg: str | None = None):
  arg = parse_arg(
    arg, smoke=False, runs=3, make_run=True, make_run_only=False, make_run_longtail=False
  )
  c = ml_collections.ConfigDict()
  if arg.make_run_longtail:
    return _make_run_longtail(c)
  if arg.make_run_only:
    return _make_run_only(c)
  c.runs = 1 if arg.smoke else arg.runs
  c.make_run = arg.make_run and not arg.smoke
  # The smoke variant checks the plumbing on one test file instead of the suites.
  c.steps = ["venv", "lint", "test", "test-slow"]
  c.smoke_pytest = "tests/test_provenance.py" if arg.smoke else ""
  c.goals = dict(
    all_passed={
      "metric": "all_passed",
      "fixed": "2026-11-30",
      "op": "==",
      "target": True,
      "what": "every CI run passed",
    },
    make_test={
      "metric": "max_test_s",
      "fixed": "2026-11-30",
      "op": "<=",
      "target": 900.0,
      "what": "make test (slowest run), seconds",
    },
    ci_total={
      "metric": "max_total_s",
      "fixed": "2026-11-30",
      "op": "<=",
      "target": 3900.0,
      "what": ".ci/run steps in total (slowest run), seconds",
    },
    make_run={
      "metric": "make_run_s",
      "fixed": "2026-11-30",
      "needs": "make_run=True (make run timed too)",
      "op": "<=",
      "target": 1200.0,
      "what": "make run, seconds",
    },
  )
  return c


def _make_run_only(c):
  """`make run` timed in one clean clone (after `make venv`), with the goals its summary must
  meet: the run fits the README's budget, co-trained SD rollouts are 1.5x faster than AR ones
  (the SD-vs-AR report measured at the end of the run), and the RL phase has something to learn
  (reward after SFT at most 0.7, rising over the RL steps) at a policy entropy of at least 0.3
  nats per token."""
  c.runs, c.make_run, c.steps, c.smoke_pytest = 1, True, ["venv"], ""
  summary = "make_run_summary"
  c.goals = dict(
    make_run={
      "metric": "make_run_s",
      "fixed": "2026-11-30",
      "op": "<=",
      "target": 1200.0,
      "what": "make run, seconds",
    },
    sd_speedup={
      "metric": f"{summary}.rollout.speedup",
      "fixed": "2026-12-01",
      "op": ">=",
      "target": 1.5,
      "what": "co-trained SD rollouts vs AR rollouts, wall-clock speedup",
    },
    reward_after_sft={
      "metric": f"{summary}.reward_first",
      "fixed": "2026-12-01",
      "op": "<=",
      "target": 0.7,
      "what": "RL reward over the first RL steps (the SFT policy)",
    },
    reward_rises={
      "metric": "make_run_reward_gain",
      "fixed": "2026-12-01",
      "op": ">",
      "target": 0.0,
      "what": "RL reward, last steps minus first steps",
    },
    entropy={
      "metric": f"{summary}.entropy_first",
      "fixed": "2026-12-01",
      "op": ">=",
      "target": 0.3,
      "what": "policy entropy over the first RL steps, nats per token",
    },
  )
  return c


def _make_run_longtail(c):
  """`make run CONFIG=configs/default.py:longtail` (the long-tailed task, auto G, compaction in
  both arms) timed in one clean clone, with the speed goal of the long-tailed task: co-trained SD
  rollouts decoded as the run decodes them (`rollout.as_run`: finished rows compacted away in
  both arms, G chosen per round) at least 1.5x AR's on held-out prompts."""
  c.runs, c.make_run, c.steps, c.smoke_pytest = 1, True, ["venv"], ""
  c.make_run_config, c.make_run_name = "longtail", "longtail"
  summary = "make_run_summary"
  c.goals = dict(
    sd_speedup_as_run={
      "metric": f"{summary}.rollout.as_run.speedup",
      "fixed": "2026-12-05",
      "op": ">=",
      "target": 1.5,
      "what": "co-trained SD rollouts vs AR rollouts as the run decodes them (compaction in "
      "both, auto G), wall-clock speedup on held-out prompts",
    },
    sd_speedup={
      "metric": f"{summary}.rollout.speedup",
      "fixed": "2026-12-05",
      "op": ">=",
      "target": 1.5,
      "what": "co-trained SD rollouts (G = decode.num_draft every round, no compaction) vs AR "
      "rollouts, wall-clock speedup on held-out prompts",
    },
    reward_rises={
      "metric": "make_run_reward_gain",
      "fixed": "2026-12-05",
      "op": ">",
      "target": 0.0,
      "what": "RL reward, last steps minus first steps",
    },
  )
  return c
