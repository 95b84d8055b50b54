"""Wall times of the README's commands on this machine, measured from clean clones.

Run:   python experiments/wall_times.py --config=configs/wall_times.py --workdir=docs/results/wall_times
Smoke: python experiments/wall_times.py --config=configs/wall_times.py:smoke --workdir=/tmp/wall_times

Each CI run clones HEAD into a fresh directory and runs the steps of `.ci/run` one by one
(`make venv`, `make lint`, `make test`, `make test-slow`), timing each; `make run` is then timed
once in the last clone. The goals are the CI budget the project holds itself to.
"""

from __future__ import annotations

import ml_collections

from specdraft.config import parse_arg


def get_config(arg: str | None = None):
  arg = parse_arg(arg, smoke=False, runs=3, make_run=True)
  c = ml_collections.ConfigDict()
  c.runs = 1 if arg.smoke else arg.runs
  c.make_run = arg.make_run and not arg.smoke
  # The smoke variant checks the plumbing on one test file instead of the suites.
  c.steps = ["venv", "lint", "test", "test-slow"]
  c.smoke_pytest = "tests/test_provenance.py" if arg.smoke else ""
  c.goals = dict(
    all_passed={"metric": "all_passed", "op": "==", "target": True, "what": "every CI run passed"},
    make_test={
      "metric": "max_test_s",
      "op": "<=",
      "target": 900.0,
      "what": "make test (slowest run), seconds",
    },
    ci_total={
      "metric": "max_total_s",
      "op": "<=",
      "target": 3900.0,
      "what": ".ci/run steps in total (slowest run), seconds",
    },
  )
  if c.make_run:
    c.goals.make_run = {
      "metric": "make_run_s",
      "op": "<=",
      "target": 1200.0,
      "what": "make run, seconds",
    }
  return c
