"""The drift experiment (experiments/drift.py): AR vs fixed-draft SD vs co-trained SD under RL."""

from __future__ import annotations

import copy
import json
import os

import jax
import numpy as np
from scipy import stats

from experiments.bench import provenance
from experiments.bench.arms import ARM_NAMES
from specdraft import config as config_lib
from specdraft.decode import speculative
from specdraft.decode.compare import decoding_figures
from specdraft.model import drafts
from specdraft.parallel import multihost
from specdraft.train import loop
from specdraft.train.evaluate import held_out_prompts


def parse_arm(arm: str, default_kind: str) -> tuple[str, str]:
  """An arm is `<rollout.draft>` (the config's draft.kind) or `<rollout.draft>_<draft.kind>`:
  "cotrained_dflash" rolls out with, and co-trains, a DFlash draft distilled from the same SFT
  policy. Returns (rollout.draft, draft.kind); a bad name raises naming the field."""
  draft, _, kind = arm.partition("_")
  kind = kind or default_kind
  if (
    draft not in config_lib.ROLLOUT_DRAFTS
    or kind not in drafts.KINDS
    or (draft == "none" and "_" in arm)
  ):
    raise ValueError(
      f"config.drift.arms has {arm!r}: expected <rollout.draft> or <rollout.draft>_<draft.kind> "
      f"with rollout.draft in {config_lib.ROLLOUT_DRAFTS} (none takes no kind) and draft.kind in {drafts.KINDS}"
    )
  return draft, kind


def _arm_config(config, arm: str):
  draft, kind = parse_arm(arm, config.draft.kind)
  c = copy.deepcopy(config)
  c.rollout.draft, c.draft.kind = draft, kind
  return c


def run(config, workdir: str, run_dir: str | None = None) -> dict:
  """Results (results.json, plots) go to `workdir`; the arms' runs (checkpoints, logs) to
  `run_dir`, by default workdir/runs, or runs/<name> when workdir is under docs/results."""
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  for arm in config.drift.arms:  # bad arm names fail before any work
    config_lib.validate(_arm_config(config, arm))
  run_dir = run_dir or provenance.run_dir_for(workdir, "runs")
  # Finished arm runs found in run_dir are restored, not re-run: each must name the commit that
  # produced it, and the code must not have changed since (checked before any work).
  restored = {}
  for arm in config.drift.arms:
    for seed in range(config.drift.seeds):
      path = os.path.join(run_dir, f"{arm}_seed{seed}")
      if _complete_rl_run(path, config.rl.steps):
        restored[f"{arm}_seed{seed}"] = provenance.check_restorable(path)["commit"]
  base_cfg = copy.deepcopy(config)
  base_cfg.rl.steps = 0
  base_dir = os.path.join(run_dir, "base")
  loop.train_and_evaluate(base_cfg, base_dir)  # SFT + draft distillation, shared by every arm
  base = loop.Context(base_cfg, base_dir)
  params, _ = loop.sft_phase(base)
  # One distilled draft per kind the arms use, each from the same SFT policy.
  dparams_by_kind = {config.draft.kind: loop.draft_phase(base, params)[0]}
  tau_start_by_kind = {
    config.draft.kind: tau_by_temperature(base, params, dparams_by_kind[config.draft.kind])
  }
  for arm in config.drift.arms:
    kind = parse_arm(arm, config.draft.kind)[1]
    if kind not in dparams_by_kind:
      kc = _arm_config(base_cfg, arm)
      kctx = loop.Context(kc, os.path.join(run_dir, f"base_{kind}"), data=base.data.shared_with(kc))
      dparams_by_kind[kind] = loop.draft_phase(kctx, params)[0]
      tau_start_by_kind[kind] = tau_by_temperature(kctx, params, dparams_by_kind[kind])

  runs, tau_end, resumed = {}, {}, []
  for arm in config.drift.arms:
    draft_mode, kind = parse_arm(arm, config.draft.kind)
    dparams = dparams_by_kind[kind]
    for seed in range(config.drift.seeds):
      c = _arm_config(config, arm)
      c.seed, c.data.shuffle_seed = 100 + seed, 100 + seed
      ctx = loop.Context(
        c, os.path.join(run_dir, f"{arm}_seed{seed}"), data=base.data.shared_with(c)
      )
      name = f"{arm}_seed{seed}"
      if name in restored:  # its RL phase is restored, not re-run
        resumed.append({"run": name, "commit": restored[name]})
      state, _ = loop.rl_phase(ctx, params, dparams)
      if name not in restored and multihost.is_primary():
        provenance.record_produced(ctx.workdir)
      if draft_mode != "none":  # the draft the arm rolls out with at its end, against its policy
        final = state["params"]
        draft = final["draft"] if draft_mode == "cotrained" else dparams
        tau_end[(arm, seed)] = tau_by_temperature(ctx, final["policy"], draft)
      if multihost.is_primary():  # process 0 wrote the arm's log; it reports
        runs[(arm, seed)] = ctx.log("metrics.jsonl").read()
        reward = runs[(arm, seed)][-1]["reward_mean"]
        print(f"{ARM_NAMES.get(arm, arm)}, seed {seed}: reward {reward:.3f}", flush=True)
  if not multihost.is_primary():  # the other processes ran their part of every arm
    return {"tau_start_by_kind": tau_start_by_kind, "tau_end": tau_end}
  summary = summarise(
    runs,
    config,
    tau_start=tau_start_by_kind[config.draft.kind],
    tau_end=tau_end,
    tau_start_by_kind=tau_start_by_kind,
  )
  # Arm runs found complete in run_dir (an earlier run's checkpoints and logs, each with the
  # commit that produced it): their timings and rewards were measured then, not in this run.
  summary["resumed_runs"] = resumed
  summary["design"] = {"stopping_rule": config.drift.design, "seeds": config.drift.seeds}
  summary = provenance.write_results(
    workdir, summary, goals=provenance.goals_from_config(config.drift.goals)
  )
  plot(runs, config, workdir)
  print(json.dumps(summary, indent=2))
  print(provenance.goals_table(summary["goals"]), flush=True)
  return summary


def _complete_rl_run(workdir: str, steps: int) -> bool:
  """Whether `workdir` holds an RL phase's log with all `steps` steps."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return False
  with open(path) as f:
    return sum(1 for line in f if line.strip()) >= steps


def tau_by_temperature(ctx, params, dparams) -> dict:
  """tau of SD on the held-out prompts (`eval.batch_size` rows, G = `decode.num_draft`) at the
  rollouts' temperature and at T = 0 (greedy): {"T=<t>": tau, "T=0": tau}."""
  c = ctx.config
  prompts_BS, lengths_B = held_out_prompts(ctx)
  out = {}
  for t in (c.rl.temperature, 0.0):
    gen = speculative.generate(
      params,
      dparams,
      ctx.models.pcfg,
      ctx.models.dcfg,
      prompts_BS,
      lengths_B,
      jax.random.key(c.seed + 17),
      max_new_tokens=c.rl.max_new_tokens or c.decode.max_new_tokens,
      num_draft=c.decode.num_draft,
      temperature=t,
    )
    out[f"T={t:g}"] = decoding_figures(gen)["tau"]
  return out


def _curve(runs, arm, key, seeds):
  return np.array([[r[key] for r in runs[(arm, s)]] for s in range(seeds)], float)


def seed_stats(x) -> dict:
  """Mean over seeds, sample standard deviation (ddof=1) and the 95% Student-t interval of the
  mean; std and interval are None with a single seed."""
  x = np.asarray(x, float)
  n = len(x)
  out = {"n": n, "mean": float(x.mean()), "std": None, "ci95": None, "per_seed": x.tolist()}
  if n > 1:
    std = float(x.std(ddof=1))
    half = float(stats.t.ppf(0.975, n - 1) * std / np.sqrt(n))
    out.update(std=std, ci95=[out["mean"] - half, out["mean"] + half])
  return out


def diff_stats(a, b) -> dict:
  """mean(b) - mean(a) over seeds with its 95% Welch t-interval and the Welch test's two-sided
  p-value; `zero_in_ci95`: the two arms cannot be told apart at this seed count; `ci95_abs_max`:
  the interval's farthest end from 0 (equivalence within a margin m when it is <= m). None with
  fewer than two seeds per arm."""
  a, b = np.asarray(a, float), np.asarray(b, float)
  d = float(b.mean() - a.mean())
  out = {"diff": d, "ci95": None, "zero_in_ci95": None, "welch_p": None, "ci95_abs_max": None}
  if len(a) > 1 and len(b) > 1:
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = float(np.sqrt(va + vb))
    if se == 0.0:
      out.update(ci95=[d, d], zero_in_ci95=d == 0.0)
      return out
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = float(stats.t.ppf(0.975, dof) * se)
    out.update(ci95=[d - half, d + half], zero_in_ci95=bool(d - half <= 0.0 <= d + half))
    out["welch_p"] = float(stats.ttest_ind(b, a, equal_var=False).pvalue)
  if out["ci95"] is not None:
    out["ci95_abs_max"] = float(max(abs(out["ci95"][0]), abs(out["ci95"][1])))
  return out


def step_seconds(runs, arm, seeds) -> dict:
  """Seconds per RL step, split: medians over seeds and steps, leaving out each run's first step
  (it compiles). `rollout_share`: rollout / (rollout + training)."""
  ro = _curve(runs, arm, "rollout_seconds", seeds)
  tr = _curve(runs, arm, "train_seconds", seeds)
  if ro.shape[1] > 1:
    ro, tr = ro[:, 1:], tr[:, 1:]
  return {
    "rollout_s": float(np.median(ro)),
    "train_s": float(np.median(tr)),
    "step_s": float(np.median(ro + tr)),
    "rollout_share": float(np.median(ro / (ro + tr))),
  }


def time_to_reward(runs, arm, seeds, threshold: float, window: int) -> dict:
  """Per seed, wall-clock seconds until the reward's trailing mean over `window` steps first
  reaches `threshold` (rollouts + training; the first step counted at the median step time, so
  compilation is left out); None for a seed that never does."""
  per_seed = []
  for s in range(seeds):
    rec = runs[(arm, s)]
    t = np.array([r["rollout_seconds"] + r["train_seconds"] for r in rec], float)
    if len(t) > 1:
      t[0] = np.median(t[1:])
    rew = np.array([r["reward_mean"] for r in rec], float)
    trail = np.convolve(rew, np.ones(window) / window, mode="full")[: len(rew)]
    trail[: window - 1] = -np.inf  # a trailing mean needs `window` steps
    hit = np.flatnonzero(trail >= threshold)
    per_seed.append(float(np.cumsum(t)[hit[0]]) if hit.size else None)
  reached = [x for x in per_seed if x is not None]
  return {
    "threshold": threshold,
    "per_seed": per_seed,
    "seeds_reached": len(reached),
    "seconds_mean": float(np.mean(reached)) if reached else None,
  }


def reward_format(config) -> str:
  """The answer format the run's reward pays for: its task's `reward_format` (arithmetic's when
  the config names no task; '' for a task without one)."""
  name = config.task.get("name", "arithmetic")
  return config.task[name].get("reward_format", "") if name in config.task else ""


def _arm_summary(runs, config, arm, k) -> dict:
  seeds = config.drift.seeds
  rew = _curve(runs, arm, "reward_mean", seeds)
  ent = _curve(runs, arm, "entropy", seeds)
  ro = _curve(runs, arm, "rollout_seconds", seeds)
  fmt = reward_format(config)
  share = np.array(
    [[r["format_share"].get(fmt, 0.0) for r in runs[(arm, s)]] for s in range(seeds)]
  )
  a = {
    "reward_first": float(rew[:, :k].mean()),
    "reward_last": seed_stats(rew[:, -k:].mean(1)),
    "rewarded_format_share_first": float(share[:, :k].mean()),
    "rewarded_format_share_last": float(share[:, -k:].mean()),
    "entropy_first": float(ent[:, :k].mean()),
    "entropy_last": float(ent[:, -k:].mean()),
    "seconds": step_seconds(runs, arm, seeds),
    # the first window leaves out step 1 (it compiles)
    "rollout_s_last_over_first": float(ro[:, -k:].mean() / ro[:, 1 : k + 1].mean()),
    "time_to_reward": time_to_reward(
      runs, arm, seeds, config.drift.reward_threshold, config.drift.threshold_window
    ),
  }
  if arm != "none":
    tau = _curve(runs, arm, "accept_len", seeds)
    a.update(tau_first=float(tau[:, :k].mean()), tau_last=float(tau[:, -k:].mean()))
    a["tau_last_over_first"] = a["tau_last"] / a["tau_first"]
    a["tau_last_over_first_seeds"] = seed_stats(tau[:, -k:].mean(1) / tau[:, :k].mean(1))
  return a


def summarise(runs, config, *, tau_start=None, tau_end=None, tau_start_by_kind=None) -> dict:
  """Per arm: first/last-window means over seeds (window = steps // 8); the last-window reward
  and tau ratio with seed statistics (sample std, 95% t-interval); seconds per step split into
  rollout and training; time to the reward threshold; tau at T = 1 and T = 0 at the start and
  end. Between arms: C - A reward (Welch), and C's speed against A's with the AR rollout share r
  and the co-training overhead c, so the step ratio can be checked against (1 - r) c + r / s.
  Every SD arm's rollout speedup and step ratio over A are in `speed_over_A`; `tau_start` is the
  config's draft kind's, `tau_start_by_kind` every kind's the arms use."""
  seeds, steps = config.drift.seeds, config.rl.steps
  k = max(1, steps // 8)
  out = {"steps": steps, "seeds": seeds, "window": k, "arms": {}, "tau_start": tau_start}
  if tau_start_by_kind:
    out["tau_start_by_kind"] = tau_start_by_kind
  for arm in config.drift.arms:
    out["arms"][arm] = _arm_summary(runs, config, arm, k)
    if arm != "none" and tau_end:
      ends = [tau_end[(arm, s)] for s in range(seeds) if (arm, s) in tau_end]
      out["arms"][arm]["tau_end"] = {t: seed_stats([e[t] for e in ends]) for t in ends[0]}
  arms = out["arms"]
  if {"none", "cotrained"} <= set(arms):
    out["reward_C_minus_A"] = diff_stats(
      arms["none"]["reward_last"]["per_seed"], arms["cotrained"]["reward_last"]["per_seed"]
    )
    a, c = arms["none"]["seconds"], arms["cotrained"]["seconds"]
    r, speedup, overhead = (
      a["rollout_share"],
      a["rollout_s"] / c["rollout_s"],
      c["train_s"] / a["train_s"],
    )
    out["speed"] = {
      "rollout_speedup_C_over_A": speedup,
      "step_ratio_C_over_A": c["step_s"] / a["step_s"],
      "ar_rollout_share": r,
      "cotrain_overhead": overhead,
      "predicted_step_ratio": (1 - r) * overhead + r / speedup,
    }
  if "none" in arms:
    a = arms["none"]["seconds"]
    out["speed_over_A"] = {
      arm: {
        "rollout_speedup": a["rollout_s"] / arms[arm]["seconds"]["rollout_s"],
        "step_ratio": arms[arm]["seconds"]["step_s"] / a["step_s"],
      }
      for arm in arms
      if arm != "none"
    }
  return out


def plot(runs, config, pdir):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  os.makedirs(pdir, exist_ok=True)
  seeds = config.drift.seeds
  for key, arms, name, ylabel in (
    ("reward_mean", config.drift.arms, "reward", "mean reward"),
    ("accept_len", [a for a in config.drift.arms if a != "none"], "tau", "tau (accepted/round)"),
    ("entropy", config.drift.arms, "entropy", "policy entropy (nats/token)"),
    ("rollout_seconds", config.drift.arms, "rollout_seconds", "rollout seconds per RL step"),
  ):
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for arm in arms:
      y = _curve(runs, arm, key, seeds)
      x = np.arange(1, y.shape[1] + 1)
      if key == "rollout_seconds":  # step 1 compiles
        x, y = x[1:], y[:, 1:]
      ax.plot(x, y.mean(0), label=ARM_NAMES.get(arm, arm))
      if seeds > 1:
        half = stats.t.ppf(0.975, seeds - 1) * y.std(0, ddof=1) / np.sqrt(seeds)
        ax.fill_between(x, y.mean(0) - half, y.mean(0) + half, alpha=0.2)
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    band = f"band = 95% t-interval over {seeds} seeds" if seeds > 1 else "1 seed"
    ax.set_title(f"drift: {name} ({band})")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(pdir, f"drift_{name}.png"), dpi=110)
    plt.close(fig)


def corrected_half_width(ci95, seeds: int, looks: int, alpha: float = 0.05) -> float:
  """An upper bound on the half-width of the (1 - alpha/looks) Welch interval of a difference of
  two arms' means with `seeds` seeds each, from its 95% interval: the Welch degrees of freedom lie
  in [n - 1, 2n - 2], so the largest t ratio bounds the unknown one."""
  half95 = (ci95[1] - ci95[0]) / 2
  ratio = stats.t.ppf(1 - alpha / (2 * looks), seeds - 1) / stats.t.ppf(0.975, 2 * seeds - 2)
  return float(half95 * ratio)


def restate_equivalence(config, workdir: str) -> dict:
  """The reward equivalence of the drift experiment's looks (`config.restate.looks`, results
  files judged on one growing sequence of seeds) under a Bonferroni split of alpha over the looks:
  per look, the corrected interval's bound and whether it lies within the goal's +-bound."""
  r = config.restate
  provenance.check_workdir(workdir)
  root = provenance.repo_root()
  looks = []
  for rel in r.looks:
    with open(os.path.join(root, rel)) as f:
      res = json.load(f)
    d = res["reward_C_minus_A"]
    half = corrected_half_width(d["ci95"], res["seeds"], len(r.looks), r.alpha)
    looks.append(
      {
        "file": rel,
        "commit": res["commit"],
        "seeds": res["seeds"],
        "diff": d["diff"],
        "ci95": d["ci95"],
        "ci95_abs_max": d["ci95_abs_max"],
        "level": 1 - r.alpha / len(r.looks),
        "ci_corrected_bound": [d["diff"] - half, d["diff"] + half],
        "ci_abs_max_corrected": abs(d["diff"]) + half,
      }
    )
  payload = {
    "design": {
      "looks": len(r.looks),
      "alpha": r.alpha,
      "correction": r.correction,
      "declared": r.declared,
    },
    "looks": looks,
    "ci_abs_max_corrected_min": min(x["ci_abs_max_corrected"] for x in looks),
  }
  out = provenance.write_results(workdir, payload, goals=provenance.goals_from_config(r.goals))
  print(json.dumps(out, indent=2))
  print(provenance.goals_table(out["goals"]), flush=True)
  return out
