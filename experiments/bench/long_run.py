"""The long-context co-training run with provenance (experiments/long_run.py).

Runs `train_and_evaluate` on a `configs/long.py` config (SFT -> draft distillation -> RL
co-training with speculative rollouts, every training step on sequence shards over 'cp'), then
writes results.json (the command, commit, date, load and the goals fixed in the config before
the run), the run's plots and a per-step table of the RL phase into `workdir`. The run itself
(checkpoints, logs) goes to runs/<name> when `workdir` is under docs/results.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from experiments.bench import provenance
from specdraft.parallel import multihost
from specdraft.train import loop, report


def run(config, workdir: str, run_dir: str | None = None) -> dict:
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  run_dir = run_dir or provenance.run_dir_for(workdir, "run")
  summary = loop.train_and_evaluate(config, run_dir)
  if not multihost.is_primary():  # process 0 wrote the logs and plots; it reports
    return {"run": summary}
  logs = report.read_logs(run_dir)
  results = {"run": summary, "measured": measured(config, summary, logs["metrics"])}
  results["rl_steps"] = [
    {k: r.get(k) for k in ("step", "reward_mean", "accept_len", "rl_loss", "draft_loss", "kl")}
    for r in logs["metrics"]
  ]
  os.makedirs(workdir, exist_ok=True)
  plots = os.path.join(run_dir, "plots")
  results["plots"] = []
  for name in sorted(os.listdir(plots)) if os.path.isdir(plots) else []:
    if name.endswith(".png"):
      shutil.copy(os.path.join(plots, name), os.path.join(workdir, name))
      results["plots"].append(name)
  out = provenance.write_results(
    workdir,
    results,
    goals=provenance.goals_from_config(config.long_run.goals),
    measured=results,
  )
  print(json.dumps(out["measured"], indent=2))
  print(provenance.goals_table(out["goals"]), flush=True)
  return out


def _format_shares(rl_rows: list[dict]) -> dict:
  """Each answer form's share of the rollouts over the first and the last fifth of the RL steps
  (tasks with `format_of`, e.g. frequency's "comma" and "semicolon"); {} for other tasks."""
  if not all("format_share" in r for r in rl_rows):
    return {}
  k = max(1, len(rl_rows) // 5)
  forms = sorted({f for r in rl_rows for f in r["format_share"]})
  mean = lambda rows, f: float(np.mean([r["format_share"].get(f, 0.0) for r in rows]))
  return {
    "format_share_first": {f: mean(rl_rows[:k], f) for f in forms},
    "format_share_last": {f: mean(rl_rows[-k:], f) for f in forms},
  }


def measured(config, summary: dict, rl_rows: list[dict]) -> dict:
  """The figures the goals read: tokens per row, layout, the RL reward's rise (last fifth of the
  steps minus the first fifth, as in the run summary) and the accepted length over the RL steps."""
  tau = [r["accept_len"] for r in rl_rows]
  m = {
    "tokens_per_row": int(config.data.seq_len),
    "max_new_tokens": int(config.rl.get("max_new_tokens") or config.decode.max_new_tokens),
    "layout": config.parallel.name,
    "cp": int(config.parallel.mesh.get("cp", 1)),
    "rl_steps_run": len(rl_rows),
    "wall_seconds": summary.get("wall_seconds"),
    "accuracy_after_sft": summary.get("accuracy_after_sft"),
    "accuracy_after_rl": summary.get("accuracy_after_rl"),
  }
  if rl_rows:
    m.update(
      reward_first=summary["reward_first"],
      reward_last=summary["reward_last"],
      reward_gain=summary["reward_last"] - summary["reward_first"],
      accept_len_mean=float(np.mean(tau)),
      accept_len_min=float(np.min(tau)),
      **_format_shares(rl_rows),
      losses_finite=bool(
        all(np.isfinite(r[k]) for r in rl_rows for k in ("rl_loss",) if r.get(k) is not None)
      ),
    )
  return m
