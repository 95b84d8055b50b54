"""Step-time benchmark: the co-training step against an RL-only step on the same batch.

Run:   python experiments/bench_step.py --config=configs/bench_step.py --workdir=runs/bench_step
Smoke: python experiments/bench_step.py --config=configs/bench_step.py:smoke --workdir=/tmp/bs
"""

from __future__ import annotations

from configs import default
from specdraft.config import parse_arg


def get_config(arg: str | None = None):
  arg = parse_arg(arg, smoke=False, size="bench")
  c = default.get_config("smoke" if arg.smoke else f"size={arg.size}")
  c.bench_step = dict(batch_size=64, seq_len=64, repeats=7, ttt_steps=(1, 3, 7))
  if arg.smoke:
    c.bench_step.update(batch_size=8, seq_len=32, repeats=2, ttt_steps=(2,))
  # Fixed before the run (copied into results.json with pass/fail): a co-training step costs at
  # most 1.15x an RL-only step on the same batch, judged at every TTT step count K.
  c.bench_step.goals = {
    f"ratio_k{k}": dict(
      metric=f"ratio_by_ttt_steps.{k}",
      op="<=",
      target=1.15,
      what=f"co-train / RL-only step time, TTT steps K={k}",
    )
    for k in c.bench_step.ttt_steps
  }
  return c
