"""SD vs AR rollout throughput on one checkpoint (experiments/bench_rollout.py).

The timing itself is `decode.compare.compare_rollouts` (the run's report uses the same function),
run here at each batch size of `config.bench.batch_sizes`. Results go through
`bench.provenance.write_results` with the goals fixed in configs/bench_rollout.py.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from specdraft.bench import provenance
from specdraft.decode.compare import (
  compare_rollouts,
  generators,
  greedy_agreement,
  sweep_num_draft,
)
from specdraft.model import eagle3
from specdraft.model import policy as pol
from specdraft.tasks import loader
from specdraft.train import evaluate, loop


def pass_costs(params, dparams, pcfg, dcfg, *, batch: int, context: int, repeats: int = 20):
  """Seconds and compiled FLOPs of one policy decode pass vs one draft pass (1 token per row)."""
  pcache = pol.init_cache(pcfg, batch, context + 8)._replace(
    lengths=np.full((batch,), context, np.int32)
  )
  dcache = eagle3.init_cache(dcfg, batch, context + 8)._replace(
    lengths=np.full((batch,), context, np.int32)
  )
  tokens_BT = np.zeros((batch, 1), np.int32)
  feats_BTE = np.zeros((batch, 1, pcfg.d_model), np.float32)
  fp = jax.jit(lambda c, t: pol.decode(params, pcfg, c, t)[0])
  fd = jax.jit(lambda c, f, t: eagle3.step(dparams, dcfg, params["embed"], c, f, t)[0])
  out = {}
  for name, f, args in (
    ("policy", fp, (pcache, tokens_BT)),
    ("draft", fd, (dcache, feats_BTE, tokens_BT)),
  ):
    compiled = f.lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(f(*args))
      ts.append(time.perf_counter() - t0)
    out[name] = {"seconds": float(np.median(ts)), "flops": float(cost.get("flops", 0.0))}
  out["draft_over_policy_seconds"] = out["draft"]["seconds"] / out["policy"]["seconds"]
  out["draft_over_policy_flops"] = out["draft"]["flops"] / max(out["policy"]["flops"], 1.0)
  return out


def run(config, workdir: str) -> dict:
  """Trains (or reloads) the policy and draft, then compares SD and AR at every batch size."""
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  b = config.bench
  if b.get("num_draft_sweep"):
    return run_sweep(config, workdir)
  summary = loop.train_and_evaluate(config, workdir)  # resumes / skips finished phases
  ctx = loop.Context(config, workdir)
  params, _ = loop.sft_phase(ctx)
  dparams, _ = loop.draft_phase(ctx, params)
  context = ctx.prompt_len + b.max_new_tokens // 2
  costs = pass_costs(params, dparams, ctx.pcfg, ctx.dcfg, batch=1, context=context)
  rows = []
  for B in b.batch_sizes:
    exs = [ctx.eval_examples[i % len(ctx.eval_examples)] for i in range(B)]
    prompts_BS, lengths_B = loader.prompt_batch(exs, ctx.tok, ctx.prompt_len)
    row = compare_rollouts(
      params,
      dparams,
      ctx.pcfg,
      ctx.dcfg,
      prompts_BS,
      lengths_B,
      max_new_tokens=b.max_new_tokens,
      num_draft=b.num_draft,
      temperature=b.temperature,
      repeats=b.repeats,
      seed=100,
    )
    rows.append(row)
    print(f"  batch {B}: speedup {row['speedup']:.2f}x tau {row['tau']:.2f}", flush=True)
  payload = {
    "config": {
      "num_draft": b.num_draft,
      "temperature": b.temperature,
      "max_new_tokens": b.max_new_tokens,
      "repeats": b.repeats,
      "policy_layers": ctx.pcfg.n_layers,
      "d_model": ctx.pcfg.d_model,
    },
    "pass_costs": costs,
    "rows": rows,
    "all_batches": over_batches(rows),
    "training_summary": summary,
  }
  measured = {"by_batch": {str(r["batch"]): r for r in rows}, "all_batches": payload["all_batches"]}
  goals = provenance.goals_from_config(b.goals)
  results = provenance.write_results(workdir, payload, goals=goals, measured=measured)
  print(table(results))
  print(provenance.goals_table(results["goals"]), flush=True)
  return results


def run_sweep(config, workdir: str) -> dict:
  """SD at every G of `bench.num_draft_sweep` against AR on the held-out prompts
  (`eval.batch_size` rows), timed side by side; greedy equality checked at the best G."""
  b = config.bench
  summary = loop.train_and_evaluate(config, workdir)  # resumes / skips finished phases
  ctx = loop.Context(config, workdir)
  params, _ = loop.sft_phase(ctx)
  dparams, _ = loop.draft_phase(ctx, params)
  prompts_BS, lengths_B = evaluate.held_out_prompts(ctx)
  sweep = sweep_num_draft(
    params,
    dparams,
    ctx.pcfg,
    ctx.dcfg,
    prompts_BS,
    lengths_B,
    max_new_tokens=b.max_new_tokens,
    num_drafts=tuple(b.num_draft_sweep),
    temperature=b.temperature,
    repeats=b.repeats,
    seed=100,
  )
  G, N = sweep["best_num_draft"], b.max_new_tokens
  run = generators(
    params, dparams, ctx.pcfg, ctx.dcfg, prompts_BS, lengths_B, max_new_tokens=N, num_draft=G
  )
  greedy = greedy_agreement(run["ar"], run["sd"], jax.random.key(100))
  payload = {
    "config": {
      "num_draft_sweep": list(b.num_draft_sweep),
      "temperature": b.temperature,
      "max_new_tokens": N,
      "repeats": b.repeats,
      "policy_layers": ctx.pcfg.n_layers,
      "d_model": ctx.pcfg.d_model,
      "ttt_steps": ctx.dcfg.ttt_steps,
      "draft_steps": config.draft.pretrain_steps,
    },
    "sweep": sweep,
    **greedy,
    "training_summary": summary,
  }
  goals = provenance.goals_from_config(b.goals)
  results = provenance.write_results(workdir, payload, goals=goals, measured=payload)
  print(sweep_table(results))
  print(provenance.goals_table(results["goals"]), flush=True)
  return results


def sweep_table(results) -> str:
  s = results["sweep"]
  lines = [
    f"batch {s['batch']}, T={s['temperature']:g}, {s['max_new_tokens']} new tokens; "
    f"best G = {s['best_num_draft']} ({s['best_speedup']:.2f}x)",
    f"{'G':>3} {'speedup':>8} {'per repeat':>24} {'tau':>6} {'SD pass/tok':>11}",
  ]
  for G in s["num_drafts"]:
    r = s["by_num_draft"][str(G)]
    per = " ".join(f"{x:.2f}" for x in r["speedup_per_repeat"])
    lines.append(
      f"{G:>3} {r['speedup']:>8.2f} {per:>24} {r['tau']:>6.2f} {r['sd_policy_passes_per_token']:>11.3f}"
    )
  return "\n".join(lines)


def over_batches(rows: list[dict]) -> dict:
  """Figures over every batch size: the lowest tau, and greedy equality on every row of all."""
  return {
    "tau_min": min(r["tau"] for r in rows),
    "greedy_equal": all(r["greedy_equal"] for r in rows),
  }


def table(results) -> str:
  c = results["pass_costs"]
  lines = [
    f"draft pass / policy pass: {c['draft_over_policy_seconds']:.3f} (time), "
    f"{c['draft_over_policy_flops']:.3f} (FLOPs)",
    f"{'batch':>5} {'AR tok/s':>10} {'SD tok/s':>10} {'speedup':>8} {'tau':>6} "
    f"{'AR pass/tok':>11} {'SD pass/tok':>11} {'1st call AR/SD s':>16} {'greedy=':>7}",
  ]
  for r in results["rows"]:
    lines.append(
      f"{r['batch']:>5} {r['ar_tokens_per_s']:>10.1f} {r['sd_tokens_per_s']:>10.1f} "
      f"{r['speedup']:>8.2f} {r['tau']:>6.2f} {r['ar_policy_passes_per_token']:>11.3f} "
      f"{r['sd_policy_passes_per_token']:>11.3f} "
      f"{r['first_call_s_ar']:>7.1f}/{r['first_call_s_sd']:<8.1f} {str(r['greedy_equal']):>7}"
    )
  return "\n".join(lines)
