"""Rollouts that stop paying for finished rows: compaction into power-of-two buckets, and the
speculation length chosen per round from a cost model.

A batch decodes in stages. A stage is one compiled loop at a fixed number of rows (the bucket):
it runs rounds until no more than the next smaller bucket's rows still generate, then the active
rows (tokens, both KV caches, lengths, PRNG keys, the draft's carried state) are gathered into the
smaller bucket and the next stage continues. Buckets are powers of two below the batch (the batch
itself first), one compile each. Every row draws from its own key, so compaction changes no row's
output: greedy token for token, sampled the same tokens for the same keys.

With a cost model (`decode.cost.CostModel`) and `adaptive`, every round picks its G in 0..G_max
from the predicted seconds of a round at this stage's bucket and the running acceptance
(`speculative.choose_num_draft`). With `per_stage` too (decode.auto_every = stage), the host picks
one G per stage instead, from the same prices and the acceptance carried in (the prior, not this
rollout's own counts), before the rollout starts, and each stage runs the loop of a fixed G (the
cheaper program: no choice, no switch between round kinds, no pending plain steps); the prices it
plans with can carry what earlier rollouts' stages cost (`decode.cost.StagePrices`), each stage's
wall time being measured at the host sync that ends it (`timings`). `num_draft = 0` decodes
autoregressively (no draft).
"""

from __future__ import annotations

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from specdraft.decode import autoregressive, speculative
from specdraft.decode.cost import Acceptance, CostModel, StagePrices
from specdraft.decode.rejection import rejection_sample
from specdraft.decode.sampling import Generation, Sampling
from specdraft.model import policy as pol
from specdraft.parallel import multihost


class Rows(NamedTuple):
  """Where decoding rows live on a mesh: row arrays are sharded over `spec` (a PartitionSpec entry:
  an axis name, a tuple of them or None); the smallest bucket holds `min_rows` rows (one per
  shard)."""

  mesh: object
  spec: object

  @property
  def min_rows(self) -> int:
    axes = self.spec if isinstance(self.spec, tuple) else (self.spec,) if self.spec else ()
    return int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1


def buckets(batch: int, min_rows: int = 1) -> list[int]:
  """The batch, then every power of two below it down to `min_rows`."""
  out, b = [batch], 1 << max(batch - 1, 0).bit_length()
  while b // 2 >= min_rows and b // 2 < out[-1]:
    b //= 2
    out.append(b)
  return out


def generate(
  params,
  dparams,
  pcfg: pol.PolicyConfig,
  dcfg,
  prompt_BS,
  prompt_lengths_B,
  key,
  *,
  max_new_tokens: int,
  temperature: float,
  num_draft: int,
  top_k: int = 0,
  top_p: float = 1.0,
  adaptive: bool = False,
  cost: CostModel | None = None,
  prior: Acceptance | None = None,
  compact: bool = True,
  min_rows: int = 1,
  window: int = 8,
  every_stage: bool = False,
  rows: Rows | None = None,
  sampler=rejection_sample,
  per_stage: bool = False,
  prices: StagePrices | None = None,
  timings: list | None = None,
) -> Generation:
  """SD (`num_draft` >= 1: G, or G_max when `adaptive`) or AR (`num_draft` = 0) generation of the
  same output as `speculative.generate` / `autoregressive.generate`, with finished rows compacted
  away (`compact`; the smallest bucket holds `min_rows` rows, or one per shard of `rows`). Runs on
  the host: one compiled stage per bucket, each a device loop. `window`: with `adaptive`, the
  most recent plain steps (G = 0) an EAGLE-3 draft takes in when drafting resumes
  (`speculative.Spec.window`). `every_stage`: run every bucket's stage even once all rows have
  finished (a finished stage runs no round), and the end of a rollout from every bucket, so that
  one call compiles every stage and every ending a later call with other keys may reach
  (benchmarks warm up with it; nothing timed then compiles).
  `per_stage` (with `adaptive`): G chosen once per stage on the host (`stage_plan`), each stage a
  fixed-G loop; the stages a call runs are a function of the batch, the cost model, `prior` and
  `prices` alone, so a warm-up call compiles every stage a timed call with other keys runs.
  `prices` (with `per_stage`): what earlier rollouts' stages cost against their price, scaling
  the plan's prices (`decode.cost.StagePrices`). `timings`: a list to which the call appends
  a record of its prefill (`prefill` True, no rounds; timed apart: a timed call prefills in a
  program of its own, then runs the first stage from it) and of each stage it runs, {rows, G,
  plain, rounds, seconds, compiled, priced, prefill}: its wall time from the host sync before it
  to the one ending it (one more sync, after the last stage), its rounds, whether the call
  compiled its program, and with `per_stage` the seconds its plan priced its rounds at; G is None
  for rounds of G chosen per round. Before each stage after the first, a record of the step down
  into its bucket (`step_down` True, no rounds, no price: writing the finished rows back and
  gathering the active ones, timed apart in a program of its own so that a stage of one or two
  rounds is not charged for it). Ignored with `every_stage`."""
  B = int(prompt_BS.shape[0])
  O = max_new_tokens
  sm = Sampling(temperature, top_k, top_p)
  staged, capacity = False, None
  if num_draft == 0:
    spec = autoregressive.Spec(pcfg, O, sm)
    choice_at = lambda b: None
  else:
    if adaptive and cost is None:
      raise ValueError("adaptive speculation needs a cost model (decode.cost.calibrate)")
    if window < 1:
      raise ValueError(f"window={window}: the draft's catch-up window must be >= 1 entries")
    staged = adaptive and per_stage
    spec = speculative.Spec(pcfg, dcfg, O, num_draft, adaptive and not staged, sm, window)
    prior = prior if prior is not None else Acceptance.prior(num_draft)
    capacity = int(prompt_BS.shape[1]) + O + num_draft + 2

    def choice_at(b):
      rs = cost.round_seconds_all(b, num_draft, capacity) if spec.adaptive else None
      return speculative.Choice.of(spec, rs, prior, xp=np)  # host arrays: no eager dispatch

  sizes = buckets(B, max(min_rows, rows.min_rows if rows else 1)) if compact else [B]
  spec_at = lambda b: spec
  plan, plain = None, set()
  if num_draft and staged:
    plan = stage_plan(cost, prior, sizes, spec, capacity, prices)
    plain = plain_stages(plan)
    spec_at = lambda b: spec._replace(stage_G=plan[b], stage_plain=b in plain)
  timings = None if every_stage else timings  # a warm-up's stages are not rollouts' stages
  clock = _StageClock(timings, sizes, plan, plain, num_draft, spec, cost, capacity)
  stop = lambda i: jnp.int32(sizes[i + 1] if i + 1 < len(sizes) else 0)
  if clock.on:  # the prefill on its own (timed apart: it is no stage's rounds), then stage one
    jax.block_until_ready((params, dparams, prompt_BS, prompt_lengths_B))
    carry = clock.call(init_jit, params, dparams, prompt_BS, prompt_lengths_B, key, spec=spec)
    clock.prefill_ended(carry, B)
    args = (params, dparams, carry, choice_at(B), stop(0))
    carry, out = clock.call(_first_stage, *args, spec=spec_at(B), sampler=sampler)
  else:
    args = (params, dparams, prompt_BS, prompt_lengths_B, key, choice_at(B), stop(0))
    carry, out = _start(*args, spec=spec_at(B), sampler=sampler)
  slots = jnp.arange(B)
  for i in range(1, len(sizes)):
    done = multihost.to_host(carry["done"])  # the one host sync of a stage
    clock.stage_ended(carry, i - 1)
    if every_stage:  # a later call whose rows all finish in this stage ends from this bucket
      _end(carry, out, slots, spec=spec)
    elif done.all():
      break
    keep = jnp.asarray(np.argsort(done, kind="stable")[: sizes[i]])  # active rows first
    if clock.on:  # the step down on its own (timed apart: it is no stage's rounds), then the stage
      carry, out, slots = clock.call(_step_down, carry, out, slots, keep, spec=spec, rows=rows)
      clock.step_down_ended((carry, out), sizes[i])
      run_args = (params, dparams, carry, choice_at(sizes[i]), stop(i))
      carry = clock.call(run_jit, *run_args, spec=spec_at(sizes[i]), sampler=sampler)
      continue
    carry, out, slots = _next_stage(
      params, dparams, carry, out, slots, keep, choice_at(sizes[i]), stop(i),
      spec=spec_at(sizes[i]), sampler=sampler, rows=rows,
    )  # fmt: skip
  else:  # the last stage's end (its counters read back: one more sync, only when timed)
    clock.stage_ended(carry, len(sizes) - 1)
  return _end(carry, out, slots, spec=spec)


class _StageClock:
  """`generate`'s stage timings (a no-op without a `timings` list): the prefill's wall time, then
  each step down between stages and each stage from the host sync before it to the one that
  ends it, a stage's rounds (from the carried counters), whether its call compiled, and its
  planned price. Every record has the same keys (`prefill`, `step_down`: which kind it is)."""

  def __init__(self, timings, sizes, plan, plain, num_draft, spec, cost, capacity):
    self.on = timings is not None
    self.records, self.sizes, self.plan, self.plain = timings, sizes, plan, plain
    self.num_draft, self.spec, self.cost = num_draft, spec, cost
    self.capacity, self.rounds, self.compiled, self.t0 = capacity, 0, False, None

  def call(self, fn, *args, **kw):
    before = fn._cache_size()
    self.t0 = time.perf_counter() if self.t0 is None else self.t0
    out = fn(*args, **kw)
    self.compiled = fn._cache_size() > before  # compiled in this call: its time is not a stage's
    return out

  def _apart(self, carry, rows: int, **kind) -> None:
    """The record of a program timed apart from the stages' rounds (the prefill, a step down)."""
    jax.block_until_ready(carry)
    now = time.perf_counter()
    rec = dict(
      rows=rows, G=None, plain=False, rounds=0, seconds=now - self.t0, compiled=self.compiled,
      priced=None, prefill=False, step_down=False,
    )  # fmt: skip
    self.records.append(dict(rec, **kind))
    self.t0 = now

  def prefill_ended(self, carry, rows: int) -> None:
    self._apart(carry, rows, prefill=True)

  def step_down_ended(self, carry, rows: int) -> None:
    self._apart(carry, rows, step_down=True)

  def stage_ended(self, carry, i: int) -> None:
    if not self.on:
      return
    st = carry["stats"]
    total = int(multihost.to_host(st["rounds"] if "rounds" in st else st["policy_passes"] - 1))
    now, b = time.perf_counter(), self.sizes[i]
    adaptive = bool(getattr(self.spec, "adaptive", False))  # G chosen per round: no one G
    G = self.plan[b] if self.plan is not None else None if adaptive else self.num_draft
    rec = dict(
      rows=b, G=G, plain=b in self.plain, rounds=total - self.rounds, seconds=now - self.t0,
      compiled=self.compiled, priced=None, prefill=False, step_down=False,
    )  # fmt: skip
    if self.plan is not None:  # the model's price, before any earlier stages' factor
      drafts_later = any(g > 0 for s, g in self.plan.items() if s < b)
      rs = self.cost.round_seconds_all(b, self.num_draft, self.capacity, plain=not drafts_later)
      rec["priced"] = rec["rounds"] * float(rs[G])
    self.records.append(rec)
    self.rounds, self.t0 = total, now


def stage_plan(
  cost: CostModel,
  prior: Acceptance,
  sizes,
  spec: speculative.Spec,
  capacity: int,
  prices: StagePrices | None = None,
) -> dict[int, int]:
  """{bucket rows: G} of a rollout whose G is chosen per stage (decode.auto_every = stage): at
  each bucket the G in 0..num_draft with the most expected tokens per second, from the cost
  model's price of a fixed loop's round at that many rows and the acceptance carried in
  (`speculative.choose_num_draft` on no counts of this rollout). G = 0 is priced as it runs: a
  policy step whose emitted token the draft takes in, so that it drafts in step at a later
  stage, or, where no smaller bucket drafts (planned from the smallest up), a plain step
  (`plain_stages`: the draft left behind). `prices`: each round's price scaled by what earlier
  rollouts' stages at that (rows, G) cost against it (`decode.cost.StagePrices`). Remembered per
  (cost model, prior, buckets, prices): a rollout of a millisecond-scale batch pays nothing for
  it."""
  if cost is None:
    raise ValueError("adaptive speculation needs a cost model (decode.cost.calibrate)")
  counts = tuple(tuple(np.asarray(x, np.float64).tolist()) for x in prior)
  spec = spec._replace(adaptive=True)
  return dict(_stage_plan(cost, counts, tuple(sizes), spec, capacity, prices))


@functools.lru_cache(maxsize=256)
def _stage_plan(
  cost: CostModel, counts: tuple, sizes: tuple, spec, capacity: int, prices=None
) -> tuple:
  arrays = tuple(np.asarray(x) for x in counts)
  prior = Acceptance(*arrays) if len(arrays) == len(Acceptance._fields) else arrays
  no_counts = {k: np.zeros((spec.num_draft,), np.int32) for k in ("accept_counts", "reach_counts")}
  plan, drafts_later = [], False
  for b in sorted(sizes):  # the smallest first: whether a later stage drafts decides G = 0's price
    rs = cost.round_seconds_all(b, spec.num_draft, capacity, plain=not drafts_later)
    if prices is not None:
      rs = rs * prices.factors(b, spec.num_draft, plain=not drafts_later).astype(rs.dtype)
    choice = speculative.Choice.of(spec, rs, prior, xp=np)  # on the host: numpy, no dispatch
    G = int(speculative.choose_num_draft(no_counts, choice, xp=np))
    plan.append((b, G))
    drafts_later = drafts_later or G > 0
  return tuple(sorted(plan, reverse=True))


def plain_stages(plan: dict[int, int]) -> set[int]:
  """The buckets of a stage plan at G = 0 after which no stage drafts: they run as plain steps
  (`speculative.Spec.stage_plain`), the draft no longer taking in the emitted tokens."""
  return {b for b in plan if all(G == 0 for s, G in plan.items() if s <= b)}


def _init(params, dparams, prompt_BS, prompt_lengths_B, key, *, spec):
  if isinstance(spec, autoregressive.Spec):
    return autoregressive.init(params, prompt_BS, prompt_lengths_B, key, spec=spec)
  return speculative.init(params, dparams, prompt_BS, prompt_lengths_B, key, spec=spec)


def _run(params, dparams, carry, choice, stop_below, *, spec, sampler):
  if isinstance(spec, autoregressive.Spec):
    return autoregressive.run(params, carry, stop_below, spec=spec)
  return speculative.run(params, dparams, carry, choice, stop_below, spec=spec, sampler=sampler)


def _finish(carry, *, spec) -> Generation:
  if isinstance(spec, autoregressive.Spec):
    return autoregressive.finish(carry, spec)
  return speculative.finish(carry, spec)


@functools.partial(jax.jit, static_argnames=("spec", "sampler"))
def _start(params, dparams, prompt_BS, prompt_lengths_B, key, choice, stop_below, *, spec, sampler):
  """Prefill and the first stage at the whole batch: (carry, the batch's output so far)."""
  carry = _init(params, dparams, prompt_BS, prompt_lengths_B, key, spec=spec)
  carry = _run(params, dparams, carry, choice, stop_below, spec=spec, sampler=sampler)
  return carry, _finish(carry, spec=spec)._replace(stats=None)


@functools.partial(jax.jit, static_argnames=("spec", "sampler"))
def _first_stage(params, dparams, carry, choice, stop_below, *, spec, sampler):
  """`_start`'s first stage from a prefilled carry (a timed rollout prefills apart)."""
  carry = _run(params, dparams, carry, choice, stop_below, spec=spec, sampler=sampler)
  return carry, _finish(carry, spec=spec)._replace(stats=None)


@functools.partial(jax.jit, static_argnames=("spec", "sampler", "rows"))
def _next_stage(
  params, dparams, carry, out, slots, keep, choice, stop_below, *, spec, sampler, rows
):
  """The step down into the next bucket (`_down`) and its stage: (carry, output, slots: each
  bucket row's row in the batch)."""
  carry, out, slots = _down(carry, out, slots, keep, spec=spec, rows=rows)
  return _run(params, dparams, carry, choice, stop_below, spec=spec, sampler=sampler), out, slots


def _down(carry, out, slots, keep, *, spec, rows):
  """Writes the bucket's rows back into the batch's output and gathers rows `keep` into the
  next bucket: (its carry, the output, its slots)."""
  out = _scatter_rows(out, _finish(carry, spec=spec), slots)
  return _gather(carry, keep, rows), out, slots[keep]


@functools.partial(jax.jit, static_argnames=("spec",))
def _end(carry, out, slots, *, spec) -> Generation:
  last = _finish(carry, spec=spec)
  return _scatter_rows(out, last, slots)._replace(stats=last.stats)


def _scatter_rows(out: Generation, gen: Generation, idx) -> Generation:
  return Generation(
    out.tokens.at[idx].set(gen.tokens),
    out.logprobs.at[idx].set(gen.logprobs),
    out.lengths.at[idx].set(gen.lengths),
    None,
  )


def _row_axis(path, leaf) -> int | None:
  """The rows axis of a carry leaf: 1 for a [L, B, C, K, D] cache, none for the counters."""
  names = [getattr(p, "key", getattr(p, "name", None)) for p in path]
  if "stats" in names or "step" in names:
    return None
  if names[-1] in ("k", "v") and leaf.ndim == 5:
    return 1
  return 0


def _gather(carry, idx, rows: Rows | None = None):
  """The carry's rows `idx` (a smaller bucket), laid out over the mesh's row axes."""

  def take(path, leaf):
    ax = _row_axis(path, leaf)
    if ax is None:
      return leaf
    x = jnp.take(leaf, idx, axis=ax)
    if rows is not None:
      spec = PartitionSpec(*([None] * ax + [rows.spec]))
      x = jax.lax.with_sharding_constraint(x, NamedSharding(rows.mesh, spec))
    return x

  return jax.tree_util.tree_map_with_path(take, carry)


# One stage's pieces on their own (calibration times a whole stage: decode/cost.py; a timed
# rollout runs its prefill, step downs and stages apart).
init_jit = jax.jit(_init, static_argnames=("spec",))
run_jit = jax.jit(_run, static_argnames=("spec", "sampler"))
_step_down = jax.jit(_down, static_argnames=("spec", "rows"))
