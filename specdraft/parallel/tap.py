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

  Used by `pipeline.gpipe` through three hooks: `init` (the channel's scan carry),
  `step` (once per loop iteration, after the stage computed) and `finish` (after the loop,
  returns the receiver buffer `[M, N, ...]` in `plan.tap_layers` order).
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

  # -- helpers ---------------------------------------------------------------------------------

  def _n(self):
    return len(self.plan.tap_layers)

  def _send(self, x, src):
    """One single-pair ppermute src -> last stage; every other device receives zeros."""
    return jax.lax.ppermute(x, self.axis_name, perm=[(src, self.plan.last)])

  def _write(self, recv, got, m, valid, src):
    """recv[m, slot] = got[j] for source `src`'s slots where `valid` (else unchanged)."""
    M = recv.shape[0]
    mc = jnp.clip(m, 0, M - 1)
    zeros = (0,) * (recv.ndim - 2)
    for j, slot in enumerate(self.plan.slots(src)):
      start = (mc, jnp.int32(slot)) + zeros
      old = jax.lax.dynamic_slice(recv, start, (1, 1) + recv.shape[2:])
      new = jnp.where(valid, got[j][None, None].astype(recv.dtype), old)
      recv = jax.lax.dynamic_update_slice(recv, new, start)
    return recv

  # -- hooks used by the pipeline --------------------------------------------------------------

  def init(self, num_microbatches: int, tap_shape, dtype):
    """The channel's scan carry for one loop: the receiver buffer and mode-specific state."""
    M, N, P = num_microbatches, self._n(), self.plan.num_stages
    carry = {"recv": jnp.zeros((M, N) + tuple(tap_shape), dtype)}
    if self.mode == "bulk":
      carry["sent"] = jnp.zeros((M, self.plan.max_per_stage) + tuple(tap_shape), dtype)
    if self.mode == "direct" and self.delay:
      carry["pending"] = jnp.zeros((self.plan.max_per_stage,) + tuple(tap_shape), dtype)
    if self.mode == "hop":  # the travelling buffer holds every source stage's slots
      n_src = sum(self.plan.count(s) for s in self.plan.sources)
      carry["hop"] = jnp.zeros((max(n_src, 1),) + tuple(tap_shape), dtype)
    del P
    return carry

  def step(self, carry, buf, *, it, stage):
    """After iteration `it`: `buf [max_per_stage, ...]` holds this stage's taps for microbatch
    `it - stage` (garbage in bubble iterations, which are masked on the receiving side)."""
    plan, P = self.plan, self.plan.num_stages
    M = carry["recv"].shape[0]
    last = plan.last
    recv = carry["recv"]
    # The last stage's own taps never travel.
    m_last = it - last
    if plan.count(last):
      recv = self._write(recv, buf, m_last, (stage == last) & (m_last >= 0) & (m_last < M), last)
    carry = dict(carry)
    if self.mode == "off":
      pass
    elif self.mode == "direct":
      out, lag = (carry["pending"], 1) if self.delay else (buf, 0)
      for s in plan.sources:
        got = self._send(out[:plan.count(s)], s)
        m = it - lag - s
        recv = self._write(recv, got, m, (stage == last) & (m >= 0) & (m < M), s)
      if self.delay:
        carry["pending"] = buf
    elif self.mode == "bulk":
      m = it - stage
      mc = jnp.clip(m, 0, M - 1)
      old = jax.lax.dynamic_index_in_dim(carry["sent"], mc, 0, keepdims=False)
      new = jnp.where((m >= 0) & (m < M), buf, old)
      carry["sent"] = jax.lax.dynamic_update_index_in_dim(carry["sent"], new, mc, 0)
    elif self.mode == "hop":
      # Stage s writes its slots into the travelling buffer, then it moves to s + 1 beside the
      # activations; the last stage reads it for the microbatch it works on next iteration.
      hop = carry["hop"]
      src_slots = [i for s in plan.sources for i in plan.slots(s)]  # hop index -> tap slot
      h = 0
      for src in plan.sources:
        for j in range(plan.count(src)):
          hop = hop.at[h].set(jnp.where(stage == src, buf[j], hop[h]))
          h += 1
      arrived = jax.lax.ppermute(hop, self.axis_name, perm=[(s, s + 1) for s in range(P - 1)])
      m = it + 1 - last  # what the last stage works on at iteration it + 1
      ok = (stage == last) & (m >= 0) & (m < M)
      mc = jnp.clip(m, 0, M - 1)
      row = jax.lax.dynamic_index_in_dim(recv, mc, 0, keepdims=False)
      for h, slot in enumerate(src_slots):
        row = row.at[slot].set(jnp.where(ok, arrived[h], row[slot]))
      recv = jax.lax.dynamic_update_index_in_dim(recv, row, mc, 0)
      carry["hop"] = arrived
    carry["recv"] = recv
    return carry

  def finish(self, carry, *, num_iterations: int, stage):
    """After the loop: flushes delayed / bulk sends; returns the receiver buffer [M, N, ...]."""
    plan = self.plan
    recv = carry["recv"]
    M = recv.shape[0]
    last = plan.last
    if self.mode == "direct" and self.delay:
      it = num_iterations  # the pending buffer is from iteration num_iterations - 1
      for s in plan.sources:
        got = self._send(carry["pending"][:plan.count(s)], s)
        m = it - 1 - s
        recv = self._write(recv, got, m, (stage == last) & (m >= 0) & (m < M), s)
    if self.mode == "bulk":
      for s in plan.sources:
        got = self._send(carry["sent"][:, :plan.count(s)], s)  # [M, count(s), ...], once
        slots = jnp.asarray(plan.slots(s))
        recv = jnp.where(stage == last, recv.at[:, slots].set(got), recv)
    return recv

  def tapped_bytes(self, tap_shape, dtype, num_microbatches: int) -> int:
    """Bytes that must travel: every source stage's taps, for every microbatch, once."""
    per = int(np.prod(tap_shape)) * jnp.dtype(dtype).itemsize
    return sum(self.plan.count(s) for s in self.plan.sources) * per * num_microbatches
