"""TapChannel: tapped features from each pipeline stage straight to the last stage.

The draft lives on the last pipeline stage but reads features from layers held by earlier
stages. A static `TapPlan` maps every tap layer to (stage, local layer index). Inside the
pipeline loop each stage collects its tapped outputs (already `stop_gradient`-ed by the caller)
in one buffer; the channel sends that buffer with ONE single-pair `ppermute` per source stage,
`(s, P-1)` (ppermute cannot fan in, so sources never share an op), on a path of its own: the
main activation shift is the same program with the channel on or off. The last stage keeps
what arrives in a receiver buffer indexed by microbatch `[M, N, ...]`; iterations in which a
source stage works on the pipeline bubble are masked out.

Modes
  off     no transfer; remote slots of the receiver buffer stay zero (a control for timing)
  direct  sent inside the loop as soon as a stage produced them (`delay=True` sends the
          previous iteration's buffer instead, so the send can overlap the next stage compute)
  bulk    every stage keeps its taps for all microbatches and sends them once after the loop:
          the wire carries exactly the tapped bytes
  hop     baseline only: the taps ride stage to stage beside the main shift ((s, s+1) pairs),
          each hop carrying every source slot, about n_taps * (P - 1) tap sizes per microbatch

Nothing here knows about models: a tap is any array a stage produces per microbatch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

MODES = ("off", "direct", "bulk", "hop")


@dataclasses.dataclass(frozen=True)
class TapPlan:
  """Which stage holds each tap layer, and where in the stage's layer slice.

  `tap_layers` are global layer indices (outputs of those layers), in the order the draft reads
  them; stage `s` holds layers `[s * L/P, (s + 1) * L/P)`.
  """

  tap_layers: tuple[int, ...]
  num_layers: int
  num_stages: int

  def __post_init__(self):
    L, P = self.num_layers, self.num_stages
    if P < 1:
      raise ValueError(f"pipeline stages must be >= 1, got {P}")
    if L % P:
      raise ValueError(f"model.n_layers={L} cannot be split into {P} equal pipeline stages "
                       f"(parallel.mesh.pp={P}); choose pp dividing {L}, e.g. "
                       f"{[d for d in range(1, L + 1) if L % d == 0]}")
    if not self.tap_layers:
      raise ValueError("a TapPlan needs at least one tap layer")
    bad = [t for t in self.tap_layers if not 0 <= t < L]
    if bad:
      raise ValueError(f"tap layer(s) {bad} do not exist: the policy has layers 0..{L - 1} "
                       f"(model.tap_layers={tuple(self.tap_layers)})")
    if len(set(self.tap_layers)) != len(self.tap_layers):
      raise ValueError(f"tap layers {tuple(self.tap_layers)} repeat a layer")

  @property
  def layers_per_stage(self) -> int:
    return self.num_layers // self.num_stages

  @property
  def last(self) -> int:
    return self.num_stages - 1

  def locate(self, layer: int) -> tuple[int, int]:
    """(stage, local layer index) of a global layer."""
    return layer // self.layers_per_stage, layer % self.layers_per_stage

  @property
  def entries(self) -> tuple[tuple[int, int], ...]:
    return tuple(self.locate(t) for t in self.tap_layers)

  def slots(self, stage: int) -> tuple[int, ...]:
    """Positions (in `tap_layers` order) of the taps held by `stage`, in local-layer order."""
    idx = [i for i, (s, _) in enumerate(self.entries) if s == stage]
    return tuple(sorted(idx, key=lambda i: self.entries[i][1]))

  def count(self, stage: int) -> int:
    return len(self.slots(stage))

  @property
  def max_per_stage(self) -> int:
    return max(self.count(s) for s in range(self.num_stages))

  @property
  def sources(self) -> tuple[int, ...]:
    """Stages other than the last that hold taps: each gets one ppermute to the last stage."""
    return tuple(s for s in range(self.num_stages - 1) if self.count(s))

  @property
  def local_union(self) -> tuple[int, ...]:
    """Every local layer index that is a tap on some stage (what each stage must keep)."""
    return tuple(sorted({loc for _, loc in self.entries}))

  def gather_table(self) -> np.ndarray:
    """[P, max_per_stage] int32: row s lists, for stage s's buffer slots, the position in
    `local_union` of the layer to take (-1 = unused slot)."""
    union = self.local_union
    table = -np.ones((self.num_stages, self.max_per_stage), np.int32)
    for s in range(self.num_stages):
      for j, i in enumerate(self.slots(s)):
        table[s, j] = union.index(self.entries[i][1])
    return table

  def describe(self) -> str:
    parts = [f"layer {t} -> stage {s} local {loc}" for t, (s, loc) in
             zip(self.tap_layers, self.entries)]
    return "; ".join(parts)


def stage_buffer(plan: TapPlan, union_taps, stage):
  """This stage's tap buffer [max_per_stage, ...] from the outputs of every `local_union` layer
  `union_taps [U, ...]`; `stage` is a traced stage index. Unused slots are zero."""
  table = jnp.asarray(plan.gather_table())[stage]
  picked = jnp.take(union_taps, jnp.maximum(table, 0), axis=0)
  keep = (table >= 0).reshape((-1,) + (1,) * (union_taps.ndim - 1))
  return jnp.where(keep, picked, jnp.zeros_like(picked))


@dataclasses.dataclass(frozen=True)
class TapChannel:
  """Moves per-stage tap buffers to the last stage during / after a pipeline loop.

  Used by `pipeline.gpipe` through three hooks: `init` (the channel's scan carry), `step` (once
  per loop iteration, after the stage computed; returns what arrived this iteration as a scan
  output) and `finish` (after the loop: assembles the receiver buffer `[M, N, ...]`, indexed by
  microbatch, in `plan.tap_layers` order).

  What arrives from source `s` at iteration `i` belongs to microbatch `i - s` (`i - 1 - s` with
  `delay`), so the receiver buffer is a STATIC slice of the per-iteration arrivals: bubble
  iterations are dropped without any per-iteration masking or dynamic writes in the loop.
  """

  plan: TapPlan
  mode: str = "direct"
  delay: bool = False
  axis_name: str = "pp"

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"parallel.pipeline.tap_mode={self.mode!r} is unknown; expected one of "
                       f"{MODES}")
    if self.delay and self.mode != "direct":
      raise ValueError(f"parallel.pipeline.tap_delay=True only applies to tap_mode='direct' "
                       f"(got tap_mode={self.mode!r})")

  def _send(self, x, src):
    """One single-pair ppermute src -> last stage; every other device receives zeros."""
    return jax.lax.ppermute(x, self.axis_name, perm=[(src, self.plan.last)])

  @property
  def _src_slots(self) -> list[int]:
    """Tap slots of every source stage, in source order (the hop buffer's layout)."""
    return [i for s in self.plan.sources for i in self.plan.slots(s)]

  # -- hooks used by the pipeline --------------------------------------------------------------

  def init(self, tap_shape, dtype):
    """The channel's scan carry (mode-specific state; may be empty)."""
    shape = tuple(tap_shape)
    carry = {}
    if self.mode == "direct" and self.delay:
      carry["pending"] = jnp.zeros((self.plan.max_per_stage,) + shape, dtype)
    if self.mode == "hop":  # the travelling buffer holds every source stage's slots
      carry["hop"] = jnp.zeros((max(len(self._src_slots), 1),) + shape, dtype)
    return carry

  def step(self, carry, buf, *, stage):
    """After an iteration: `buf [max_per_stage, ...]` holds this stage's taps for the microbatch
    it worked on. Returns (carry, arrivals) where arrivals are this iteration's scan outputs."""
    plan, P = self.plan, self.plan.num_stages
    carry = dict(carry)
    out = {"own": buf}  # each stage's own buffer (the last stage's own taps never travel)
    if self.mode == "direct":
      send = carry["pending"] if self.delay else buf
      for s in plan.sources:
        out[f"from{s}"] = self._send(send[:plan.count(s)], s)
      if self.delay:
        carry["pending"] = buf
    elif self.mode == "hop":
      # Source stages write their slots into the travelling buffer, which then moves to s + 1
      # beside the activations (the microbatch matches: stage s + 1 works next iteration on
      # what stage s worked on now).
      hop, h = carry["hop"], 0
      for src in plan.sources:
        for j in range(plan.count(src)):
          hop = hop.at[h].set(jnp.where(stage == src, buf[j], hop[h]))
          h += 1
      carry["hop"] = jax.lax.ppermute(hop, self.axis_name,
                                      perm=[(s, s + 1) for s in range(P - 1)])
      out["hop"] = carry["hop"]
    return carry, out

  def finish(self, carry, arrivals, *, num_microbatches: int, stage):
    """After the loop (`arrivals`: step outputs stacked over iterations): flushes delayed and bulk
    sends; returns the receiver buffer [M, N, ...] (meaningful on the last stage)."""
    plan, M, last = self.plan, num_microbatches, self.plan.last
    own = arrivals["own"]  # [n_iter, max_per_stage, ...]
    N = len(plan.tap_layers)
    rows: list = [None] * N
    # the last stage works on microbatch m at iteration m + last
    for j, slot in enumerate(plan.slots(last)):
      rows[slot] = own[last:last + M, j]
    if self.mode == "direct":
      for s in plan.sources:
        got = arrivals[f"from{s}"]  # [n_iter, count(s), ...]
        if self.delay:  # arrivals lag one iteration; the last one is flushed here
          flush = self._send(carry["pending"][:plan.count(s)], s)
          got = jnp.concatenate([got[1:], flush[None]], axis=0)
        for j, slot in enumerate(plan.slots(s)):
          rows[slot] = got[s:s + M, j]
    elif self.mode == "hop":
      # what arrives at the last stage at iteration i is for microbatch i + 1 - last
      got = arrivals["hop"]
      for h, slot in enumerate(self._src_slots):
        rows[slot] = got[last - 1:last - 1 + M, h]
    elif self.mode == "bulk":
      mine = jax.lax.dynamic_slice_in_dim(own, stage, M, 0)  # my microbatches, in order
      for s in plan.sources:
        got = self._send(mine[:, :plan.count(s)], s)  # [M, count(s), ...], once
        for j, slot in enumerate(plan.slots(s)):
          rows[slot] = got[:, j]
    zeros = jnp.zeros_like(own[:M, 0])
    return jnp.stack([zeros if r is None else r for r in rows], axis=1)  # "off": zeros

  def tapped_bytes(self, tap_shape, dtype, num_microbatches: int) -> int:
    """Bytes that must travel: every source stage's taps, for every microbatch, once."""
    per = int(np.prod(tap_shape)) * jnp.dtype(dtype).itemsize
    return sum(self.plan.count(s) for s in self.plan.sources) * per * num_microbatches
