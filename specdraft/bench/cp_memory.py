"""Context-parallel memory and work plan (experiments/bench_cp.py), compile-only.

Per-device memory of forward + backward trunk+branch attention from
`compiled.memory_analysis()` (argument + output + temp bytes) for the zigzag ring, the all-gather
baseline and the dense oracle (compiled up to `dense_max_tokens`; beyond it an analytic estimate of
its score tensor, kept in its own field); plus per-rank attention work for zigzag vs contiguous
sharding, by construction of the schedule (counted, not measured).
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from specdraft.attention import reference, ring
from specdraft.bench import provenance


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


WORK_BASIS = "by construction of the schedule (not measured)"


def rank_work(S: int, cp: int) -> dict:
  """Per-rank attention work, zigzag vs contiguous sharding, BY CONSTRUCTION of the schedule
  (counted from the index layout, not measured from a running ring): causal (query, key) pairs
  per rank, and c x c sub-blocks the ring computes per rank (zigzag: 3 + 2(cp-1) on every rank,
  see attention/ring.py; a contiguous ring that skips fully-masked steps computes r+1 blocks of
  2c x 2c on rank r)."""
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
  zig_blocks = [3 + 2 * (cp - 1)] * cp
  cont_blocks = [4 * (r + 1) for r in range(cp)]
  ratio = lambda x: max(x) / np.mean(x)
  return {
    "cp": cp,
    "zigzag_pairs_max_over_mean": ratio(zig),
    "contiguous_pairs_max_over_mean": ratio(cont),
    "zigzag_blocks_max_over_mean": ratio(zig_blocks),
    "contiguous_blocks_max_over_mean": ratio(cont_blocks),
  }


def run(config, workdir: str) -> dict:
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  os.makedirs(workdir, exist_ok=True)
  b = config.bench_cp
  dims = dict(B=b.batch, H=b.heads, K=b.kv_heads, D=b.head_dim)
  rows, estimates = [], []
  for branch, W in (("ttt", b.ttt_width), ("block", b.block_width)):
    for cp in b.cps:
      S = b.tokens_per_rank * cp
      for impl in b.impls:
        if impl == "dense" and S > b.dense_max_tokens:
          # not compiled: the analytic size of the dense score tensor, kept apart from the
          # compiled figures
          est = dense_estimate(S=S, W=W, branch=branch, **dims)
          estimates.append(
            {"impl": impl, "S": S, "cp": cp, "branch": branch, "W": W, "score_bytes": est}
          )
          print(
            f"{branch:>5} W={W:<2} {impl:>9} cp={cp} S={S:>7}: {est / 2**30:10.2f} GiB"
            " (analytic estimate, not compiled)",
            flush=True,
          )
          continue
        r = compile_memory(impl, S=S, cp=cp, W=W, branch=branch, tile=b.tile, **dims)
        rows.append(r)
        print(
          f"{branch:>5} W={W:<2} {impl:>9} cp={cp} S={S:>7}: "
          f"{r.get('peak_bytes', float('nan')) / 2**30:10.2f} GiB"
          f"{'  ' + r['error'] if 'error' in r else ''}",
          flush=True,
        )
  results = {
    "dims": dict(dims, tokens_per_rank=b.tokens_per_rank, dense_max_tokens=b.dense_max_tokens),
    "memory": rows,
    "dense_estimates": {
      "basis": "analytic float32 score-tensor bytes of the dense oracle (not compiled)",
      "rows": estimates,
    },
    "work": {
      "basis": WORK_BASIS,
      "tokens": b.work_tokens,
      "rows": [rank_work(b.work_tokens, cp) for cp in b.cps if cp > 1],
    },
  }
  results["summary"] = summary(results)
  results = provenance.write_results(workdir, results, goals=provenance.goals_from_config(b.goals))
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(table(results) + "\n")
  plot(results, os.path.join(workdir, "cp_memory.png"))
  print(table(results))
  print(provenance.goals_table(results["goals"]))
  return results


def _peak(results, branch, impl, cp):
  for r in results["memory"]:
    if (r.get("branch"), r["impl"], r["cp"]) == (branch, impl, cp) and "error" not in r:
      return r["peak_bytes"]
  return None


def summary(results) -> dict:
  """Ratios of compiled peak bytes per branch: the ring from the smallest cp > 1 to the largest
  (flatness at fixed S/cp), all-gather over ring at the largest cp, dense over ring at the
  largest cp where dense was compiled; the dense estimate over the ring at the largest cp
  (labelled as an estimate); the per-rank work at the largest cp (by construction)."""
  out = {}
  cps = sorted({r["cp"] for r in results["memory"]})
  ring_cps = [cp for cp in cps if cp > 1]
  for branch in ("ttt", "block"):
    s = {}
    ring = lambda cp: _peak(results, branch, "ring", cp)
    if ring_cps and ring(ring_cps[0]) and ring(ring_cps[-1]):
      s["ring_flatness"] = ring(ring_cps[-1]) / ring(ring_cps[0])
      s["ring_flatness_cps"] = [ring_cps[0], ring_cps[-1]]
    if ring(cps[0]) and ring(cps[-1]):
      s["ring_over_cp1"] = ring(cps[-1]) / ring(cps[0])
    ag = _peak(results, branch, "allgather", cps[-1])
    if ag and ring(cps[-1]):
      s["allgather_over_ring_at_max_cp"] = ag / ring(cps[-1])
    dense_cps = [cp for cp in cps if _peak(results, branch, "dense", cp)]
    if dense_cps and ring(dense_cps[-1]):
      s["dense_over_ring_compiled"] = _peak(results, branch, "dense", dense_cps[-1]) / ring(
        dense_cps[-1]
      )
      s["dense_over_ring_compiled_cp"] = dense_cps[-1]
    est = [
      e for e in results["dense_estimates"]["rows"] if e["branch"] == branch and e["cp"] == cps[-1]
    ]
    if est and ring(cps[-1]):
      s["dense_estimate_over_ring_at_max_cp"] = est[0]["score_bytes"] / ring(cps[-1])
    out[branch] = s
  if results["work"]["rows"]:
    w = results["work"]["rows"][-1]
    out["work_by_construction"] = {
      "basis": WORK_BASIS,
      "cp": w["cp"],
      "zigzag_blocks_max_over_mean": w["zigzag_blocks_max_over_mean"],
      "contiguous_blocks_max_over_mean": w["contiguous_blocks_max_over_mean"],
    }
  return out


def _gib(n):
  return f"{n / 2**30:.2f}"


def table(results) -> str:
  """Compiled per-device GiB (fwd+bwd) by branch/impl and cp; dense estimates in their own rows."""
  cps = sorted(
    {r["cp"] for r in results["memory"]} | {e["cp"] for e in results["dense_estimates"]["rows"]}
  )
  S = {cp: results["dims"]["tokens_per_rank"] * cp for cp in cps}
  lines = [
    "| branch | impl | " + " | ".join(f"cp={cp} (S={S[cp]})" for cp in cps) + " |",
    "|---|---|" + "---|" * len(cps),
  ]
  keys = []
  for r in results["memory"]:
    if (r.get("branch"), r["impl"]) not in keys:
      keys.append((r.get("branch"), r["impl"]))
  for branch, impl in keys:
    cells = []
    for cp in cps:
      r = next(
        (
          x
          for x in results["memory"]
          if (x.get("branch"), x["impl"], x["cp"]) == (branch, impl, cp)
        ),
        None,
      )
      cells.append("-" if r is None or "peak_bytes" not in r else _gib(r["peak_bytes"]))
    lines.append(f"| {branch} | {impl} compiled | " + " | ".join(cells) + " |")
  for branch in ("ttt", "block"):
    est = {e["cp"]: e for e in results["dense_estimates"]["rows"] if e["branch"] == branch}
    if est:
      cells = [_gib(est[cp]["score_bytes"]) if cp in est else "-" for cp in cps]
      lines.append(
        f"| {branch} | dense analytic estimate (not compiled) | " + " | ".join(cells) + " |"
      )
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
    est = [e for e in results["dense_estimates"]["rows"] if e["branch"] == branch]
    if est:
      ax.plot(
        [e["S"] for e in est],
        [e["score_bytes"] / 2**30 for e in est],
        ls="--",
        marker="x",
        label="dense (analytic estimate)",
      )
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
