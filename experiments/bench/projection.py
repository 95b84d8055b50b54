"""Projected SD-over-AR speedups on accelerators (experiments/project_speedup.py).

The projection runs the cost model that the CPU validates (`decode.cost`: a pass's roofline plus
fixed costs per pass, layer and round) with a machine built from a datasheet
(`cost.Machine.from_spec`) and a rollout shaped like a run's: its measured per-position
acceptance and its tail profile (how many rows still generate at each round).

The rollout is a deterministic fluid simulation of `decode.engine`: rows finish in the order of
their lengths; a round runs at the compaction bucket of the rows still generating
(`engine.buckets`: the smallest bucket holding them); AR advances every active row by one token a
step; SD picks each round's G as the engine does (`speculative.choose_num_draft` over
`CostModel.round_seconds_all` at the bucket, the measured rates) and advances every active row by
the expected tokens of a round at that G (`cost.expected_tokens`), fractions included. Both arms
compact. Completion lengths count the prefill's token: a row of length n decodes n - 1 tokens.

Shape letters: M = G_max (the most a round drafts).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os

import jax.numpy as jnp
import numpy as np

from experiments.bench import provenance
from specdraft.decode import cost, engine, speculative
from specdraft.model import drafts, eagle3
from specdraft.model import policy as pol

_EPS = 1e-9  # tokens: a row whose length the fluid front reached is done


# ----------------------------------------------------------------------------- the simulation


def choose_G(model: cost.CostModel, rates_M, rows: int, capacity: int) -> int:
  """The engine's choice of G at `rows` (`speculative.choose_num_draft`) with acceptance `rates`
  and no counts of its own."""
  M = len(rates_M)
  rs = model.round_seconds_all(rows, M, capacity)
  choice = speculative.Choice(
    np.asarray(rs, np.float32), np.asarray(rates_M, np.float32), np.ones((M,), np.float32)
  )
  zeros = np.zeros((M,), np.float32)
  return int(speculative.choose_num_draft(dict(accept_counts=zeros, reach_counts=zeros), choice))


def bucket_of(active: int, sizes: list[int]) -> int:
  """The bucket a round with `active` rows runs at: the smallest one holding them (a stage runs
  until no more than the next bucket's rows generate)."""
  return min((b for b in sizes if b >= active), default=sizes[0])


def _fluid(decode_tokens, sizes, step):
  """Advances a fluid front over rows needing `decode_tokens` tokens: `step(bucket)` gives
  (tokens a round adds to every active row, its seconds). Returns per-bucket rounds and seconds."""
  d = np.sort(np.asarray(decode_tokens, np.float64))
  per, t = {}, 0.0
  while True:
    active = len(d) - int(np.searchsorted(d, t + _EPS, side="right"))
    if active == 0:
      return per
    b = bucket_of(active, sizes)
    tokens, seconds = step(b)
    # every round until the next row finishes runs at the same bucket: take them at once
    nxt = d[len(d) - active]
    n = max(1, math.ceil((nxt - t - _EPS) / tokens))
    e = per.setdefault(b, dict(rounds=0, seconds=0.0))
    e["rounds"] += n
    e["seconds"] += n * seconds
    t += n * tokens


def simulate(
  model: cost.CostModel,
  decode_tokens,
  rates_M,
  *,
  prompt_len: int,
  max_new_tokens: int,
  min_rows: int = 1,
) -> dict:
  """AR and SD (adaptive G, both compacting) seconds of one rollout whose rows decode
  `decode_tokens` tokens each after the prefill (prompt_len = 0: no prefill counted).

  Returns ar_seconds, sd_seconds, speedup (AR / SD), tokens (decoded, and each row's prefill token
  when the prefill is counted), ar/sd_tokens_per_s,
  prefill seconds of each arm and `by_bucket` {bucket: G, expected tokens per round, round and AR
  step seconds, rounds and seconds in each arm}."""
  rows, M = len(decode_tokens), len(rates_M)
  sizes = engine.buckets(rows, min_rows)
  ar_cap = prompt_len + max_new_tokens
  sd_cap = ar_cap + M + 2  # the engine's SD cache: room for a round's drafted tokens
  by = {}
  for b in sizes:
    G = choose_G(model, rates_M, b, sd_cap) if M else 0
    by[b] = dict(
      G=G,
      expected_tokens=cost.expected_tokens(rates_M, G),
      round_seconds=model.round_seconds(b, G, sd_cap),
      ar_step_seconds=model.ar_step_seconds(b, ar_cap),
    )
  ar = _fluid(decode_tokens, sizes, lambda b: (1.0, by[b]["ar_step_seconds"]))
  sd = _fluid(decode_tokens, sizes, lambda b: (by[b]["expected_tokens"], by[b]["round_seconds"]))
  for b, e in by.items():
    e.update(
      ar_steps=ar.get(b, {}).get("rounds", 0),
      ar_seconds=ar.get(b, {}).get("seconds", 0.0),
      sd_rounds=sd.get(b, {}).get("rounds", 0),
      sd_seconds=sd.get(b, {}).get("seconds", 0.0),
    )
  ar_prefill = sd_prefill = 0.0
  if prompt_len:
    ar_prefill = model.policy_seconds(rows, prompt_len, ar_cap)
    sd_prefill = model.policy_seconds(rows, prompt_len, sd_cap)
    sd_prefill += model.draft_seconds(rows, prompt_len, sd_cap)
  ar_s = ar_prefill + sum(e["seconds"] for e in ar.values())
  sd_s = sd_prefill + sum(e["seconds"] for e in sd.values())
  tokens = float(np.sum(decode_tokens)) + (rows if prompt_len else 0)
  return dict(
    ar_seconds=ar_s,
    sd_seconds=sd_s,
    speedup=ar_s / sd_s,
    tokens=tokens,
    ar_tokens_per_s=tokens / ar_s,
    sd_tokens_per_s=tokens / sd_s,
    ar_prefill_seconds=ar_prefill,
    sd_prefill_seconds=sd_prefill,
    by_bucket=by,
  )


def replay(model: cost.CostModel, active_trace, num_draft_trace, *, capacity: int, sizes) -> float:
  """Predicted seconds of a run's recorded rounds: each at the bucket of its active rows and its
  recorded G (AR: `num_draft_trace` None, one step each)."""
  if num_draft_trace is None:
    return sum(model.ar_step_seconds(bucket_of(a, sizes), capacity) for a in active_trace)
  return sum(
    model.round_seconds(bucket_of(a, sizes), int(G), capacity)
    for a, G in zip(active_trace, num_draft_trace)
  )


# ----------------------------------------------------------------------------- tail profiles


def lognormal_lengths(rows: int, median: float, sigma: float, max_len: int) -> np.ndarray:
  """Completion lengths at the rows' quantiles (j + 1/2) / rows of a lognormal, in 1..max_len."""
  from scipy.stats import norm

  q = (np.arange(rows) + 0.5) / rows
  return np.clip(np.round(median * np.exp(sigma * norm.ppf(q))), 1, max_len)


def rounds_alive(active_trace, rows: int) -> np.ndarray:
  """[rows] rounds each row generated in, from the rows still generating at each round (rows
  never active finished in the prefill: 0)."""
  a = np.asarray(list(active_trace) + [0], np.int64)
  finished = a[:-1] - a[1:]  # rows alive at round r and not at r + 1 generated r + 1 rounds
  alive = np.repeat(np.arange(1, len(a)), finished)
  return np.concatenate([np.zeros((rows - len(alive),), np.int64), alive])


def trace_lengths(active_trace, num_draft_trace, rates_M, rows: int, mean_length: float):
  """[rows] completion lengths of a run's rollout: rounds alive from the trace, each SD round
  worth the expected tokens of its recorded G (AR: one), rescaled so their mean is the run's
  measured mean_length (the rates are an average; the total is measured)."""
  alive = rounds_alive(active_trace, rows)
  if num_draft_trace is None:
    per_round = np.ones((len(active_trace),))
  else:
    per_round = np.asarray([cost.expected_tokens(rates_M, int(G)) for G in num_draft_trace])
  cum = np.concatenate([[0.0], np.cumsum(per_round)])
  decoded = cum[alive]
  if decoded.mean() > 0:
    decoded *= max(mean_length - 1.0, 0.0) / decoded.mean()
  return decoded + 1.0


def resample(fractions, rows: int, max_len: int) -> np.ndarray:
  """`rows` completion lengths at the rows' quantiles of the pooled `fractions` of a run's
  max_new_tokens, scaled to `max_len`."""
  q = (np.arange(rows) + 0.5) / rows
  return np.clip(np.round(np.quantile(np.asarray(fractions), q) * max_len), 1, max_len)


# ----------------------------------------------------------------------------- inputs


def policy_config(p) -> pol.PolicyConfig:
  keys = ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff", "tie_embeddings")
  return pol.PolicyConfig(vocab_size=p.vocab_size, dtype=p.dtype, **{k: p[k] for k in keys})


def draft_config(d, pcfg: pol.PolicyConfig) -> eagle3.DraftConfig:
  """A one-layer EAGLE-3 draft on `pcfg` (its vocabulary reduced to the first draft_vocab ids:
  only the count matters to the cost model)."""
  ids = tuple(range(d.draft_vocab)) if 0 < d.draft_vocab < pcfg.vocab_size else None
  return eagle3.DraftConfig(
    d_model=pcfg.d_model,
    vocab_size=pcfg.vocab_size,
    n_taps=d.n_taps,
    n_heads=d.n_heads,
    n_kv_heads=d.n_kv_heads,
    head_dim=d.head_dim,
    d_ff=d.d_ff,
    ttt_steps=d.ttt_steps,
    dtype=pcfg.dtype,
    vocab_ids=ids,
  )


def machine_for(hw, efficiency) -> cost.Machine:
  """A datasheet's machine: achieved FLOP/s and HBM bytes/s, the assumed fixed costs, and the
  round's own work at the achieved bandwidth."""
  hbm = hw["hbm_bytes_per_s"] * efficiency["hbm"]
  return cost.Machine.from_spec(
    dict(
      peak_flops=hw["peak_flops"] * efficiency["flops"],
      hbm_bytes_per_s=hbm,
      pass_s=hw["pass_s"],
      layer_s=hw["layer_s"],
      round_s=hw["round_s"],
      sample_rate=hbm / hw["sample_bytes_per_entry"],
    )
  )


def read_metrics(run_dir: str, last_steps: int) -> list[dict]:
  """The last `last_steps` RL steps of run_dir/metrics.jsonl that carry a tail profile."""
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  rows = [r for r in rows if r.get("active_trace")]
  if not rows:
    raise ValueError(f"{run_dir}/metrics.jsonl has no RL step with an active_trace")
  return rows[-last_steps:]


def measured_rates(steps: list[dict], unmeasured: str) -> tuple[np.ndarray, list[bool]]:
  """[M] the mean conditional acceptance per position over the steps that drafted that far, and
  which positions were measured at all (others: 0, or the deepest measured rate for 'last')."""
  M = max(len(s.get("accept_per_position") or []) for s in steps)
  sums, n = np.zeros((M,)), np.zeros((M,))
  for s in steps:
    rates, counts = s.get("accept_per_position") or [], s.get("num_draft_counts")
    for j, a in enumerate(rates):
      if counts is None or sum(counts[j + 1 :]) > 0:  # some round drafted position j
        sums[j], n[j] = sums[j] + a, n[j] + 1
  measured = [bool(x) for x in n > 0]
  rates = np.where(n > 0, sums / np.maximum(n, 1), 0.0)
  if unmeasured == "last" and any(measured):
    deepest = max(j for j in range(M) if measured[j])
    rates[deepest + 1 :] = rates[deepest]
  elif unmeasured != "zero":
    raise ValueError(f"config.project.unmeasured={unmeasured!r} is invalid: 'zero' or 'last'")
  return rates, measured


def _run_config(run_dir: str):
  """The run's ConfigDict rebuilt from run_dir/run_config.json, or, for an arm of the drift
  experiment (whose run directory holds none), from its experiment's base/run_config.json: an
  arm's config is the base's with only `rollout.draft` and `draft.kind` set, which the projection
  does not read."""
  import ml_collections

  path = os.path.join(run_dir, "run_config.json")
  base = os.path.join(os.path.dirname(os.path.abspath(run_dir)), "base", "run_config.json")
  if not os.path.exists(path) and os.path.exists(base):
    path = base
  with open(path) as f:
    flat = json.load(f)["config"]
  d = {}
  for k, v in flat.items():
    *head, last = k.split(".")
    cur = d
    for h in head:
      cur = cur.setdefault(h, {})
    cur[last] = v
  return ml_collections.ConfigDict(d)


def run_inputs(run_dir: str, last_steps: int, unmeasured: str) -> dict:
  """A run's rates, tail profile (pooled completion lengths as fractions of its max_new_tokens),
  and its own rollout setting (config, rows, G_max, N)."""
  steps = read_metrics(run_dir, last_steps)
  rc = _run_config(run_dir)
  rows = int(rc.rl.prompts_per_step * rc.rl.group_size)
  N = int(rc.rl.get("max_new_tokens", 0) or rc.decode.max_new_tokens)
  rates, measured = measured_rates(steps, unmeasured)
  fractions = []
  for s in steps:
    G = s.get("num_draft_trace")
    step_rates = s.get("accept_per_position") or []
    lengths = trace_lengths(s["active_trace"], G, step_rates, rows, s["mean_length"])
    fractions += list(lengths / N)
  return dict(
    steps=steps,
    config=rc,
    rows=rows,
    max_new_tokens=N,
    rates=rates,
    measured=measured,
    fractions=fractions,
  )


# ----------------------------------------------------------------------------- training


def params(w: cost.Work, dtype: str) -> float:
  """Matmul parameters of a pass's Work (its weight bytes over the dtype's size)."""
  return w.weight_bytes / jnp.dtype(dtype).itemsize


def train_seconds(pcfg, dcfg, tokens: float, peak_flops: float, mfu: float) -> dict:
  """6 * params * tokens / (peak * mfu) for the policy and, times its TTT steps, the draft."""
  p = params(cost.policy_work(pcfg, 1, 1, 1), pcfg.dtype)
  d = params(cost.draft_work(dcfg, 1, 1, 1), dcfg.dtype)
  rate = peak_flops * mfu
  return dict(
    policy_params=p,
    draft_params=d,
    policy_seconds=6 * p * tokens / rate,
    draft_seconds=6 * d * tokens * dcfg.ttt_steps / rate,
  )


def cache_bytes(cfg, rows: int, capacity: int) -> float:
  """Bytes of a model's KV cache held at `capacity`: keys and values of every layer (one layer for
  EAGLE-3's draft). Not `Work.kv_bytes`, which prices the traffic of a pass (the decode's scan reads
  the carried cache once per layer, so its traffic is n_layers times what is held)."""
  layers = cfg.n_layers if isinstance(cfg, pol.PolicyConfig) or drafts.is_block(cfg) else 1
  itemsize = jnp.dtype(cfg.dtype).itemsize
  return float(rows * capacity * layers * 2 * cfg.n_kv_heads * cfg.head_dim * itemsize)


def decode_bytes(pcfg, dcfg, rows: int, capacity: int) -> float:
  """HBM a rollout holds: both models' weights and KV caches at `capacity`."""
  p, d = cost.policy_work(pcfg, rows, 1, capacity), cost.draft_work(dcfg, rows, 1, capacity)
  return (
    p.weight_bytes
    + d.weight_bytes
    + cache_bytes(pcfg, rows, capacity)
    + cache_bytes(dcfg, rows, capacity)
  )


# ----------------------------------------------------------------------------- the projection


def _rollout(hw, pcfg, dcfg, lengths, rates, p, fixed_scale: float = 1.0) -> tuple:
  """(CostModel, simulate's result) on one accelerator, its fixed costs scaled by fixed_scale."""
  fixed = {k: hw[k] * fixed_scale for k in ("pass_s", "layer_s", "round_s")}
  model = cost.CostModel(machine_for(dict(hw, **fixed), p.efficiency), pcfg, dcfg)
  sim = simulate(
    model,
    np.asarray(lengths) - 1.0,
    rates,
    prompt_len=p.prompt_len,
    max_new_tokens=p.max_new_tokens,
    min_rows=p.min_rows,
  )
  return model, sim


def project_hardware(hw, pcfg, dcfg, lengths, rates, p) -> dict:
  """One accelerator's projection: rollout (AR and SD), training, the RL step, and the rollout
  speedup with the assumed fixed costs scaled by each of `sensitivity.fixed_scale`."""
  model, sim = _rollout(hw, pcfg, dcfg, lengths, rates, p)
  sens = {
    str(f): _rollout(hw, pcfg, dcfg, lengths, rates, p, f)[1]["speedup"]
    for f in p.sensitivity.fixed_scale
  }
  trained = len(lengths) * (p.prompt_len + float(np.mean(lengths)))
  tr = train_seconds(pcfg, dcfg, trained, hw["peak_flops"], p.train.mfu)
  ar_step = sim["ar_seconds"] + tr["policy_seconds"]
  sd_step = sim["sd_seconds"] + tr["policy_seconds"] + tr["draft_seconds"]
  need = decode_bytes(pcfg, dcfg, len(lengths), p.prompt_len + p.max_new_tokens + len(rates) + 2)
  return dict(
    hardware=hw["name"],
    source=hw["source"],
    machine=dataclasses.asdict(model.machine),
    rollout=sim,
    train=dict(tr, trained_tokens=trained),
    ar_step_seconds=ar_step,
    sd_step_seconds=sd_step,
    rl_step_speedup=ar_step / sd_step,
    ar_rollout_share=sim["ar_seconds"] / ar_step,
    rollout_speedup_by_fixed_scale=sens,
    decode_bytes=need,
    fits_hbm=bool(need <= hw["hbm_bytes"]),
  )


def sanity_check(run_dir: str, inputs: dict) -> dict | None:
  """The run's own rollouts under the machine it calibrated on the CPU (run_dir/cost): each step's
  measured rollout seconds next to the replay of its recorded rounds and the fluid projection."""
  from specdraft.model import drafts
  from specdraft.tasks import tokenizer as tok_lib
  from specdraft.train import state as state_lib

  paths = sorted(glob.glob(os.path.join(run_dir, "cost", "cost_*.json")), key=os.path.getmtime)
  if not paths:
    return None
  with open(paths[-1]) as f:
    record = json.load(f)
  rc = inputs["config"]
  tok = tok_lib.make_tokenizer(rc)
  pcfg = state_lib.policy_config(rc, tok)
  M = int(rc.decode.num_draft)
  nv = int(rc.draft.get("vocab_size", 0) or 0)
  ids = tuple(range(nv)) if 0 < nv < pcfg.vocab_size else None  # only the count matters here
  dcfg = drafts.draft_config(rc.draft, pcfg, M, vocab_ids=ids)
  coef = dict(record["machine"])
  missing = [k for k in ("round_s", "sample_rate") if k not in coef]
  # a record from before the round's own work was modelled: that term is zero
  coef.setdefault("round_s", 0.0)
  coef.setdefault("sample_rate", math.inf)
  coef.setdefault("kv_rate", coef["byte_rate"])  # records before the KV rate: one byte rate
  model = cost.CostModel(cost.Machine(**coef), pcfg, dcfg)
  N = inputs["max_new_tokens"]
  sd_cap = int(record["grid"]["capacity"])  # prompt_len + N + G_max + 2 (Context.cost_model)
  prompt_len = sd_cap - N - M - 2
  min_rows = int(rc.decode.get("min_rows", 1) or 1)
  sizes = engine.buckets(inputs["rows"], min_rows)
  steps = []
  for s in inputs["steps"]:
    G = s.get("num_draft_trace")
    cap = sd_cap if G is not None else prompt_len + N
    rates = s.get("accept_per_position") or [0.0] * M
    lengths = trace_lengths(s["active_trace"], G, rates, inputs["rows"], s["mean_length"])
    sim = simulate(
      model, lengths - 1.0, rates, prompt_len=prompt_len, max_new_tokens=N, min_rows=min_rows
    )
    prefill = sim["sd_prefill_seconds"] if G is not None else sim["ar_prefill_seconds"]
    rep = prefill + replay(model, s["active_trace"], G, capacity=cap, sizes=sizes)
    fluid = sim["sd_seconds"] if G is not None else sim["ar_seconds"]
    steps.append(
      dict(
        step=s.get("step"),
        arm="sd" if G is not None else "ar",
        measured_seconds=s["rollout_seconds"],
        replay_seconds=rep,
        fluid_seconds=fluid,
        replay_over_measured=rep / s["rollout_seconds"],
        # host work between stages (dispatch, compaction's gathers, the batch's assembly) and
        # compiles are not in the cost model: the part of the measured time the replay leaves
        stages=len({bucket_of(a, sizes) for a in s["active_trace"]}),
        unmodelled_seconds=s["rollout_seconds"] - rep,
        fluid_over_measured=fluid / s["rollout_seconds"],
        train_seconds=s.get("train_seconds"),
      )
    )
  return dict(
    record=os.path.relpath(paths[-1], run_dir),
    backend=record.get("backend"),
    machine={k: (None if v == math.inf else v) for k, v in coef.items()},
    terms_missing_from_record=missing,
    policy=dataclasses.asdict(pcfg),
    prompt_len=prompt_len,
    steps=steps,
  )


def assumptions(p, inputs: dict | None) -> dict:
  """Every number of the projection that is not read from a run or a datasheet, and the model's
  simplifications, as recorded in results.json."""
  hw = {
    k: {f: v[f] for f in ("pass_s", "layer_s", "round_s", "sample_bytes_per_entry")}
    for k, v in p.hardware.items()
  }
  return dict(
    fixed_costs=hw,
    fixed_costs_note="not on datasheets: kernel launches and loop overhead per pass, layer and "
    "round (GPU without CUDA graphs; TPU: on-device loop); decode.cost.calibrate on the device "
    "replaces them and the efficiencies",
    efficiency=p.efficiency.to_dict(),
    train_mfu=p.train.mfu,
    sensitivity_fixed_scale=list(p.sensitivity.fixed_scale),
    rates=None if inputs else list(p.rates),
    rates_source="run" if inputs else p.rates_source,
    unmeasured_positions=p.unmeasured,
    tail=None if inputs else p.tail.to_dict(),
    model=[
      "fluid rollout: every active row advances by the expected tokens of a round at its G "
      "(E[a + 1] from the per-position conditional rates, fractions kept); rows finish in the "
      "order of their lengths; no variance of acceptance across rows or rounds",
      "G per round: the engine's rule (argmax expected tokens / predicted round seconds at the "
      "compaction bucket) with the rates fixed over the rollout",
      "compaction in both arms: a round runs at the smallest power-of-two bucket holding the "
      "active rows (engine.buckets); the gathers between stages are not counted",
      "roofline pass time from decode.cost: the decode attends over the whole cache capacity "
      "(masked), as this codebase's decode does; a paged-attention server reads only filled "
      "entries, so KV bytes are an upper bound",
      "prefill: one policy pass over the prompt (SD: and one draft pass) per arm",
      "training: 6 * matmul params * trained tokens / (peak * mfu); trained tokens = rows * "
      "(prompt + mean completion); draft: times its TTT steps; attention FLOPs and the optimizer "
      "not counted; the AR baseline trains no draft",
      "one accelerator decodes `rows` rows and trains on their tokens (no parallelism modelled); "
      "fits_hbm counts weights and both KV caches only",
      "tail from a run: its completion lengths as fractions of its max_new_tokens, pooled over "
      "the last steps and resampled at the projected rows' quantiles",
    ],
  )


def project(config) -> dict:
  """The projection on every hardware entry of `config.project` (and the sanity check when
  run_dir holds a CPU calibration). Returns the results payload."""
  p = config.project
  inputs = run_inputs(p.run_dir, p.last_steps, p.unmeasured) if p.run_dir else None
  if inputs:
    rates = inputs["rates"]
    lengths = resample(inputs["fractions"], p.rows, p.max_new_tokens)
  else:
    rates = np.asarray(p.rates, np.float64)
    lengths = lognormal_lengths(p.rows, p.tail.median, p.tail.sigma, p.max_new_tokens)
  pcfg = policy_config(p.policy)
  dcfg = draft_config(p.draft, pcfg)
  by_hw = {k: project_hardware(hw, pcfg, dcfg, lengths, rates, p) for k, hw in p.hardware.items()}
  out = dict(
    policy=dict(p.policy.to_dict(), params=by_hw[next(iter(by_hw))]["train"]["policy_params"]),
    draft=dict(p.draft.to_dict(), params=by_hw[next(iter(by_hw))]["train"]["draft_params"]),
    rollout=dict(
      rows=p.rows,
      prompt_len=p.prompt_len,
      max_new_tokens=p.max_new_tokens,
      min_rows=p.min_rows,
      num_draft_max=len(rates),
      mean_length=float(np.mean(lengths)),
      max_length=float(np.max(lengths)),
      buckets=engine.buckets(p.rows, p.min_rows),
    ),
    rates=[float(r) for r in rates],
    tau_at_G_max=cost.expected_tokens(rates, len(rates)),
    hardware=by_hw,
    assumptions=assumptions(p, inputs),
  )
  if inputs:
    out["run"] = dict(
      run_dir=p.run_dir,
      steps=[s.get("step") for s in inputs["steps"]],
      rows=inputs["rows"],
      max_new_tokens=inputs["max_new_tokens"],
      measured_positions=inputs["measured"],
    )
    out["sanity_check"] = sanity_check(p.run_dir, inputs)
  return out


def table(results: dict) -> str:
  r = results["rollout"]
  lines = [
    f"{results['policy']['name']} ({results['policy']['params'] / 1e9:.2f}B matmul params), "
    f"rows {r['rows']}, prompt {r['prompt_len']}, max new {r['max_new_tokens']}, mean length "
    f"{r['mean_length']:.0f}, G_max {r['num_draft_max']}, tau at G_max "
    f"{results['tau_at_G_max']:.2f}",
    "",
    "| hardware | fits HBM | AR rollout s | SD rollout s | rollout speedup | AR tok/s | SD tok/s "
    "| G by bucket | train s (policy + draft) | AR rollout share | RL step speedup |",
    "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for h in results["hardware"].values():
    s, t = h["rollout"], h["train"]
    gs = " ".join(f"{b}:{e['G']}" for b, e in s["by_bucket"].items())
    lines.append(
      f"| {h['hardware']} | {'yes' if h['fits_hbm'] else 'NO'} ({h['decode_bytes'] / 1e9:.0f} GB) "
      f"| {s['ar_seconds']:.2f} | {s['sd_seconds']:.2f} | {s['speedup']:.2f} | "
      f"{s['ar_tokens_per_s']:.0f} | {s['sd_tokens_per_s']:.0f} | {gs} | "
      f"{t['policy_seconds']:.2f} + {t['draft_seconds']:.2f} | {h['ar_rollout_share']:.0%} | "
      f"{h['rl_step_speedup']:.2f} |"
    )
  scales = list(next(iter(results["hardware"].values()))["rollout_speedup_by_fixed_scale"])
  lines += [
    "",
    "Rollout speedup with the assumed fixed costs (pass_s, layer_s, round_s) scaled:",
    "",
    "| hardware | " + " | ".join(f"x{f}" for f in scales) + " |",
    "|---|" + "---|" * len(scales),
  ]
  for h in results["hardware"].values():
    v = h["rollout_speedup_by_fixed_scale"]
    lines.append(f"| {h['hardware']} | " + " | ".join(f"{v[f]:.2f}" for f in scales) + " |")
  sc = results.get("sanity_check")
  if sc:
    lines += [
      "",
      f"CPU sanity check ({sc['record']}, the run's own policy; not asserted):",
      "",
      "| step | arm | stages | measured s | replayed rounds s | ratio | fluid s | ratio "
      "| unmodelled s |",
      "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sc["steps"]:
      lines.append(
        f"| {s['step']} | {s['arm']} | {s['stages']} | {s['measured_seconds']:.3f} | "
        f"{s['replay_seconds']:.3f} | {s['replay_over_measured']:.2f} | "
        f"{s['fluid_seconds']:.3f} | {s['fluid_over_measured']:.2f} | "
        f"{s['unmodelled_seconds']:.3f} |"
      )
    lines += [
      "",
      "measured: the step's rollout_seconds (the first steps include compiles and the "
      "calibration); replayed: the cost model over the recorded rounds (bucket, G) plus the "
      "prefill; fluid: this projection at the step's tail and rates.",
    ]
  elif "run" in results:
    lines += ["", "CPU sanity check: the run has no cost calibration under cost/."]
  return "\n".join(lines)


def run(config, workdir: str) -> dict:
  """Projects, prints the table and writes workdir/results.json and table.md (no goals: a
  projection; every assumption is in the file)."""
  provenance.check_workdir(workdir)
  results = provenance.write_results(workdir, project(config), goals={})
  text = table(results)
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(text + "\n")
  print(text)
  return results
