"""Projected SD-over-AR rollout and RL-step speedups on accelerators, from the CPU-validated cost
model (specdraft/decode/cost.py) and a run's measured acceptance and tail profile.

Run:   python experiments/project_speedup.py --config=configs/project_speedup.py \
         --workdir=docs/results/project_speedup
From a run (its last `last_steps` RL steps' acceptance and tail profile, and the CPU sanity check
against its measured rollout times when it calibrated a cost model under run_dir/cost):
       python experiments/project_speedup.py --config=configs/project_speedup.py \
         --config.project.run_dir=runs/default --workdir=/tmp/project_speedup
Smoke: python experiments/project_speedup.py --config=configs/project_speedup.py:smoke \
         --workdir=/tmp/project_speedup_smoke

Every number that is not read from a run or a datasheet is an assumption of this file, copied
into results.json (`assumptions`). A device calibration (`decode.cost.calibrate` on the machine
itself) replaces the fixed costs and the efficiencies below.
"""

from __future__ import annotations

import ml_collections

from specdraft.config import parse_arg

# Fixed costs of a pass, a layer and a round are not on any datasheet. Without CUDA graphs a GPU
# pays a kernel launch per fused op: about 10-20 us per decoder layer (some ten kernels), a few
# tens of us per pass (embedding, final norm, LM head) and about 100 us per round (sampling,
# verification, the while loop's condition read back by the host, the G switch). A TPU runs the
# whole loop on the device (no launches), so its fixed costs are the small ops' latencies.
# sample_bytes_per_entry: HBM bytes moved per vocabulary entry of a round's own work (float32
# logits, log-softmax, the probabilities the verification compares: about eight 4-byte passes),
# so sample_rate = hbm * efficiency / sample_bytes_per_entry entries per second.
GPU_FIXED = dict(pass_s=50e-6, layer_s=15e-6, round_s=100e-6, sample_bytes_per_entry=32.0)
TPU_FIXED = dict(pass_s=20e-6, layer_s=5e-6, round_s=30e-6, sample_bytes_per_entry=32.0)

HARDWARE = dict(
  h100_sxm=dict(
    name="H100 SXM",
    peak_flops=989e12,
    hbm_bytes_per_s=3.35e12,
    hbm_bytes=80e9,
    source="NVIDIA H100 datasheet: 989 TFLOP/s dense BF16 (1979 with sparsity), 3.35 TB/s "
    "HBM3, 80 GB (SXM)",
    **GPU_FIXED,
  ),
  h200_sxm=dict(
    name="H200 SXM",
    peak_flops=989e12,
    hbm_bytes_per_s=4.8e12,
    hbm_bytes=141e9,
    source="NVIDIA H200 datasheet: 989 TFLOP/s dense BF16 (1979 with sparsity), 4.8 TB/s "
    "HBM3e, 141 GB (SXM)",
    **GPU_FIXED,
  ),
  tpu_v5p=dict(
    name="TPU v5p",
    peak_flops=459e12,
    hbm_bytes_per_s=2765e9,
    hbm_bytes=95e9,
    source="Google Cloud TPU v5p documentation: 459 TFLOP/s BF16, 2765 GB/s HBM2e, 95 GiB per chip",
    **TPU_FIXED,
  ),
)


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(arg, smoke=False)
  c = ml_collections.ConfigDict()
  c.project = dict(
    # A run's workdir (metrics.jsonl, run_config.json, cost/); "" projects from `rates` and
    # `tail` below.
    run_dir="",
    last_steps=5,  # RL steps of the run whose acceptance and tail profile are used
    # Positions no round of those steps drafted to: "zero" (no credit for what was not measured:
    # the projection cannot draft deeper than the run did) or "last" (the deepest measured rate).
    unmeasured="zero",
    # Conditional acceptance per drafted position when no run_dir is given (G_max = len(rates)).
    rates=(0.768, 0.692, 0.538, 0.579, 0.516, 0.348),
    rates_source="docs/results/bench_num_draft/results.json sweep.by_num_draft.6."
    "accept_per_position (the default run's SFT policy and distilled EAGLE-3 draft, T=1)",
    # Completion lengths when no run_dir is given: the rows' quantiles of a lognormal (median
    # tokens, sigma of the log), clipped to 1..max_new_tokens.
    tail=dict(median=800.0, sigma=0.9),
    # The rollout projected: rows decoded by one accelerator, prompt and generation lengths
    # (capacity of the AR cache: prompt_len + max_new_tokens; SD's adds G_max + 2).
    rows=64,
    prompt_len=512,
    max_new_tokens=4096,
    min_rows=1,  # the smallest compaction bucket
    # The policy: an 8B Llama-like (Llama 3 8B's shapes), bf16, untied embeddings.
    policy=dict(
      name="Llama-3-8B-like",
      d_model=4096,
      n_layers=32,
      n_heads=32,
      n_kv_heads=8,
      head_dim=128,
      d_ff=14336,
      vocab_size=128256,
      tie_embeddings=False,
      dtype="bfloat16",
    ),
    # Its one-layer EAGLE-3 draft (the policy's attention and MLP shapes, three tapped layers,
    # a reduced 32k-token draft vocabulary as EAGLE-3 ships for Llama 3), trained with 7 TTT steps.
    draft=dict(
      n_heads=32, n_kv_heads=8, head_dim=128, d_ff=14336, n_taps=3, draft_vocab=32000, ttt_steps=7
    ),
    # Achieved fraction of peak: of the FLOP rate in decode matmuls and of the HBM bandwidth.
    efficiency=dict(flops=0.6, hbm=0.8),
    # Training step: 6 * params * trained tokens / (peak * mfu) for the policy, and for the draft
    # times its TTT steps (attention FLOPs not counted); trained tokens = rows * (prompt + mean
    # completion length). The AR baseline trains no draft.
    train=dict(mfu=0.4),
    hardware=HARDWARE,
    # The rollout speedup again with the fixed costs above scaled by each factor (0: a pure
    # roofline; they are the guesses of this file).
    sensitivity=dict(fixed_scale=(0.0, 0.5, 2.0)),
  )
  if arg.smoke:
    c.project.update(rows=16, prompt_len=64, max_new_tokens=256, tail=dict(median=60.0, sigma=0.9))
  return c
