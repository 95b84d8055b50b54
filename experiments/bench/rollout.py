"""SD vs AR rollout throughput on one checkpoint (experiments/bench_rollout.py).

The timing itself is `decode.compare.compare_rollouts` (the run's report uses the same function),
run here at each batch size of `config.bench.batch_sizes`. Results go through
`bench.provenance.write_results` with the goals fixed in configs/bench_rollout.py.
"""

from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

from experiments.bench import provenance
from specdraft.decode import autoregressive, cost, engine, speculative
from specdraft.decode.compare import (
  compare_rollouts,
  engine_arms,
  generators,
  greedy_agreement,
  sweep_num_draft,
  time_side_by_side,
)
from specdraft.model import eagle3
from specdraft.model import policy as pol
from specdraft.parallel import multihost
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
  if b.get("adaptive"):
    return run_adaptive(config, workdir)
  summary = loop.train_and_evaluate(config, workdir)  # resumes / skips finished phases
  ctx = loop.Context(config, workdir)
  params, _ = loop.sft_phase(ctx)
  dparams, _ = loop.draft_phase(ctx, params)
  context = ctx.data.prompt_len + b.max_new_tokens // 2
  costs = pass_costs(params, dparams, ctx.models.pcfg, ctx.models.dcfg, batch=1, context=context)
  rows = []
  for B in b.batch_sizes:
    exs = [ctx.data.eval_examples[i % len(ctx.data.eval_examples)] for i in range(B)]
    prompts_BS, lengths_B = loader.prompt_batch(exs, ctx.data.tok, ctx.data.prompt_len)
    row = compare_rollouts(
      params,
      dparams,
      ctx.models.pcfg,
      ctx.models.dcfg,
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
      "policy_layers": ctx.models.pcfg.n_layers,
      "d_model": ctx.models.pcfg.d_model,
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
    ctx.models.pcfg,
    ctx.models.dcfg,
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
    params,
    dparams,
    ctx.models.pcfg,
    ctx.models.dcfg,
    prompts_BS,
    lengths_B,
    max_new_tokens=N,
    num_draft=G,
  )
  greedy = greedy_agreement(run["ar"], run["sd"], jax.random.key(100))
  payload = {
    "config": {
      "num_draft_sweep": list(b.num_draft_sweep),
      "temperature": b.temperature,
      "max_new_tokens": N,
      "repeats": b.repeats,
      "policy_layers": ctx.models.pcfg.n_layers,
      "d_model": ctx.models.pcfg.d_model,
      "ttt_steps": ctx.models.dcfg.ttt_steps,
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


def run_adaptive(config, workdir: str) -> dict:
  """Adaptive G against AR and every fixed G, all with finished rows compacted away
  (`decode.compare.engine_arms`), at every batch size, timed side by side.

  The cost model is calibrated once on this machine (cached in workdir/cost). The auto arm starts
  from the acceptance an RL run would carry in: the prior updated by one sampled auto rollout of
  the same prompts before the timed calls."""
  b = config.bench
  summary = loop.train_and_evaluate(config, workdir)  # resumes / skips finished phases
  ctx = loop.Context(config, workdir)
  params, _ = loop.sft_phase(ctx)
  dparams, _ = loop.draft_phase(ctx, params)
  models = (ctx.models.pcfg, ctx.models.dcfg)
  M, N = max(b.num_drafts), b.max_new_tokens
  correct = config.decode.get("cost_correction", True)
  outlier = config.decode.get("cost_outlier", 0.0)
  stage = b.get("auto_stage", False)
  grid = cost.Grid(
    rows=tuple(b.grid_rows),
    tokens=tuple(sorted({1, (M + 2) // 2, M + 1})),
    round_rows=tuple(b.grid_round_rows),
    round_G=tuple(sorted({max(1, (M + 1) // 2), M})),
    capacity=ctx.data.prompt_len + N + M + 2,
    prompt_len=ctx.data.prompt_len,
    adaptive=correct,
    stage=correct and stage,  # the fixed loop at every G: the rounds the stage plan prices
  )
  model, record = cost.calibrate(
    params, dparams, *models, grid=grid, cache_dir=os.path.join(workdir, "cost"), correct=correct,
    outlier=outlier,
  )  # fmt: skip
  # G chosen per stage (decode.auto_every = stage) runs the fixed loop: its correction is from
  # the calibration's AR steps and fixed-loop rounds
  stage_fix = cost.Correction.from_points(
    record["points"], ctx.models.pcfg.n_layers, every="stage", outlier=outlier
  )
  stage_model = dataclasses.replace(model, correction=stage_fix if correct else None)
  # bench.as_timed_arm: a second stage arm whose plan prices every timed round as measured
  # (outlier 0), beside the arm the config's decode.cost_outlier plans; where both plan the same
  # G they run the same program (another control)
  as_timed = None
  if stage and correct and outlier > 0 and b.get("as_timed_arm", False):
    fix = cost.Correction.from_points(record["points"], ctx.models.pcfg.n_layers, every="stage")
    as_timed = dataclasses.replace(model, correction=fix)
  window = config.decode.get("catch_up_window", 8)
  kw = dict(max_new_tokens=N, compact=True, min_rows=b.min_rows, window=window)
  rows = []
  for B in b.batch_sizes:
    exs = [ctx.data.eval_examples[i % len(ctx.data.eval_examples)] for i in range(B)]
    prompts_BS, lengths_B = loader.prompt_batch(exs, ctx.data.tok, ctx.data.prompt_len)
    prior = cost.Acceptance.prior(M, config.decode.prior_rate, config.decode.prior_weight)
    warm = engine.generate(
      params, dparams, ctx.models.pcfg, ctx.models.dcfg, prompts_BS, lengths_B, jax.random.key(99),
      temperature=b.temperature, num_draft=M, adaptive=True, cost=model, prior=prior, **kw,
    )  # fmt: skip
    stats = {k: multihost.to_host(warm.stats[k]) for k in ("accept_counts", "reach_counts")}
    prior = prior.updated(stats, keep=config.decode.prior_keep)
    arms_kw = dict(num_drafts=b.num_drafts, cost=model, prior=prior, **kw)
    if stage:
      arms_kw["stage_cost"] = stage_model
    learned, learning = None, []
    if stage and b.get("learn_rollouts", 0):  # untimed rollouts of the stage plan, learning
      learned, learning = _learn_stage_prices(
        params, dparams, ctx, prompts_BS, lengths_B, stage_model, prior, config, b, kw
      )
      jax.clear_caches()  # (the learning's programs: held on, they crowd the process's mappings)
    run = engine_arms(
      params, dparams, ctx.models.pcfg, ctx.models.dcfg, prompts_BS, lengths_B, **arms_kw
    )
    run["ar_plain"] = lambda key, t: autoregressive.generate(
      params, ctx.models.pcfg, prompts_BS, lengths_B, key, temperature=t, max_new_tokens=N
    )
    if b.get("control", False):  # the fixed arm at G_max again: the same program, timed apart
      run["control"] = run[M]
    # the first (untimed) calls run every bucket's stage: no timed call compiles one
    every_stage = engine_arms(
      params,
      dparams,
      ctx.models.pcfg,
      ctx.models.dcfg,
      prompts_BS,
      lengths_B,
      every_stage=True,
      **arms_kw,
    )
    if "control" in run:
      every_stage["control"] = every_stage[M]
    if learned is not None:
      for arms, full in ((run, False), (every_stage, True)):
        arms["auto_stage_learned"] = engine_arms(
          params, dparams, *models, prompts_BS, lengths_B, every_stage=full,
          **dict(arms_kw, prices=learned),
        )["auto_stage"]  # fmt: skip
    if as_timed is not None:
      for arms, full in ((run, False), (every_stage, True)):
        arms["auto_stage_as_timed"] = engine_arms(
          params, dparams, *models, prompts_BS, lengths_B, every_stage=full,
          **dict(arms_kw, stage_cost=as_timed),
        )["auto_stage"]  # fmt: skip
    first, samples = time_side_by_side(
      run, temperature=b.temperature, repeats=b.repeats, seed=100, warm=every_stage,
      min_seconds=b.get("min_seconds", 0.0),
    )  # fmt: skip
    # the timed executables are not needed again: held beside the greedy checks' compiles they
    # exhausted the process's memory mappings at 128 rows (an LLVM allocation error)
    jax.clear_caches()
    row = _adaptive_row(B, samples, first, b.num_drafts)
    row["prior_rates"] = prior.rates().tolist()
    # what auto chose G from at this batch (before compaction): the fit's seconds of a round at
    # G = 0..M and the corrected ones (equal without decode.cost_correction)
    capacity = int(prompts_BS.shape[1]) + N + M + 2
    fit_only = dataclasses.replace(model, correction=None)
    row["round_seconds_fit"] = fit_only.round_seconds_all(B, M, capacity).tolist()
    row["round_seconds"] = model.round_seconds_all(B, M, capacity).tolist()
    row.update(greedy_agreement(run["ar"], run["auto"], jax.random.key(100)))
    if stage:  # the G each bucket's stage drafted, and what it was chosen from
      sizes = engine.buckets(B, b.min_rows)
      spec = speculative.Spec(ctx.models.pcfg, ctx.models.dcfg, N, M, True, None)
      row["stage_plan"] = {str(k): v for k, v in engine.stage_plan(
        stage_model, prior, sizes, spec, capacity
      ).items()}  # fmt: skip
      row["auto_stage_over_planned_fixed"] = _over_planned(row)
      row["round_seconds_stage"] = stage_model.round_seconds_all(
        B, M, capacity, plain=False
      ).tolist()
      eq = greedy_agreement(run["ar"], run["auto_stage"], jax.random.key(100))
      row["greedy_equal_stage"] = eq["greedy_equal"]
      row["greedy_rows_differing_stage"] = eq["greedy_rows_differing"]
    if learned is not None:  # (only with stage: sizes and spec above)
      row["stage_plan_learned"] = {str(k): v for k, v in engine.stage_plan(
        stage_model, prior, sizes, spec, capacity, learned
      ).items()}  # fmt: skip
      row["stage_price_factors"] = learned.summary()
      row["learning"] = learning
      rate = row["tokens_per_s"]
      row["auto_stage_learned_over_ar"] = row["over_ar"]["auto_stage_learned"]
      row["auto_stage_learned_over_best_fixed"] = (
        rate["auto_stage_learned"] / rate[str(row["best_fixed"])]
      )
      row["auto_stage_learned_over_stage"] = rate["auto_stage_learned"] / rate["auto_stage"]
      eq = greedy_agreement(run["ar"], run["auto_stage_learned"], jax.random.key(100))
      row["greedy_equal_stage_learned"] = eq["greedy_equal"]
    if as_timed is not None:  # (only with stage: sizes and spec above)
      row["stage_plan_as_timed"] = {str(k): v for k, v in engine.stage_plan(
        as_timed, prior, sizes, spec, capacity
      ).items()}  # fmt: skip
      rate = row["tokens_per_s"]
      row["auto_stage_as_timed_over_best_fixed"] = (
        rate["auto_stage_as_timed"] / rate[str(row["best_fixed"])]
      )
      row["auto_stage_over_as_timed"] = rate["auto_stage"] / rate["auto_stage_as_timed"]
    rows.append(row)
    jax.clear_caches()  # this batch's compiles (every arm's buckets) are not needed again
    per_stage = (
      f", auto_stage/AR {row['auto_stage_over_ar']:.2f}x, auto_stage/best "
      f"{row['auto_stage_over_best_fixed']:.2f} (G by bucket {row['stage_plan']})"
      if stage
      else ""
    )
    if learned is not None:
      per_stage += (
        f", learned/best {row['auto_stage_learned_over_best_fixed']:.2f} "
        f"(G by bucket {row['stage_plan_learned']})"
      )
    if "control_over_same" in row:
      per_stage += f", control/G={M} {row['control_over_same']:.2f}"
    print(
      f"  batch {B}: auto/AR {row['auto_over_ar']:.2f}x, best fixed G={row['best_fixed']} "
      f"{row['best_fixed_over_ar']:.2f}x, auto/best {row['auto_over_best_fixed']:.2f}{per_stage}",
      flush=True,
    )
  payload = {
    "config": {
      "num_drafts": list(b.num_drafts),
      "temperature": b.temperature,
      "max_new_tokens": N,
      "repeats": b.repeats,
      "min_seconds": b.get("min_seconds", 0.0),
      "min_rows": b.min_rows,
      "auto_stage": stage,
      "control": b.get("control", False),
      "as_timed_arm": as_timed is not None,
      "learn_rollouts": int(b.get("learn_rollouts", 0)) if stage else 0,
      "price_prior_rounds": config.decode.get("price_prior_rounds", 4.0),
      "price_keep": config.decode.get("price_keep", 0.7),
      "cost_outlier": outlier,
      "policy_layers": ctx.models.pcfg.n_layers,
      "d_model": ctx.models.pcfg.d_model,
    },
    "cost_model": record,
    "cost_correction": dataclasses.asdict(model.correction) if model.correction else None,
    # the stage arm's correction (the fixed loop's rounds; with `replaced`, the timed rounds its
    # outlier rule priced by their row count's line)
    "cost_correction_stage": (
      dataclasses.asdict(stage_model.correction) if stage and stage_model.correction else None
    ),
    "rows": rows,
    "all_batches": {
      "auto_over_ar_min": min(r["auto_over_ar"] for r in rows),
      "auto_over_best_fixed_min": min(r["auto_over_best_fixed"] for r in rows),
      "greedy_equal": all(r["greedy_equal"] for r in rows),
      **(
        {
          "auto_stage_over_ar_min": min(r["auto_stage_over_ar"] for r in rows),
          "auto_stage_over_best_fixed_min": min(r["auto_stage_over_best_fixed"] for r in rows),
          "greedy_equal_stage": all(r["greedy_equal_stage"] for r in rows),
        }
        if stage
        else {}
      ),
      **(
        {
          "auto_stage_as_timed_over_best_fixed_min": min(
            r["auto_stage_as_timed_over_best_fixed"] for r in rows
          ),
        }
        if as_timed is not None
        else {}
      ),
      **(
        {
          "auto_stage_learned_over_ar_min": min(r["auto_stage_learned_over_ar"] for r in rows),
          "auto_stage_learned_over_best_fixed_min": min(
            r["auto_stage_learned_over_best_fixed"] for r in rows
          ),
          "greedy_equal_stage_learned": all(r["greedy_equal_stage_learned"] for r in rows),
        }
        if stage and b.get("learn_rollouts", 0)
        else {}
      ),
      **(
        {
          "control_over_same_min": min(r["control_over_same"] for r in rows),
          "control_over_same_max": max(r["control_over_same"] for r in rows),
        }
        if b.get("control", False)
        else {}
      ),
    },
    "training_summary": summary,
  }
  measured = {"by_batch": {str(r["batch"]): r for r in rows}, "all_batches": payload["all_batches"]}
  goals = provenance.goals_from_config(b.goals)
  results = provenance.write_results(workdir, payload, goals=goals, measured=measured)
  print(adaptive_table(results))
  print(provenance.goals_table(results["goals"]), flush=True)
  return results


def _learn_stage_prices(params, dparams, ctx, prompts_BS, lengths_B, model, prior, config, b, kw):
  """(StagePrices, [{plan, stages}]): `bench.learn_rollouts` untimed rollouts of the G-per-stage
  plan, keys 200, 201, ..., each planning with the prices the earlier ones learned and folding its
  own stages' times in (stages whose call compiled are left out), as an RL run's rollouts do."""
  models = (ctx.models.pcfg, ctx.models.dcfg)
  prices = cost.StagePrices(
    config.decode.get("price_prior_rounds", 4.0), config.decode.get("price_keep", 0.7)
  )
  history = []
  for k in range(int(b.learn_rollouts)):
    timings = []
    engine.generate(
      params, dparams, *models, prompts_BS, lengths_B, jax.random.key(200 + k),
      temperature=b.temperature, num_draft=max(b.num_drafts), adaptive=True, per_stage=True,
      cost=model, prior=prior, prices=prices, timings=timings, **kw,
    )  # fmt: skip
    prices = prices.updated(timings)
    history.append({"stages": [dict(t) for t in timings], "factors": prices.summary()})
  return prices, history


def _over_planned(row: dict) -> float | None:
  """auto_stage tokens/s over the fixed arm at the G its plan chose, where the plan chose one G
  for every stage (then both arms run the same rounds; None otherwise): a diagnostic beside the
  goals, which compare with the best of the fixed arms."""
  planned = set(row["stage_plan"].values())
  if len(planned) != 1:
    return None
  G = planned.pop()
  return row["tokens_per_s"]["auto_stage"] / row["tokens_per_s"]["ar" if G == 0 else str(G)]


def _adaptive_row(B: int, samples: dict, first: dict, num_drafts) -> dict:
  """Median tokens/s of every arm; each arm's speedup over compacted AR; the best fixed G; with a
  `control` arm (the fixed arm at the largest G again) its tokens/s over that arm's: how far
  apart this host times one program in two arms, the floor under every ratio of two arms here
  (and the best of five fixed arms is the largest of five such noisy medians)."""
  rate = {str(k): float(np.median([s["tokens_per_s"] for s in v])) for k, v in samples.items()}
  over_ar = {k: r / rate["ar"] for k, r in rate.items()}
  best = max((int(G) for G in num_drafts), key=lambda G: rate[str(G)])
  control = (
    {"control_over_same": rate["control"] / rate[str(max(int(G) for G in num_drafts))]}
    if "control" in rate
    else {}
  )
  auto = samples["auto"]
  stage = (
    {
      "auto_stage_over_ar": over_ar["auto_stage"],
      "auto_stage_over_best_fixed": rate["auto_stage"] / rate[str(best)],
      "auto_stage_num_draft_counts": samples["auto_stage"][-1].get("num_draft_counts"),
    }
    if "auto_stage" in samples
    else {}
  )
  return {
    **stage,
    **control,
    "batch": B,
    "tokens_per_s": rate,
    "over_ar": over_ar,
    "best_fixed": best,
    "best_fixed_over_ar": over_ar[str(best)],
    "auto_over_ar": over_ar["auto"],
    "auto_over_best_fixed": rate["auto"] / rate[str(best)],
    "auto_over_ar_per_repeat": [
      a["tokens_per_s"] / r["tokens_per_s"] for a, r in zip(auto, samples["ar"])
    ],
    "tau": {str(k): float(np.median([s.get("tau", 1.0) for s in v])) for k, v in samples.items()},
    "policy_passes_per_token": {
      str(k): float(np.median([s["policy_passes_per_token"] for s in v]))
      for k, v in samples.items()
    },
    "auto_num_draft_counts": auto[-1].get("num_draft_counts"),
    # the timing's own scatter: each arm's (max - min) / median tokens/s over the repeats
    "spread": {
      str(k): float(np.ptp(r := [s["tokens_per_s"] for s in v]) / np.median(r))
      for k, v in samples.items()
    },
    "calls_per_sample": {str(k): int(v[0].get("calls", 1)) for k, v in samples.items()},
    "first_call_s": {str(k): float(v) for k, v in first.items()},
  }


def adaptive_table(results) -> str:
  arms = ["ar_plain"] + [str(G) for G in results["config"]["num_drafts"]] + ["auto"]
  if results["config"].get("auto_stage"):
    arms.append("auto_stage")
  if results["config"].get("learn_rollouts"):
    arms.append("auto_stage_learned")
  if results["config"].get("as_timed_arm"):
    arms.append("auto_stage_as_timed")
  stage = results["config"].get("auto_stage", False)
  control = results["config"].get("control", False)
  short = {"auto_stage_as_timed": "as_timed", "auto_stage_learned": "learned"}
  label = lambda a: "G=" + a if a.isdigit() else short.get(a, a)
  head = " ".join(f"{label(a):>8}" for a in arms)
  extra = f" {'stage/best':>10} {'stage/plan':>10}" if stage else ""
  extra += f" {'ctl/same':>8}" if control else ""
  lines = [
    "tokens/s over compacted AR (every arm compacted but ar_plain); best = best fixed G; "
    "auto_stage: G chosen per compaction stage; stage/plan: over the fixed arm at the planned G "
    "(one G planned for every stage); ctl/same: the largest fixed G's arm timed twice",
    f"{'batch':>5} {'AR tok/s':>9} {head} {'best':>4} {'auto/best':>9}{extra} {'greedy=':>7}",
  ]
  for r in results["rows"]:
    cells = " ".join(f"{r['over_ar'][a]:>8.2f}" for a in arms)
    extra = ""
    if stage:
      plan = r.get("auto_stage_over_planned_fixed")
      plan = f"{plan:>10.2f}" if plan is not None else f"{'-':>10}"
      extra = f" {r['auto_stage_over_best_fixed']:>10.2f} {plan}"
    extra += f" {r['control_over_same']:>8.2f}" if control else ""
    greedy = r["greedy_equal"] and r.get("greedy_equal_stage", True)
    greedy = greedy and r.get("greedy_equal_stage_learned", True)
    lines.append(
      f"{r['batch']:>5} {r['tokens_per_s']['ar']:>9.1f} {cells} {r['best_fixed']:>4} "
      f"{r['auto_over_best_fixed']:>9.2f}{extra} {str(greedy):>7}"
    )
  return "\n".join(lines)
