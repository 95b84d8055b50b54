"""EAGLE-3 vs DFlash vs DSpark on one policy: the same SFT policy, prompts, sampling and number of
proposed tokens per round, each draft distilled for the same steps.

Run:   python experiments/bench_drafts.py --config=configs/bench_drafts.py --workdir=docs/results/bench_drafts
Smoke: python experiments/bench_drafts.py --config=configs/bench_drafts.py:smoke --workdir=/tmp/bd
Deeper block drafts (DFlash and DSpark of 2 layers; EAGLE-3 keeps its one):
       python experiments/bench_drafts.py --config=configs/bench_drafts.py:layers=2 \
         --workdir=docs/results/bench_drafts_layers2

The task and model of configs/bench_rollout.py (a 12-layer policy; one-layer drafts; the
one-format arithmetic scratchpad, 40 new tokens, temperature 1), with G = 3 proposals a round
(the EAGLE-3 draft with K = 3 TTT steps, DFlash with blocks of 4, DSpark with blocks of 3).
"""

from __future__ import annotations

from configs import bench_rollout
from specdraft.config import parse_arg


def get_config(arg: str | None = None):
  """`:markov` (with or without smoke): DFlash, DSpark and DSpark without its Markov head
  ("dspark:markov_rank=0"), the ablation that says whether the head raises tau. `:layers=N`:
  the block drafts (DFlash, DSpark) with N layers (DFlash's reference uses several; one pass of
  an N-layer block draft still costs less than EAGLE-3's G one-layer passes for N < G)."""
  arg = parse_arg(arg, smoke=False, num_draft=3, markov=False, layers=1)
  c = bench_rollout.get_config("smoke" if arg.smoke else None)
  c.draft.block.n_layers = arg.layers
  G = arg.num_draft
  c.decode.num_draft = G
  c.draft.ttt_steps = G  # EAGLE-3 trains as many TTT steps as it proposes
  c.draft.block.block_size = 0  # each block draft's block proposes G tokens
  c.bench = dict(
    kinds=("dflash", "dspark", "dspark:markov_rank=0")
    if arg.markov
    # the last entry is the anchor-slot ablation (its residual at the token's embedding, which
    # the tied head reads back as that token; DSpark's default starts it at MASK), run with the
    # one-layer default only
    else ("eagle3", "dflash", "dspark") + (("dspark:anchor_residual=token",) * (arg.layers == 1)),
    batch_sizes=(1, 4) if arg.smoke else (1, 8, 32, 128),
    num_draft=G,
    temperature=1.0,
    repeats=2 if arg.smoke else 3,
    max_new_tokens=c.decode.max_new_tokens,
  )
  # Fixed before the run (copied into results.json with pass/fail): the comparisons.
  c.bench.goals = dict(
    dflash_tau=dict(
      metric="all_batches.dflash_over_eagle3_tau",
      fixed="2026-12-01",
      op=">=",
      target=1.0,
      what=f"DFlash tau / EAGLE-3 tau at G={G}, T=1 (mean over batch sizes)",
    ),
    dflash_speedup=dict(
      metric="all_batches.dflash_over_eagle3_speedup_smallest_batch",
      fixed="2026-12-01",
      op=">=",
      target=1.0,
      what="DFlash's SD/AR speedup / EAGLE-3's at the smallest batch",
    ),
    markov_head=dict(
      metric="all_batches.dspark_over_dflash_tau",
      fixed="2026-12-01",
      op=">",
      target=1.0,
      what="DSpark tau / DFlash tau (the Markov head raises tau at the same proposals)",
    ),
    greedy_equal=dict(
      metric="all_batches.greedy_equal",
      fixed="2026-12-01",
      op="==",
      target=True,
      what="greedy SD == greedy AR on every row, for every draft and batch size",
    ),
  )
  if arg.markov:  # fixed before the run, like the goals above
    del c.bench.goals["dflash_tau"], c.bench.goals["dflash_speedup"]
    c.bench.goals["markov_head_isolated"] = dict(
      metric="all_batches.dspark_over_no_markov_tau",
      fixed="2026-12-01",
      op=">",
      target=1.0,
      what="DSpark tau / DSpark-without-its-Markov-head tau (same backbone, same proposals)",
    )
  return c
