"""The drift experiment (experiments/drift.py): AR vs fixed-draft SD vs co-trained SD under RL."""

from __future__ import annotations

import copy
import json
import os

import numpy as np
from scipy import stats

from specdraft.bench import provenance
from specdraft.train import loop

ARM_NAMES = {
  "none": "A: AR rollouts",
  "fixed": "B: SD, fixed draft",
  "cotrained": "C: SD, co-trained draft",
}


def run(config, workdir: str, run_dir: str | None = None) -> dict:
  """Results (results.json, plots) go to `workdir`; the arms' runs (checkpoints, logs) to
  `run_dir`, by default workdir/runs, or runs/<name> when workdir is under docs/results."""
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  run_dir = run_dir or provenance.run_dir_for(workdir, "runs")
  base_cfg = copy.deepcopy(config)
  base_cfg.rl.steps = 0
  base_dir = os.path.join(run_dir, "base")
  loop.train_and_evaluate(base_cfg, base_dir)  # SFT + draft distillation, shared by every arm
  base = loop.Context(base_cfg, base_dir)
  params, _ = loop.sft_phase(base)
  dparams, _ = loop.draft_phase(base, params)

  runs = {}
  for arm in config.drift.arms:
    for seed in range(config.drift.seeds):
      c = copy.deepcopy(config)
      c.rollout.draft = arm
      c.seed, c.data.shuffle_seed = 100 + seed, 100 + seed
      ctx = loop.Context(c, os.path.join(run_dir, f"{arm}_seed{seed}"))
      loop.rl_phase(ctx, params, dparams)
      runs[(arm, seed)] = ctx.log("metrics.jsonl").read()
      print(
        f"{ARM_NAMES[arm]}, seed {seed}: reward {runs[(arm, seed)][-1]['reward_mean']:.3f}",
        flush=True,
      )
  summary = summarise(runs, config)
  summary = provenance.write_results(
    workdir, summary, goals=provenance.goals_from_config(config.drift.goals)
  )
  plot(runs, config, workdir)
  print(json.dumps(summary, indent=2))
  print(provenance.goals_table(summary["goals"]), flush=True)
  return summary


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
  """mean(b) - mean(a) over seeds with its 95% Welch t-interval; `zero_in_ci95`: the two arms
  cannot be told apart at this seed count. None with fewer than two seeds per arm."""
  a, b = np.asarray(a, float), np.asarray(b, float)
  d = float(b.mean() - a.mean())
  out = {"diff": d, "ci95": None, "zero_in_ci95": None}
  if len(a) > 1 and len(b) > 1:
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    se = float(np.sqrt(va + vb))
    if se == 0.0:
      out.update(ci95=[d, d], zero_in_ci95=d == 0.0)
      return out
    dof = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = float(stats.t.ppf(0.975, dof) * se)
    out.update(ci95=[d - half, d + half], zero_in_ci95=bool(d - half <= 0.0 <= d + half))
  return out


def summarise(runs, config) -> dict:
  """Per arm: first/last-window means over seeds (window = steps // 8); the last-window reward
  with seed statistics (sample std, 95% t-interval); tau for the SD arms; C - A reward."""
  seeds, steps = config.drift.seeds, config.rl.steps
  k = max(1, steps // 8)
  out = {"steps": steps, "seeds": seeds, "window": k, "arms": {}}
  for arm in config.drift.arms:
    rew = _curve(runs, arm, "reward_mean", seeds)
    tau = _curve(runs, arm, "accept_len", seeds)
    share = np.array(
      [
        [r["format_share"].get(config.task.arithmetic.reward_format, 0.0) for r in runs[(arm, s)]]
        for s in range(seeds)
      ]
    )
    a = {
      "reward_first": float(rew[:, :k].mean()),
      "reward_last": seed_stats(rew[:, -k:].mean(1)),
      "rewarded_format_share_first": float(share[:, :k].mean()),
      "rewarded_format_share_last": float(share[:, -k:].mean()),
      "entropy_first": float(_curve(runs, arm, "entropy", seeds)[:, :k].mean()),
      "entropy_last": float(_curve(runs, arm, "entropy", seeds)[:, -k:].mean()),
      "rollout_seconds_mean": float(_curve(runs, arm, "rollout_seconds", seeds).mean()),
    }
    if arm != "none":
      a.update(tau_first=float(tau[:, :k].mean()), tau_last=float(tau[:, -k:].mean()))
      a["tau_last_over_first"] = a["tau_last"] / a["tau_first"]
    out["arms"][arm] = a
  if {"none", "cotrained"} <= set(out["arms"]):
    out["reward_C_minus_A"] = diff_stats(
      out["arms"]["none"]["reward_last"]["per_seed"],
      out["arms"]["cotrained"]["reward_last"]["per_seed"],
    )
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
    ("entropy", config.drift.arms, "entropy", "policy entropy"),
  ):
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for arm in arms:
      y = _curve(runs, arm, key, seeds)
      x = np.arange(1, y.shape[1] + 1)
      ax.plot(x, y.mean(0), label=ARM_NAMES[arm])
      if seeds > 1:
        ax.fill_between(x, y.min(0), y.max(0), alpha=0.2)
    ax.set_xlabel("RL step")
    ax.set_ylabel(ylabel)
    ax.set_title(f"drift: {name} (band = min/max over {seeds} seeds)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(pdir, f"drift_{name}.png"), dpi=110)
    plt.close(fig)
