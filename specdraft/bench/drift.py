"""The drift experiment (experiments/drift.py): AR vs fixed-draft SD vs co-trained SD under RL."""

from __future__ import annotations

import copy
import json
import os

import numpy as np

from specdraft.train import loop

ARM_NAMES = {
  "none": "A: AR rollouts",
  "fixed": "B: SD, fixed draft",
  "cotrained": "C: SD, co-trained draft",
}


def run(config, workdir: str) -> dict:
  base_cfg = copy.deepcopy(config)
  base_cfg.rl.steps = 0
  base_dir = os.path.join(workdir, "base")
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
      ctx = loop.Context(c, os.path.join(workdir, f"{arm}_seed{seed}"))
      loop.rl_phase(ctx, params, dparams)
      runs[(arm, seed)] = ctx.log("metrics.jsonl").read()
      print(
        f"{ARM_NAMES[arm]}, seed {seed}: reward {runs[(arm, seed)][-1]['reward_mean']:.3f}",
        flush=True,
      )
  summary = summarise(runs, config)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  plot(runs, config, os.path.join(workdir, "plots"))
  print(json.dumps(summary, indent=2))
  return summary


def _curve(runs, arm, key, seeds):
  return np.array([[r[key] for r in runs[(arm, s)]] for s in range(seeds)], float)


def summarise(runs, config) -> dict:
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
      "reward_last": float(rew[:, -k:].mean()),
      "reward_last_seed_std": float(rew[:, -k:].mean(1).std()),
      "rewarded_format_share_first": float(share[:, :k].mean()),
      "rewarded_format_share_last": float(share[:, -k:].mean()),
      "entropy_first": float(_curve(runs, arm, "entropy", seeds)[:, :k].mean()),
      "entropy_last": float(_curve(runs, arm, "entropy", seeds)[:, -k:].mean()),
    }
    if arm != "none":
      a.update(tau_first=float(tau[:, :k].mean()), tau_last=float(tau[:, -k:].mean()))
      a["tau_last_over_first"] = a["tau_last"] / a["tau_first"]
      a["rollout_seconds_mean"] = float(_curve(runs, arm, "rollout_seconds", seeds).mean())
    else:
      a["rollout_seconds_mean"] = float(_curve(runs, arm, "rollout_seconds", seeds).mean())
    out["arms"][arm] = a
  arms = out["arms"]
  if {"fixed", "cotrained", "none"} <= set(arms):
    out["goals"] = {
      "cotrained_tau_kept_ge_95pct": arms["cotrained"]["tau_last_over_first"] >= 0.95,
      "fixed_tau_fell_ge_15pct": arms["fixed"]["tau_last_over_first"] <= 0.85,
      "reward_A_vs_C_diff": arms["cotrained"]["reward_last"] - arms["none"]["reward_last"],
      "reward_seed_noise": max(
        arms["cotrained"]["reward_last_seed_std"], arms["none"]["reward_last_seed_std"]
      ),
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
