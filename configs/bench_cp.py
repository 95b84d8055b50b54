"""Context-parallel branch attention: memory against the floor (compile-only), work balance from
the ring's own counter, and speed, ring beside all-gather.

Run:   python experiments/bench_cp.py --config=configs/bench_cp.py --workdir=runs/bench_cp
Smoke: python experiments/bench_cp.py --config=configs/bench_cp.py:smoke --workdir=/tmp/bcp
"""

from __future__ import annotations

import ml_collections

from specdraft.config import parse_arg


def _goals(cases, speed_goal: bool):
  """Fixed before the run (copied into results.json with pass/fail)."""
  g = {}
  for case in cases:
    name = f"{case['branch']}_W{case['W']}_K{case['kv_heads']}"
    g[f"{name}_ring_near_floor"] = dict(
      metric=f"summary.{name}.ring_peak_over_floor_max",
      fixed="2026-11-30",
      op="<=",
      target=2.5,
      what=f"{name}: ring peak / floor, worst cp",
    )
    g[f"{name}_ring_flat"] = dict(
      metric=f"summary.{name}.ring_flatness",
      fixed="2026-11-30",
      op="<=",
      target=1.1,
      what=f"{name}: ring peak, largest cp / smallest cp > 1 (S/cp fixed)",
    )
  g["mha_ring_below_allgather"] = dict(
    metric="summary.ttt_W7_K32.allgather_over_ring_min_cp_ge_4",
    fixed="2026-11-30",
    op=">",
    target=1.0,
    what="MHA (K = H): all-gather / ring peak at every cp >= 4",
  )
  g["zigzag_balanced_whole_row"] = dict(
    metric="summary.work.whole_row_document_zigzag_max_over_mean",
    fixed="2026-11-30",
    op="<=",
    target=1.05,
    what="zigzag per-rank work max/mean, one causal document over the row",
  )
  g["zigzag_balanced_packed"] = dict(
    metric="summary.work.packed_zigzag_max_over_mean",
    fixed="2026-11-30",
    op="<=",
    target=1.05,
    what="zigzag per-rank work max/mean, packed rows (worst seed)",
  )
  # added with the per-document zigzag order (fixed before its first run)
  g["document_zigzag_balanced_packed"] = dict(
    metric="summary.work.packed_document_max_over_mean",
    fixed="2026-11-30",
    op="<=",
    target=1.05,
    what="per-document zigzag per-rank work max/mean, packed rows (worst seed)",
  )
  g["contiguous_visibly_worse_packed"] = dict(
    metric="summary.work.packed_contiguous_max_over_mean",
    fixed="2026-11-30",
    op=">=",
    target=1.25,
    what="contiguous per-rank work max/mean, packed rows (worst seed): visibly unbalanced",
  )
  if speed_goal:
    g["ring_faster_than_allgather"] = dict(
      metric="summary.speed.ring_over_allgather",
      fixed="2026-11-30",
      op="<=",
      target=0.7,
      what="fwd+bwd time, ring / all-gather",
    )
  return g


def get_config(arg: str | None = None):
  arg = parse_arg(arg, smoke=False)
  c = ml_collections.ConfigDict()
  case = lambda branch, W, kv_heads: dict(branch=branch, W=W, kv_heads=kv_heads)
  c.bench_cp = dict(
    batch=1,
    heads=32,
    head_dim=128,
    # TTT (W = 7) and DFlash blocks (W = 16) at GQA K = 8; MHA (K = H) where trunk K/V are as
    # large as the queries, the case all-gather handles worst.
    cases=[case("ttt", 7, 8), case("block", 16, 8), case("ttt", 7, 32)],
    tokens_per_rank=32768,
    cps=(1, 2, 4, 8),
    impls=("ring", "allgather", "dense"),
    dense_max_tokens=32768,
    tile=512,
    # work from the ring's counter (it runs the forward, so tiny heads): 64K tokens over 8 ranks,
    # packed rows with one long document (a quarter of the row) among many short ones (geometric
    # lengths, mean 2048), tail padding; document lengths rounded up to 2*cp tokens
    work=dict(
      tokens=65536, cp=8, tile=512, W=7, seeds=3, long_fraction=0.25, mean_short=2048, pad=1024
    ),
    # fwd+bwd time at a size that runs on 8 simulated CPU devices
    speed=dict(
      tokens=8192,
      cp=8,
      heads=8,
      kv_heads=2,
      head_dim=64,
      W=7,
      branch="ttt",
      tile=256,
      repeats=5,
      long_fraction=0.25,
      mean_short=512,
      pad=64,
    ),
  )
  if arg.smoke:
    c.bench_cp.update(
      heads=4,
      head_dim=16,
      cases=[case("ttt", 3, 2), case("block", 4, 2), case("ttt", 3, 4)],
      tokens_per_rank=64,
      cps=(1, 2, 4),
      dense_max_tokens=128,
      tile=16,
    )
    c.bench_cp.work.update(tokens=1024, cp=4, tile=16, W=3, seeds=1, mean_short=32, pad=8)
    c.bench_cp.speed.update(tokens=256, cp=4, heads=4, head_dim=16, W=3, tile=16, repeats=2)
    c.bench_cp.speed.update(mean_short=16, pad=8)
  c.bench_cp.goals = _goals(c.bench_cp.cases, speed_goal=True)
  if arg.smoke:  # the smoke variant checks the plumbing; its MHA case is K = 4 = H
    c.bench_cp.goals.mha_ring_below_allgather.metric = (
      "summary.ttt_W3_K4.allgather_over_ring_min_cp_ge_4"
    )
  return c
