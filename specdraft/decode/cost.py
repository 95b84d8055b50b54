"""A measured cost model of a decoding round, and the acceptance it is weighed against.

Time of one pass (the policy's or the draft's) over `rows` rows of `tokens` new tokens each,
attending over a cache of `capacity` entries, in a roofline form:

    seconds = pass_s + layer_s * layers + combine(compute, moved)
    compute = flops / (flop_rate * (1 + thread_gain * m^2 / (m^2 + thread_rows^2)))
    moved   = weight_bytes / byte_rate + kv_bytes / kv_rate

flops and bytes are counted from the model's config (`policy_work`, `draft_work`); the layers
term is what a pass costs whatever its size (kernel launches, loop and scheduling overhead).
`combine` is max (a roofline: the chip overlaps compute with memory traffic, as a GPU or TPU
does) or the sum (the two run one after the other); `calibrate` fits both and keeps the better.
m is the number of token rows a pass's matrix products have (rows x tokens): on a CPU, XLA
splits a product over its threads only past some size, so the sustained FLOP rate rises by
`thread_gain` (at most about 1 on two cores) around m = `thread_rows`; a datasheet has gain 0.
Without the threads term the max form prices a CPU's small batches too dear and its middling
ones too cheap (the sustained rate is not one number there).
Weights and the KV cache move at rates of their own: on a CPU the weights of a small model stay
in cache while the KV cache streams; on a GPU both are HBM (a datasheet gives one figure for
both). The policy's decode carries its whole [L, B, C, K, D] cache through the scan over layers,
and each layer's step touches it (the compiled program's bytes accessed are about L times the
cache: 1.14 GB a pass at 128 rows, 12 layers and a 100 MB cache), so its KV traffic is counted
as L passes over the cache.

A round at G (`round_seconds`) is one policy pass over G + 1 tokens plus the draft's passes
(EAGLE-3: G - 1 single-token steps and a (G + 1)-token catch-up, G = 0: none, the draft takes in
the plain steps' entries with one window-wide pass when drafting resumes, not counted here; a
block draft: one block pass and the context write of the verified tokens, G = 0: the write only)
plus the round's own work, round_s + round_layer_s * L + rows * (G + 1) * V / sample_rate (the
distributions over the vocabulary, sampling, verification, writing out, the per-layer cache's
bookkeeping). An AR step is one policy
pass over one token plus the same own work at G = 0.

The twelve machine coefficients are fitted by `calibrate` from timed passes of both models and timed
AR steps and SD rounds at a few (rows, G) on the machine at hand, plus passes, AR steps and SD
rounds of the policy cut to half its layers (the draft tapping as many of its layers), so that
what a pass costs, what a layer costs and what a drafted token costs a round can be told apart
(a minute or two; cached per config, backend and JAX version). The rates are shared by the
policy and the draft, the fixed costs per pass and per layer are each model's own, and a round's
own work has a per-layer part; every coefficient is per layer or per unit of work, so the model
carries over to a policy size it was not fitted on.

What an adaptive round chooses G by (`CostModel.round_seconds_all`) is the model corrected by
the calibration's own timed rounds (`Correction`, `decode.cost_correction`): at the timed row
counts, the adaptive loop's rounds timed at every G (`Grid.adaptive`), or AR steps and the fixed
loop's rounds at a few G (for a G chosen per stage: the fixed loop's at every G, as a stage runs
them, with `Grid.stage`); between them the model's shape scaled to the nearby measurements. The
choice compares rounds at the same rows whose expected tokens differ by 10-20%, finer than the
fit's point errors (up to 25% on this CPU); the fit carries over to sizes and machines never
timed, the correction does not.

Shape letters: M = G_max (the most a round drafts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.model import dflash, drafts, eagle3
from specdraft.model import policy as pol


class Work(NamedTuple):
  """What one pass does: floating-point operations, bytes of weights and of the KV cache read,
  the number of layers (each a fixed cost in kernel launches on any backend) and the token rows
  its matrix products have (rows x tokens)."""

  flops: float
  weight_bytes: float
  kv_bytes: float
  layers: int
  token_rows: float = 1.0


def _layer_flops(E, H, K, D, F, tokens, capacity, in_width=None):
  """One decoder layer per token: q/k/v and output projections, SwiGLU MLP, attention over the
  cache (scores and values; the decode attends over every entry of the capacity, masked)."""
  in_width = in_width or E
  proj = 2 * in_width * (H + 2 * K) * D + 2 * H * D * E + 6 * E * F
  return tokens * (proj + 4 * H * D * capacity)


def _layer_params(E, H, K, D, F, in_width=None):
  in_width = in_width or E
  return in_width * (H + 2 * K) * D + H * D * E + 3 * E * F + 2 * E


def policy_work(pcfg: pol.PolicyConfig, rows: int, tokens: int, capacity: int) -> Work:
  """One policy pass (`policy.decode`)."""
  E, L, H, K, D, F, V = (
    pcfg.d_model,
    pcfg.n_layers,
    pcfg.n_heads,
    pcfg.n_kv_heads,
    pcfg.head_dim,
    pcfg.d_ff,
    pcfg.vocab_size,
  )
  itemsize = jnp.dtype(pcfg.dtype).itemsize
  flops = rows * (L * _layer_flops(E, H, K, D, F, tokens, capacity) + tokens * 2 * E * V)
  weights = (L * _layer_params(E, H, K, D, F) + V * E) * itemsize
  kv = L * rows * capacity * L * 2 * K * D * itemsize  # the carried cache, once per layer
  return Work(float(flops), float(weights), float(kv), L, float(rows * tokens))


def draft_work(dcfg, rows: int, tokens: int, capacity: int) -> Work:
  """One draft pass: EAGLE-3's step over `tokens` entries (with the fusion of the tapped layers
  when it catches up, tokens > 1); a block draft's block pass plus the context write of `tokens`
  verified positions (tokens = 0: the write of one position only, a G = 0 round)."""
  itemsize = jnp.dtype(dcfg.dtype).itemsize
  E, H, K, D, F = dcfg.d_model, dcfg.n_heads, dcfg.n_kv_heads, dcfg.head_dim, dcfg.d_ff
  if not drafts.is_block(dcfg):
    V = dcfg.draft_vocab
    fuse = 2 * dcfg.n_taps * E * E * tokens if tokens > 1 else 0
    flops = rows * (
      _layer_flops(E, H, K, D, F, tokens, capacity, 2 * E) + fuse + tokens * 2 * E * V
    )
    weights = (_layer_params(E, H, K, D, F, 2 * E) + dcfg.n_taps * E * E + E * V) * itemsize
    kv = rows * capacity * 2 * K * D * itemsize
    return Work(float(flops), float(weights), float(kv), 1, float(rows * tokens))
  W, L, V = dcfg.block_size, dcfg.n_layers, dcfg.vocab_size
  written = max(tokens, 1)
  write = 2 * dcfg.n_taps * E * E * written + L * 2 * E * 2 * K * D * written
  block = 0 if tokens == 0 else L * _layer_flops(E, H, K, D, F, W, capacity + W) + W * 2 * E * V
  weights = L * _layer_params(E, H, K, D, F) + dcfg.n_taps * E * E + (E * V if tokens else 0)
  kv = (rows * capacity * L * 2 * K * D if tokens else 0) * itemsize
  m = rows * (dcfg.block_size if tokens else written)
  return Work(float(rows * (write + block)), float(weights * itemsize), float(kv), L, float(m))


@dataclasses.dataclass(frozen=True)
class Machine:
  """Fitted coefficients: fixed seconds per policy pass and per policy layer, sustained FLOP/s and
  bytes/s of weights of a pass; fixed seconds per round and vocabulary entries per second of a
  round's own work; bytes/s of KV-cache traffic; fixed seconds per draft pass and per draft layer
  (None: the policy's). A draft layer's fixed cost is its own: its program differs from a policy
  layer's (EAGLE-3's fusion and head; no scan over a carried cache), and one fixed cost for both
  leaves a policy pass at one row underpredicted and a draft pass overpredicted by 2x here.
  `thread_rows` and `thread_gain` shape the FLOP rate's rise with a pass's token rows and
  `overlap` picks max (True) or sum (False) of its compute and memory times (module docstring)."""

  pass_s: float
  layer_s: float
  flop_rate: float
  byte_rate: float
  round_s: float
  sample_rate: float
  kv_rate: float
  draft_pass_s: float | None = None
  draft_layer_s: float | None = None
  round_layer_s: float = 0.0
  thread_rows: float = 1.0
  thread_gain: float = 0.0
  overlap: bool = True

  def seconds(self, w: Work, *, draft: bool = False) -> float:
    moved = w.weight_bytes / self.byte_rate + w.kv_bytes / self.kv_rate
    pass_s, layer_s = self.pass_s, self.layer_s
    if draft and self.draft_pass_s is not None:
      pass_s, layer_s = self.draft_pass_s, self.draft_layer_s
    m2 = w.token_rows**2
    rate = self.flop_rate * (1.0 + self.thread_gain * m2 / (m2 + self.thread_rows**2))
    compute = w.flops / rate
    body = max(compute, moved) if self.overlap else compute + moved
    return pass_s + layer_s * w.layers + body

  def round_overhead(self, rows: int, tokens: int, vocab: int, layers: int = 0) -> float:
    """A round's own work: fixed seconds, per policy layer (the loop's bookkeeping of the
    per-layer cache), and per vocabulary entry of the rows' distributions."""
    fixed = self.round_s + self.round_layer_s * layers
    return fixed + rows * tokens * vocab / self.sample_rate

  @classmethod
  def from_spec(cls, spec: dict) -> Machine:
    """An accelerator's datasheet (`peak_flops`, `hbm_bytes_per_s`) with its fixed costs
    (`pass_s`, `layer_s`, `round_s`) and `sample_rate`, for projections
    (experiments/project_speedup.py)."""
    return cls(
      spec["pass_s"],
      spec["layer_s"],
      spec["peak_flops"],
      spec["hbm_bytes_per_s"],
      spec["round_s"],
      spec["sample_rate"],
      spec.get("kv_bytes_per_s", spec["hbm_bytes_per_s"]),
    )


# decode.auto_every: auto G chosen before every round (in the adaptive loop) or once per stage
AUTO_EVERY = ("round", "stage")


@dataclasses.dataclass(frozen=True)
class Correction:
  """log(measured / predicted) seconds of whole rounds where the calibration timed them: an AR
  step (G = 0) and SD rounds at each G of its round grid, at each of its row counts, full depth.
  `factor` interpolates it linearly in G and in log rows between the timed points and holds it
  flat beyond them, so a corrected round is the measurement at a timed (rows, G) and the model's
  shape scaled by the nearby measurements' level elsewhere.

  Why: the choice of G compares rounds at the same rows whose expected tokens differ by 10-20%,
  so it needs their relative prices to a few percent; a global fit of the machine coefficients
  misses single points by up to 25% on a CPU and can tilt the price of a deep round against a
  shallow one. The correction is for choosing G at the configs it was timed on; a policy size or
  machine never timed (a projection) has none.

  Outliers (`from_points(outlier=)`): a timed round is one fastest-of measurement, and a lucky or
  unlucky one moves the choice of G as much as a real price difference does. At each row count
  with at least four rounds at G >= 1 timed, they get a robust line in G (Theil-Sen: the median
  of the pairwise slopes, then the median intercept), and a round further than `outlier` from it
  (in log ratio) is taken as a timing outlier and priced by the line instead. The others keep
  their measurement, so a real bend in G that the line does not follow survives unless it is
  larger than `outlier`. With three drafted rounds the Theil-Sen line is the one through the two
  ends whatever the middle does, so an end could never be caught and a good middle could be
  replaced: nothing is replaced there. G = 0 (an AR step or the fixed loop's G = 0 round, a
  different program) is always kept as timed."""

  rows: tuple[int, ...]  # ascending
  G: tuple[int, ...]  # ascending, from 0
  log_ratio: tuple[tuple[float, ...], ...]  # [rows][G]
  # [rows]: AR steps', where the G = 0 column is a fixed loop's round whose draft takes in the
  # emitted token (a G per stage with `Grid.stage`); a plain G = 0 reads this instead
  plain: tuple[float, ...] = ()
  # (rows, G) of timed rounds priced by their row count's robust line instead (`outlier`), and
  # the measured log ratios they replaced
  replaced: tuple[tuple[int, int, float], ...] = ()

  @classmethod
  def from_points(
    cls, points: list[dict], n_layers: int, *, every: str = "round", outlier: float = 0.0
  ) -> Correction | None:
    """From a calibration record's points (each with its `predicted` seconds): for a G chosen
    every round, the adaptive loop's own rounds at every G when it timed them (`Grid.adaptive`),
    else (and for a G chosen per stage, `every` = "stage", which runs the fixed loop) AR steps
    (G = 0) and the fixed loop's SD rounds. For a G per stage the fixed loop's G = 0 round, where
    timed (`Grid.stage`), is the G = 0 column and the AR steps are kept apart (`plain`: a
    last G = 0 stage runs as they do); for a G per round a plain step is an AR step's price, so
    that round is left out. `outlier` > 0: a timed round at G >= 1 further than that from its
    row count's robust line in G is priced by the line (the class docstring; four or more
    drafted rounds); 0 keeps every measurement. None when no row count has G = 0 timed."""
    if every not in AUTO_EVERY:
      raise ValueError(f"every={every!r}: expected one of {AUTO_EVERY}")
    if not outlier >= 0.0:
      raise ValueError(f"outlier={outlier}: expected a log ratio >= 0 (0 = keep every timed round)")
    auto = every == "round" and any(p["model"] == "auto" for p in points)
    kinds = ("auto",) if auto else ("ar", "sd")
    timed, ar = {}, {}
    for p in points:
      if p["model"] in kinds and p.get("layers", n_layers) == n_layers:
        ratio = float(np.log(p["seconds"] / p["predicted"]))
        if p["model"] == "ar":
          ar[int(p["rows"])] = ratio
        elif p["model"] == "auto" or int(p["tokens"]) > 0 or every == "stage":
          timed[(int(p["rows"]), int(p["tokens"]))] = ratio
    staged_zero = any(G == 0 for _, G in timed) and not auto
    if not auto:
      for r, ratio in ar.items():
        timed.setdefault((r, 0), ratio)  # the AR step, where no fixed-loop G = 0 was timed
    Gs = sorted({G for _, G in timed})
    rows = sorted(r for r in {r for r, _ in timed} if all((r, G) in timed for G in Gs))
    if staged_zero:
      rows = [r for r in rows if r in ar]
    if not rows or 0 not in Gs:
      return None
    table, replaced = [], []
    for r in rows:
      measured = [timed[(r, G)] for G in Gs]
      line = list(measured)
      drafted = [i for i, G in enumerate(Gs) if G > 0]
      if outlier > 0.0 and len(drafted) >= 4:
        slope, icept = theil_sen([Gs[i] for i in drafted], [measured[i] for i in drafted])
        for i in drafted:
          fitted = icept + slope * Gs[i]
          if abs(measured[i] - fitted) > outlier:
            replaced.append((r, Gs[i], measured[i]))
            line[i] = fitted
      table.append(tuple(line))
    plain = tuple(ar[r] for r in rows) if staged_zero else ()
    return cls(tuple(rows), tuple(Gs), tuple(table), plain, tuple(replaced))

  def factor(self, rows: int, G: int, *, plain: bool = False) -> float:
    """measured / predicted at (rows, G): interpolated, held flat outside the timed points.
    `plain` at G = 0: an AR step's, where the G = 0 column is not (`plain` above)."""
    table = np.asarray(self.log_ratio, np.float64)
    at_G = [np.interp(G, self.G, t) for t in table] if len(self.G) > 1 else table[:, 0]
    if plain and G == 0 and self.plain:
      at_G = list(self.plain)
    if len(self.rows) == 1:
      return float(np.exp(at_G[0]))
    return float(np.exp(np.interp(np.log(rows), np.log(self.rows), at_G)))


def theil_sen(x, y) -> tuple[float, float]:
  """(slope, intercept) of the Theil-Sen line through (x, y): the median of the slopes between
  every pair of points with distinct x, then the median of y - slope * x (scipy's
  `theilslopes`, method "joint"). A minority of wild points moves it little, unlike least
  squares. All x equal: slope 0 through the median of y."""
  from scipy.stats import theilslopes

  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if np.all(x == x[0]):
    return 0.0, float(np.median(y))
  fit = theilslopes(y, x, method="joint")
  return float(fit.slope), float(fit.intercept)


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Predicted seconds of passes, AR steps and SD rounds for one policy, draft and machine, and
  (`correction`) the calibration's measured level of whole rounds, which `round_seconds_all` (what
  an adaptive round chooses G from) applies; every other prediction is the fitted model's alone."""

  machine: Machine
  pcfg: pol.PolicyConfig
  dcfg: object  # eagle3.DraftConfig | dflash.BlockDraftConfig | None (AR only)
  correction: Correction | None = None

  def policy_seconds(self, rows: int, tokens: int, capacity: int) -> float:
    return self.machine.seconds(policy_work(self.pcfg, rows, tokens, capacity))

  def draft_seconds(self, rows: int, tokens: int, capacity: int) -> float:
    return self.machine.seconds(draft_work(self.dcfg, rows, tokens, capacity), draft=True)

  def ar_step_seconds(self, rows: int, capacity: int) -> float:
    own = self.machine.round_overhead(rows, 1, self.pcfg.vocab_size, self.pcfg.n_layers)
    return self.policy_seconds(rows, 1, capacity) + own

  def round_seconds(self, rows: int, G: int, capacity: int, *, plain: bool = True) -> float:
    """A round at G. G = 0 under adaptive G is a plain step (`plain`); in a loop fixed at G = 0
    (plain=False, as the validation times it) EAGLE-3 still takes in the emitted token."""
    t = self.policy_seconds(rows, G + 1, capacity)
    t += self.machine.round_overhead(rows, G + 1, self.pcfg.vocab_size, self.pcfg.n_layers)
    if drafts.is_block(self.dcfg):
      return t + self.draft_seconds(rows, G + 1 if G else 0, capacity)
    if G == 0:  # a plain step: the draft does not run (decode.speculative._plain_step)
      return t if plain else t + self.draft_seconds(rows, 1, capacity)
    steps = self.draft_seconds(rows, 1, capacity) * (G - 1)
    return t + steps + self.draft_seconds(rows, G + 1, capacity)

  def round_seconds_all(
    self, rows: int, num_draft_max: int, capacity: int, *, plain: bool = True
  ) -> np.ndarray:
    """[M + 1]: a round's predicted seconds at G = 0..M (what an adaptive round chooses from),
    corrected by the calibration's timed rounds when the model carries a `correction`. `plain`:
    G = 0 is a plain step (per-round choice); False: a fixed loop's round at G = 0, where
    EAGLE-3 takes in the emitted token (a G chosen per stage)."""
    rs = [self.round_seconds(rows, G, capacity, plain=plain) for G in range(num_draft_max + 1)]
    if self.correction is not None:
      rs = [t * self.correction.factor(rows, G, plain=plain) for G, t in enumerate(rs)]
    return np.asarray(rs, np.float32)


class Acceptance(NamedTuple):
  """Pseudo counts (accepted, reached) [M] per drafted position that an adaptive round starts
  from: a fixed prior plus the rollouts' own counts, which `updated` folds in with geometric
  forgetting (so the estimate follows a draft and policy that change during training). The prior
  never decays: a position no recent round drafted keeps the prior's rate rather than falling to
  zero, which would stop the choice from ever drafting that deep again."""

  prior_accepted: np.ndarray
  prior_reached: np.ndarray
  seen_accepted: np.ndarray
  seen_reached: np.ndarray

  @classmethod
  def prior(cls, num_draft_max: int, rate: float = 0.6, weight: float = 4.0) -> Acceptance:
    """`weight` pseudo rounds at conditional acceptance `rate` at every position: optimistic
    enough that a fresh run drafts, weak enough that a few rounds overrule it."""
    reached = np.full((num_draft_max,), weight, np.float64)
    zero = np.zeros((num_draft_max,), np.float64)
    return cls(rate * reached, reached, zero, zero)

  @property
  def accepted(self) -> np.ndarray:
    return self.prior_accepted + self.seen_accepted

  @property
  def reached(self) -> np.ndarray:
    return self.prior_reached + self.seen_reached

  def updated(self, stats: dict, keep: float = 0.5) -> Acceptance:
    acc = np.asarray(stats["accept_counts"], np.float64)
    reach = np.asarray(stats["reach_counts"], np.float64)
    return self._replace(
      seen_accepted=keep * self.seen_accepted + acc, seen_reached=keep * self.seen_reached + reach
    )

  def rates(self) -> np.ndarray:
    return np.where(self.reached > 0, self.accepted / np.maximum(self.reached, 1e-9), 0.0)


@dataclasses.dataclass(frozen=True)
class StagePrices:
  """What the rollouts' own stages cost against the price their plan paid for them
  (decode.price_feedback): the plan of a G chosen per stage (`engine.stage_plan`) multiplies the
  corrected model's price of a round at (rows, G) by `factor(rows, G)`.

  Why: the calibration times rounds of random prompts with every row riding to the end; a
  rollout's rounds (real prompts, rows finishing, the cache at other lengths) can cost another
  amount, and unevenly across G, which is what the choice of G turns on. Every stage of a
  rollout ends at a host sync, so its wall time is known for free: each stage that ran rounds
  and compiled nothing adds (measured seconds, priced seconds, rounds) to its (rows, G, plain)
  entry, every entry's earlier evidence kept at weight `keep` per rollout. The factor is the
  pooled ratio measured / priced, shrunk toward 1 by `prior_rounds` pseudo rounds at the priced
  seconds of a round: a stage of a few rounds moves it a little, a long record a lot. Only the G
  a plan ran are observed: a G priced too cheaply is found out and dropped; one priced too
  dearly (or one slow stage) stays unplanned until its evidence fades toward the model's price
  or its neighbours' makes it the cheapest (greedy, no explicit exploration).
  `plain` separates a G = 0 stage run as plain steps (the draft left behind) from one whose
  draft takes in the emitted token. Host values only; hashable (the plan is memoised on it)."""

  prior_rounds: float = 4.0
  keep: float = 0.7
  # ((rows, G, plain), (measured seconds, priced seconds, rounds)) sorted by key
  table: tuple = ()

  def factor(self, rows: int, G: int, *, plain: bool = False) -> float:
    """measured / priced at (rows, G), shrunk toward 1; 1 where no stage was observed."""
    entry = dict(self.table).get((int(rows), int(G), bool(plain and G == 0)))
    if entry is None:
      return 1.0
    measured, priced, rounds = entry
    unit = priced / max(rounds, 1e-9)  # the priced seconds of one round
    pseudo = self.prior_rounds * unit
    return float((measured + pseudo) / (priced + pseudo))

  def factors(self, rows: int, num_draft_max: int, *, plain: bool = False) -> np.ndarray:
    """[M + 1] factors at G = 0..M (`plain`: G = 0 as plain steps)."""
    return np.asarray(
      [self.factor(rows, G, plain=plain) for G in range(num_draft_max + 1)], np.float64
    )

  def updated(self, records: list[dict]) -> StagePrices:
    """Folds in a rollout's stage records (`engine.generate(timings=)`): every entry's evidence
    is first kept at weight `keep` (one rollout older), then each stage's record with a price,
    at least one round and no compile adds its own (the prefill and the step downs, timed apart,
    are no stage's rounds). An entry no plan runs again so fades back toward the
    model's price, and the plan tries its G again once its neighbours look dearer (one slow
    stage does not bar a G for good)."""
    table = {k: tuple(self.keep * v for v in vals) for k, vals in self.table}
    for r in records:
      apart = r.get("prefill") or r.get("step_down")  # no stage's rounds
      if apart or r.get("priced") is None or r.get("compiled") or r.get("rounds", 0) < 1:
        continue
      key = (int(r["rows"]), int(r["G"]), bool(r.get("plain", False) and r["G"] == 0))
      old = table.get(key, (0.0, 0.0, 0.0))
      obs = (float(r["seconds"]), float(r["priced"]), float(r["rounds"]))
      table[key] = tuple(o + x for o, x in zip(old, obs))
    return dataclasses.replace(self, table=tuple(sorted(table.items())))

  def summary(self) -> dict:
    """{"rows:G[p]": factor} of every observed entry (p: a plain G = 0), for metrics.jsonl."""
    tag = lambda k: f"{k[0]}:{k[1]}" + ("p" if k[2] else "")  # noqa: E731
    return {tag(k): round(self.factor(k[0], k[1], plain=k[2]), 4) for k, _ in self.table}


def expected_tokens(rates_M, G: int) -> float:
  """E[a + 1] of a round at G: 1 + sum_{i <= G} prod_{j <= i} alpha_j."""
  return 1.0 + float(np.sum(np.cumprod(np.asarray(rates_M, np.float64)[:G])))


# ----------------------------------------------------------------------------- calibration


def time_policy_pass(params, pcfg, rows: int, tokens: int, capacity: int, *, min_s=0.05):
  """Seconds of one policy pass as it runs inside a decoding loop: a jitted loop of passes whose
  cache is carried (updated in place), its tokens fed back from the logits so nothing is hoisted."""
  cache = pol.init_cache(pcfg, rows, capacity)._replace(
    lengths=jnp.full((rows,), capacity - tokens - 1, jnp.int32)
  )

  def one(carry):
    cache, tok = carry
    logits, _, c2 = pol.decode(params, pcfg, cache, tok)
    nxt = jnp.argmax(logits, -1).astype(jnp.int32)
    return c2._replace(lengths=cache.lengths), nxt

  return _time_loop(one, (cache, jnp.zeros((rows, tokens), jnp.int32)), min_s)


def time_draft_pass(
  params, dparams, pcfg, dcfg, rows: int, tokens: int, capacity: int, *, min_s=0.05
):
  """Seconds of one draft pass (`draft_work`'s), timed like `time_policy_pass`."""
  E, n = pcfg.d_model, len(pcfg.taps)
  room = max(tokens, 1) + 1 + (dcfg.block_size if drafts.is_block(dcfg) else 0)
  start = jnp.full((rows,), capacity - room, jnp.int32)
  taps_NBTE = jnp.ones((n, rows, max(tokens, 1), E), jnp.float32) * 0.01
  if drafts.is_block(dcfg):
    cache = dflash.init_cache(dcfg, rows, capacity)._replace(lengths=start)

    def one(carry):
      cache, anchor = carry
      c2 = dflash.write_context(dparams, dcfg, cache, taps_NBTE, start, start + max(tokens, 1))
      if tokens:
        h = dflash.propose_hidden(dparams, dcfg, params["embed"], c2, anchor)
        anchor = jnp.argmax(h[:, 0], -1).astype(jnp.int32) % pcfg.vocab_size
      return c2._replace(lengths=start), anchor

    return _time_loop(one, (cache, jnp.zeros((rows,), jnp.int32)), min_s)
  cache = eagle3.init_cache(dcfg, rows, capacity)._replace(lengths=start)

  def one(carry):
    cache, tok = carry
    feats = eagle3.fuse(dparams, taps_NBTE, dcfg) if tokens > 1 else taps_NBTE[0]
    logits, _, c2 = eagle3.step(dparams, dcfg, params["embed"], cache, feats, tok)
    return c2._replace(lengths=start), jnp.argmax(logits, -1).astype(jnp.int32)

  return _time_loop(one, (cache, jnp.zeros((rows, tokens), jnp.int32)), min_s)


def _time_loop(one, carry, min_s: float, repeats: int = 5) -> float:
  """Seconds per iteration of `one` in a jitted fori_loop: compiled once, then timed with enough
  iterations to last `min_s`, `repeats` times, the fastest kept (on a shared CPU other work only
  ever adds time, so the minimum is the least noisy estimate of the pass itself)."""
  loop = jax.jit(lambda c, n: jax.lax.fori_loop(0, n, lambda i, c: one(c), c))
  jax.block_until_ready(loop(carry, 1))
  n, t = 1, 0.0
  while True:
    t0 = time.perf_counter()
    jax.block_until_ready(loop(carry, n))
    t = time.perf_counter() - t0
    if t >= min_s or n >= 4096:
      break
    n *= max(2, int(min_s / max(t, 1e-6)))
  ts = [t / n]
  for _ in range(repeats - 1):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(carry, n))
    ts.append((time.perf_counter() - t0) / n)
  return float(np.min(ts))


@dataclasses.dataclass(frozen=True)
class Grid:
  """The calibration points: both models' passes at every (rows, tokens), whole AR steps and SD
  rounds at every (round_rows, round_G); `capacity` is the cache's, `new_tokens` a timed
  generation's length."""

  rows: tuple[int, ...] = (1, 4, 16, 64, 128)
  tokens: tuple[int, ...] = (1, 3, 6)
  round_rows: tuple[int, ...] = (1, 4, 16, 64, 128)
  round_G: tuple[int, ...] = (2, 5)
  capacity: int = 128
  prompt_len: int = 9
  # also time policy passes and AR steps of the policy's first half of its layers: with one depth,
  # fixed seconds per pass and per layer cannot be told apart (nor a round's per-layer cost),
  # and a policy of another depth would be predicted from an arbitrary split
  shallow: bool = True
  # also time the adaptive loop's own rounds, its choice forced to each G = 0..max(round_G) in
  # turn, at every round_rows (full depth; one compile per row count, the choice being an
  # argument): what an adaptive round costs at G, which `Correction` prices the choice by. Not
  # fitted on (a plain step and the adaptive loop's branches are not the fixed loop's rounds).
  adaptive: bool = False
  # also time the fixed loop at every G = 0..max(round_G) (full depth), buffers sized by the
  # largest G, as a stage of G chosen per stage runs it (decode.auto_every = stage): the rounds
  # its plan prices, G = 0 included (EAGLE-3 taking in the emitted token, a draft pass an AR step
  # does not have); the stage plan compares adjacent G, so none of them is interpolated
  stage: bool = False

  def full_depth_G(self, has_draft: bool = True) -> tuple[int, ...]:
    """The G at which the fixed loop's rounds are timed at full depth (`time_rounds`)."""
    if self.stage and has_draft and self.round_G:
      return tuple(range(max(self.round_G) + 1))
    return tuple(self.round_G)


def shallow_policy(params, pcfg: pol.PolicyConfig, layers: int, n_taps: int | None = None):
  """(params, config) of the policy's first `layers` layers, its embedding, norm and head kept
  (a second depth to calibrate on; its outputs mean nothing). With `n_taps` (a draft's), it taps
  that many distinct layers spread over its depth, so the draft runs on it as on the policy
  (None when it is shallower than that)."""
  cut = dict(params)
  cut["layers"] = jax.tree.map(lambda x: x[:layers], params["layers"])
  taps = None
  if n_taps is not None:
    if layers < n_taps:
      return None
    taps = tuple(int(t) for t in np.linspace(0, layers - 1, n_taps).round())
  return cut, dataclasses.replace(pcfg, n_layers=layers, tap_layers=taps)


def measure(params, dparams, pcfg, dcfg, grid: Grid, *, min_s: float = 0.05) -> list[dict]:
  """Timed passes and rounds at every grid point: [{model, rows, tokens, capacity, seconds}]
  (model: policy | draft | ar | sd; for ar and sd, tokens is G), and with `grid.shallow` policy
  passes and AR steps of a shallower policy (their points carry its `layers`)."""
  out = []
  for rows in grid.rows:
    for tokens in grid.tokens:
      s = time_policy_pass(params, pcfg, rows, tokens, grid.capacity, min_s=min_s)
      out.append(dict(model="policy", rows=rows, tokens=tokens, capacity=grid.capacity, seconds=s))
      s = time_draft_pass(params, dparams, pcfg, dcfg, rows, tokens, grid.capacity, min_s=min_s)
      out.append(dict(model="draft", rows=rows, tokens=tokens, capacity=grid.capacity, seconds=s))
  new_tokens = grid.capacity - grid.prompt_len - max(grid.round_G, default=0) - 2
  out += time_rounds(
    params,
    dparams,
    pcfg,
    dcfg,
    rows=grid.round_rows,
    num_drafts=grid.full_depth_G(dcfg is not None),
    prompt_len=grid.prompt_len,
    new_tokens=new_tokens,
    repeats=3,
    stage=grid.stage,
  )
  if grid.adaptive and dcfg is not None and grid.round_G:
    out += time_adaptive_rounds(
      params, dparams, pcfg, dcfg, rows=grid.round_rows, num_draft=max(grid.round_G),
      prompt_len=grid.prompt_len, new_tokens=new_tokens, repeats=3,
    )  # fmt: skip
  depth = max(1, pcfg.n_layers // 2)
  if grid.shallow and depth < pcfg.n_layers:
    sparams, scfg = shallow_policy(params, pcfg, depth)
    for rows in grid.rows:
      for tokens in grid.tokens:
        s = time_policy_pass(sparams, scfg, rows, tokens, grid.capacity, min_s=min_s)
        out.append(
          dict(
            model="policy", rows=rows, tokens=tokens, capacity=grid.capacity, seconds=s,
            layers=depth,
          )
        )  # fmt: skip
    # AR steps and SD rounds of the shallower policy with the same draft (tapping as many layers
    # of it): with rounds timed at one depth only, what a round costs per policy layer and what
    # it costs per drafted token (the rows' distributions, verification) cannot be told apart
    shallow = shallow_policy(params, pcfg, depth, n_taps=len(pcfg.taps) if dcfg else None)
    sd = shallow is not None and dcfg is not None
    sparams, scfg = shallow if sd else (sparams, scfg)
    rounds = time_rounds(
      sparams, dparams if sd else None, scfg, dcfg if sd else None, rows=grid.round_rows,
      num_drafts=grid.round_G if sd else (), prompt_len=grid.prompt_len,
      new_tokens=new_tokens, repeats=3,
    )  # fmt: skip
    out += [dict(p, layers=depth) for p in rounds]
  return out


def time_rounds(
  params, dparams, pcfg, dcfg, *, rows, num_drafts, prompt_len, new_tokens, repeats, stage=False
):
  """Seconds of an AR step and of an SD round at each G in `num_drafts`, at each row count, as the
  decoding loop runs them: a stage's seconds over its rounds (the stop token disabled, so every
  row rides in every pass to the end). G = 0 (and every G with `stage`): the fixed loop's round
  at that G with buffers sized by the largest G, as a stage of G chosen per stage runs it
  (`speculative.Spec.stage_G`).
  [{model: ar | sd, rows, tokens: G, capacity, seconds}]"""
  from specdraft.decode import autoregressive, engine, speculative
  from specdraft.decode.rejection import rejection_sample
  from specdraft.decode.sampling import Sampling

  pcfg = dataclasses.replace(pcfg, eos_id=-1, stop_ids=())
  sm = Sampling(1.0, 0, 1.0)
  out = []
  for b in rows:
    prompts, lengths, key = _timing_prompts(pcfg, b, prompt_len)
    spec = autoregressive.Spec(pcfg, new_tokens, sm)
    stages = [
      (
        dict(model="ar", rows=b, tokens=0, capacity=prompt_len + new_tokens),
        lambda spec=spec: engine.init_jit(params, None, prompts, lengths, key, spec=spec),
        lambda c, spec=spec: engine.run_jit(
          params, None, c, None, jnp.int32(0), spec=spec, sampler=None
        ),
      )
    ]
    M = max(num_drafts, default=0)
    for G in num_drafts:
      if M == 0:
        raise ValueError("num_drafts=(0,): a fixed loop's G = 0 round needs a G > 0 to size it")
      sized = M if stage or G == 0 else G
      spec = speculative.Spec(
        pcfg, dcfg, new_tokens, sized, False, sm, stage_G=G if sized != G or G == 0 else -1
      )
      choice = speculative.Choice.of(spec, None, None)
      stages.append(
        (
          dict(model="sd", rows=b, tokens=G, capacity=prompt_len + new_tokens + spec.num_draft + 2),
          lambda spec=spec: engine.init_jit(params, dparams, prompts, lengths, key, spec=spec),
          lambda c, spec=spec, choice=choice: engine.run_jit(
            params, dparams, c, choice, jnp.int32(0), spec=spec, sampler=rejection_sample
          ),
        )
      )
    seconds = _time_stages([(init, stage) for _, init, stage in stages], repeats)
    out += [dict(point, seconds=s) for (point, _, _), s in zip(stages, seconds)]
    # every stage here is its own compile: hundreds of executables held at once exhausted the
    # process's memory mappings on this CPU (an LLVM allocation abort), so they go per row count
    jax.clear_caches()
  return out


def _timing_prompts(pcfg, rows: int, prompt_len: int):
  """(prompts, lengths, key) a timed stage decodes from: random tokens after BOS, every row the
  full `prompt_len`, seeded by the row count."""
  rng = np.random.default_rng(rows)
  prompts = rng.integers(3, pcfg.vocab_size, (rows, prompt_len)).astype(np.int32)
  prompts[:, 0] = 1
  lengths = jnp.full((rows,), prompt_len, jnp.int32)
  return jnp.asarray(prompts), lengths, jax.random.key(rows)


def forced_choice(spec, G: int):
  """An adaptive loop's choice that always picks G: every other G's round "costs" a billion
  seconds (the expected tokens of a round are between 1 and G_max + 1)."""
  from specdraft.decode import speculative

  forced = np.full((spec.num_draft + 1,), 1e9, np.float32)
  forced[G] = 1.0
  return speculative.Choice.of(spec, forced, Acceptance.prior(spec.num_draft))


def time_adaptive_rounds(
  params, dparams, pcfg, dcfg, *, rows, num_draft, prompt_len, new_tokens, repeats
):
  """Seconds of a round of the adaptive loop (G_max = `num_draft`) with its choice forced to each
  G = 0..G_max, at each row count: the rounds `decode.num_draft=auto` runs (the choice, the switch
  between round kinds, plain steps at G = 0; no catch-up, G never changing in a stage).
  [{model: auto, rows, tokens: G, capacity, seconds}]"""
  from specdraft.decode import engine, speculative
  from specdraft.decode.rejection import rejection_sample
  from specdraft.decode.sampling import Sampling

  pcfg = dataclasses.replace(pcfg, eos_id=-1, stop_ids=())
  spec = speculative.Spec(pcfg, dcfg, new_tokens, num_draft, True, Sampling(1.0, 0, 1.0))
  capacity = prompt_len + new_tokens + num_draft + 2
  out = []
  for b in rows:
    prompts, lengths, key = _timing_prompts(pcfg, b, prompt_len)
    init = lambda: engine.init_jit(params, dparams, prompts, lengths, key, spec=spec)
    stages = []
    for G in range(num_draft + 1):
      choice = forced_choice(spec, G)
      stage = lambda c, choice=choice: engine.run_jit(
        params, dparams, c, choice, jnp.int32(0), spec=spec, sampler=rejection_sample
      )
      stages.append((init, stage))
    seconds = _time_stages(stages, repeats)
    out += [
      dict(model="auto", rows=b, tokens=G, capacity=capacity, seconds=s)
      for G, s in enumerate(seconds)
    ]
    jax.clear_caches()
  return out


def _time_stages(stages, repeats: int, min_s: float = 0.2) -> list[float]:
  """Seconds per round of each (init, stage) pair, a stage run from its init's carry (each compiled
  and warmed first). The pairs are timed in turn, `repeats` times round the list and on until
  each has run for `min_s` in all, and each keeps its fastest run, as `_time_loop`: a burst of
  other work on a shared CPU lasts longer than one short stage, so repeats taken back to back
  can all fall inside it (the same stage timed twice so differed by up to 1.9x here); spread
  over the list's whole timing, they rarely do."""
  for init, stage in stages:
    jax.block_until_ready(stage(jax.block_until_ready(init())))
  best = [np.inf] * len(stages)
  spent = [0.0] * len(stages)
  done = 0
  while done < repeats or min(spent) < min_s:
    for i, (init, stage) in enumerate(stages):
      carry = jax.block_until_ready(init())
      t0 = time.perf_counter()
      out = jax.block_until_ready(stage(carry))
      dt = time.perf_counter() - t0
      st = out["stats"]
      rounds = int(st["rounds"]) if "rounds" in st else int(st["policy_passes"]) - 1
      best[i] = min(best[i], dt / max(rounds, 1))
      spent[i] += dt
    done += 1
    if done >= 50 * max(repeats, 1):
      break
  return [float(b) for b in best]


def predict(model: CostModel, point: dict) -> float:
  """The model's seconds for a measured point of `measure` / `time_rounds`."""
  m, b, t, cap = point["model"], point["rows"], point["tokens"], point["capacity"]
  if point.get("layers", model.pcfg.n_layers) != model.pcfg.n_layers:  # a shallower policy
    pcfg = dataclasses.replace(model.pcfg, n_layers=point["layers"], tap_layers=None)
    model = dataclasses.replace(model, pcfg=pcfg)
  if m == "policy":
    return model.policy_seconds(b, t, cap)
  if m == "draft":
    return model.draft_seconds(b, t, cap)
  if m == "ar":
    return model.ar_step_seconds(b, cap)
  if m == "auto":  # the adaptive loop's round at a forced G (G = 0: a plain step)
    return model.round_seconds(b, t, cap)
  return model.round_seconds(b, t, cap, plain=False)  # timed in a loop at fixed G


def predict_corrected(model: CostModel, point: dict) -> float:
  """`predict` times the model's correction for a full-depth AR step or SD round (what an
  adaptive round's choice sees); other points are the fitted model's alone."""
  t = predict(model, point)
  c, m = model.correction, point["model"]
  if (
    c is None
    or m not in ("ar", "sd", "auto")
    or point.get("layers", model.pcfg.n_layers) != model.pcfg.n_layers
  ):
    return t
  return t * c.factor(point["rows"], 0 if m == "ar" else point["tokens"], plain=m == "ar")


def fit(points: list[dict], pcfg, dcfg) -> Machine:
  """The machine coefficients minimising the squared log error over the timed points (relative
  error counts alike at 1 and at 128 rows); both combinations of compute and memory time (max
  and sum), several starts each, the best kept."""
  from scipy.optimize import least_squares

  points = [p for p in points if p["model"] != "auto"]  # the correction's, not the fit's
  t = np.log(np.asarray([p["seconds"] for p in points]))

  def resid(x, overlap):
    model = CostModel(Machine(*np.exp(x), overlap=overlap), pcfg, dcfg)
    return np.log([predict(model, p) for p in points]) - t

  best, best_overlap = None, True
  t_min = float(np.exp(t.min()))
  for overlap in (True, False):
    resid_o = lambda x, overlap=overlap: resid(x, overlap)  # noqa: E731
    for rate in (1e9, 1e10, 1e11):
      for share in (0.1, 0.5):
        fixed = [t_min * share, t_min * share / 10]
        x0 = fixed + [rate, rate, t_min * share, rate / 10, rate] + fixed + fixed[1:]
        x0 = np.log(x0 + [32.0, 1.0])  # threads: rate doubles around 32 token rows
        r = least_squares(resid_o, x0, method="trf")
        if best is None or r.cost < best.cost:
          best, best_overlap = r, overlap
  return Machine(*(float(v) for v in np.exp(best.x)), overlap=best_overlap)


# The model's form: a calibration cached under another form is not read back.
FORM = (
  "kv_rate, policy KV once per layer, draft fixed costs, two depths, shallow SD rounds, "
  "threads term, max or sum"
)


def cache_key(pcfg, dcfg, grid: Grid) -> str:
  """What a calibration depends on: the model's form, both configs, the grid, the backend and
  device kind, JAX."""
  d = jax.devices()[0]
  desc = json.dumps(
    [
      FORM,
      repr(pcfg),
      repr(dcfg),
      repr(grid),
      d.platform,
      d.device_kind,
      jax.__version__,
      os.cpu_count(),
    ]
  )
  return hashlib.sha1(desc.encode()).hexdigest()[:16]


def calibrate(
  params,
  dparams,
  pcfg,
  dcfg,
  *,
  grid: Grid = Grid(),
  cache_dir: str | None = None,
  min_s: float = 0.05,
  correct: bool = False,
  every: str = "round",
  outlier: float = 0.0,
) -> tuple[CostModel, dict]:
  """(CostModel, record): the coefficients fitted from timed passes at `grid`, read from
  `cache_dir/<key>.json` when an earlier calibration of the same configs on the same backend
  wrote it. The record holds the points, the coefficients and each point's relative error.
  `correct`: the model carries the `Correction` of its timed rounds (`decode.cost_correction`)
  of the loop a G chosen `every` round or stage runs (`decode.auto_every`), timed rounds further
  than `outlier` from their row count's robust line priced by the line (`decode.cost_outlier`)."""

  def model_of(record):
    model = CostModel(Machine(**record["machine"]), pcfg, dcfg)
    if correct:
      fix = Correction.from_points(record["points"], pcfg.n_layers, every=every, outlier=outlier)
      model = dataclasses.replace(model, correction=fix)
    return model

  path = None
  if cache_dir:
    path = os.path.join(cache_dir, f"cost_{cache_key(pcfg, dcfg, grid)}.json")
    if os.path.exists(path):
      with open(path) as f:
        record = json.load(f)
      return model_of(record), record
  t0 = time.perf_counter()
  points = measure(params, dparams, pcfg, dcfg, grid, min_s=min_s)
  machine = fit(points, pcfg, dcfg)
  model = CostModel(machine, pcfg, dcfg)
  for p in points:
    p["predicted"] = predict(model, p)
    p["rel_error"] = p["predicted"] / p["seconds"] - 1.0
  record = {
    "machine": dataclasses.asdict(machine),
    "grid": dataclasses.asdict(grid),
    "points": points,
    "calibration_s": time.perf_counter() - t0,
    "backend": jax.devices()[0].platform,
    "device_kind": jax.devices()[0].device_kind,
  }
  if path:
    os.makedirs(cache_dir, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      json.dump(record, f, indent=1)
    os.replace(tmp, path)
  return model_of(record), record
