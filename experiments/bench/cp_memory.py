"""Context-parallel branch attention (experiments/bench_cp.py): memory against its floor, work
balance measured from the running schedule, and speed, ring beside all-gather.

1. Memory, compile-only (nothing is allocated): per-device `compiled.memory_analysis()`
   (argument + output + temp bytes) of forward + backward trunk + branch attention with a random
   output cotangent (an argument, so nothing folds away), for the ring, the all-gather baseline
   and the dense oracle (compiled up to `dense_max_tokens`; beyond it the analytic size of its
   float32 score tensor, in its own field). Beside each figure, the FLOOR computed from the
   shapes (`FLOOR_FORMULA`) and the ratio to it.
2. Work: the ring skips (query tile, key tile) pairs with nothing visible and counts the pairs it
   computes; per-rank counts from that counter, zigzag vs contiguous order, on a whole-row
   causal document and on packed rows (many short documents and one long); max/mean per rank.
3. Speed: forward + backward wall time at a size that runs here, ring (skipping), ring (every tile
   pair), all-gather, timed interleaved; medians and ratios.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from experiments.bench import cp_work, provenance
from specdraft.attention import reference, ring

FLOOR_FORMULA = (
  "2*E*B*Sl*(H*D + 2*K*D + W*H*D + 2*W*K*D)   # inputs q, k, v, q_br, k_br, v_br and their grads"
  " + 2*E*B*Sl*(1+W)*H*D                      # outputs out, out_br and their cotangents"
  " + 4*B*Sl*(1+W)*H                          # one float32 log-sum-exp per query row and head;"
  " E = bytes per input element, Sl = S/cp tokens per device"
)


def floor_bytes(*, B, Sl, H, K, D, W, itemsize) -> int:
  """The least a device must hold for fwd+bwd (see FLOOR_FORMULA)."""
  inputs = B * Sl * (H * D + 2 * K * D + W * H * D + 2 * W * K * D) * itemsize
  outputs = B * Sl * (1 + W) * H * D * itemsize
  return int(2 * inputs + 2 * outputs + 4 * B * Sl * (1 + W) * H)


def cp_mesh(cp: int):
  """A one-axis 'cp' mesh over the first cp devices (automatic axis type)."""
  return jax.make_mesh((cp,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:cp])


def _fwd_bwd(impl: str, cp: int, branch: str, tile: int, skip: bool = True):
  """(q, k, v, q_br, k_br, v_br, seg, pos, dout, dout_br) -> the six input gradients."""
  if impl == "dense":

    def fn(q, k, v, qb, kb, vb, seg, pos):
      del pos  # natural order
      o, ob, _, _ = reference.branch_attention_dense(q, k, v, qb, kb, vb, seg, branch=branch)
      return o.astype(q.dtype), ob.astype(qb.dtype)
  else:
    spec = PartitionSpec(None, "cp")  # every per-token array sharded on its sequence axis
    kw = dict(branch=branch, axis_name="cp", cp=cp, tile=tile)
    if impl == "ring":
      body = lambda *a: ring.ring_attention_shard(*a, **kw, skip_empty=skip)
    else:
      body = lambda *a: ring.allgather_attention_shard(*a, **kw)
    fn = jax.shard_map(
      body, mesh=cp_mesh(cp), in_specs=(spec,) * 8, out_specs=(spec, spec), check_vma=False
    )

  def fwd_bwd(q, k, v, qb, kb, vb, seg, pos, do, dob):
    _, vjp = jax.vjp(lambda *x: fn(*x, seg, pos), q, k, v, qb, kb, vb)
    return vjp((do, dob))

  return fwd_bwd


def _shapes(B, S, H, K, D, W):
  inputs = [(B, S, H, D), (B, S, K, D), (B, S, K, D), (B, S, W, H, D), (B, S, W, K, D)]
  inputs.append((B, S, W, K, D))
  return inputs, [(B, S, H, D), (B, S, W, H, D)]


def compile_memory(impl, *, S, cp, B, H, K, D, W, branch, dtype=jnp.bfloat16, tile=512) -> dict:
  """Compiles forward + backward with a cotangent argument; per-device bytes, no allocation."""
  sh = NamedSharding(cp_mesh(cp), PartitionSpec(None, "cp"))
  abstract = lambda s, d=dtype: jax.ShapeDtypeStruct(s, d, sharding=sh)
  inputs, cots = _shapes(B, S, H, K, D, W)
  args = [abstract(s) for s in inputs] + [abstract((B, S), jnp.int32)] * 2
  args += [abstract(s) for s in cots]
  row = {"impl": impl, "S": S, "cp": cp, "branch": branch, "W": W, "K": K}
  t0 = time.perf_counter()
  try:
    compiled = jax.jit(_fwd_bwd(impl, cp, branch, tile)).lower(*args).compile()
  except Exception as e:  # noqa: BLE001 -- report what could not be planned
    return {**row, "error": f"{type(e).__name__}: {str(e)[:200]}"}
  m = compiled.memory_analysis()
  peak = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
  peak -= getattr(m, "alias_size_in_bytes", 0)
  floor = floor_bytes(B=B, Sl=S // cp, H=H, K=K, D=D, W=W, itemsize=jnp.dtype(dtype).itemsize)
  return {
    **row,
    "argument_bytes": int(m.argument_size_in_bytes),
    "output_bytes": int(m.output_size_in_bytes),
    "temp_bytes": int(m.temp_size_in_bytes),
    "peak_bytes": int(peak),
    "floor_bytes": floor,
    "peak_over_floor": peak / floor,
    "compile_seconds": time.perf_counter() - t0,
  }


def dense_estimate(*, S, B, H, W, **_) -> int:
  """Analytic float32 score bytes of the dense oracle (it materialises every score)."""
  return int(4 * B * H * (S * S + S * W * (S + W)))


# ----------------------------------------------------------------------------- work


def measure_work(w) -> dict:
  """Per-rank tile pairs from the ring's own counter, every token order, on a whole-row document and
  on packed rows (documents padded to 2*cp tokens so the per-document order applies)."""
  S, cp = w.tokens, w.cp
  rows = {"whole_row_document": [np.ones(S, np.int32)]}
  rows["packed"] = [
    cp_work.packed_segments(
      S,
      seed=s,
      long_fraction=w.long_fraction,
      mean_short=w.mean_short,
      pad=w.pad,
      granule=2 * cp,
    )
    for s in range(w.seeds)
  ]
  out = {"tokens": S, "cp": cp, "tile": w.tile, "W": w.W, "rows": {}}
  for name, segs in rows.items():
    out["rows"][name] = {order: _order_work(segs, cp, order, w) for order in cp_work.ORDERS}
  seg = rows["packed"][0]
  out["packed_documents"] = int(len(np.unique(seg[seg > 0])))
  return out


def _order_work(segs, cp: int, order: str, w) -> dict:
  counts = [
    cp_work.tile_pairs_per_rank(seg, cp=cp, order=order, W=w.W, tile=w.tile) for seg in segs
  ]
  total = cp_work.tile_pairs_per_rank(segs[0], cp=cp, order=order, W=w.W, tile=w.tile, skip=False)
  x = {
    "pairs_per_rank": [c.tolist() for c in counts],
    "max_over_mean": [cp_work.balance(c) for c in counts],
    "worst_max_over_mean": max(cp_work.balance(c) for c in counts),
    # the busiest rank sets the step time: its pairs, worst seed
    "worst_max_pairs": int(max(c.max() for c in counts)),
    "pairs_without_skipping_per_rank": total.tolist(),
    "computed_fraction": float(np.mean([c.sum() / total.sum() for c in counts])),
  }
  print(
    f"work {len(segs)} row(s) {order:>10}: max/mean {x['worst_max_over_mean']:.3f}, busiest rank "
    f"{x['worst_max_pairs']} pairs, computed {x['computed_fraction']:.3f} of all tile pairs",
    flush=True,
  )
  return x


# ----------------------------------------------------------------------------- speed


def measure_speed(sp) -> dict:
  """fwd+bwd wall time, ring (skip), ring (no skip), all-gather, interleaved repeats."""
  S, cp, W = sp.tokens, sp.cp, sp.W
  B, H, K, D = 1, sp.heads, sp.kv_heads, sp.head_dim
  inputs, cots = _shapes(B, S, H, K, D, W)
  keys = jax.random.split(jax.random.key(0), len(inputs) + len(cots))
  sh = NamedSharding(cp_mesh(cp), PartitionSpec(None, "cp"))
  rnd = lambda k, s: jax.device_put(jax.random.normal(k, s, jnp.float32).astype(jnp.bfloat16), sh)
  xs = [rnd(k, s) for k, s in zip(keys, inputs)]
  seg_S = cp_work.packed_segments(
    S, seed=0, long_fraction=sp.long_fraction, mean_short=sp.mean_short, pad=sp.pad, granule=2 * cp
  )
  cots = [rnd(k, s) for k, s in zip(keys[len(inputs) :], cots)]

  def in_order(order):  # the same row's segment ids and positions in `order`
    row = lambda x: jax.device_put(cp_work.order_rows(x[None], cp, order, seg_S), sh)
    return [*xs, row(jnp.asarray(seg_S)), row(jnp.arange(S, dtype=jnp.int32)), *cots]

  zig, doc = in_order("zigzag"), in_order("document")  # inputs are i.i.d. noise: any order
  variants = {
    "ring": (_fwd_bwd("ring", cp, sp.branch, sp.tile), zig),
    "ring_no_skip": (_fwd_bwd("ring", cp, sp.branch, sp.tile, skip=False), zig),
    "ring_document_layout": (_fwd_bwd("ring", cp, sp.branch, sp.tile), doc),
    "allgather": (_fwd_bwd("allgather", cp, sp.branch, sp.tile), zig),
  }
  fns = {n: (jax.jit(f), a) for n, (f, a) in variants.items()}
  for f, a in fns.values():
    jax.block_until_ready(f(*a))  # compile and warm up
  times = {n: [] for n in fns}
  for _ in range(sp.repeats):
    for n, (f, a) in fns.items():
      t0 = time.perf_counter()
      jax.block_until_ready(f(*a))
      times[n].append(time.perf_counter() - t0)
  med = {n: float(np.median(t)) for n, t in times.items()}
  print("speed (s, median): " + ", ".join(f"{n} {t:.2f}" for n, t in med.items()), flush=True)
  return {
    "dims": dict(S=S, cp=cp, H=H, K=K, D=D, W=W, branch=sp.branch, tile=sp.tile),
    "seconds": times,
    "median_seconds": med,
    "ring_over_allgather": med["ring"] / med["allgather"],
    "skip_speedup": med["ring_no_skip"] / med["ring"],
    "document_layout_speedup": med["ring"] / med["ring_document_layout"],
  }


# ----------------------------------------------------------------------------- run


def run(config, workdir: str) -> dict:
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  os.makedirs(workdir, exist_ok=True)
  b = config.bench_cp
  rows, estimates = [], []
  for case in b.cases:
    case = dict(case)
    branch, W, K = case["branch"], case["W"], case["kv_heads"]
    dims = dict(B=b.batch, H=b.heads, K=K, D=b.head_dim)
    for cp in b.cps:
      S = b.tokens_per_rank * cp
      for impl in b.impls:
        if impl == "dense" and S > b.dense_max_tokens:
          est = dense_estimate(S=S, W=W, **dims)
          estimates.append(
            {"impl": impl, "S": S, "cp": cp, "branch": branch, "W": W, "K": K, "score_bytes": est}
          )
          continue
        r = compile_memory(impl, S=S, cp=cp, W=W, branch=branch, tile=b.tile, **dims)
        rows.append(r)
        note = r.get("error") or f"{r['peak_bytes'] / 2**30:8.2f} GiB ({r['peak_over_floor']:.2f}x)"
        print(f"{branch:>5} W={W:<2} K={K:<2} {impl:>9} cp={cp}: {note}", flush=True)
  results = {
    "dims": dict(
      B=b.batch,
      H=b.heads,
      D=b.head_dim,
      tokens_per_rank=b.tokens_per_rank,
      dense_max_tokens=b.dense_max_tokens,
      tile=b.tile,
      dtype="bfloat16",
    ),
    "cases": [dict(c) for c in b.cases],
    "floor_formula": FLOOR_FORMULA,
    "memory": rows,
    "dense_estimates": {
      "basis": "analytic float32 score-tensor bytes of the dense oracle (not compiled)",
      "rows": estimates,
    },
    "work": measure_work(b.work),
    "speed": measure_speed(b.speed),
  }
  results["summary"] = summary(results)
  return provenance.publish(
    workdir, results, b.goals, table=table, plot=plot, plot_name="cp_memory.png"
  )


def case_name(case) -> str:
  return f"{case['branch']}_W{case['W']}_K{case['kv_heads']}"


def _rows(results, case, impl):
  return {
    r["cp"]: r
    for r in results["memory"]
    if (r["branch"], r["W"], r["K"], r["impl"])
    == (case["branch"], case["W"], case["kv_heads"], impl)
    and "error" not in r
  }


def summary(results) -> dict:
  """Per case: ring peak / floor (max over cp), ring flatness (largest cp / smallest cp > 1),
  all-gather / ring at each cp and the least of them at cp >= 4; work balance; speed."""
  out = {}
  for case in results["cases"]:
    ring_rows, ag_rows = _rows(results, case, "ring"), _rows(results, case, "allgather")
    cps = sorted(ring_rows)
    s = {"ring_peak_over_floor_max": max(r["peak_over_floor"] for r in ring_rows.values())}
    multi = [cp for cp in cps if cp > 1]
    if len(multi) > 1:
      s["ring_flatness"] = ring_rows[multi[-1]]["peak_bytes"] / ring_rows[multi[0]]["peak_bytes"]
      s["ring_flatness_cps"] = [multi[0], multi[-1]]
    s["allgather_over_ring"] = {
      str(cp): ag_rows[cp]["peak_bytes"] / ring_rows[cp]["peak_bytes"]
      for cp in cps
      if cp in ag_rows
    }
    big = [v for cp, v in s["allgather_over_ring"].items() if int(cp) >= 4]
    if big:
      s["allgather_over_ring_min_cp_ge_4"] = min(big)
    if ag_rows:
      s["allgather_peak_over_floor_max"] = max(r["peak_over_floor"] for r in ag_rows.values())
      agc = sorted(ag_rows)
      s["allgather_growth"] = ag_rows[agc[-1]]["peak_bytes"] / ag_rows[agc[0]]["peak_bytes"]
    out[case_name(case)] = s
  w = results["work"]["rows"]
  out["work"] = {
    f"{name}_{order}_max_over_mean": w[name][order]["worst_max_over_mean"]
    for name in w
    for order in w[name]
  }
  out["work"].update(
    {
      f"{name}_{order}_computed_fraction": w[name][order]["computed_fraction"]
      for name in w
      for order in w[name]
    }
  )
  out["work"].update(
    {
      f"{name}_{order}_max_pairs": w[name][order]["worst_max_pairs"]
      for name in w
      for order in w[name]
    }
  )
  keys = ("ring_over_allgather", "skip_speedup", "document_layout_speedup")
  out["speed"] = {k: results["speed"][k] for k in keys}
  return out


def _gib(n):
  return f"{n / 2**30:.2f}"


def table(results) -> str:
  """GiB per device (and x floor) by case, impl and cp; dense estimates in their own rows."""
  cps = sorted({r["cp"] for r in results["memory"]})
  S = {cp: results["dims"]["tokens_per_rank"] * cp for cp in cps}
  lines = [
    "| case | impl | " + " | ".join(f"cp={cp} (S={S[cp]})" for cp in cps) + " |",
    "|---|---|" + "---|" * len(cps),
  ]
  for case in results["cases"]:
    for impl in ("ring", "allgather", "dense"):
      rows = _rows(results, case, impl)
      if not rows:
        continue
      cells = [
        f"{_gib(rows[cp]['peak_bytes'])} ({rows[cp]['peak_over_floor']:.2f}x)"
        if cp in rows
        else "-"
        for cp in cps
      ]
      lines.append(f"| {case_name(case)} | {impl}, compiled | " + " | ".join(cells) + " |")
    est = {
      e["cp"]: e
      for e in results["dense_estimates"]["rows"]
      if (e["branch"], e["W"], e["K"]) == (case["branch"], case["W"], case["kv_heads"])
    }
    if est:
      cells = [_gib(est[cp]["score_bytes"]) if cp in est else "-" for cp in cps]
      lines.append(
        f"| {case_name(case)} | dense, analytic estimate (not compiled) | "
        + " | ".join(cells)
        + " |"
      )
  return "\n".join(lines)


def plot(results, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  cases = results["cases"]
  fig, axes = plt.subplots(1, len(cases), figsize=(4.2 * len(cases), 3.8), squeeze=False)
  for ax, case in zip(axes[0], cases):
    for impl in ("ring", "allgather", "dense"):
      rows = _rows(results, case, impl)
      if rows:
        cps = sorted(rows)
        ax.plot(
          [rows[c]["S"] for c in cps],
          [rows[c]["peak_bytes"] / 2**30 for c in cps],
          marker="o",
          label=impl,
        )
    ring_rows = _rows(results, case, "ring")
    cps = sorted(ring_rows)
    ax.plot(
      [ring_rows[c]["S"] for c in cps],
      [ring_rows[c]["floor_bytes"] / 2**30 for c in cps],
      "k--",
      lw=1,
      label="floor",
    )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length S (S/cp fixed)")
    ax.set_ylabel("GiB per device (fwd+bwd)")
    ax.set_title(case_name(case))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
