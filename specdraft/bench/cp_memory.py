"""Context-parallel memory and work plan (experiments/bench_cp.py), compile-only.

Per-device memory of forward + backward trunk+branch attention from
`compiled.memory_analysis()` (argument + output + temp bytes) for the zigzag ring, the all-gather
baseline and the dense oracle; plus per-rank attention work for zigzag vs contiguous sharding.
"""

from __future__ import annotations

import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from specdraft.attention import reference, ring


def _abstract(shape, dtype, sharding):
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def compile_memory(
  impl: str,
  *,
  S: int,
  cp: int,
  B: int,
  H: int,
  K: int,
  D: int,
  W: int,
  branch: str,
  dtype=jnp.bfloat16,
  tile: int = 512,
) -> dict:
  """Compiles grad(sum(outputs)) and returns per-device bytes (no array is allocated)."""
  devices = jax.devices()[:cp]
  mesh = jax.make_mesh((cp,), ("cp",), axis_types=(AxisType.Auto,), devices=devices)
  spec = P(None, "cp")
  sh = NamedSharding(mesh, spec)
  shapes = [
    (B, S, H, D),
    (B, S, K, D),
    (B, S, K, D),
    (B, S, W, H, D),
    (B, S, W, K, D),
    (B, S, W, K, D),
  ]
  args = [_abstract(s, dtype, sh) for s in shapes]
  ints = [_abstract((B, S), jnp.int32, sh)] * 2
  if impl == "dense":

    def fn(q, k, v, qb, kb, vb, seg, pos):
      o, ob, _, _ = reference.branch_attention_dense(q, k, v, qb, kb, vb, seg, branch=branch)
      return o, ob
  else:
    body = ring.ring_attention_shard if impl == "ring" else ring.allgather_attention_shard
    fn = jax.shard_map(
      lambda *a: body(*a, branch=branch, axis_name="cp", cp=cp, tile=tile),
      mesh=mesh,
      in_specs=(spec,) * 8,
      out_specs=(spec, spec),
      check_vma=False,
    )

  def loss(q, k, v, qb, kb, vb, seg, pos):
    o, ob = fn(q, k, v, qb, kb, vb, seg, pos)
    return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ob.astype(jnp.float32))

  t0 = time.perf_counter()
  try:
    compiled = jax.jit(jax.grad(loss, argnums=tuple(range(6)))).lower(*args, *ints).compile()
  except Exception as e:  # noqa: BLE001 -- report what could not be planned
    return {"impl": impl, "S": S, "cp": cp, "error": f"{type(e).__name__}: {str(e)[:200]}"}
  m = compiled.memory_analysis()
  total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
  total -= getattr(m, "alias_size_in_bytes", 0)
  return {
    "impl": impl,
    "S": S,
    "cp": cp,
    "branch": branch,
    "W": W,
    "argument_bytes": int(m.argument_size_in_bytes),
    "output_bytes": int(m.output_size_in_bytes),
    "temp_bytes": int(m.temp_size_in_bytes),
    "peak_bytes": int(total),
    "compile_seconds": time.perf_counter() - t0,
  }


def dense_estimate(*, S, B, H, W, branch, **_) -> int:
  """Analytic float32 score bytes of the dense oracle (it materialises every score)."""
  return int(4 * B * H * (S * S + S * W * (S + W)))


def rank_work(S: int, cp: int) -> dict:
  """Causal (query, key) pairs per rank, and blocks the ring computes per rank, zigzag vs
  contiguous. A contiguous ring that skips fully-masked steps computes r+1 blocks on rank r."""
  c = S // (2 * cp)
  pairs = lambda idx: float(np.sum(idx + 1))
  zig, cont = [], []
  for r in range(cp):
    zig.append(
      pairs(
        np.concatenate(
          [np.arange(r * c, (r + 1) * c), np.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)]
        )
      )
    )
    cont.append(pairs(np.arange(r * 2 * c, (r + 1) * 2 * c)))
  zig_blocks = [3 + 2 * (cp - 1)] * cp  # sub-blocks of c x c per rank (see attention/ring.py)
  cont_blocks = [4 * (r + 1) for r in range(cp)]  # (2c x 2c) blocks = 4 sub-blocks each
  ratio = lambda x: max(x) / np.mean(x)
  return {
    "cp": cp,
    "zigzag_pairs_max_over_mean": ratio(zig),
    "contiguous_pairs_max_over_mean": ratio(cont),
    "zigzag_blocks_max_over_mean": ratio(zig_blocks),
    "contiguous_blocks_max_over_mean": ratio(cont_blocks),
  }


def run(config, workdir: str) -> dict:
  os.makedirs(workdir, exist_ok=True)
  b = config.bench_cp
  dims = dict(B=b.batch, H=b.heads, K=b.kv_heads, D=b.head_dim)
  rows = []
  for branch, W in (("ttt", b.ttt_width), ("block", b.block_width)):
    for cp in b.cps:
      S = b.tokens_per_rank * cp
      for impl in b.impls:
        if impl == "dense" and S > b.dense_max_tokens:
          rows.append(
            {
              "impl": impl,
              "S": S,
              "cp": cp,
              "branch": branch,
              "W": W,
              "peak_bytes": dense_estimate(S=S, W=W, branch=branch, **dims),
              "estimated": True,
            }
          )
        else:
          rows.append(compile_memory(impl, S=S, cp=cp, W=W, branch=branch, tile=b.tile, **dims))
        r = rows[-1]
        print(
          f"{branch:>5} W={W:<2} {impl:>9} cp={cp} S={S:>7}: "
          f"{r.get('peak_bytes', float('nan')) / 2**30:10.2f} GiB"
          f"{' (estimate)' if r.get('estimated') else ''}{'  ' + r['error'] if 'error' in r else ''}",
          flush=True,
        )
  work = [rank_work(b.work_tokens, cp) for cp in b.cps if cp > 1]
  results = {"dims": dict(dims, tokens_per_rank=b.tokens_per_rank), "memory": rows, "work": work}
  results["goals"] = goals(results)
  with open(os.path.join(workdir, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  plot(results, os.path.join(workdir, "cp_memory.png"))
  print(table(results))
  return results


def goals(results) -> dict:
  out = {}
  for branch in ("ttt", "block"):
    mem = {
      (r["impl"], r["cp"]): r.get("peak_bytes")
      for r in results["memory"]
      if r.get("branch") == branch and "error" not in r
    }
    cps = sorted({cp for _, cp in mem})
    if ("ring", cps[0]) in mem and ("ring", cps[-1]) in mem:
      out[f"{branch}_ring_flatness"] = mem[("ring", cps[-1])] / mem[("ring", cps[0])]
    if ("allgather", cps[-1]) in mem and ("ring", cps[-1]) in mem:
      out[f"{branch}_allgather_over_ring_at_max"] = (
        mem[("allgather", cps[-1])] / mem[("ring", cps[-1])]
      )
    if ("dense", cps[-1]) in mem and ("ring", cps[-1]) in mem:
      out[f"{branch}_dense_over_ring_at_max"] = mem[("dense", cps[-1])] / mem[("ring", cps[-1])]
  if results["work"]:
    w = results["work"][-1]
    out["zigzag_work_max_over_mean"] = w["zigzag_blocks_max_over_mean"]
    out["contiguous_work_max_over_mean"] = w["contiguous_blocks_max_over_mean"]
  return out


def table(results) -> str:
  lines = [
    f"{'branch':>6} {'impl':>9} "
    + " ".join(f"{'cp=' + str(cp):>10}" for cp in sorted({r["cp"] for r in results["memory"]}))
  ]
  keys = sorted({(r.get("branch"), r["impl"]) for r in results["memory"]})
  for branch, impl in keys:
    cells = []
    for cp in sorted({r["cp"] for r in results["memory"]}):
      r = next(
        (
          x
          for x in results["memory"]
          if x.get("branch") == branch and x["impl"] == impl and x["cp"] == cp
        ),
        None,
      )
      v = (
        "-"
        if r is None or "peak_bytes" not in r
        else f"{r['peak_bytes'] / 2**30:.2f}G" + ("*" if r.get("estimated") else "")
      )
      cells.append(f"{v:>10}")
    lines.append(f"{branch:>6} {impl:>9} " + " ".join(cells))
  lines.append("(* analytic estimate of the dense score tensor; GiB per device, fwd+bwd)")
  for w in results["work"]:
    lines.append(
      f"cp={w['cp']}: work max/mean zigzag {w['zigzag_blocks_max_over_mean']:.3f} "
      f"(causal pairs {w['zigzag_pairs_max_over_mean']:.3f}) vs contiguous "
      f"{w['contiguous_blocks_max_over_mean']:.3f} "
      f"(pairs {w['contiguous_pairs_max_over_mean']:.3f})"
    )
  lines.append(json.dumps(results["goals"], indent=1))
  return "\n".join(lines)


def plot(results, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
  for ax, branch in zip(axes, ("ttt", "block")):
    for impl in ("ring", "allgather", "dense"):
      rs = [
        r
        for r in results["memory"]
        if r.get("branch") == branch and r["impl"] == impl and "peak_bytes" in r
      ]
      if rs:
        ax.plot([r["S"] for r in rs], [r["peak_bytes"] / 2**30 for r in rs], marker="o", label=impl)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S (S/cp fixed)")
    ax.set_ylabel("GiB per device (fwd+bwd)")
    ax.set_title(f"branch={branch}")
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
