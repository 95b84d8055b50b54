#!/usr/bin/env bash
# The accelerator check of speculation that pays (issue 41): on a GPU machine whose image has JAX
# (with CUDA), flax, optax, orbax and absl but not this project's data stack, it installs the
# wheels carried in .whl/ (ml-collections, tensorflow-datasets, array-record, grain and their
# pure-Python needs; `scripts/device_wheels.sh` downloads them here), then runs, each under its
# own time limit so one failure leaves the others' results:
#   1. auto G against AR and fixed G at batch 1..256, every arm compacted
#      (configs/bench_rollout.py:auto,gpu: trains its own policy and draft first)
#   2. a shortened `make run` with adaptive speculation (SFT, distillation, 4 RL steps)
#   3. the cost model's validation (configs/bench_cost.py:gpu: random weights, no data)
# Results (results.json of each, logs, the environment) go to $OUT (default runs/device_check).
# Usage: bash scripts/device_check.sh   (limits add to 8 minutes; on one H200 on 2026-12-04, at
# larger grids, every step ran into its limit: compiles dominate there, a few seconds each)
set -u
OUT=${OUT:-runs/device_check}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TFDS_DATA_DIR=/tmp/tfds
{ nvidia-smi; python3 -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"; } >"$OUT/env.txt" 2>&1
W=runs/device
step() {  # step NAME SECONDS COMMAND...: runs COMMAND under a limit, keeps its log and results
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
  [ -f "$W/$name/results.json" ] && cp "$W/$name/results.json" "$OUT/$name.json"
}
step bench_rollout_auto 200 python3 experiments/bench_rollout.py \
  --config=configs/bench_rollout.py:auto,gpu --workdir=$W/bench_rollout_auto
step make_run 150 python3 experiments/train.py --config=configs/default.py \
  --workdir=$W/make_run --config.sft.steps=150 --config.draft.pretrain_steps=40 \
  --config.rl.steps=4 --config.rl.eval_every=4 --config.decode.speculation=auto \
  --config.eval.report_repeats=1 --config.eval.num_examples=64
[ -f "$W/make_run/summary.json" ] && cp "$W/make_run/summary.json" "$OUT/make_run_summary.json"
[ -f "$W/make_run/metrics.jsonl" ] && cp "$W/make_run/metrics.jsonl" "$OUT/make_run_metrics.jsonl"
step bench_cost 130 python3 experiments/bench_cost.py --config=configs/bench_cost.py:gpu \
  --workdir=$W/bench_cost
exit 0
