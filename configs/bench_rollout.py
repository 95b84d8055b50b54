"""SD-vs-AR rollout benchmark: the same checkpoint, prompts, G and sampling for both.

Run:   python experiments/bench_rollout.py --config=configs/bench_rollout.py --workdir=runs/bench_rollout
Smoke: python experiments/bench_rollout.py --config=configs/bench_rollout.py:smoke --workdir=/tmp/br

The policy is sized like real systems relative to its draft (12 layers against the draft's one),
trained here first (SFT + draft distillation; skipped when the workdir already holds them).
"""

from __future__ import annotations

from configs import default
from specdraft.config import parse_arg


def get_config(arg: str | None = None):
  arg = parse_arg(arg, smoke=False, task="arithmetic")
  c = default.get_config(f"size=bench,task={arg.task}" + (",smoke" if arg.smoke else ""))
  c.rl.steps = 0  # the benchmark needs the SFT policy and the distilled draft only
  if not arg.smoke:
    c.sft.steps, c.sft.lr = 800, 2e-3
    c.eval.every = c.checkpoint.every = 400
    c.draft.pretrain_steps = 300
  c.bench = dict(
    batch_sizes=(1, 8, 32, 128), num_draft=5, temperature=1.0, repeats=3, max_new_tokens=40
  )
  if arg.smoke:
    c.bench.batch_sizes, c.bench.repeats, c.bench.max_new_tokens = (1, 4), 2, 16
  return c
