"""Per-rank work of the ring, measured from the schedule that runs.

The ring skips every (query tile, key tile) pair whose mask has no visible entry and counts the
pairs it computes (`ring_attention_shard(..., return_work=True)`); this module runs that forward
on real packed rows under one of three orders and returns each rank's count:

- "zigzag": the whole row cut into 2*cp chunks (rank r: chunks r, 2cp-1-r), built for one causal
  document per row;
- "document": the same cut made per document (`zigzag.document_permutation`), built for packed
  rows;
- "contiguous": rank r holds the r-th contiguous slice.

Work depends only on positions, segment ids and tile sizes, so the rows carry tiny heads.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec

from specdraft.attention import ring
from specdraft.parallel import zigzag

ORDERS = ("zigzag", "document", "contiguous")


def packed_segments(
  S: int, *, seed: int, long_fraction: float, mean_short: int, pad: int, granule: int = 1
):
  """One packed row [S]: one long document (long_fraction of the row), many short ones (lengths
  drawn from a geometric distribution with mean `mean_short`), in random order, then `pad`
  padding tokens (segment 0). Every length is rounded up to a multiple of `granule` (a packer
  that pads documents to 2*cp tokens for the per-document order); the tail padding takes the
  rest, so `pad` and S must then be multiples of it too."""
  if S % granule or pad % granule:
    raise ValueError(f"S={S} and pad={pad} must be multiples of granule={granule}")
  rng = np.random.default_rng(seed)
  up = lambda n: -(-int(n) // granule) * granule
  real = S - pad
  n_long = up(real * long_fraction)
  lengths = [n_long]
  left = real - n_long
  while left > 0:
    n = min(left, up(max(1, rng.geometric(1.0 / mean_short))))
    lengths.append(n)
    left -= n
  order = rng.permutation(len(lengths))
  seg = np.concatenate([np.full(lengths[i], j + 1) for j, i in enumerate(order)])
  return np.concatenate([seg, np.zeros(pad, seg.dtype)]).astype(np.int32)


def order_rows(x_BS, cp: int, order: str, seg_S=None):
  """x_BS [B, S] put in `order` (the "document" order reads the documents from `seg_S`, one
  row shared by all B rows)."""
  if order not in ORDERS:
    raise ValueError(f"order={order!r} is not valid; expected one of {ORDERS}")
  if order == "zigzag":
    return zigzag.to_zigzag(x_BS, cp)
  if order == "document":
    if seg_S is None:
      raise ValueError("order='document' needs the row's segment ids (seg_S)")
    perm = zigzag.document_permutation(zigzag.document_lengths(seg_S), cp)
    return x_BS[:, perm]
  return x_BS


@functools.lru_cache(maxsize=None)
def _program(cp: int, S: int, W: int, branch: str, tile: int, skip: bool):
  mesh = jax.make_mesh((cp,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:cp])
  spec = PartitionSpec(None, "cp")  # every per-token array sharded on its sequence axis

  def body(q, k, v, qb, kb, vb, seg, pos):
    _, _, count = ring.ring_attention_shard(
      q,
      k,
      v,
      qb,
      kb,
      vb,
      seg,
      pos,
      branch=branch,
      axis_name="cp",
      cp=cp,
      tile=tile,
      skip_empty=skip,
      return_work=True,
    )
    return count[None]

  fn = jax.shard_map(
    body, mesh=mesh, in_specs=(spec,) * 8, out_specs=PartitionSpec("cp"), check_vma=False
  )
  return jax.jit(fn)


def tile_pairs_per_rank(
  seg_S, *, cp: int, order: str, W: int = 0, branch: str = "ttt", tile: int = 64, skip=True
) -> np.ndarray:
  """Runs the ring forward on one packed row laid out for `cp` ranks and returns the number of
  (query tile, key tile) pairs each rank computed."""
  S = len(seg_S)
  zigzag.check_length(S, cp)
  seg = order_rows(jnp.asarray(seg_S, jnp.int32)[None], cp, order, seg_S)
  pos = order_rows(jnp.arange(S, dtype=jnp.int32)[None], cp, order, seg_S)
  H, K, D = 1, 1, 1
  z = lambda *shape: jnp.zeros((1, S, *shape), jnp.float32)
  args = (z(H, D), z(K, D), z(K, D), z(W, H, D), z(W, K, D), z(W, K, D), seg, pos)
  return np.asarray(_program(cp, S, W, branch, tile, skip)(*args))


def visible_pairs_host(seg_S, *, cp: int, order: str, W: int, tile: int) -> np.ndarray:
  """The same count computed on the host from the mask alone (the oracle for the counter)."""
  S = len(seg_S)
  seg = np.asarray(order_rows(np.asarray(seg_S)[None], cp, order, seg_S))[0]
  pos = np.asarray(order_rows(np.arange(S)[None], cp, order, seg_S))[0]
  L = S // cp
  A, T = ring.tile_sizes(L, W, tile)
  out = np.zeros(cp, np.int64)
  for r in range(cp):
    qs, qp = seg[r * L : (r + 1) * L], pos[r * L : (r + 1) * L]
    for src in range(cp):
      ks, kp = seg[src * L : (src + 1) * L], pos[src * L : (src + 1) * L]
      vis = (qs[:, None] == ks[None, :]) & (qs[:, None] != 0) & (kp[None, :] <= qp[:, None])
      tiles = vis.reshape(L // A, A, L // T, T).any(axis=(1, 3))
      out[r] += int(tiles.sum())
  return out


def balance(counts) -> float:
  """max / mean of per-rank work (1.0 = perfectly balanced)."""
  counts = np.asarray(counts, np.float64)
  return float(counts.max() / counts.mean())
