"""experiments/bench_long.py's compile of the whole co-training step under cp (its harness builds
the training mesh the step expects)."""

import pytest

from configs import bench_long as bench_long_config
from experiments.bench import long_memory


@pytest.mark.slow
def test_the_long_context_bench_compiles_the_ring_step_at_cp2():
  c = bench_long_config.get_config("smoke")
  r = long_memory.compile_memory(c, cp=2, dense=False)
  assert "error" not in r, r.get("error")
  assert r["S"] == 2 * c.bench_long.tokens_per_rank and r["temp_bytes"] > 0
  assert r["argument_bytes"] > 0
