"""Drift experiment: does a co-trained draft keep its acceptance while RL moves the policy?

Run:   python experiments/drift.py --config=configs/drift.py --workdir=runs/drift
Smoke: python experiments/drift.py --config=configs/drift.py:smoke --workdir=/tmp/drift

SFT data mixes two answer formats (95% "columns", 5% "semicolon": same work, other separators);
the RL reward pays only for correct answers in the rare format, so the policy's output
distribution moves. From one SFT policy and one distilled draft, three arms run RL:
A (autoregressive rollouts), B (SD with the fixed draft), C (SD with the co-trained draft),
each over several seeds.
"""

from __future__ import annotations

from configs import default
from specdraft.config import parse_arg


def get_config(arg: str | None = None):
  arg = parse_arg(arg, smoke=False, seeds=3, steps=40)
  c = default.get_config("smoke" if arg.smoke else None)
  c.task.arithmetic.formats = "columns:0.95,semicolon:0.05"
  c.task.arithmetic.reward_format = "semicolon"
  c.rl.steps = 4 if arg.smoke else arg.steps
  c.rl.eval_every = 1000
  c.rl.lr = 5e-4
  c.drift = dict(arms=("none", "fixed", "cotrained"), seeds=1 if arg.smoke else arg.seeds)
  # Fixed before the run (copied into results.json with pass/fail). tau is compared between the
  # first and last window of RL steps (window = steps // 8), averaged over seeds.
  c.drift.goals = dict(
    cotrained_tau_kept=dict(
      metric="arms.cotrained.tau_last_over_first",
      op=">=",
      target=0.95,
      what="C (co-trained draft): tau at the end / tau at the start",
    ),
    fixed_tau_fell=dict(
      metric="arms.fixed.tau_last_over_first",
      op="<=",
      target=0.85,
      what="B (fixed draft): tau at the end / tau at the start (falls by >= 15%)",
    ),
    reward_A_vs_C_within_seed_interval=dict(
      metric="reward_C_minus_A.zero_in_ci95",
      op="==",
      target=True,
      what="final reward C - A: 0 inside its 95% t-interval over seeds",
    ),
  )
  return c
