"""SD vs AR on the same checkpoint, prompts, G and sampling: the one timing used by the run's
report (`train/evaluate.py`) and by the rollout benchmark (`bench/rollout.py`).

Definitions (every figure below is one of these):
  tau                         tokens emitted per SD round and active row (accepted drafts + the
                              correction or bonus token), averaged over every (row, round) pair
                              in which the row was still generating: `tau_sum / row_rounds`.
                              1 <= tau <= G + 1.
  policy passes per token     the rows of every policy forward pass (prefill included), summed,
                              divided by the tokens generated: passes times the batch size, or
                              less where finished rows were compacted away (`decode.engine`).
                              Without compaction a row that stopped early keeps costing passes
                              until every row stops. AR needs about 1; SD about 1/tau.
  greedy_equal                at temperature 0, the SD tokens equal the AR tokens on every row,
                              exactly (all `max_new_tokens` positions, PAD after the end).
  tokens/s                    generated tokens (EOS included) over the wall time of one
                              `generate` call, after `block_until_ready`.

Shape letters: B batch, S prompt width (BOS + prompt, right-padded), G draft tokens per round.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from specdraft.decode import autoregressive, engine, speculative
from specdraft.parallel import multihost


def compare_rollouts(
  params,
  dparams,
  pcfg,
  dcfg,
  prompts_BS,
  prompt_lengths_B,
  *,
  max_new_tokens: int,
  num_draft: int,
  temperature: float,
  repeats: int,
  seed: int = 0,
  engine_kw: dict | None = None,
) -> dict:
  """Times AR and SD generation on the same inputs; returns the figures defined above.

  Each function is called once first (compile + one run, reported as `first_call_s_*`, never
  timed); then `repeats` timed calls alternate AR, SD, AR, SD, ... with the same key for both
  in each repeat, so slow phases of a shared machine hit both. Rates are medians over repeats;
  `speedup` is the ratio of the median rates and `speedup_per_repeat` the paired ratios.

  `engine_kw`: both arms run through `decode.engine` as RL rollouts do (finished rows compacted
  away when `compact`; SD at a fixed G, or choosing G per round when `adaptive`, with its `cost`
  and `prior`), the first call compiling every bucket's stage; None: one loop per arm, every
  row riding in every pass.
  """
  kw = dict(max_new_tokens=max_new_tokens, num_draft=num_draft)
  warm = None
  if engine_kw is None:
    run = generators(params, dparams, pcfg, dcfg, prompts_BS, prompt_lengths_B, **kw)
  else:
    run = engine_pair(params, dparams, pcfg, dcfg, prompts_BS, prompt_lengths_B, **kw, **engine_kw)
    warm = engine_pair(
      params, dparams, pcfg, dcfg, prompts_BS, prompt_lengths_B, **kw, **engine_kw,
      every_stage=True,
    )  # fmt: skip
  first_call_s, samples = time_side_by_side(
    run, temperature=temperature, repeats=repeats, seed=seed, warm=warm
  )
  out = _summarise(samples, batch=int(prompts_BS.shape[0]))
  if engine_kw is not None:
    out["engine"] = {k: v for k, v in engine_kw.items() if isinstance(v, (bool, int, float))}
    counts = [s["num_draft_counts"] for s in samples["sd"] if "num_draft_counts" in s]
    if counts:  # rounds at each G, summed over the timed repeats
      out["num_draft_counts"] = np.sum(counts, axis=0).tolist()
  out.update(
    temperature=float(temperature),
    num_draft=int(num_draft),
    max_new_tokens=int(max_new_tokens),
    repeats=int(repeats),
    first_call_s_ar=first_call_s["ar"],
    first_call_s_sd=first_call_s["sd"],
  )
  out.update(greedy_agreement(run["ar"], run["sd"], jax.random.key(seed)))
  return out


def sweep_num_draft(
  params,
  dparams,
  pcfg,
  dcfg,
  prompts_BS,
  prompt_lengths_B,
  *,
  max_new_tokens: int,
  num_drafts: tuple[int, ...],
  temperature: float,
  repeats: int,
  seed: int = 0,
) -> dict:
  """SD at every G of `num_drafts` against one AR baseline, timed side by side.

  Choosing G is a trade: a longer proposal raises tau but costs G draft passes and a wider
  verification pass per round, so the fastest G depends on the draft's acceptance and on the
  cost of a draft pass relative to a policy pass on the machine at hand. Every generator is
  called once first (compile, never timed); then each repeat runs AR and SD at every G in turn
  with the same key, so slow phases of a shared machine hit all of them. Per G: the figures of
  `compare_rollouts` (speedup = median SD rate / median AR rate, paired ratios per repeat);
  `best_num_draft` is the G with the highest speedup.
  """
  at = lambda G: generators(
    params, dparams, pcfg, dcfg, prompts_BS, prompt_lengths_B,
    max_new_tokens=max_new_tokens, num_draft=int(G),
  )  # fmt: skip
  run = {"ar": at(1)["ar"], **{G: at(G)["sd"] for G in num_drafts}}
  _, samples = time_side_by_side(run, temperature=temperature, repeats=repeats, seed=seed)
  batch = int(prompts_BS.shape[0])
  by_num_draft = {}
  for G in num_drafts:
    row = _summarise({"ar": samples["ar"], "sd": samples[G]}, batch=batch)
    by_num_draft[str(G)] = dict(row, num_draft=int(G))
  best = max(by_num_draft.values(), key=lambda r: r["speedup"])
  return {
    "batch": batch,
    "temperature": float(temperature),
    "max_new_tokens": int(max_new_tokens),
    "repeats": int(repeats),
    "num_drafts": [int(G) for G in num_drafts],
    "by_num_draft": by_num_draft,
    "best_num_draft": best["num_draft"],
    "best_speedup": best["speedup"],
  }


def compare_drafts(
  params,
  pcfg,
  drafts_by_name: dict,
  prompts_BS,
  prompt_lengths_B,
  *,
  max_new_tokens: int,
  num_draft: int,
  temperature: float,
  repeats: int,
  seed: int = 0,
) -> dict:
  """SD with each draft of `drafts_by_name` ({name: (dparams, dcfg)}) against one AR baseline
  on the same policy, prompts, G and sampling, timed side by side (`time_side_by_side`).

  Returns {"by_draft": {name: the figures of `compare_rollouts`}, ...}; greedy equality is
  checked for every draft."""
  kw = dict(max_new_tokens=max_new_tokens, num_draft=num_draft)
  run = {}
  for name, (dparams, dcfg) in drafts_by_name.items():
    gens = generators(params, dparams, pcfg, dcfg, prompts_BS, prompt_lengths_B, **kw)
    run.setdefault("ar", gens["ar"])
    run[name] = gens["sd"]
  first_call_s, samples = time_side_by_side(
    run, temperature=temperature, repeats=repeats, seed=seed
  )
  batch = int(prompts_BS.shape[0])
  by_draft = {}
  for name in drafts_by_name:
    row = _summarise({"ar": samples["ar"], "sd": samples[name]}, batch=batch)
    row.update(first_call_s_ar=first_call_s["ar"], first_call_s_sd=first_call_s[name])
    row.update(greedy_agreement(run["ar"], run[name], jax.random.key(seed)))
    by_draft[name] = row
  return {
    "batch": batch,
    "temperature": float(temperature),
    "num_draft": int(num_draft),
    "max_new_tokens": int(max_new_tokens),
    "repeats": int(repeats),
    "by_draft": by_draft,
  }


def time_side_by_side(
  run: dict,
  *,
  temperature: float,
  repeats: int,
  seed: int = 0,
  warm: dict | None = None,
  min_seconds: float = 0.0,
):
  """Calls every generator of `run` ({name: (key, temperature) -> Generation}) once first
  (compile + one run: `first_call_s`, never timed; `warm[name]` instead where given, e.g. an
  engine generator that compiles every bucket's stage), then `repeats` times in turn with the
  same key per repeat, so slow phases of a shared machine hit all of them. With `min_seconds`,
  one sample calls the generator with that key until the calls add up to `min_seconds` (the
  same tokens every call) and its rate is their tokens over their total time: a call of tens of
  milliseconds is otherwise at the mercy of one scheduler hiccup.

  Returns (first_call_s {name: s}, samples {name: [decoding_figures + tokens_per_s + calls per
  repeat]})."""
  if repeats < 1:
    raise ValueError(f"repeats={repeats}: must be >= 1")
  if not min_seconds >= 0.0:
    raise ValueError(f"min_seconds={min_seconds}: must be >= 0 (0 = one call per sample)")
  warm = warm or {}
  first_call_s = {
    name: _seconds(warm.get(name, fn), jax.random.key(seed), temperature)[0]
    for name, fn in run.items()
  }
  samples = {name: [] for name in run}
  for r in range(repeats):
    key = jax.random.key(seed + 1 + r)
    for name, fn in run.items():
      seconds, gen = _seconds(fn, key, temperature)
      calls = 1
      while seconds < min_seconds:
        seconds += _seconds(fn, key, temperature)[0]
        calls += 1
      figures = decoding_figures(gen)
      figures["tokens_per_s"] = figures["tokens"] * calls / seconds
      figures["calls"] = calls
      samples[name].append(figures)
  return first_call_s, samples


def generators(params, dparams, pcfg, dcfg, prompts_BS, prompt_lengths_B, **kw) -> dict:
  """{"ar": (key, temperature) -> Generation, "sd": the same with the draft}."""
  num_draft = kw.pop("num_draft")
  ar = lambda key, t: autoregressive.generate(
    params, pcfg, prompts_BS, prompt_lengths_B, key, temperature=t, **kw
  )
  sd = lambda key, t: speculative.generate(
    params,
    dparams,
    pcfg,
    dcfg,
    prompts_BS,
    prompt_lengths_B,
    key,
    temperature=t,
    num_draft=num_draft,
    **kw,
  )
  return {"ar": ar, "sd": sd}


def engine_pair(
  params, dparams, pcfg, dcfg, prompts_BS, prompt_lengths_B, *, num_draft, **kw
) -> dict:
  """{"ar": AR, "sd": SD at `num_draft` (G, or G_max with `adaptive`)} through `decode.engine`,
  each (key, temperature) -> Generation; `kw` as `engine.generate`'s."""
  arm = lambda G: lambda key, t: engine.generate(
    params, dparams, pcfg, dcfg, prompts_BS, prompt_lengths_B, key, temperature=t,
    num_draft=G, **kw,
  )  # fmt: skip
  return {"ar": arm(0), "sd": arm(num_draft)}


def engine_arms(
  params, dparams, pcfg, dcfg, prompts_BS, prompt_lengths_B, *, num_drafts, cost, prior,
  stage_cost=None, **kw,
) -> dict:  # fmt: skip
  """Rollouts through `decode.engine` (finished rows compacted away in every arm): {"ar": AR,
  G: SD at that fixed G for each G of `num_drafts`, "auto": SD choosing G in 0..max(num_drafts)
  per round from `cost` and the acceptance `prior`, and with `stage_cost` "auto_stage": G chosen
  per stage from it (decode.auto_every = stage)}, each (key, temperature) -> Generation."""
  arm = lambda G, adaptive, c=cost, per_stage=False: lambda key, t: engine.generate(
    params, dparams, pcfg, dcfg, prompts_BS, prompt_lengths_B, key, temperature=t,
    num_draft=G, adaptive=adaptive, cost=c, prior=prior, per_stage=per_stage, **kw,
  )  # fmt: skip
  run = {"ar": arm(0, False), **{int(G): arm(int(G), False) for G in num_drafts}}
  run["auto"] = arm(max(num_drafts), True)
  if stage_cost is not None:
    run["auto_stage"] = arm(max(num_drafts), True, stage_cost, True)
  return run


def greedy_agreement(run_ar, run_sd, key) -> dict:
  """`greedy_equal`: temperature-0 SD tokens == AR tokens on every row, exactly."""
  ar_BO = multihost.to_host(run_ar(key, 0.0).tokens)
  sd_BO = multihost.to_host(run_sd(key, 0.0).tokens)
  rows_differ = ~np.all(ar_BO == sd_BO, axis=1)
  return {
    "greedy_equal": bool(not rows_differ.any()),
    "greedy_rows_differing": int(rows_differ.sum()),
  }


def _seconds(fn, key, temperature):
  t0 = time.perf_counter()
  gen = jax.block_until_ready(fn(key, temperature))
  return time.perf_counter() - t0, gen


def decoding_figures(gen) -> dict:
  """tokens, policy passes per token and, for SD, tau and per-position acceptance (accepted /
  reached) of one Generation, as defined in the module docstring."""
  stats = jax.tree.map(multihost.to_host, gen.stats)
  batch = int(gen.lengths.shape[0])
  tokens = int(np.sum(multihost.to_host(gen.lengths)))
  out = {
    "tokens": tokens,
    "policy_passes_per_token": _row_passes(stats, batch) / max(tokens, 1),
  }
  if "tau_sum" in stats:
    out["tau"] = float(stats["tau_sum"] / max(int(stats["row_rounds"]), 1))
    reached = np.maximum(stats["reach_counts"], 1)
    out["accept_per_position"] = (stats["accept_counts"] / reached).tolist()
  if "num_draft_counts" in stats:  # rounds at each G (adaptive speculation)
    out["num_draft_counts"] = np.asarray(stats["num_draft_counts"]).tolist()
  return out


def _summarise(samples: dict, *, batch: int) -> dict:
  """Medians over repeats of each per-call figure."""
  med = lambda name, k: float(np.median([s[k] for s in samples[name]]))
  out = {
    "batch": batch,
    "ar_tokens_per_s": med("ar", "tokens_per_s"),
    "sd_tokens_per_s": med("sd", "tokens_per_s"),
    "ar_policy_passes_per_token": med("ar", "policy_passes_per_token"),
    "sd_policy_passes_per_token": med("sd", "policy_passes_per_token"),
    "tau": med("sd", "tau"),
    "accept_per_position": np.median(
      [s["accept_per_position"] for s in samples["sd"]], axis=0
    ).tolist(),
  }
  out["speedup"] = out["sd_tokens_per_s"] / out["ar_tokens_per_s"]
  out["speedup_per_repeat"] = [
    s["tokens_per_s"] / a["tokens_per_s"] for a, s in zip(samples["ar"], samples["sd"])
  ]
  return out


def _row_passes(stats: dict, batch: int) -> int:
  """Rows of every policy pass, summed: passes x batch, or less where finished rows were
  compacted away (`decode.engine`)."""
  return int(stats.get("row_passes", int(stats["policy_passes"]) * batch))
