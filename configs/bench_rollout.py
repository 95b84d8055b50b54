"""SD-vs-AR rollout benchmark: the same checkpoint, prompts, G and sampling for both.

Run:   python experiments/bench_rollout.py --config=configs/bench_rollout.py --workdir=runs/bench_rollout
Smoke: python experiments/bench_rollout.py --config=configs/bench_rollout.py:smoke --workdir=/tmp/br
Adaptive G (decode.speculation = auto) against AR and every fixed G, all with finished rows
compacted away, at batch 1..128:
       python experiments/bench_rollout.py --config=configs/bench_rollout.py:auto \
         --workdir=docs/results/bench_rollout_auto
G sweep at the default run's setting (which G makes SD fastest for `make run`):
       python experiments/bench_rollout.py --config=configs/bench_rollout.py:sweep \
         --workdir=docs/results/bench_num_draft

The policy is sized like real systems relative to its draft (12 layers against the draft's one),
trained here first (SFT + draft distillation; skipped when the workdir already holds them).
The timing is `specdraft/decode/compare.py::compare_rollouts`, which defines tau, policy passes
per token and `greedy_equal`.
"""

from __future__ import annotations

from configs import default
from specdraft.config import parse_arg


def get_config(arg: str | None = None):
  arg = parse_arg(arg, smoke=False, task="arithmetic", sweep=False, auto=False, gpu=False)
  if arg.sweep:
    return sweep_config(arg.smoke)
  if arg.auto:
    return adaptive_config(arg.smoke, arg.task, arg.gpu)
  c = default.get_config(f"size=bench,task={arg.task}" + (",smoke" if arg.smoke else ""))
  c.rl.steps = 0  # the benchmark needs the SFT policy and the distilled draft only
  if not arg.smoke:
    c.sft.steps, c.sft.lr = 800, 2e-3
    c.eval.every = c.checkpoint.every = 400
    c.draft.pretrain_steps, c.draft.ttt_steps = 300, 7
    # the one-format scratchpad this benchmark was first measured on (the default run's free
    # variation and rare rewarded format are a separate setting)
    c.task.arithmetic.update(formats="columns", reward_format="", free_order=False, space_prob=0.0)
    c.decode.max_new_tokens = 40
  # G = num_draft tokens proposed per SD round; T = temperature of both AR and SD sampling.
  c.bench = dict(
    batch_sizes=(1, 8, 32, 128), num_draft=5, temperature=1.0, repeats=3, max_new_tokens=40
  )
  if arg.smoke:
    c.bench.batch_sizes, c.bench.repeats, c.bench.max_new_tokens = (1, 4), 2, 16
  c.bench.goals = goals(c.bench.batch_sizes, c.bench.num_draft, c.bench.temperature)
  return c


def goals(batch_sizes, num_draft: int, temperature: float) -> dict:
  """Fixed before the run and copied into results.json with pass/fail."""
  small, large = min(batch_sizes), max(batch_sizes)
  return dict(
    tau=dict(
      metric="all_batches.tau_min",
      fixed="2026-11-30",
      op=">=",
      target=3.5,
      what=f"tau at G={num_draft}, T={temperature:g} (lowest over batch sizes)",
    ),
    greedy_equal=dict(
      metric="all_batches.greedy_equal",
      fixed="2026-11-30",
      op="==",
      target=True,
      what="greedy SD tokens == greedy AR tokens on every row, exactly (every batch size)",
    ),
    speedup_smallest_batch=dict(
      metric=f"by_batch.{small}.speedup",
      fixed="2026-11-30",
      op=">=",
      target=2.0,
      what=f"SD/AR tokens per second at batch {small}",
    ),
    speedup_largest_batch=dict(
      metric=f"by_batch.{large}.speedup",
      fixed="2026-11-30",
      op=">",
      target=1.0,
      what=f"SD/AR tokens per second at batch {large}",
    ),
  )


def sweep_config(smoke: bool = False):
  """SD at several G against AR on the default run's SFT policy and distilled draft
  (configs/default.py: its task, sizes, K, batch of held-out prompts and 60 new tokens), all timed
  side by side by `decode.compare.sweep_num_draft`."""
  c = default.get_config("smoke" if smoke else None)
  c.rl.steps = 0  # the SFT policy and the distilled draft that make run's RL phase starts from
  c.bench = dict(
    batch_sizes=(c.eval.batch_size,),
    num_draft_sweep=(1, 2, 3, 4, 5, 6) if not smoke else (1, 2),
    temperature=c.rl.temperature,
    repeats=2 if smoke else 5,
    max_new_tokens=c.decode.max_new_tokens,
  )
  c.bench.goals = dict(
    best_speedup=dict(
      metric="sweep.best_speedup",
      fixed="2026-12-01",
      op=">=",
      target=1.5,
      what=f"SD/AR tokens per second at the best G, batch {c.eval.batch_size}, "
      f"T={c.bench.temperature:g} (the default run's setting)",
    ),
    greedy_equal=dict(
      metric="greedy_equal",
      fixed="2026-11-30",
      op="==",
      target=True,
      what="greedy SD tokens == greedy AR tokens on every row, exactly (at the best G)",
    ),
  )
  return c


def adaptive_config(smoke: bool = False, task: str = "arithmetic", gpu: bool = False):
  """Auto G against AR and G = 1..5 on this benchmark's policy and draft (the default variant's
  training, same workdir layout), every arm with compaction (`decode.compare.engine_arms`).
  `gpu` (scripts/device_check.sh): batch 1, 32, 256, G = 1, 3, no bucket below 32 rows, shorter
  training, sized for a few minutes of one accelerator, compiles included."""
  c = get_config(f"task={task}" + (",smoke" if smoke else ""))
  c.bench = dict(
    adaptive=True,
    batch_sizes=(1, 4, 8, 16, 32, 64, 128),
    num_drafts=(1, 2, 3, 4, 5),
    temperature=1.0,
    # timing design: each of the repeats calls an arm until its calls add up to min_seconds
    # (one call at batch 1-8 lasts 30-60 ms)
    repeats=7,
    min_seconds=0.5,
    max_new_tokens=40,
    min_rows=c.decode.min_rows,
    # cost-model calibration: passes at grid_rows x (1, G_max/2 + 1, G_max + 1) tokens, whole
    # AR steps and SD rounds at (G_max + 1)/2 and G_max at grid_round_rows (decode/cost.py)
    grid_rows=(1, 4, 16, 64, 128),
    grid_round_rows=(1, 4, 16, 64, 128),
    # also time auto with G chosen once per compaction stage (decode.auto_every = stage: each
    # stage the fixed loop at its G), beside auto's per-round choice
    auto_stage=True,
    # time the fixed arm at the largest G twice, as two arms: the ratio of one program to itself
    # (results: control_over_same), the resolution of every ratio of two arms on this host
    control=True,
    # a second stage arm planned from every timed round as measured (decode.cost_outlier = 0),
    # beside the one the config's cost_outlier plans (off: it planned as the outlier arm did)
    as_timed_arm=False,
    # and a stage arm whose prices carry what its own stages cost (decode.price_feedback;
    # decode/cost.py: StagePrices): before timing, this many untimed rollouts of the stage plan
    # at each batch (keys of their own), each folding its stages' times into the prices the
    # next plans with, as an RL run's rollouts do; 0: no such arm. Fixed before the first run.
    learn_rollouts=8,
  )
  # the choice of G prices a round by the cost model corrected to the calibration's own timed
  # rounds of the adaptive loop at every G (decode/cost.py: Correction); False: the fit alone
  c.decode.cost_correction = True
  # ... each row count's timed rounds further than 0.1 (log ratio) from its robust line in G
  # priced by the line (decode.cost_outlier; 0: every timed round as measured)
  c.decode.cost_outlier = 0.1
  if smoke:
    c.bench.update(
      batch_sizes=(1, 4), num_drafts=(1, 2), repeats=1, min_seconds=0.0, max_new_tokens=16,
      min_rows=1, learn_rollouts=2,
      grid_rows=(1, 4), grid_round_rows=(1, 4),
    )  # fmt: skip
  if gpu and not smoke:
    c.sft.steps, c.draft.pretrain_steps = 400, 150
    c.eval.every = c.checkpoint.every = 400
    c.bench.update(
      batch_sizes=(1, 32, 256), num_drafts=(1, 3), repeats=2, min_rows=32,
      grid_rows=(1, 256), grid_round_rows=(256,),
    )  # fmt: skip
  # Fixed 2026-12-04, before the first run (issue 41).
  c.bench.goals = dict(
    auto_never_slower=dict(
      metric="all_batches.auto_over_ar_min",
      op=">=",
      target=0.98,
      fixed="2026-12-04",
      what="auto G tokens/s over AR tokens/s, lowest over batch sizes (both compacted)",
    ),
    auto_near_best_fixed=dict(
      metric="all_batches.auto_over_best_fixed_min",
      op=">=",
      target=0.95,
      fixed="2026-12-04",
      what="auto G tokens/s over the best fixed G's (1..5), lowest over batch sizes",
    ),
    greedy_equal=dict(
      metric="all_batches.greedy_equal",
      op="==",
      target=True,
      fixed="2026-12-04",
      what="greedy auto-G SD tokens == greedy AR tokens on every row, every batch size",
    ),
    # Fixed 2026-12-07, before the first run with the auto_stage arm: the same targets for G
    # chosen per stage (the goals above keep measuring the per-round choice); judged where the
    # run times that arm (bench.auto_stage)
    auto_stage_never_slower=dict(
      metric="all_batches.auto_stage_over_ar_min",
      op=">=",
      target=0.98,
      fixed="2026-12-07",
      needs="bench.auto_stage",
      what="auto G per stage tokens/s over AR tokens/s, lowest over batch sizes (both compacted)",
    ),
    auto_stage_near_best_fixed=dict(
      metric="all_batches.auto_stage_over_best_fixed_min",
      op=">=",
      target=0.95,
      fixed="2026-12-07",
      needs="bench.auto_stage",
      what="auto G per stage tokens/s over the best fixed G's (1..5), lowest over batch sizes",
    ),
    greedy_equal_stage=dict(
      metric="all_batches.greedy_equal_stage",
      op="==",
      target=True,
      fixed="2026-12-07",
      needs="bench.auto_stage",
      what="greedy auto-G-per-stage SD tokens == greedy AR tokens on every row, every batch size",
    ),
    # Fixed 2026-12-07, before the first run with the learned-prices arm: the same targets for G
    # per stage planned with the prices its bench.learn_rollouts rollouts learned (the goals above
    # keep measuring the calibration's plan)
    auto_stage_learned_never_slower=dict(
      metric="all_batches.auto_stage_learned_over_ar_min",
      op=">=",
      target=0.98,
      fixed="2026-12-07",
      needs="bench.learn_rollouts",
      what="auto G per stage, prices learned from its own stages, tokens/s over AR tokens/s, "
      "lowest over batch sizes (both compacted)",
    ),
    auto_stage_learned_near_best_fixed=dict(
      metric="all_batches.auto_stage_learned_over_best_fixed_min",
      op=">=",
      target=0.95,
      fixed="2026-12-07",
      needs="bench.learn_rollouts",
      what="auto G per stage, prices learned from its own stages, tokens/s over the best fixed "
      "G's (1..5), lowest over batch sizes",
    ),
    greedy_equal_stage_learned=dict(
      metric="all_batches.greedy_equal_stage_learned",
      op="==",
      target=True,
      fixed="2026-12-07",
      needs="bench.learn_rollouts",
      what="greedy auto-G-per-stage (learned prices) SD tokens == greedy AR tokens on every row, "
      "every batch size",
    ),
  )
  return c
