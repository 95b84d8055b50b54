"""Context-parallel memory / work plan (compile-only; nothing is allocated).

Run:   python experiments/bench_cp.py --config=configs/bench_cp.py --workdir=runs/bench_cp
Smoke: python experiments/bench_cp.py --config=configs/bench_cp.py:smoke --workdir=/tmp/bcp
"""

from __future__ import annotations

import ml_collections

from specdraft.config import parse_arg


def get_config(arg: str | None = None):
  arg = parse_arg(arg, smoke=False)
  c = ml_collections.ConfigDict()
  c.bench_cp = dict(
    batch=1,
    heads=32,
    kv_heads=8,
    head_dim=128,
    ttt_width=7,
    block_width=16,
    tokens_per_rank=32768,
    cps=(1, 2, 4, 8),
    impls=("ring", "allgather", "dense"),
    dense_max_tokens=32768,
    tile=512,
    work_tokens=262144,
  )
  # Fixed before the run (copied into results.json with pass/fail): the ring's per-device memory
  # stays flat as cp grows at fixed S/cp (smallest cp > 1 to the largest), and stays below the
  # all-gather baseline at the largest cp.
  c.bench_cp.goals = {}
  for branch in ("ttt", "block"):
    c.bench_cp.goals[f"{branch}_ring_flat"] = dict(
      metric=f"summary.{branch}.ring_flatness",
      op="<=",
      target=1.1,
      what=f"{branch} branch: ring peak bytes, largest cp / smallest cp > 1 (S/cp fixed)",
    )
    c.bench_cp.goals[f"{branch}_ring_below_allgather"] = dict(
      metric=f"summary.{branch}.allgather_over_ring_at_max_cp",
      op=">",
      target=1.0,
      what=f"{branch} branch: all-gather / ring peak bytes at the largest cp",
    )
  if arg.smoke:
    c.bench_cp.update(
      heads=4,
      kv_heads=2,
      head_dim=16,
      tokens_per_rank=64,
      cps=(1, 2),
      dense_max_tokens=128,
      tile=16,
      work_tokens=1024,
      ttt_width=3,
      block_width=4,
    )
  return c
