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
(`speculative.choose_num_draft`). `num_draft = 0` decodes autoregressively (no draft).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from specdraft.decode import autoregressive, speculative
from specdraft.decode.cost import Acceptance, CostModel
from specdraft.decode.rejection import rejection_sample
from specdraft.decode.sampling import Generation, Sampling
from specdraft.model import policy as pol


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
  rows: Rows | None = None,
  sampler=rejection_sample,
) -> Generation:
  """SD (`num_draft` >= 1: G, or G_max when `adaptive`) or AR (`num_draft` = 0) generation of the
  same output as `speculative.generate` / `autoregressive.generate`, with finished rows compacted
  away (`compact`; the smallest bucket holds `min_rows` rows, or one per shard of `rows`). Runs on
  the host: one compiled stage per bucket, each a device loop."""
  B = int(prompt_BS.shape[0])
  sm = Sampling(temperature, top_k, top_p)
  N = max_new_tokens
  if num_draft == 0:
    spec = autoregressive.Spec(pcfg, N, sm)
    stage = lambda carry, stop_below, b: _ar_stage(params, carry, stop_below, spec=spec)
    carry = _ar_init(params, prompt_BS, prompt_lengths_B, key, spec=spec)
    finish = functools.partial(_ar_finish, spec=spec)
  else:
    if adaptive and cost is None:
      raise ValueError("adaptive speculation needs a cost model (decode.cost.calibrate)")
    spec = speculative.Spec(pcfg, dcfg, N, num_draft, adaptive, sm)
    prior = prior if prior is not None else Acceptance.prior(num_draft)
    capacity = int(prompt_BS.shape[1]) + N + num_draft + 2

    def stage(carry, stop_below, b):
      rs = cost.round_seconds_all(b, num_draft, capacity) if adaptive else None
      choice = speculative.Choice.of(spec, rs, (prior.accepted, prior.reached))
      return _sd_stage(params, dparams, carry, choice, stop_below, spec=spec, sampler=sampler)

    carry = _sd_init(params, dparams, prompt_BS, prompt_lengths_B, key, spec=spec)
    finish = functools.partial(_sd_finish, spec=spec)
  sizes = buckets(B, max(min_rows, rows.min_rows if rows else 1)) if compact else [B]
  slots = np.arange(B)
  out = None
  for i, b in enumerate(sizes):
    nxt = sizes[i + 1] if i + 1 < len(sizes) else 0
    carry = stage(carry, jnp.int32(nxt), b)
    n = int(_num_active(carry))
    if n == 0 or not nxt:
      break
    out = _scatter(out, finish(carry), slots, B)
    done = np.asarray(jax.device_get(carry["done"]))
    keep = np.argsort(done, kind="stable")[:nxt]  # the active rows first, in their order
    carry = _gather(carry, jnp.asarray(keep), rows)
    slots = slots[keep]
  last = finish(carry)
  out = _scatter(out, last, slots, B)
  return Generation(out.tokens, out.logprobs, out.lengths, last.stats)


@jax.jit
def _num_active(carry):
  return jnp.sum(~carry["done"])


def _scatter(out: Generation | None, gen: Generation, slots, B: int) -> Generation:
  """Writes a bucket's rows back at their places in the whole batch."""
  idx = jnp.asarray(slots)
  if out is None:
    out = Generation(
      jnp.zeros((B,) + gen.tokens.shape[1:], gen.tokens.dtype),
      jnp.zeros((B,) + gen.logprobs.shape[1:], gen.logprobs.dtype),
      jnp.zeros((B,), gen.lengths.dtype),
      None,
    )
  return _scatter_rows(out, gen, idx)


@jax.jit
def _scatter_rows(out: Generation, gen: Generation, idx):
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


@functools.partial(jax.jit, static_argnames=("rows",))
def _gather(carry, idx, rows: Rows | None = None):
  """The carry's rows `idx` (a smaller bucket), laid out over the mesh's row axes."""

  def take(path, leaf):
    ax = _row_axis(path, leaf)
    if ax is None:
      return leaf
    x = jnp.take(leaf, idx, axis=ax)
    if rows is not None:
      spec = P(*([None] * ax + [rows.spec]))
      x = jax.lax.with_sharding_constraint(x, NamedSharding(rows.mesh, spec))
    return x

  return jax.tree_util.tree_map_with_path(take, carry)


# One compile per (settings, bucket): the stages are jitted with their settings static.
_sd_init = jax.jit(speculative.init, static_argnames=("spec",))
_sd_stage = jax.jit(speculative.run, static_argnames=("spec", "sampler"))
_sd_finish = jax.jit(speculative.finish, static_argnames=("spec",))
_ar_init = jax.jit(autoregressive.init, static_argnames=("spec",))
_ar_stage = jax.jit(autoregressive.run, static_argnames=("spec",))
_ar_finish = jax.jit(autoregressive.finish, static_argnames=("spec",))
