"""TapChannel: tapped features from each pipeline stage straight to the last stage.

The draft lives on the last pipeline stage but reads features from layers held by earlier
stages. A static `TapPlan` maps every tap layer to (stage, local layer index). Inside the
pipeline loop each stage collects its tapped outputs (already `stop_gradient`-ed by the caller)
in one buffer; the channel sends that buffer with ONE single-pair `ppermute` per source stage,
`(s, P-1)` (ppermute cannot fan in, so sources never share an op), on a path of its own: the
main activation shift is the same program with the channel on or off. The last stage keeps
what arrives in a receiver buffer indexed by microbatch `[M, N, ...]`; iterations in which a
source stage works on the pipeline bubble write to an extra row that is dropped.

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
      raise ValueError(
        f"model.n_layers={L} cannot be split into {P} equal pipeline stages "
        f"(parallel.mesh.pp={P}); choose pp dividing {L}, e.g. "
        f"{[d for d in range(1, L + 1) if L % d == 0]}"
      )
    if not self.tap_layers:
      raise ValueError("a TapPlan needs at least one tap layer")
    bad = [t for t in self.tap_layers if not 0 <= t < L]
    if bad:
      raise ValueError(
        f"tap layer(s) {bad} do not exist: the policy has layers 0..{L - 1} "
        f"(model.tap_layers={tuple(self.tap_layers)})"
      )
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
    parts = [
      f"layer {t} -> stage {s} local {loc}" for t, (s, loc) in zip(self.tap_layers, self.entries)
    ]
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

  Used by `pipeline.gpipe` through three hooks: `init` (the channel's scan carry, separate from
  the activation carry), `step` (once per loop iteration, after the stage computed) and `finish`
  (after the loop: the receiver buffer `[M, N, ...]`, indexed by microbatch, in
  `plan.tap_layers` order).

  Buffers indexed by microbatch have one extra row, `M`, where bubble iterations write: the
  microbatch index of an iteration is `m` when valid and `M` otherwise, so bubble results are
  dropped without reading or selecting the old contents (one dynamic-update-slice per write).
  """

  plan: TapPlan
  mode: str = "direct"
  delay: bool = False
  axis_name: str = "pp"

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(
        f"parallel.pipeline.tap_mode={self.mode!r} is unknown; expected one of {MODES}"
      )
    if self.delay and self.mode != "direct":
      raise ValueError(
        f"parallel.pipeline.tap_delay=True only applies to tap_mode='direct' "
        f"(got tap_mode={self.mode!r})"
      )

  def _send(self, x, src):
    """One single-pair ppermute src -> last stage; every other device receives zeros."""
    return jax.lax.ppermute(x, self.axis_name, perm=[(src, self.plan.last)])

  @property
  def _src_slots(self) -> list[int]:
    """Tap slots of every source stage, in source order (the hop buffer's layout)."""
    return [i for s in self.plan.sources for i in self.plan.slots(s)]

  @staticmethod
  def _row(m, M):
    """Row of a microbatch-indexed buffer: m when 0 <= m < M, else the bubble row M."""
    return jnp.where((m >= 0) & (m < M), m, M).astype(jnp.int32)

  @staticmethod
  def _put(buf, row, slot, value):
    """buf[row, slot] = value (a dynamic-update-slice; `slot` static)."""
    start = (row, jnp.int32(slot)) + (jnp.int32(0),) * (buf.ndim - 2)
    return jax.lax.dynamic_update_slice(buf, value[None, None].astype(buf.dtype), start)

  # -- hooks used by the pipeline --------------------------------------------------------------

  def init(self, num_microbatches: int, tap_shape, dtype):
    """The channel's scan carry: every stage's own taps by microbatch, the receiver buffer and
    mode-specific state. Microbatch-indexed buffers have M + 1 rows (row M: bubble writes)."""
    M, N, shape = num_microbatches, len(self.plan.tap_layers), tuple(tap_shape)
    carry = {"own": jnp.zeros((M + 1, self.plan.max_per_stage) + shape, dtype)}
    if self.mode in ("direct", "hop"):
      carry["recv"] = jnp.zeros((M + 1, N) + shape, dtype)
    if self.mode == "direct" and self.delay:
      carry["pending"] = jnp.zeros((self.plan.max_per_stage,) + shape, dtype)
    if self.mode == "hop":  # the travelling buffer holds every source stage's slots
      carry["hop"] = jnp.zeros((max(len(self._src_slots), 1),) + shape, dtype)
    return carry

  def step(self, carry, buf, *, it, stage):
    """After iteration `it`: `buf [max_per_stage, ...]` holds this stage's taps for microbatch
    `it - stage`."""
    plan, P = self.plan, self.plan.num_stages
    M = carry["own"].shape[0] - 1
    carry = dict(carry)
    carry["own"] = jax.lax.dynamic_update_index_in_dim(
      carry["own"], buf.astype(carry["own"].dtype), self._row(it - stage, M), 0
    )
    if self.mode == "direct":
      send, lag = (carry["pending"], 1) if self.delay else (buf, 0)
      recv = carry["recv"]
      for s in plan.sources:
        got = self._send(send[: plan.count(s)], s)  # microbatch it - lag - s
        row = self._row(it - lag - s, M)
        for j, slot in enumerate(plan.slots(s)):
          recv = self._put(recv, row, slot, got[j])
      carry["recv"] = recv
      if self.delay:
        carry["pending"] = buf
    elif self.mode == "hop":
      # Source stages write their slots into the travelling buffer, which then moves to s + 1
      # beside the activations (stage s + 1 works next iteration on the microbatch stage s
      # worked on now); what reaches the last stage is for its next microbatch.
      hop, h = carry["hop"], 0
      for src in plan.sources:
        for j in range(plan.count(src)):
          hop = hop.at[h].set(jnp.where(stage == src, buf[j], hop[h]))
          h += 1
      hop = jax.lax.ppermute(hop, self.axis_name, perm=[(s, s + 1) for s in range(P - 1)])
      row = self._row(it + 1 - plan.last, M)
      recv = carry["recv"]
      for h, slot in enumerate(self._src_slots):
        recv = self._put(recv, row, slot, hop[h])
      carry["recv"], carry["hop"] = recv, hop
    return carry

  def finish(self, carry, *, num_iterations: int, stage):
    """After the loop: flushes delayed and bulk sends; returns the receiver buffer [M, N, ...]
    (meaningful on the last stage; 'off' leaves remote slots zero)."""
    plan, last = self.plan, self.plan.last
    own = carry["own"]
    M = own.shape[0] - 1
    N = len(plan.tap_layers)
    recv = carry.get("recv", jnp.zeros((M + 1, N) + own.shape[2:], own.dtype))
    if self.mode == "direct" and self.delay:  # the last iteration's buffer is still pending
      for s in plan.sources:
        got = self._send(carry["pending"][: plan.count(s)], s)
        row = self._row(num_iterations - 1 - s, M)
        for j, slot in enumerate(plan.slots(s)):
          recv = self._put(recv, row, slot, got[j])
    recv = recv[:M]
    if self.mode == "bulk":
      for s in plan.sources:
        got = self._send(own[:M, : plan.count(s)], s)  # [M, count(s), ...], once
        recv = recv.at[:, jnp.asarray(plan.slots(s))].set(got)
    # the last stage's own taps never travel
    recv = (
      recv.at[:, jnp.asarray(plan.slots(last), jnp.int32)].set(own[:M, : plan.count(last)])
      if plan.count(last)
      else recv
    )
    return recv

  def tapped_bytes(self, tap_shape, dtype, num_microbatches: int) -> int:
    """Bytes that must travel: every source stage's taps, for every microbatch, once."""
    per = int(np.prod(tap_shape)) * jnp.dtype(dtype).itemsize
    return sum(self.plan.count(s) for s in self.plan.sources) * per * num_microbatches
