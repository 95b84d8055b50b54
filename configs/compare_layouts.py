"""Sharding layouts side by side: per-device memory, FLOPs and collective bytes of the compiled
co-training and SFT steps, step time on 8 simulated CPU devices and parity with one device.

Run:    python experiments/compare_layouts.py --config=configs/compare_layouts.py \
          --workdir=runs/compare_layouts
Smoke:  python experiments/compare_layouts.py --config=configs/compare_layouts.py:smoke \
          --workdir=/tmp/cl
A few:  --config.compare.layouts=single,dp8,fsdp4_tp2
A mesh of your own beside them: --config.parallel.mesh.tensor=2 --config.parallel.mesh.fsdp=4
Plan (64 simulated devices, compile-only, nothing allocated):
        python experiments/compare_layouts.py --config=configs/compare_layouts.py --plan \
          --workdir=runs/plan_layouts
Snapshots (tests/snapshots/shardings/*.txt) regenerated on purpose:
        python experiments/compare_layouts.py --config=configs/compare_layouts.py:smoke \
          --update_snapshots
"""

from __future__ import annotations

import ml_collections

from configs import default
from specdraft.config import layout_config, parse_arg


def get_config(arg: str | None = None):
  arg = parse_arg(arg, smoke=False, size="bench")
  c = default.get_config("smoke" if arg.smoke else f"size={arg.size}")
  # Tensor layouts split the KV heads: at least 2 (the micro model of the smoke size has 1).
  c.model.n_kv_heads = max(int(c.model.n_kv_heads), 2)
  c.model.n_heads = max(int(c.model.n_heads), c.model.n_kv_heads)
  c.draft.ttt_steps = 3
  # A mesh given on the command line (--config.parallel.mesh.<axis>=N) joins the comparison.
  c.parallel = layout_config("single")
  c.parallel.name = "custom"
  c.parallel.pipeline.microbatches = 0  # 0: 2 * pp (when the command line's mesh has pp > 1)
  c.compare = ml_collections.ConfigDict(
    dict(
      layouts="all",  # or names separated by commas; `single` (the reference) is always included
      batch_size=16,  # divides every layout's data*fsdp and pipeline microbatches
      seq_len=64,
      sft=True,  # compile the SFT step too
      parity=True,
      parity_rtol=1e-4,  # gradient leaves, loss and gradient norms, relative to single
      repeats=5,  # timed co-training steps per layout, interleaved (0: no timing)
    )
  )
  if arg.smoke:
    c.compare.update(batch_size=8, seq_len=32, repeats=2)
    # compile time dominates here (every layout compiles in CI): two TTT steps still run a branch
    # beyond the first, and whole-row logits (32 tokens) skip the chunk loop (tested elsewhere)
    c.draft.ttt_steps = 2
    c.compute.update(attn_tile=16, vocab_chunk=0)
  # Planning at scale: a 100B-class dense policy (bf16 compute, float32 weights and Adam moments,
  # every layer rematerialised) on 64 devices.
  c.compare.plan = dict(
    devices=64,
    model=dict(
      d_model=9216,
      n_layers=88,
      n_heads=72,
      n_kv_heads=8,
      head_dim=128,
      d_ff=32768,
      vocab_size=32768,
      dtype="bfloat16",
      rope_theta=500000.0,
      norm_eps=1e-5,
      tie_embeddings=False,
      init_std=0.02,
      tap_layers=(1, 43, 84),
    ),
    # 64 rows of 32K tokens (2M tokens per step): one row per device under fsdp64; divides
    # data*fsdp of every mesh, and data*fsdp*microbatches of the pipelined one
    batch_size=64,
    seq_len=32768,
    microbatches=8,  # pipeline microbatches of pp meshes (0: 2 * pp, as the named layouts)
    compute=dict(attn_tile=512, vocab_chunk=1024, remat=True),
    isolate=True,  # each mesh compiles in a child process (an XLA check failure aborts one)
    # fixed before the run (copied into plan.json with pass/fail)
    goals=dict(
      wall_time=dict(
        metric="summary.wall_seconds",
        fixed="2026-12-01",
        op="<=",
        target=600.0,
        what="seconds to plan every mesh (compile-only, 64 simulated devices)",
      ),
      # weights sharded over cp (parallel.shard_weights_over_cp)
      fsdp8_cp8_arguments=dict(
        metric="meshes.fsdp8_cp8.argument_bytes",
        fixed="2026-12-05",
        op="<=",
        target=20 * 2**30,
        what="fsdp8_cp8's per-device arguments (parameters, Adam moments, batch), bytes: 20 GiB",
      ),
      cp8_fits_h200=dict(
        metric="summary.cp8_least_arguments_plus_temp_bytes",
        fixed="2026-12-05",
        op="<=",
        target=141e9,
        what="arguments + temp per device of the best 64-device mesh with cp = 8, bytes (H200)",
      ),
      fsdp8_cp8_collectives=dict(
        metric="summary.fsdp8_cp8_collective_ratio",
        fixed="2026-12-05",
        op="<=",
        target=1.3,
        what="fsdp8_cp8's collective bytes per step over the plan's at cee358a (2217.8e9 B, "
        "weights replicated over cp)",
      ),
      fsdp8_cp8_reductions=dict(
        metric="summary.fsdp8_cp8_reduction_ratio",
        fixed="2026-12-05",
        op="<=",
        target=1.3,
        what="fsdp8_cp8's all-reduce + reduce-scatter bytes per step over the all-reduce bytes at "
        "cee358a (741.5 GiB)",
      ),
    ),
    # The fsdp8_cp8 figures before weights were sharded over cp (plan.json at cee358a), the
    # goals' reference.
    baseline=dict(
      fsdp8_cp8_collective_bytes=2217847007112.0, fsdp8_cp8_all_reduce_bytes=741.5 * 2**30
    ),
    meshes=dict(
      fsdp64=dict(fsdp=64),
      fsdp8_tp8=dict(fsdp=8, tensor=8),
      fsdp8_cp8=dict(fsdp=8, cp=8),
      # the same mesh with the weights replicated over cp (the layout before the rule), side by side
      fsdp8_cp8_replicated=dict(fsdp=8, cp=8, shard_weights_over_cp=False),
      tp8_cp8=dict(tensor=8, cp=8),
      pp8_fsdp8=dict(pp=8, fsdp=8),
    ),
  )
  if arg.smoke:
    c.compare.plan.update(batch_size=128, seq_len=256, microbatches=0)
    c.compare.plan.model.update(
      d_model=64, n_layers=8, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, vocab_size=512
    )
    c.compare.plan.model.tap_layers = (1, 3, 4)
    c.compare.plan.compute.update(attn_tile=64, vocab_chunk=64)
    # (fsdp x tensor meshes with pp or cp abort XLA's SPMD partitioner in jaxlib 0.10.2: a
    # failed check in its gather partitioning; the plan reports them as errors)
    c.compare.plan.meshes = dict(
      fsdp64=dict(fsdp=64), fsdp32_tp2=dict(fsdp=32, tensor=2), pp2_fsdp32=dict(pp=2, fsdp=32)
    )
  # Fixed before the run (copied into results.json with pass/fail).
  c.compare.goals = dict(
    parity=dict(
      metric="summary.parity_failures",
      fixed="2026-12-01",
      op="==",
      target=0,
      what="layouts whose co-training step differs from single beyond parity_rtol",
    ),
    single_moves_nothing=dict(
      metric="summary.single_collective_bytes",
      fixed="2026-12-01",
      op="==",
      target=0.0,
      what="collective bytes of the single-device step",
    ),
    wall_time=dict(
      metric="summary.wall_seconds",
      fixed="2026-12-01",
      op="<=",
      target=1200.0,
      what="seconds for the whole comparison (compile, parity, timing)",
    ),
  )
  return c
