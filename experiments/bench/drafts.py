"""EAGLE-3, DFlash and DSpark on one policy (experiments/bench_drafts.py).

One SFT policy; each draft kind distilled from it for the same number of steps on the same
rollouts' distribution; then, at every batch size of `bench.batch_sizes`, AR and SD with every
draft are timed side by side (`decode.compare.compare_drafts`) at the same G (proposals per
round), sampling and prompts. Results go through `bench.provenance.write_results` with the goals
fixed in configs/bench_drafts.py.
"""

from __future__ import annotations

import copy
import os

from experiments.bench import provenance
from specdraft.decode.compare import compare_drafts
from specdraft.model.drafts import KINDS
from specdraft.tasks import loader
from specdraft.train import loop

NO_MARKOV = "dspark:markov_rank=0"  # the ablation: DSpark's backbone without its Markov head
# the ablation of DSpark's anchor slot: its residual starting at the token's embedding (as
# before anchor_residual existed) instead of at MASK
ANCHOR_AT_TOKEN = "dspark:anchor_residual=token"


def parse_variant(name: str, block_fields) -> tuple[str, dict]:
  """A benchmark entry is a draft kind, or a kind with `draft.block` overrides:
  "dspark:markov_rank=0" (DSpark without its Markov head). Returns (kind, overrides); a bad
  entry raises naming it and what is valid."""
  kind, _, rest = name.partition(":")
  over = {}
  for item in filter(None, rest.split(",")):
    field, eq, value = item.partition("=")
    if not eq or field not in block_fields:
      raise ValueError(
        f"config.bench.kinds has {name!r}: overrides are <draft.block field>=<value>, fields "
        f"{sorted(block_fields)}"
      )
    default = block_fields[field]
    over[field] = value if isinstance(default, str) else type(default)(float(value))
  if kind not in KINDS or (over and kind == "eagle3"):
    raise ValueError(
      f"config.bench.kinds has {name!r}: expected a draft kind in {KINDS}, optionally with "
      "draft.block overrides for a block draft (e.g. 'dspark:markov_rank=0')"
    )
  return kind, over


def run(config, workdir: str, run_dir: str | None = None) -> dict:
  """Results to `workdir`; the SFT run and each kind's distillation to `run_dir` (by default
  workdir/runs, or runs/<name> when workdir is under docs/results)."""
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  b = config.bench
  run_dir = run_dir or provenance.run_dir_for(workdir, "runs")
  base_cfg = copy.deepcopy(config)
  base_cfg.draft.pretrain_steps, base_cfg.rl.steps = 0, 0
  base = loop.Context(base_cfg, os.path.join(run_dir, "sft"))
  params, _ = loop.sft_phase(base)
  variants = {name: parse_variant(name, config.draft.block) for name in b.kinds}
  drafts, training = {}, {}
  for kind, (draft_kind, over) in variants.items():  # `kind`: the entry's name
    c = copy.deepcopy(config)
    c.draft.kind = draft_kind
    c.draft.block.update(over)
    ctx = loop.Context(
      c,
      os.path.join(run_dir, kind.replace(":", "_").replace("=", "")),
      data=base.data.shared_with(c),
    )
    dparams, _ = loop.draft_phase(ctx, params)
    drafts[kind] = (dparams, ctx.models.dcfg)
    last = ctx.log("draft_metrics.jsonl").read()[-1]
    G = ctx.models.dcfg.ttt_steps
    training[kind] = {
      "draft_loss": last["draft_loss"],
      "proposals": G,
      # top-1 agreement with the policy per proposal, on the last logged distillation batch
      "ttt_acc": [last[f"ttt_acc_{g}"] for g in range(G)],
    }
    print(f"  {kind}: distilled, draft loss {last['draft_loss']:.3f}", flush=True)
  rows = []
  for B in b.batch_sizes:
    exs = [base.data.eval_examples[i % len(base.data.eval_examples)] for i in range(B)]
    prompts_BS, lengths_B = loader.prompt_batch(exs, base.data.tok, base.data.prompt_len)
    row = compare_drafts(
      params,
      base.models.pcfg,
      drafts,
      prompts_BS,
      lengths_B,
      max_new_tokens=b.max_new_tokens,
      num_draft=b.num_draft,
      temperature=b.temperature,
      repeats=b.repeats,
      seed=100,
    )
    rows.append(row)
    figures = ", ".join(
      f"{k} {r['speedup']:.2f}x tau {r['tau']:.2f}" for k, r in row["by_draft"].items()
    )
    print(f"  batch {B}: {figures}", flush=True)
  payload = {
    "config": {
      "kinds": list(b.kinds),
      "num_draft": b.num_draft,
      "temperature": b.temperature,
      "max_new_tokens": b.max_new_tokens,
      "repeats": b.repeats,
      "policy_layers": base.models.pcfg.n_layers,
      "block_layers": int(config.draft.block.n_layers),
      "d_model": base.models.pcfg.d_model,
      "draft_steps": config.draft.pretrain_steps,
      "sft_steps": config.sft.steps,
    },
    "training": training,
    "rows": rows,
  }
  measured = dict(payload, by_batch={str(r["batch"]): r["by_draft"] for r in rows})
  measured["all_batches"] = over_batches(rows, b.kinds)
  payload["all_batches"] = measured["all_batches"]
  goals = provenance.goals_from_config(b.goals)
  results = provenance.write_results(workdir, payload, goals=goals, measured=measured)
  print(table(results))
  print(provenance.goals_table(results["goals"]), flush=True)
  return results


def over_batches(rows: list[dict], kinds) -> dict:
  """Per kind: the mean tau over batch sizes, and greedy equality on every row of every batch;
  the figures the goals compare (ratios of one kind's figure to another's)."""
  out = {}
  for k in kinds:
    taus = [r["by_draft"][k]["tau"] for r in rows]
    out[k] = {
      "tau_mean": sum(taus) / len(taus),
      "greedy_equal": all(r["by_draft"][k]["greedy_equal"] for r in rows),
    }
  if "dflash" in kinds and "eagle3" in kinds:
    out["dflash_over_eagle3_tau"] = out["dflash"]["tau_mean"] / out["eagle3"]["tau_mean"]
    first = rows[0]["by_draft"]
    out["dflash_over_eagle3_speedup_smallest_batch"] = (
      first["dflash"]["speedup"] / first["eagle3"]["speedup"]
    )
  if "dspark" in kinds and "dflash" in kinds:
    out["dspark_over_dflash_tau"] = out["dspark"]["tau_mean"] / out["dflash"]["tau_mean"]
  if "dspark" in kinds and ANCHOR_AT_TOKEN in kinds:  # the anchor slot's residual
    out["dspark_over_anchor_at_token_tau"] = (
      out["dspark"]["tau_mean"] / out[ANCHOR_AT_TOKEN]["tau_mean"]
    )
  if "dspark" in kinds and NO_MARKOV in kinds:  # the Markov head's own effect
    out["dspark_over_no_markov_tau"] = out["dspark"]["tau_mean"] / out[NO_MARKOV]["tau_mean"]
  out["greedy_equal"] = all(out[k]["greedy_equal"] for k in kinds)
  return out


def table(results) -> str:
  kinds = results["config"]["kinds"]
  head = f"{'batch':>5} " + " ".join(f"{k + ' x':>10} {k + ' tau':>11}" for k in kinds)
  lines = [head]
  for r in results["rows"]:
    cells = " ".join(
      f"{r['by_draft'][k]['speedup']:>10.2f} {r['by_draft'][k]['tau']:>11.2f}" for k in kinds
    )
    lines.append(f"{r['batch']:>5} {cells}")
  return "\n".join(lines)
