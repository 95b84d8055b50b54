"""Co-training step vs RL-only step, timed side by side in one run (experiments/bench_step.py)."""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.bench import provenance
from specdraft.model import eagle3
from specdraft.model import policy as pol
from specdraft.tasks.tokenizer import CharTokenizer
from specdraft.train import step as step_lib


def synthetic_batch(B: int, S: int, V: int, seed: int = 0):
  """A rollout-shaped batch: prompt of S//4 tokens, completion to a random length."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(S // 2, S + 1, B)
  seg = (np.arange(S)[None] < lengths[:, None]).astype(np.int32)
  mask = (seg * (np.arange(S)[None] >= S // 4)).astype(np.float32)
  return {
    "tokens": jnp.asarray(rng.integers(3, V, (B, S)), jnp.int32),
    "positions": jnp.asarray(np.arange(S)[None] * seg, jnp.int32),
    "segment_ids": jnp.asarray(seg),
    "loss_mask": jnp.asarray(mask),
    "logprobs": jnp.asarray(-rng.uniform(0.1, 3.0, (B, S)) * mask, jnp.float32),
    "advantages": jnp.asarray(rng.normal(size=B), jnp.float32),
  }


def run(config, workdir: str) -> dict:
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  os.makedirs(workdir, exist_ok=True)
  pcfg = pol.PolicyConfig.from_config(config.model, CharTokenizer().vocab_size)
  b = config.bench_step
  results = {
    "policy_layers": pcfg.n_layers,
    "d_model": pcfg.d_model,
    "batch_size": b.batch_size,
    "seq_len": b.seq_len,
    "repeats": b.repeats,
    "rows": [],
    "ratio_by_ttt_steps": {},
  }
  for ttt_steps in b.ttt_steps:
    draft_cfg = config.draft.copy_and_resolve_references()
    draft_cfg.ttt_steps = ttt_steps
    dcfg = eagle3.DraftConfig.from_config(draft_cfg, pcfg)
    params = pol.init_params(pcfg, 0)
    dparams = eagle3.init_params(dcfg, 1, params, pcfg)
    batch = synthetic_batch(b.batch_size, b.seq_len, pcfg.vocab_size)
    fns, states = {}, {}
    for name, train_draft in (("rl_only", False), ("cotrain", True)):
      tx = step_lib.make_cotrain_optimizer(config.rl, config.draft, train_draft=train_draft)
      tr = {"policy": params, "draft": dparams}
      states[name] = {"step": jnp.zeros((), jnp.int32), "params": tr, "opt_state": tx.init(tr)}
      fns[name] = jax.jit(
        functools.partial(
          step_lib.cotrain_step,
          pcfg=pcfg,
          dcfg=dcfg,
          rl_cfg=config.rl,
          tx=tx,
          lam=config.rl.lam,
          train_draft=train_draft,
        )
      )
      jax.block_until_ready(fns[name](states[name], batch))  # compile + warm-up
    times = {k: [] for k in fns}
    for _ in range(b.repeats):  # interleaved
      for name, f in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(f(states[name], batch))
        times[name].append(time.perf_counter() - t0)
    med = {k: float(np.median(v)) for k, v in times.items()}
    row = {
      "ttt_steps": ttt_steps,
      "rl_only_s": med["rl_only"],
      "cotrain_s": med["cotrain"],
      "ratio": med["cotrain"] / med["rl_only"],
    }
    results["rows"].append(row)
    results["ratio_by_ttt_steps"][str(ttt_steps)] = row["ratio"]
    print(
      f"ttt_steps={ttt_steps}: co-train {row['cotrain_s'] * 1e3:.1f} ms vs RL-only "
      f"{row['rl_only_s'] * 1e3:.1f} ms -> ratio {row['ratio']:.3f}",
      flush=True,
    )
  results = provenance.write_results(workdir, results, goals=provenance.goals_from_config(b.goals))
  print(provenance.goals_table(results["goals"]), flush=True)
  return results
