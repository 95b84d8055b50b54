#!/usr/bin/env bash
# The accelerator check of the fused attention block (issue 45): on a GPU (or TPU) machine whose
# image has JAX for that chip, runs experiments/bench_kernel.py at its full size (causal, head
# dim 128, bf16, 4K..32K tokens): the compiled kernel's exactness against the oracle, then the
# Pallas block, the XLA tiles and jax.nn.dot_product_attention timed side by side, forward and
# backward, with FLOP/s against the chip's peak; its goals are judged in results.json.
# Installs the wheels carried in .whl/ first where the image lacks ml-collections
# (`scripts/device_wheels.sh` downloads them). Results and the log go to $OUT.
# Usage: bash scripts/device_kernel.sh   (one time limit, LIMIT seconds, default 420)
set -u
OUT=${OUT:-runs/device_kernel}
LIMIT=${LIMIT:-420}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{ nvidia-smi || true; python3 -c "import jax; print(jax.__version__, jax.devices())"; } >"$OUT/env.txt" 2>&1
t0=$SECONDS
timeout "$LIMIT" python3 experiments/bench_kernel.py --config=configs/bench_kernel.py \
  --workdir=runs/device/bench_kernel >"$OUT/bench_kernel.log" 2>&1
echo "bench_kernel: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/env.txt"
for f in results.json table.md; do
  [ -f "runs/device/bench_kernel/$f" ] && cp "runs/device/bench_kernel/$f" "$OUT/bench_kernel_$f"
done
exit 0
