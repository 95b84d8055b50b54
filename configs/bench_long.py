"""The whole co-training step at long context: per-device memory as cp grows (compile-only) beside
the dense step it replaces, and step time at a size that runs here.

Run:   python experiments/bench_long.py --config=configs/bench_long.py --workdir=runs/bench_long
Smoke: python experiments/bench_long.py --config=configs/bench_long.py:smoke --workdir=/tmp/bl
"""

from __future__ import annotations

import ml_collections

from configs import default
from specdraft.config import parse_arg


def get_config(arg: str | None = None):
  arg = parse_arg(arg, smoke=False)
  c = default.get_config("smoke" if arg.smoke else "size=tiny")
  c.draft.ttt_steps = 7
  c.bench_long = ml_collections.ConfigDict(
    dict(
      # a 1B-class policy (bf16 compute, float32 weights and Adam moments); the draft takes the
      # policy's width and heads
      model=dict(
        d_model=2048,
        n_layers=16,
        n_heads=16,
        n_kv_heads=8,
        head_dim=128,
        d_ff=5632,
        vocab_size=32768,
        dtype="bfloat16",
      ),
      batch=1,
      tokens_per_rank=32768,  # S / cp: S = 32K, 64K, 128K, 256K
      cps=(1, 2, 4, 8),
      dense=True,  # compile the dense step beside the ring step at every S
      vocab_chunk=1024,
      attn_tile=512,
      remat=False,  # the compared step keeps every layer's activations
      remat_rows=True,  # and, for information, the same step with each layer rematerialised
      # measured step time (for information): a small policy, cp = 1 against cp = 8
      timing=dict(
        model=dict(
          d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=32, d_ff=384, vocab_size=99
        ),
        batch=1,
        tokens=4096,
        cps=(1, 8),
        attn_tile=256,
        repeats=3,
      ),
    )
  )
  if arg.smoke:
    c.bench_long.model.update(
      d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=128, vocab_size=512
    )
    c.bench_long.update(tokens_per_rank=256, cps=(1, 2, 4), vocab_chunk=64, attn_tile=64)
    c.bench_long.timing.update(tokens=256, cps=(1, 4), attn_tile=32, repeats=2)
    c.bench_long.timing.model.update(d_model=32, d_ff=64, head_dim=8)
  # Fixed before the run (copied into results.json with pass/fail): activation memory (temp bytes)
  # flat in cp at fixed S/cp, within 1.25x of one device at S/cp, and far below the dense step.
  c.bench_long.goals = dict(
    temp_flat_from_cp2=dict(
      metric="summary.temp_max_over_min_cp_ge_2",
      fixed="2026-11-30",
      op="<=",
      target=1.1,
      what="temp bytes, max / min over cp = 2..8 (S/cp fixed)",
    ),
    temp_near_one_device=dict(
      metric="summary.temp_max_cp_ge_2_over_cp1",
      fixed="2026-11-30",
      op="<=",
      target=1.25,
      what="temp bytes, worst cp >= 2 / cp = 1 (S/cp fixed)",
    ),
    arguments_constant=dict(
      metric="summary.argument_bytes_max_over_min",
      fixed="2026-11-30",
      op="<=",
      target=1.01,
      what="argument bytes (parameters + optimizer state), max / min over cp",
    ),
    far_below_dense=dict(
      metric="summary.dense_over_ring_temp_min",
      fixed="2026-11-30",
      op=">=",
      target=10.0,
      what="dense step temp / ring step temp at the same S (smallest over S)",
    ),
  )
  return c
