"""`train_and_evaluate(config, workdir)`: the whole run, top to bottom.

  1. SFT                  the policy learns the task                      (train/phases.py)
  2. draft distillation   the EAGLE-3 draft learns the SFT policy         (train/phases.py)
  3. RL                   GRPO with SD rollouts; policy and draft co-train (train/phases.py)
  4. SD vs AR report      tau, speedup, greedy equality on the final checkpoint (train/evaluate.py)
  5. plots and summary    plots/*.png, summary.json                       (train/report.py)
  6. export (export.dir)  the policy as an HF checkpoint, the draft for serving (interop/export.py)

Every phase checkpoints on its own and is skipped when already complete, so a killed run resumes
where it stopped. Train states and their restore are in train/state.py.
"""

from __future__ import annotations

import json
import os
import time

import jax

from specdraft import config as config_lib
from specdraft.parallel import multihost
from specdraft.tasks import tokenizer as tok_lib
from specdraft.train.evaluate import rollout_report
from specdraft.train.phases import Context, draft_phase, init_draft, rl_phase, sft_phase
from specdraft.train.report import summarise, summary_table, write_plots
from specdraft.train.state import init_state, state_shardings

# The names scripts and tests reach through `loop.` (experiments/*.py, bench/*.py).
__all__ = [
  "Context",
  "draft_phase",
  "init_state",
  "rl_phase",
  "sft_phase",
  "state_shardings",
  "summary_table",
  "train_and_evaluate",
]


# The settings that make a run what it is: a workdir resumed under other values would continue
# another run's checkpoints (the policy's architecture and source, the task and its data, the
# draft's kind and sizes). Steps, evaluation, checkpointing, export and layout may change.
IDENTITY = (
  "seed",
  "model.",
  "task.",
  "data.tokenizer",
  "data.chat_template",
  "data.shuffle_seed",
  "draft.kind",
  "draft.vocab_size",
  "draft.vocab_file",
  "draft.n_heads",
  "draft.n_kv_heads",
  "draft.head_dim",
  "draft.d_ff",
  "draft.block.n_layers",
  "draft.block.block_size",
  "draft.block.markov_rank",
  "draft.block.mask_token_id",
  "draft.block.qk_norm",
  "draft.block.anchor_residual",
)
RUN_CONFIG = "run_config.json"
# identity settings added after runs were recorded: the value a run recorded without one had
# (from what it recorded), so that it resumes under that value and is refused under another.
# Before anchor_residual, every block draft's anchor slot started at its token; the default ""
# still means that for DFlash (and EAGLE-3 has no such slot), not for DSpark.
ADDED_LATER = {
  "draft.block.anchor_residual": lambda before: (
    "token" if before.get("draft.kind") == "dspark" else ""
  ),
}


def _flat(d: dict, prefix: str = "") -> dict:
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out |= _flat(v, f"{prefix}{k}.")
    else:
      out[f"{prefix}{k}"] = v
  return out


def _identity(flat: dict) -> dict:
  """The IDENTITY settings of a flat config. Of the tasks' sub-configs only the run's own task's
  count (`task.<task.name>.*`, what its data builder reads: tasks/datasets.py), so another task's
  knobs, or a task added after the run was recorded, do not change what the run is."""
  task = flat.get("task.name")
  own = lambda k: k.count(".") < 2 or not k.startswith("task.") or k.startswith(f"task.{task}.")
  return {
    k: v for k, v in flat.items() if own(k) and any(k == p or k.startswith(p) for p in IDENTITY)
  }


def check_and_record_config(config, workdir: str) -> None:
  """Writes the run's config to workdir/run_config.json; when the workdir already holds one (a
  resumed run), refuses, naming the field, a change to a setting of IDENTITY."""
  flat = json.loads(json.dumps(_flat(config.copy_and_resolve_references().to_dict()), default=str))
  ident = _identity(flat)
  path = os.path.join(workdir, RUN_CONFIG)
  if os.path.isfile(path):
    with open(path) as f:
      before = _identity(json.load(f)["identity"])
    for k in sorted(set(before) | set(ident)):
      if k not in before and k in ADDED_LATER:
        before[k] = ADDED_LATER[k](before)
      if before.get(k) != ident.get(k):
        raise ValueError(
          f"config.{k}={ident.get(k)!r} is invalid for workdir {workdir}: the run there was "
          f"started with {before.get(k)!r}, and resuming it under another value would continue "
          f"its checkpoints as a different run; set it back, or use a new workdir"
        )
  else:
    before = ident
  multihost.sync("specdraft: run config checked")  # every process reads before one writes
  if multihost.is_primary():
    os.makedirs(workdir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump({"identity": before, "config": flat}, f, indent=2)
    os.replace(tmp, path)


def train_and_evaluate(config, workdir: str, *, stop_after: tuple[str, int] | None = None) -> dict:
  """SFT -> draft distillation -> RL with (co-trained) speculative rollouts -> SD report.

  `stop_after=(phase, step)` ends the run early (to test resumption). Writes metrics, evals,
  plots and checkpoints; returns the run summary (also in `workdir/summary.json`).
  """
  t_start = time.time()
  # Before any work: the config's values, then that a resumed workdir is the same run.
  config_lib.validate(config)
  check_and_record_config(config, workdir)
  ctx = Context(config, workdir, validated=True)
  stop = dict([stop_after]) if stop_after else {}
  # Wall seconds of each phase in this invocation (a phase resumed as complete costs ~0).
  phase_seconds = {}
  tick = time.time()

  def lap(name):
    nonlocal tick
    now = time.time()
    phase_seconds[name] = now - tick
    tick = now

  # 1. SFT.
  params, done = sft_phase(ctx, stop.get("sft"))
  lap("sft")

  # 2. Draft distillation from the fixed SFT policy (or the untrained draft when skipped).
  dparams = init_draft(ctx, params)
  if done and config.draft.pretrain_steps > 0:
    dparams, done = draft_phase(ctx, params, stop.get("draft"))
  lap("draft")

  # 3. RL: rollouts by SD (rollout.draft = cotrained | fixed) or AR (none), one co-training step.
  if done and config.rl.steps > 0:
    state, done = rl_phase(ctx, params, dparams, stop.get("rl"))
    params, dparams = state["params"]["policy"], state["params"]["draft"]
  lap("rl")

  # 4. SD vs AR on the final checkpoint, once every phase has finished.
  rollout = None
  repeats = int(config.eval.get("report_repeats", 3))
  if done and repeats > 0 and (config.draft.pretrain_steps > 0 or config.rl.steps > 0):
    rollout = rollout_report(ctx, params, dparams, repeats=repeats)
    if config.decode.compact or config.decode.speculation == "auto":
      # and as the run's rollouts decode (compaction, auto G): rollout.as_run
      rollout["as_run"] = rollout_report(ctx, params, dparams, repeats=repeats, as_run=True)
  lap("report")

  # 5. Plots and the summary (process 0 writes them; every process returns the summary).
  multihost.sync("specdraft: logs written")
  if multihost.is_primary():
    write_plots(workdir, config, ttt_steps=ctx.models.dcfg.ttt_steps)
  summary = summarise(workdir, config, rollout)
  lap("plots")
  # 6. The policy and the draft for serving (export.dir), once every phase has finished.
  out = config.get("export", {}).get("dir", "")
  if done and out:
    from specdraft.interop import export

    out = out if os.path.isabs(out) else os.path.join(workdir, out)
    summary["export"] = export.export_run(
      out,
      ctx.models.pcfg,
      params,
      ctx.models.dcfg,
      dparams,
      dtype=config.export.get("dtype", "float32"),
      tokenizer_path=tok_lib.tokenizer_path(config),
      checkpoint_dir=config.model.get("init_from", "") or "",
    )
    lap("export")
  summary["phase_seconds"] = phase_seconds
  summary["wall_seconds"] = time.time() - t_start
  summary["processes"] = jax.process_count()
  if multihost.is_primary():
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
  return summary
