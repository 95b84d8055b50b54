"""Seconds per policy decoding step (`policy.decode` in a jitted 8-step loop, best of 3) at
SmolLM2-135M's shapes (30 layers, d_model 576, 9/3 heads, vocabulary 49152), for the checkout it
runs from. Compare two commits by running it in a clone of each, one after the other:

  python scripts/decode_step_time.py          # prints one JSON line: {"B1_C256_T1": s, ...}

B rows, C cache capacity (rows filled to 100), T new tokens per step (T > 1: an SD verify pass).
"""

import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from experiments.bench import provenance  # noqa: E402
from specdraft.model import policy as pol  # noqa: E402

POINTS = ((1, 256, 1), (1, 256, 6), (8, 256, 1), (8, 2048, 1))


def step_seconds(cfg, params, B: int, C: int, T: int, steps: int = 8) -> float:
  cache = pol.init_cache(cfg, B, C)._replace(lengths=jnp.full((B,), 100, jnp.int32))

  @jax.jit
  def run(params, cache, tok):
    def body(_, carry):
      cache, tok = carry
      logits, _, cache = pol.decode(params, cfg, cache, tok)
      # roll back, so every step sees the same lengths
      return cache._replace(lengths=cache.lengths - T), jnp.argmax(logits, -1).astype(jnp.int32)

    return jax.lax.fori_loop(0, steps, body, (cache, tok))

  tok = jnp.ones((B, T), jnp.int32)
  jax.block_until_ready(run(params, cache, tok))
  best = float("inf")
  for _ in range(3):
    t = time.perf_counter()
    jax.block_until_ready(run(params, cache, tok))
    best = min(best, (time.perf_counter() - t) / steps)
  return best


def main():
  cfg = pol.PolicyConfig(
    vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536
  )
  params = pol.init_params(cfg, 0)
  out = {"commit": provenance.git_commit(ROOT)}
  out.update({f"B{b}_C{c}_T{t}": step_seconds(cfg, params, b, c, t) for b, c, t in POINTS})
  print(json.dumps(out))


if __name__ == "__main__":
  main()
