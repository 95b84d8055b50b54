"""TapChannel benchmark (experiments/bench_tap.py): the pipelined co-training step with the
channel off / direct / direct+delay / bulk / hop, timed side by side (interleaved) in one run;
collective bytes per step from the compiled HLO; peak memory from `memory_analysis()`;
correctness checks (taps bit-exact, outputs unchanged by the channel).
"""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from experiments.bench import hlo as hlo_lib
from experiments.bench import provenance
from experiments.bench.step_time import synthetic_batch
from specdraft.model import drafts, pipelined
from specdraft.model import policy as pol
from specdraft.parallel import layouts
from specdraft.parallel import mesh as mesh_lib
from specdraft.parallel import pipeline as pipe
from specdraft.parallel.tap import TapChannel, TapPlan
from specdraft.train import step as step_lib
from specdraft.train.spec import StepSpec

MODES = (("off", False), ("direct", False), ("direct", True), ("bulk", False), ("hop", False))


def mode_name(mode: str, delay: bool) -> str:
  return f"{mode}+delay" if delay else mode


def make_mesh(pp: int):
  lay = layouts.layout("single")
  lay["name"] = f"pp{pp}"
  lay["mesh"]["pp"] = pp
  lay["devices"] = pp
  return mesh_lib.make_mesh(ml_collections.ConfigDict(lay))


def _setup(config, case):
  model = config.model.copy_and_resolve_references()
  model.tap_layers = tuple(case["taps"])
  pcfg = pol.PolicyConfig.from_config(model, 99)
  dcfg = drafts.draft_config(config.draft, pcfg, num_draft=int(config.decode.num_draft))
  theta = pol.init_params(pcfg, 0)
  dparams = drafts.init_params(dcfg, 1, theta, pcfg)
  batch = synthetic_batch(case["batch"], case["seq_len"], pcfg.vocab_size)
  return pcfg, dcfg, {"policy": theta, "draft": dparams}, batch


def _memory(compiled) -> int:
  m = compiled.memory_analysis()
  total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
  return int(total - getattr(m, "alias_size_in_bytes", 0))


def correctness(config, case) -> dict:
  """Receiver buffer == sender buffer == unpipelined taps (bit-exact), and the co-training
  step's policy update and RL metrics identical with the channel on vs off."""
  pcfg, dcfg, tr, batch = _setup(config, case)
  P, M = case["pp"], case["microbatches"]
  mesh = make_mesh(P)
  recv_eq_unpiped, recv_eq_sent = _taps_exact(pcfg, tr["policy"], batch, mesh, P, M)
  tx = step_lib.make_cotrain_optimizer(config.rl, config.draft)
  state = {"step": jnp.zeros((), jnp.int32), "params": tr, "opt_state": tx.init(tr)}
  spec = StepSpec.of(pcfg, dcfg, config.rl, tx=tx)
  step = lambda sp: jax.jit(functools.partial(step_lib.cotrain_step, spec=sp))  # noqa: E731
  outs = {
    mode: step(
      spec.replace(mesh=mesh, pipeline=pipelined.PipelineSpec(microbatches=M, tap_mode=mode))
    )(state, batch)
    for mode in ("direct", "off")
  }
  (s_on, m_on), (s_off, m_off) = outs["direct"], outs["off"]
  same_policy = all(
    np.array_equal(a, b)
    for a, b in zip(
      jax.tree.leaves(s_on["params"]["policy"]), jax.tree.leaves(s_off["params"]["policy"])
    )
  )
  same_rl = all(np.array_equal(m_on[k], m_off[k]) for k in ("rl_loss", "entropy") if k in m_on)
  single = step(spec)(state, batch)  # against the single-device step
  rel = max(
    abs(float(m_on[k]) - float(single[1][k])) / max(abs(float(single[1][k])), 1e-6)
    for k in ("loss", "draft_loss", "policy_grad_norm", "draft_grad_norm")
  )
  return {
    "taps_bit_exact": recv_eq_unpiped and recv_eq_sent,
    "receiver_equals_sender": recv_eq_sent,
    "receiver_equals_unpipelined": recv_eq_unpiped,
    "outputs_unchanged": same_policy and same_rl,
    "max_rel_diff_vs_single_device": rel,
    "case": case,
  }


def _taps_exact(pcfg, theta, batch, mesh, P: int, M: int) -> tuple[bool, bool]:
  """(receiver buffer == unpipelined taps, receiver buffer == what every stage sent), bit-exact."""
  plan = TapPlan(tuple(pcfg.taps), pcfg.n_layers, P)
  spec = pipelined.PipelineSpec(microbatches=M, tap_mode="direct")
  _, taps, sent = jax.jit(
    lambda th: pipelined.forward(
      th, pcfg, batch["tokens"], batch["positions"], batch["segment_ids"], mesh=mesh, spec=spec
    )
  )(theta)
  f = jax.jit(lambda t, p, s: pol.forward(theta, pcfg, t, p, s))
  split = lambda x: pipe.split_microbatches(x, M)
  per = [
    f(*(split(batch[k])[m] for k in ("tokens", "positions", "segment_ids")))[1].layers
    for m in range(M)
  ]
  unpiped = jax.vmap(pipe.merge_microbatches, in_axes=1)(jnp.stack(per))
  recv_eq_sent = all(
    np.array_equal(pipe.merge_microbatches(sent[s, :, j]), taps.layers[i])
    for s in range(P)
    for j, i in enumerate(plan.slots(s))
  )
  return bool(np.array_equal(taps.layers, unpiped)), recv_eq_sent


def run_case(config, case, repeats: int) -> dict:
  pcfg, dcfg, tr, batch = _setup(config, case)
  P, M = case["pp"], case["microbatches"]
  mesh = make_mesh(P)
  plan = TapPlan(tuple(pcfg.taps), pcfg.n_layers, P)
  tx = step_lib.make_cotrain_optimizer(config.rl, config.draft)
  state = {"step": jnp.zeros((), jnp.int32), "params": tr, "opt_state": tx.init(tr)}
  b = case["batch"] // M
  tap_shape = (b, case["seq_len"], pcfg.d_model)
  tapped = TapChannel(plan, "bulk").tapped_bytes(tap_shape, jnp.float32, M)
  spec = StepSpec.of(pcfg, dcfg, config.rl, tx=tx, mesh=mesh)
  fns, rows = _compile_modes(spec, state, batch, M, case.get("remat", False))
  off_total = rows["off"]["permute_bytes"]["total_bytes"]
  for row in rows.values():
    row["tap_wire_bytes"] = row["permute_bytes"]["total_bytes"] - off_total
  for _ in range(repeats):  # interleaved: every mode once per round
    for name, fn in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn(state, batch))
      rows[name]["times"].append(time.perf_counter() - t0)
  for row in rows.values():
    row["step_seconds"] = float(np.median(row["times"]))
  off = rows["off"]["step_seconds"]
  for row in rows.values():
    row["ratio_vs_off"] = row["step_seconds"] / off
  out = {
    **case,
    "layers": pcfg.n_layers,
    "d_model": pcfg.d_model,
    "n_taps": len(pcfg.taps),
    "sources": list(plan.sources),
    "tapped_bytes": tapped,
    "main_shift_bytes": off_total,
    "bubble_fraction": (P - 1) / (M + P - 1),
    "direct_ratio_of_medians": rows["direct"]["step_seconds"] / off,
    "modes": rows,
  }
  out["bulk_bytes_equal_tapped"] = rows["bulk"]["tap_wire_bytes"] == tapped
  out["direct_useful_bytes"] = tapped
  out["direct_bubble_bytes"] = rows["direct"]["tap_wire_bytes"] - tapped
  return out


def _compile_modes(spec, state, batch, M: int, remat: bool):
  """Every tap mode's co-training step (`spec` with that mode's pipeline) compiled and warmed
  up: ({mode: compiled}, {mode: row with compile time, peak bytes, collective-permute bytes and
  an empty list of times})."""
  fns, rows = {}, {}
  for mode, delay in MODES:
    name = mode_name(mode, delay)
    pipe_spec = pipelined.PipelineSpec(microbatches=M, tap_mode=mode, tap_delay=delay, remat=remat)
    step = functools.partial(step_lib.cotrain_step, spec=spec.replace(pipeline=pipe_spec))
    t0 = time.perf_counter()
    compiled = jax.jit(step).lower(state, batch).compile()
    compile_s = time.perf_counter() - t0
    perms = hlo_lib.collective_permutes(compiled.as_text())
    jax.block_until_ready(compiled(state, batch))  # warm-up
    fns[name] = compiled
    rows[name] = {
      "mode": name,
      "compile_seconds": compile_s,
      "peak_bytes": _memory(compiled),
      "permute_bytes": hlo_lib.summarize(perms),
      "times": [],
    }
  return fns, rows


def paired_stats(results, *, bootstrap: int = 10000, seed: int = 0) -> dict:
  """Per-round paired ratios (mode time / off time in the same round), robust to the machine's
  drift between rounds: per case, and pooled over every case and round with its spread (IQR of
  the pooled ratios; 95% bootstrap CI of the pooled median, resampling rounds within each case)."""
  pooled, by_case, per_case = {}, {}, []
  for c in results["cases"]:
    off = np.asarray(c["modes"]["off"]["times"])
    row = {}
    for name, m in c["modes"].items():
      r = np.asarray(m["times"]) / off
      row[name] = float(np.median(r))
      pooled.setdefault(name, []).extend(r.tolist())
      by_case.setdefault(name, []).append(r)
    per_case.append(row)
  rng = np.random.default_rng(seed)
  ci, iqr = {}, {}
  for name, rs in by_case.items():
    boots = np.empty(bootstrap)
    for i in range(bootstrap):
      boots[i] = np.median(np.concatenate([r[rng.integers(0, len(r), len(r))] for r in rs]))
    ci[name] = [float(np.quantile(boots, 0.025)), float(np.quantile(boots, 0.975))]
    iqr[name] = [float(np.quantile(pooled[name], 0.25)), float(np.quantile(pooled[name], 0.75))]
  return {
    "paired_median_by_case": per_case,
    "pooled_paired_median": {k: float(np.median(v)) for k, v in pooled.items()},
    "pooled_paired_iqr": iqr,
    "pooled_paired_median_ci95": ci,
    "pooled_rounds": len(pooled.get("off", [])),
    "bootstrap_resamples": bootstrap,
  }


def _fmt_bytes(n):
  return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def table(results) -> str:
  lines = [
    "| P | M | S | taps | off ms | direct | +delay | bulk | hop | tapped | direct wire "
    "(bubble) | bulk wire | hop wire | peak direct/off |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in results["cases"]:
    m = r["modes"]
    lines.append(
      f"| {r['pp']} | {r['microbatches']} | {r['seq_len']} | {r['n_taps']} | "
      f"{m['off']['step_seconds'] * 1e3:.1f} | {m['direct']['ratio_vs_off']:.3f} | "
      f"{m['direct+delay']['ratio_vs_off']:.3f} | {m['bulk']['ratio_vs_off']:.3f} | "
      f"{m['hop']['ratio_vs_off']:.3f} | {_fmt_bytes(r['tapped_bytes'])} | "
      f"{_fmt_bytes(m['direct']['tap_wire_bytes'])} ({_fmt_bytes(r['direct_bubble_bytes'])}) | "
      f"{_fmt_bytes(m['bulk']['tap_wire_bytes'])} | {_fmt_bytes(m['hop']['tap_wire_bytes'])} | "
      f"{m['direct']['peak_bytes'] / m['off']['peak_bytes']:.3f} |"
    )
  return "\n".join(lines)


def plot(results, path: str) -> None:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cases = results["cases"]
  labels = [f"P{r['pp']} M{r['microbatches']}\nS{r['seq_len']} N{r['n_taps']}" for r in cases]
  x = np.arange(len(cases))
  names = ["direct", "direct+delay", "bulk", "hop"]
  fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
  w = 0.2
  for i, n in enumerate(names):
    axes[0].bar(x + (i - 1.5) * w, [r["modes"][n]["ratio_vs_off"] for r in cases], w, label=n)
  for g in results["goals"].values():
    if g["metric"].startswith("overhead_"):
      axes[0].axhline(g["target"], color="k", ls="--", lw=1, label=f"goal {g['target']}")
      break
  axes[0].axhline(1.0, color="gray", lw=0.8)
  axes[0].set_xticks(x, labels, fontsize=7)
  axes[0].set_ylabel("step time / channel off")
  axes[0].set_title("co-training step time by tap mode (interleaved medians)")
  axes[0].legend(fontsize=7)
  for i, n in enumerate(names):
    axes[1].bar(
      x + (i - 1.5) * w, [max(r["modes"][n]["tap_wire_bytes"], 1) for r in cases], w, label=n
    )
  axes[1].scatter(
    x,
    [r["tapped_bytes"] for r in cases],
    marker="_",
    s=400,
    color="k",
    label="tapped bytes",
    zorder=3,
  )
  axes[1].set_yscale("log")
  axes[1].set_xticks(x, labels, fontsize=7)
  axes[1].set_ylabel("tap bytes on the wire per step (HLO)")
  axes[1].set_title("channel traffic vs the tapped bytes")
  axes[1].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def summarize(results) -> None:
  """The direct-mode overhead two ways, each under its own name (neither is "the" ratio):

  overhead_worst_case   max over cases of (median direct time / median off time), the per-case
                        ratio of medians;
  overhead_pooled       median over every case and round of the paired ratio direct/off (same
                        round), with its IQR and a 95% bootstrap CI.
  """
  cases = results["cases"]
  paired = paired_stats(results)
  results["paired"] = paired
  results["overhead_worst_case"] = float(np.max([r["direct_ratio_of_medians"] for r in cases]))
  results["overhead_median_case"] = float(np.median([r["direct_ratio_of_medians"] for r in cases]))
  results["overhead_pooled"] = {
    "median": paired["pooled_paired_median"]["direct"],
    "iqr": paired["pooled_paired_iqr"]["direct"],
    "ci95": paired["pooled_paired_median_ci95"]["direct"],
    "rounds": paired["pooled_rounds"],
  }


def run(config, workdir: str) -> dict:
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  os.makedirs(workdir, exist_ok=True)
  bc = config.bench_tap
  goals = provenance.goals_from_config(bc.goals)
  print("correctness ...", flush=True)
  check = correctness(config, dict(bc.check_case))
  print(json.dumps({k: v for k, v in check.items() if k != "case"}), flush=True)
  results = {
    "taps_bit_exact": check["taps_bit_exact"],
    "outputs_unchanged": check["outputs_unchanged"],
    "correctness": check,
    "repeats": bc.repeats,
    "cases": [],
  }
  for case in bc.cases:
    case = dict(case)
    print(f"case {case} ...", flush=True)
    r = run_case(config, case, bc.repeats)
    results["cases"].append(r)
    m = r["modes"]
    print(
      "  "
      + "  ".join(
        f"{k} {v['step_seconds'] * 1e3:.1f}ms ({v['ratio_vs_off']:.3f})" for k, v in m.items()
      ),
      flush=True,
    )
    print(
      f"  tapped {r['tapped_bytes']} B; wire: direct {m['direct']['tap_wire_bytes']} "
      f"bulk {m['bulk']['tap_wire_bytes']} hop {m['hop']['tap_wire_bytes']}",
      flush=True,
    )
  cases = results["cases"]
  summarize(results)
  results["bytes_per_step_by_mode"] = {
    f"P{r['pp']}_M{r['microbatches']}_S{r['seq_len']}_N{r['n_taps']}": {
      "tapped": r["tapped_bytes"],
      "main_shift": r["main_shift_bytes"],
      **{k: v["tap_wire_bytes"] for k, v in r["modes"].items()},
    }
    for r in cases
  }
  results["bulk_bytes_equal_tapped"] = all(r["bulk_bytes_equal_tapped"] for r in cases)
  results = provenance.write_results(workdir, results, goals=goals)
  md = table(results)
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(md + "\n")
  plot(results, os.path.join(workdir, "bench_tap.png"))
  print(md, flush=True)
  print(provenance.goals_table(results["goals"]), flush=True)
  return results
