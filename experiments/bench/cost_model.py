"""Validation of the round cost model (experiments/bench_cost.py).

For each policy size: calibrate the machine coefficients from timed passes (`decode.cost`), then
time whole AR steps and SD rounds at fixed G as the decoding loop runs them (a stage's seconds over
its rounds) and compare with the model's prediction. A held-out size is predicted with the
coefficients fitted on another size, never timed for the fit. Results go through
`bench.provenance.write_results` with the goals fixed in configs/bench_cost.py.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from experiments.bench import provenance
from specdraft.decode import cost
from specdraft.model import drafts
from specdraft.model import policy as pol


def models(size_cfg, vocab: int, num_draft: int, seed: int = 0):
  """(pcfg, dcfg, params, dparams) of one size, freshly initialised (timing needs no training)."""
  pcfg = pol.PolicyConfig.from_config(size_cfg.model, vocab)
  dcfg = drafts.draft_config(size_cfg.draft, pcfg, num_draft)
  params = pol.init_params(pcfg, seed)
  return pcfg, dcfg, params, drafts.init_params(dcfg, seed + 1, params, pcfg)


class Metronome:
  """The host's own speed through a benchmark: one fixed program (a policy pass, `time_pass`'s)
  timed at every `tick` (before the first calibration and after every calibration and
  validation). The same program on the same inputs, so its ticks differ only by what the host
  does to it: their spread (`drift`: largest over smallest - 1) is how far this host's speed
  moved during the run, a floor under any point error a model of a round can be checked to when
  its fit and its validation are timed minutes apart."""

  def __init__(self, time_pass):
    self._time_pass = time_pass  # () -> seconds of the fixed pass (the fastest of its repeats)
    self._t0 = time.perf_counter()
    self.ticks: list[dict] = []

  def tick(self, label: str) -> float:
    s = float(self._time_pass())
    self.ticks.append({"label": label, "at_s": time.perf_counter() - self._t0, "seconds": s})
    return s

  def drift(self) -> float:
    """Largest tick over smallest, minus 1 (nan with fewer than two ticks)."""
    if len(self.ticks) < 2:
      return float("nan")
    ts = [t["seconds"] for t in self.ticks]
    return max(ts) / min(ts) - 1.0


def run(config, workdir: str) -> dict:
  """Calibrates on each of `bench.sizes`, validates rounds there and on `bench.held_out`."""
  from configs import default

  provenance.check_workdir(workdir)
  b = config.bench
  fitted, sizes = {}, {}
  beat = b.metronome  # the fixed pass the host's speed is read from through the run
  beat_pcfg, _, beat_params, _ = models(
    default.get_config(f"size={beat.size}"), b.vocab, max(b.num_drafts)
  )
  metronome = Metronome(
    lambda: cost.time_policy_pass(
      beat_params, beat_pcfg, beat.rows, 1, b.prompt_len + b.new_tokens, min_s=b.min_s
    )
  )
  metronome.tick("start")
  for name in list(b.sizes) + [b.held_out.size]:
    size_cfg = default.get_config(f"size={name}")
    pcfg, dcfg, params, dparams = models(size_cfg, b.vocab, max(b.num_drafts))
    entry = {"policy": dataclasses.asdict(pcfg), "layers": pcfg.n_layers, "width": pcfg.d_model}
    if name in b.sizes:
      grid = cost.Grid(
        rows=tuple(b.grid_rows),
        tokens=tuple(b.grid_tokens),
        round_rows=tuple(b.grid_round_rows),
        round_G=tuple(b.grid_round_G),
        capacity=b.prompt_len + b.new_tokens + max(b.num_drafts) + 2,
        prompt_len=b.prompt_len,
      )
      model, record = cost.calibrate(params, dparams, pcfg, dcfg, grid=grid, min_s=b.min_s)
      metronome.tick(f"{name}: calibrated")
      fitted[name] = model.machine
      entry["calibration"] = record
      entry["max_abs_calibration_error"] = max(abs(p["rel_error"]) for p in record["points"])
    else:
      model = cost.CostModel(fitted[b.held_out.fitted_on], pcfg, dcfg)
      entry["fitted_on"] = b.held_out.fitted_on
    points = cost.time_rounds(
      params,
      dparams,
      pcfg,
      dcfg,
      rows=b.rows,
      num_drafts=b.num_drafts,
      prompt_len=b.prompt_len,
      new_tokens=b.new_tokens,
      repeats=b.repeats,
    )
    metronome.tick(f"{name}: validated")
    for p in points:
      p["predicted"] = cost.predict(model, p)
      p["rel_error"] = p["predicted"] / p["seconds"] - 1.0
    if "calibration" in entry:
      entry.update(corrected_errors(model, entry["calibration"]["points"], points))
    entry["rounds"] = points
    entry["max_abs_round_error"] = max(abs(p["rel_error"]) for p in points)
    if "calibration" in entry:
      entry["repeats"] = repeat_pairs(entry["calibration"]["points"], points)
    sizes[name] = entry
    worst = max(points, key=lambda p: abs(p["rel_error"]))
    print(
      f"{name}: max |error| rounds {entry['max_abs_round_error']:.3f} (at {worst['model']}, "
      f"rows {worst['rows']}, G {worst['tokens']})",
      flush=True,
    )
  metrics = {
    "calibrated": {n: sizes[n]["max_abs_calibration_error"] for n in b.sizes},
    "rounds": {n: sizes[n]["max_abs_round_error"] for n in b.sizes},
    "held_out": sizes[b.held_out.size]["max_abs_round_error"],
    "max_calibration_error": max(sizes[n]["max_abs_calibration_error"] for n in b.sizes),
    "max_round_error": max(sizes[n]["max_abs_round_error"] for n in b.sizes),
    # the fit corrected by the calibration's own timed rounds, at the validated rounds it did
    # not time (what the correction adds between timed points) and at those it did (there it is
    # the calibration's own measurement, so this is the host's repeatability again)
    "rounds_corrected_between": {n: sizes[n]["max_abs_corrected_between"] for n in b.sizes},
    "max_round_error_corrected_between": _max_of(sizes, b.sizes, "max_abs_corrected_between"),
    "max_round_error_corrected_at_timed": _max_of(sizes, b.sizes, "max_abs_corrected_at_timed"),
    # a diagnostic, not a goal: how well this host repeats its own timings (see repeat_pairs)
    "timing_repeatability": {n: _max_abs(sizes[n]["repeats"]) for n in b.sizes},
    "max_timing_repeatability": _max_abs([q for n in b.sizes for q in sizes[n]["repeats"]]),
    # a diagnostic, not a goal: the one fixed pass's speed through the run (Metronome)
    "host_drift": metronome.drift(),
  }
  results = {"metrics": metrics, "sizes": sizes, "metronome": metronome.ticks}
  return provenance.publish(
    workdir, results, b.goals, table=table, plot=plot, plot_name="cost_model.png"
  )


def corrected_errors(model: cost.CostModel, calibration: list[dict], rounds: list[dict]) -> dict:
  """The validated rounds predicted by the fit corrected by the calibration's timed rounds
  (`decode.cost.Correction`; here from its AR steps and the fixed loop's SD rounds, the kinds
  this benchmark validates): each round's `predicted_corrected`, `rel_error_corrected` and
  `timed_for_fit` (its (rows, G) is one the calibration timed), and the largest |error| apart
  and at the timed points. A fixed loop's SD round at G = 0 (the draft still takes in each token)
  is not what the AR steps timed, so it keeps the fit's prediction."""
  k = cost.Correction.from_points(calibration, model.pcfg.n_layers)
  corrected = dataclasses.replace(model, correction=k)
  timed = {(r, G) for r in k.rows for G in k.G} if k else set()
  between, at_timed = [], []
  for p in rounds:
    G = p["tokens"]
    same = p["model"] == "sd" and G == 0
    p["predicted_corrected"] = p["predicted"] if same else cost.predict_corrected(corrected, p)
    p["rel_error_corrected"] = p["predicted_corrected"] / p["seconds"] - 1.0
    p["timed_for_fit"] = (p["rows"], G) in timed and not same
    (at_timed if p["timed_for_fit"] else between).append(abs(p["rel_error_corrected"]))
  return {
    "max_abs_corrected_between": max(between, default=float("nan")),
    "max_abs_corrected_at_timed": max(at_timed, default=float("nan")),
  }


def _max_of(sizes: dict, names, key: str) -> float:
  return max(sizes[n][key] for n in names)


def repeat_pairs(calibration: list[dict], rounds: list[dict]) -> list[dict]:
  """The AR steps and SD rounds timed twice in one run: once for the fit (the calibration's
  round grid, full depth) and once for the validation, independently. [{model, rows, tokens,
  calibration_s, rounds_s, rel_diff = rounds_s / calibration_s - 1}]. Their spread is the host's
  repeatability: no model can be checked to a tolerance tighter than the timings repeat to."""
  key = lambda p: (p["model"], p["rows"], p["tokens"], p["capacity"])
  timed = {key(p): p["seconds"] for p in rounds}
  pairs = []
  for p in calibration:
    if p["model"] in ("ar", "sd") and "layers" not in p and key(p) in timed:
      again = timed[key(p)]
      pairs.append(
        dict(
          model=p["model"], rows=p["rows"], tokens=p["tokens"], calibration_s=p["seconds"],
          rounds_s=again, rel_diff=again / p["seconds"] - 1.0,
        )
      )  # fmt: skip
  return pairs


def _max_abs(pairs: list[dict]) -> float:
  return max((abs(p["rel_diff"]) for p in pairs), default=float("nan"))


def plot(results: dict, path: str) -> None:
  """Predicted against measured seconds of every AR step and SD round, one colour per size."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(5, 5))
  lo, hi = np.inf, 0.0
  for name, entry in results["sizes"].items():
    m = np.asarray([p["seconds"] for p in entry["rounds"]]) * 1e3
    q = np.asarray([p["predicted"] for p in entry["rounds"]]) * 1e3
    tag = " (held out)" if "fitted_on" in entry else ""
    ax.loglog(m, q, "o", ms=4, label=f"{name}{tag}")
    lo, hi = min(lo, m.min(), q.min()), max(hi, m.max(), q.max())
  xs = np.asarray([lo, hi])
  ax.plot(xs, xs, "k-", lw=0.8)
  ax.fill_between(xs, xs / 1.15, xs * 1.15, color="0.85", label="+-15%")
  ax.set_xlabel("measured ms per AR step / SD round")
  ax.set_ylabel("predicted ms")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def table(results: dict) -> str:
  lines = [
    "Corrected: the fit scaled by the calibration's own timed AR steps and SD rounds "
    "(decode.cost.Correction; * a (rows, G) the calibration timed; held-out size: none).",
    "",
    "| size | kind | rows | G | measured ms | predicted ms | error | corrected error |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for name, entry in results["sizes"].items():
    for p in entry["rounds"]:
      c = p.get("rel_error_corrected")
      lines.append(
        f"| {name} | {p['model']} | {p['rows']} | {p['tokens']} | {p['seconds'] * 1e3:.3f} | "
        f"{p['predicted'] * 1e3:.3f} | {p['rel_error']:+.1%} | "
        + ("-" if c is None else f"{c:+.1%}" + ("*" if p.get("timed_for_fit") else ""))
        + " |"
      )
  ticks = results.get("metronome", [])
  if ticks:
    lines += [
      "",
      "One fixed policy pass timed through the run (the host's own speed; "
      f"largest over smallest - 1: {results['metrics']['host_drift']:+.1%}).",
      "",
      "| when | at s | ms |",
      "|---|---|---|",
    ]
    lines += [f"| {t['label']} | {t['at_s']:.0f} | {t['seconds'] * 1e3:.3f} |" for t in ticks]
  pairs = [(n, p) for n, e in results["sizes"].items() for p in e.get("repeats", [])]
  if pairs:
    lines += [
      "",
      "The same AR steps and SD rounds timed twice in this run (the calibration, then the "
      "validation): the host's repeatability, a floor under any model's error.",
      "",
      "| size | kind | rows | G | calibration ms | validation ms | difference |",
      "|---|---|---|---|---|---|---|",
    ]
    for n, p in pairs:
      lines.append(
        f"| {n} | {p['model']} | {p['rows']} | {p['tokens']} | {p['calibration_s'] * 1e3:.3f} | "
        f"{p['rounds_s'] * 1e3:.3f} | {p['rel_diff']:+.1%} |"
      )
  return "\n".join(lines)
