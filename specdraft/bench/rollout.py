"""SD vs AR rollout throughput on one checkpoint (experiments/bench_rollout.py)."""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from specdraft.decode import autoregressive, speculative
from specdraft.model import eagle3
from specdraft.model import policy as pol
from specdraft.tasks import loader
from specdraft.train import loop


def pass_costs(params, dparams, pcfg, dcfg, *, batch: int, context: int, repeats: int = 20):
  """Seconds and compiled FLOPs of one policy decode pass vs one draft pass (1 token per row)."""
  pcache = pol.init_cache(pcfg, batch, context + 8)._replace(
    lengths=np.full((batch,), context, np.int32)
  )
  dcache = eagle3.init_cache(dcfg, batch, context + 8)._replace(
    lengths=np.full((batch,), context, np.int32)
  )
  tok = np.zeros((batch, 1), np.int32)
  feat = np.zeros((batch, 1, pcfg.d_model), np.float32)
  fp = jax.jit(lambda c, t: pol.decode(params, pcfg, c, t)[0])
  fd = jax.jit(lambda c, f, t: eagle3.step(dparams, dcfg, params["embed"], c, f, t)[0])
  out = {}
  for name, f, args in (("policy", fp, (pcache, tok)), ("draft", fd, (dcache, feat, tok))):
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
  summary = loop.train_and_evaluate(config, workdir)  # resumes / skips finished phases
  ctx = loop.Context(config, workdir)
  params, _ = loop.sft_phase(ctx)
  dparams, _ = loop.draft_phase(ctx, params)
  b = config.bench
  N, G, T = b.max_new_tokens, b.num_draft, b.temperature
  costs = pass_costs(params, dparams, ctx.pcfg, ctx.dcfg, batch=1, context=ctx.prompt_len + N // 2)
  rows = []
  for B in b.batch_sizes:
    exs = [ctx.eval_examples[i % len(ctx.eval_examples)] for i in range(B)]
    prompts, lengths = loader.prompt_batch(exs, ctx.tok, ctx.prompt_len)
    ar = lambda key, t: autoregressive.generate(
      params, ctx.pcfg, prompts, lengths, key, max_new_tokens=N, temperature=t
    )
    sd = lambda key, t: speculative.generate(
      params,
      dparams,
      ctx.pcfg,
      ctx.dcfg,
      prompts,
      lengths,
      key,
      max_new_tokens=N,
      temperature=t,
      num_draft=G,
    )
    compile_s = {}
    for name, fn in (("ar", ar), ("sd", sd)):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(jax.random.key(0), T))
      compile_s[name] = time.perf_counter() - t0
    greedy_equal = bool(
      np.array_equal(
        np.asarray(ar(jax.random.key(0), 0.0).tokens), np.asarray(sd(jax.random.key(0), 0.0).tokens)
      )
    )
    m = {"ar": [], "sd": []}
    for r in range(b.repeats):  # interleaved: AR, SD, AR, SD, ...
      for name, fn in (("ar", ar), ("sd", sd)):
        t0 = time.perf_counter()
        g = jax.block_until_ready(fn(jax.random.key(100 + r), T))
        dt = time.perf_counter() - t0
        st = jax.device_get(g.stats)
        ntok = int(np.sum(g.lengths))
        rec = {"tokens_per_s": ntok / dt, "passes_per_token": int(st["policy_passes"]) * B / ntok}
        if name == "sd":
          rec["tau"] = float(st["tau_sum"] / max(st["row_rounds"], 1))
        m[name].append(rec)
    med = lambda name, k: float(np.median([x[k] for x in m[name]]))
    row = {
      "batch": B,
      "compile_s_ar": compile_s["ar"],
      "compile_s_sd": compile_s["sd"],
      "ar_tokens_per_s": med("ar", "tokens_per_s"),
      "sd_tokens_per_s": med("sd", "tokens_per_s"),
      "ar_passes_per_token": med("ar", "passes_per_token"),
      "sd_passes_per_token": med("sd", "passes_per_token"),
      "tau": med("sd", "tau"),
      "greedy_equal": greedy_equal,
    }
    row["speedup"] = row["sd_tokens_per_s"] / row["ar_tokens_per_s"]
    rows.append(row)
    print(f"  batch {B}: speedup {row['speedup']:.2f}x tau {row['tau']:.2f}", flush=True)
  results = {
    "config": {
      "num_draft": G,
      "temperature": T,
      "max_new_tokens": N,
      "policy_layers": ctx.pcfg.n_layers,
      "d_model": ctx.pcfg.d_model,
    },
    "pass_costs": costs,
    "rows": rows,
    "training_summary": summary,
  }
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  print(table(results))
  return results


def table(results) -> str:
  c = results["pass_costs"]
  lines = [
    f"draft pass / policy pass: {c['draft_over_policy_seconds']:.3f} (time), "
    f"{c['draft_over_policy_flops']:.3f} (FLOPs)",
    f"{'batch':>5} {'AR tok/s':>10} {'SD tok/s':>10} {'speedup':>8} {'tau':>6} "
    f"{'AR pass/tok':>11} {'SD pass/tok':>11} {'compile AR/SD s':>16} {'greedy=':>7}",
  ]
  for r in results["rows"]:
    lines.append(
      f"{r['batch']:>5} {r['ar_tokens_per_s']:>10.1f} {r['sd_tokens_per_s']:>10.1f} "
      f"{r['speedup']:>8.2f} {r['tau']:>6.2f} {r['ar_passes_per_token']:>11.3f} "
      f"{r['sd_passes_per_token']:>11.3f} "
      f"{r['compile_s_ar']:>7.1f}/{r['compile_s_sd']:<8.1f} {str(r['greedy_equal']):>7}"
    )
  return "\n".join(lines)
