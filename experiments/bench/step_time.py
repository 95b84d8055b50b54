"""Co-training step vs RL-only step, timed side by side in one run (experiments/bench_step.py).

Per case (policy depth L, TTT steps K, a one-layer draft; a case may name another draft kind,
(L, K, kind): a block draft proposing K tokens a round): the RL-only step, the co-training
step and the draft's loss alone (forward + backward from fixed policy features) are compiled
and timed interleaved on the same batch. Their matmul FLOPs are read from the compiled programs
(`bench.hlo.dot_flops`, loop trip counts included). The co-training step's matmul work is
RL-only's plus the draft's (`cotrain_flops_over_sum` checks it), so the time ratio it would show
if time followed matmul FLOPs, its "FLOP bound", is 1 + draft FLOPs / RL-only FLOPs.
`ratio_over_bound` is the measured time ratio over that figure. It can sit below 1: the RL step
also spends time on work the count leaves out (elementwise ops, the optimizer), which the draft
adds little of. `extra_over_draft_alone` is what the co-training step adds over RL-only, in
units of the draft alone's measured time.
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench import hlo, provenance
from specdraft.model import drafts
from specdraft.model import policy as pol
from specdraft.tasks.tokenizer import CharTokenizer
from specdraft.train import sequence
from specdraft.train import step as step_lib
from specdraft.train.spec import StepSpec


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


def _programs(config, pcfg, dcfg, batch, *, vocab_chunk: int, attn_tile: int):
  """The three programs timed side by side: an RL-only step, a co-training step (both with their
  optimizer update) and the draft's TTT loss alone, forward + backward, from the policy's
  (fixed, precomputed) final hidden state and taps. Returns ({name: jitted}, {name: args})."""
  params = pol.init_params(pcfg, 0)
  dparams = drafts.init_params(dcfg, 1, params, pcfg)
  fns, args = {}, {}
  for name, train_draft in (("rl_only", False), ("cotrain", True)):
    tx = step_lib.make_cotrain_optimizer(config.rl, config.draft, train_draft=train_draft)
    tr = {"policy": params, "draft": dparams}
    spec = StepSpec.of(
      pcfg, dcfg, config.rl, tx=tx, train_draft=train_draft, vocab_chunk=vocab_chunk,
      attn_tile=attn_tile,
    )  # fmt: skip
    fns[name] = jax.jit(functools.partial(step_lib.cotrain_step, spec=spec))
    args[name] = ({"step": jnp.zeros((), jnp.int32), "params": tr, "opt_state": tx.init(tr)}, batch)
  ops = sequence.ShardOps(tile=attn_tile)
  h, taps = jax.jit(lambda th, b: sequence.policy_hidden(th, pcfg, b, ops))(params, batch)
  spec = StepSpec.of(pcfg, dcfg, vocab_chunk=vocab_chunk, attn_tile=attn_tile)

  def draft_alone(phi, theta, h, taps, b):
    loss = lambda ph: sequence.draft_terms(spec, ops, theta, ph, h, taps, b, None)[0]
    return jax.value_and_grad(loss)(phi)

  fns["draft_alone"] = jax.jit(draft_alone)
  args["draft_alone"] = (dparams, params, h, taps, batch)
  return fns, args


def case_key(layers: int, ttt_steps: int, kind: str = "eagle3") -> str:
  """by_case key: L{layers}_K{K} for EAGLE-3, L{layers}_{kind}_G{K} for a block draft."""
  return f"L{layers}_K{ttt_steps}" if kind == "eagle3" else f"L{layers}_{kind}_G{ttt_steps}"


def _case(config, layers: int, ttt_steps: int, b, kind: str = "eagle3") -> dict:
  """One (policy depth, K, draft kind) case: compiled matmul FLOPs of each program, then
  interleaved timing. A block draft (dflash, dspark) gets the block that proposes K tokens."""
  model = config.model.copy_and_resolve_references()
  model.n_layers = layers
  pcfg = pol.PolicyConfig.from_config(model, CharTokenizer().vocab_size)
  draft_cfg = config.draft.copy_and_resolve_references()
  draft_cfg.kind = kind
  draft_cfg.ttt_steps = ttt_steps
  draft_cfg.block.block_size = 0  # the block that proposes K tokens
  dcfg = drafts.draft_config(draft_cfg, pcfg, num_draft=ttt_steps)
  batch = sequence.zigzag_order(synthetic_batch(b.batch_size, b.seq_len, pcfg.vocab_size), 1)
  batch = jax.tree.map(jnp.asarray, batch)
  fns, args = _programs(
    config, pcfg, dcfg, batch, vocab_chunk=config.compute.vocab_chunk, attn_tile=b.attn_tile
  )
  flops = {k: hlo.dot_flops(f.lower(*args[k]).compile().as_text()) for k, f in fns.items()}
  for k, f in fns.items():
    jax.block_until_ready(f(*args[k]))  # compile + warm-up
  times = {k: [] for k in fns}
  for _ in range(b.repeats):  # interleaved, so a slow phase of the machine hits every program
    for k, f in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args[k]))
      times[k].append(time.perf_counter() - t0)
  med = {k: float(np.median(v)) for k, v in times.items()}
  flop_ratio = flops["draft_alone"] / flops["rl_only"]
  ratio = med["cotrain"] / med["rl_only"]
  return {
    "policy_layers": layers,
    "draft_kind": kind,
    "ttt_steps": ttt_steps,
    "rl_only_s": med["rl_only"],
    "cotrain_s": med["cotrain"],
    "draft_alone_s": med["draft_alone"],
    "ratio": ratio,
    "flops": flops,
    "draft_over_rl_flops": flop_ratio,
    "flop_bound": 1.0 + flop_ratio,
    "ratio_over_bound": ratio / (1.0 + flop_ratio),
    "cotrain_flops_over_sum": flops["cotrain"] / (flops["rl_only"] + flops["draft_alone"]),
    "extra_over_draft_alone": (med["cotrain"] - med["rl_only"]) / med["draft_alone"],
  }


def parse_case(case) -> tuple[int, int, str]:
  """(policy layers, K, draft kind) of a case (layers, K) or (layers, K, kind); raises naming a
  bad one."""
  ok = isinstance(case, (tuple, list)) and len(case) in (2, 3)
  layers, k, kind = (*case, "eagle3")[:3] if ok else (0, 0, "")
  if not ok or kind not in drafts.KINDS or int(layers) < 1 or int(k) < 1:
    raise ValueError(
      f"config.bench_step.cases: {case!r} is invalid; expected (policy layers >= 1, K >= 1) "
      f"or (layers, K, kind) with kind in {drafts.KINDS}"
    )
  return int(layers), int(k), kind


def check_cases(cases) -> None:
  """Every case parses (before any work)."""
  for case in cases:
    parse_case(case)


def run(config, workdir: str) -> dict:
  check_cases(config.bench_step.cases)
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  os.makedirs(workdir, exist_ok=True)
  b = config.bench_step
  results = {
    "d_model": config.model.d_model,
    "draft_layers": 1,
    "batch_size": b.batch_size,
    "seq_len": b.seq_len,
    "repeats": b.repeats,
    "rows": [],
    "by_case": {},
  }
  for case in b.cases:
    layers, ttt_steps, kind = parse_case(case)
    row = _case(config, layers, ttt_steps, b, kind)
    results["rows"].append(row)
    results["by_case"][case_key(layers, ttt_steps, kind)] = row
    print(
      f"L={layers} K={ttt_steps} {kind}: co-train {row['cotrain_s'] * 1e3:.1f} ms, RL-only "
      f"{row['rl_only_s'] * 1e3:.1f} ms, draft alone {row['draft_alone_s'] * 1e3:.1f} ms -> "
      f"ratio {row['ratio']:.3f} vs FLOP bound {row['flop_bound']:.3f} "
      f"({row['ratio_over_bound']:.3f}x); extra / draft alone {row['extra_over_draft_alone']:.2f}",
      flush=True,
    )
  results = provenance.write_results(workdir, results, goals=provenance.goals_from_config(b.goals))
  print(provenance.goals_table(results["goals"]), flush=True)
  return results
