"""What a run writes besides checkpoints: JSONL metrics, progress bars, plots, the summary.

Files in the workdir: sft_metrics.jsonl, eval.jsonl, draft_metrics.jsonl, metrics.jsonl (one
line per RL step), rl_eval.jsonl, plots/*.png and summary.json (`summarise`, printed by
`summary_table`).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np
from tqdm.auto import tqdm


def progress(iterable, **kw):
  """tqdm that redraws often on a terminal and rarely in a log file."""
  return tqdm(iterable, dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 10.0, **kw)


def _primary() -> bool:
  import jax

  return jax.process_index() == 0


class RunLog:
  """Append-only JSONL metrics that a resumed run truncates back to its checkpoint step."""

  def __init__(self, path: str):
    self.path = path

  def truncate_after(self, step: int) -> None:
    if not _primary() or not os.path.exists(self.path):
      return
    with open(self.path) as f:
      keep = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= step]
    with open(self.path, "w") as f:
      f.writelines(keep)

  def write(self, record: dict) -> None:
    if not _primary():  # one process writes a multi-process run's (global) metrics
      return
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")

  def read(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(ln) for ln in f if ln.strip()]


def read_logs(workdir: str) -> dict[str, list[dict]]:
  """Every metrics file of a run, by name without extension (missing files are empty)."""
  names = ("sft_metrics", "eval", "draft_metrics", "metrics", "rl_eval")
  return {n: RunLog(os.path.join(workdir, f"{n}.jsonl")).read() for n in names}


# ----------------------------------------------------------------------------- plots


def plot_curves(path: str, series: dict[str, tuple[list, list]], *, title: str, ylabel: str):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 3.5))
  for label, (x, y) in series.items():
    ax.plot(x, y, label=label, marker="o" if len(x) < 20 else None)
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  if len(series) > 1:
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_plots(workdir: str, config, *, ttt_steps: int) -> None:
  """plots/{sft_loss, eval_accuracy, reward, accept_len, draft_ttt_acc}.png from the logs."""
  logs, pdir = read_logs(workdir), os.path.join(workdir, "plots")
  os.makedirs(pdir, exist_ok=True)
  curve = lambda rows, key: ([r["step"] for r in rows], [r[key] for r in rows])
  plots = [  # (file, rows, {label: key}, title, ylabel)
    (
      "sft_loss",
      logs["sft_metrics"],
      {"loss": "loss"},
      "SFT loss",
      "cross-entropy (answer tokens)",
    ),
    (
      "eval_accuracy",
      logs["eval"],
      {"greedy": "accuracy"},
      f"held-out greedy accuracy ({config.task.name})",
      "accuracy",
    ),
    (
      "reward",
      logs["metrics"],
      {"reward": "reward_mean"},
      f"RL reward (rollout.draft={config.rollout.draft})",
      "mean reward",
    ),
    ("accept_len", logs["metrics"], {"tau": "accept_len"}, "tokens per SD round (tau)", "tau"),
    (
      "draft_ttt_acc",
      logs["draft_metrics"],
      {f"step {k}": f"ttt_acc_{k}" for k in range(0, ttt_steps, max(1, ttt_steps // 4))},
      "draft agreement with the policy (TTT steps)",
      "top-1 agreement",
    ),
  ]
  for name, rows, keys, title, ylabel in plots:
    if rows:
      series = {label: curve(rows, key) for label, key in keys.items()}
      plot_curves(os.path.join(pdir, f"{name}.png"), series, title=title, ylabel=ylabel)


# ----------------------------------------------------------------------------- summary


def summarise(workdir: str, config, rollout: dict | None) -> dict:
  """The run's summary from its logs (and the SD-vs-AR report, when one was made)."""
  logs = read_logs(workdir)
  evals, sft, draft, rl = logs["eval"], logs["sft_metrics"], logs["draft_metrics"], logs["metrics"]
  summary = {
    "task": config.task.name,
    "layout": config.parallel.name,
    "rollout_draft": config.rollout.draft,
  }
  if rollout is not None:
    summary["rollout"] = rollout
  summary.update(
    sft_steps=sft[-1]["step"] if sft else 0,
    accuracy_before=evals[0]["accuracy"] if evals else None,
    accuracy_after_sft=evals[-1]["accuracy"] if evals else None,
    draft_steps=draft[-1]["step"] if draft else 0,
    draft_loss=draft[-1]["draft_loss"] if draft else None,
    rl_steps=rl[-1]["step"] if rl else 0,
  )
  if rl:
    k = max(1, len(rl) // 5)  # average the first and last fifth: single steps are noisy
    mean = lambda rows, key: float(np.mean([r[key] for r in rows]))
    summary.update(
      reward_first=mean(rl[:k], "reward_mean"),
      reward_last=mean(rl[-k:], "reward_mean"),
      tau_first=mean(rl[:k], "accept_len"),
      tau_last=mean(rl[-k:], "accept_len"),
      accuracy_after_rl=logs["rl_eval"][-1]["accuracy"] if logs["rl_eval"] else None,
      entropy_first=mean(rl[:k], "entropy"),
      entropy_last=mean(rl[-k:], "entropy"),
    )
    timed = rl[1:] if len(rl) > 1 else rl  # step 1 compiles
    summary.update(
      rl_rollout_seconds=float(np.median([r["rollout_seconds"] for r in timed])),
      rl_train_seconds=float(np.median([r["train_seconds"] for r in timed])),
    )
  return summary


def _pair(summary: dict, a: str, b: str) -> str | None:
  if summary.get(a) is None:
    return None
  return f"{summary[a]:.3f} / {summary[b]:.3f}"


def summary_table(summary: dict) -> str:
  """A human-readable table of a run's summary."""
  f = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
  rows = [
    ("task", summary.get("task")),
    ("rollout draft", summary.get("rollout_draft")),
    ("greedy accuracy: before SFT", summary.get("accuracy_before")),
    ("greedy accuracy: after SFT", summary.get("accuracy_after_sft")),
    ("greedy accuracy: after RL", summary.get("accuracy_after_rl")),
    ("RL reward: first steps", summary.get("reward_first")),
    ("RL reward: last steps", summary.get("reward_last")),
    ("tau: first RL steps", summary.get("tau_first")),
    ("tau: last RL steps", summary.get("tau_last")),
    ("policy entropy: first / last RL steps", _pair(summary, "entropy_first", "entropy_last")),
    (
      "RL step: rollout s / training s (median)",
      _pair(summary, "rl_rollout_seconds", "rl_train_seconds"),
    ),
  ]
  r = summary.get("rollout")
  if r:
    rows += [
      (f"SD vs AR (T={r['temperature']}, G={r['num_draft']}): tau", r["tau"]),
      ("SD vs AR: rollout speedup", r["speedup"]),
      (
        "SD vs AR: policy passes/token",
        f"{r['sd_policy_passes_per_token']:.3f} vs {r['ar_policy_passes_per_token']:.3f}",
      ),
      ("greedy SD == AR (every row)", "yes" if r["greedy_equal"] else "NO"),
    ]
    a = r.get("as_run")
    if a:  # both arms decoded as the run's rollouts (compaction; auto G)
      how = "auto G" if a.get("engine", {}).get("adaptive") else f"G={a['num_draft']}"
      how += ", compacted" if a.get("engine", {}).get("compact") else ""
      rows += [
        (f"SD vs AR as the run decodes ({how}): speedup", a["speedup"]),
        ("SD vs AR as the run decodes: tau", a["tau"]),
        ("greedy SD == AR as the run decodes", "yes" if a["greedy_equal"] else "NO"),
      ]
      if a.get("num_draft_counts"):
        counts = " ".join(str(int(n)) for n in a["num_draft_counts"])
        rows.append(("auto G: rounds at G = 0, 1, ...", counts))
  ph = summary.get("phase_seconds")
  if ph:
    rows.append((f"wall time (s): {' / '.join(ph)}", " / ".join(f"{v:.0f}" for v in ph.values())))
  rows.append(("wall time (s)", summary.get("wall_seconds")))
  w = max(len(k) for k, _ in rows)
  return "\n".join(["", "Summary", "-" * (w + 14)] + [f"{k:<{w}}  {f(v)}" for k, v in rows])
