"""The attention kernel benchmark (configs/bench_kernel.py): exactness of the Pallas block against
the dense oracle, then plain causal attention timed side by side on three paths (the Pallas
block, the XLA tiles, `jax.nn.dot_product_attention`), forward and forward + backward.

FLOPs are the model's, the same for every path: the forward's two products over the visible
(causal) half of the score matrix, 4 * B * H * D * S (S + 1) / 2, and a backward of 2.5 times
that (FlashAttention-2's count: the recomputed scores and four products). Achieved FLOP/s are
model FLOPs over the median time; the fraction of peak uses the config's bf16 dense peak for the
device kind (none on CPU). The Pallas backward computes seven products, not five (its dq and
dk/dv kernels each recompute the scores and dp), so its hardware rate is reported beside:
`backward_hardware_flops_per_s`, 3.5 times the forward's FLOPs over the backward's time. The
backward's time is derived: forward + backward less forward, both medians.
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.bench import provenance
from specdraft.attention import reference
from specdraft.attention.blockwise import Rows, blk, block_mask
from specdraft.attention.kernels import KernelSettings, block_attention, resolve_backend

PATHS = ("pallas", "xla_tiles", "dot_product_attention")


def check_exact(check, backend: str = "interpret", tile: int | None = None) -> dict:
  """float32 against the dense oracle on a packed mask (two documents, padding, mixed
  strictness): max abs error of out and lse, and dq, dk, dv's error relative to norms. In
  interpret mode this is the kernel's algorithm; on a chip (`backend` triton or mosaic) it is the
  compiled kernel, whose float32 products may run at the chip's reduced matmul precision."""
  B, S, H, K, D = check.batch, check.seq_len, check.heads, check.kv_heads, check.head_dim
  rng = np.random.default_rng(0)
  seg = np.where(np.arange(S) < S // 3, 1, 2)[None].repeat(B, 0)
  seg[1, -S // 4 :] = 0
  pos = np.concatenate([np.arange(S // 3), np.arange(S - S // 3)])[None].repeat(B, 0)
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  qr = Rows(i32(pos), i32(seg), i32(rng.integers(0, 2, (B, S))))
  kr = Rows(i32(pos), i32(seg))
  n = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  q, k, v = n(B, S, H, D), n(B, S, K, D), n(B, S, K, D)
  w_out, w_lse = n(B, S, H, D), n(B, H, S)
  tile = check.tile if tile is None else tile
  settings = KernelSettings(tile, tile, backend=backend)

  def loss(fn, q, k, v):
    out, lse = fn(q, k, v)
    return jnp.sum(out * w_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * w_lse), (
      out,
      lse,
    )

  kernel = lambda q, k, v: block_attention(q, k, v, qr, kr, settings=settings)
  dense = lambda q, k, v: reference.masked_attention(q, k, v, block_mask(qr, kr))
  grad = lambda fn: jax.jit(jax.grad(functools.partial(loss, fn), (0, 1, 2), has_aux=True))
  (g1, (o1, l1)), (g2, (o2, l2)) = grad(kernel)(q, k, v), grad(dense)(q, k, v)
  finite = np.isfinite(np.asarray(l2))
  same_empty = bool(np.array_equal(np.isfinite(np.asarray(l1)), finite))
  errors = {
    "out_max_abs": float(jnp.max(jnp.abs(o1 - o2))),
    "lse_max_abs": float(np.max(np.abs(np.asarray(l1)[finite] - np.asarray(l2)[finite]))),
    **{
      f"d{name}_rel": float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
      for name, a, b in zip("qkv", g1, g2)
    },
  }
  worst = max(errors.values()) if same_empty else float("inf")
  return {"errors": errors, "same_empty_rows": same_empty, "max_rel_error": worst, **check}


def causal_flops(B: int, H: int, S: int, D: int) -> dict:
  fwd = 4.0 * B * H * D * S * (S + 1) / 2
  return {"forward": fwd, "backward": 2.5 * fwd, "forward_backward": 3.5 * fwd}


def peak_flops(peaks, device_kind: str) -> float | None:
  """The peak of the longest kind named in `device_kind` ("H100 PCIe" before "H100")."""
  found = [(len(kind), float(peak)) for kind, peak in dict(peaks).items() if kind in device_kind]
  return max(found)[1] if found else None


def _paths(b, settings: KernelSettings, dpa_impl: str | None):
  """{path: (q, k, v) -> out} on one causal document."""

  def rows(q):
    B, S = q.shape[:2]
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    return Rows(pos, jnp.ones_like(pos)), Rows(pos, jnp.ones_like(pos))

  def pallas(q, k, v):
    return block_attention(q, k, v, *rows(q), settings=settings)[0]

  def xla_tiles(q, k, v):
    return blk(q, k, v, *rows(q), tile_q=b.xla_tile, tile_k=b.xla_tile)[0]

  def dpa(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=dpa_impl)

  return {"pallas": pallas, "xla_tiles": xla_tiles, "dot_product_attention": dpa}


def _programs(fn):
  fwd = jax.jit(fn)

  def loss(q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32))

  return {"forward": fwd, "forward_backward": jax.jit(jax.grad(loss, (0, 1, 2)))}


def time_seq_len(b, S: int, settings: KernelSettings) -> dict:
  """Median seconds of each path and pass at sequence length S, the paths timed in turn each
  repeat (so slow phases of the machine hit all of them). On a GPU the dot_product_attention
  path is cuDNN's fused attention where it runs (dense XLA at 32K tokens would materialise the
  score matrix), else XLA's; which one ran is recorded."""
  B, H, K, D = b.batch, b.heads, b.kv_heads, b.head_dim
  dtype = jnp.dtype(b.dtype)
  keys = jax.random.split(jax.random.key(S), 3)
  q = jax.random.normal(keys[0], (B, S, H, D), jnp.float32).astype(dtype)
  k = jax.random.normal(keys[1], (B, S, K, D), jnp.float32).astype(dtype)
  v = jax.random.normal(keys[2], (B, S, K, D), jnp.float32).astype(dtype)
  dpa_impl = None
  if jax.default_backend() == "gpu":
    try:
      jax.block_until_ready(_paths(b, settings, "cudnn")["dot_product_attention"](q, k, v))
      dpa_impl = "cudnn"
    except Exception:
      dpa_impl = "xla"
  programs = {p: _programs(fn) for p, fn in _paths(b, settings, dpa_impl).items()}
  compile_s, seconds, errors = {}, {}, {}
  for path, progs in programs.items():
    for name, prog in progs.items():
      t0 = time.perf_counter()
      try:
        jax.block_until_ready(prog(q, k, v))
      except Exception as e:  # a path the backend lacks is reported, not fatal
        errors[f"{path}.{name}"] = f"{type(e).__name__}: {str(e)[:300]}"
        continue
      compile_s[f"{path}.{name}"] = time.perf_counter() - t0
      seconds[f"{path}.{name}"] = []
  for _ in range(b.repeats):
    for path, progs in programs.items():
      for name, prog in progs.items():
        if f"{path}.{name}" in errors:
          continue
        t0 = time.perf_counter()
        jax.block_until_ready(prog(q, k, v))
        seconds[f"{path}.{name}"].append(time.perf_counter() - t0)
  flops = causal_flops(B, H, S, D)
  out = {
    "seq_len": S,
    "flops": flops,
    "errors": errors,
    "first_call_s": compile_s,
    "dot_product_attention_implementation": dpa_impl or "xla",
  }
  for path in PATHS:
    out[path] = {}
    for name in ("forward", "forward_backward"):
      ts = seconds.get(f"{path}.{name}")
      if not ts:
        continue
      med = float(np.median(ts))
      out[path][f"{name}_time"] = med
      out[path][f"{name}_spread"] = float(np.ptp(ts) / med)
      out[path][f"{name}_flops_per_s"] = flops[name] / med
    f, fb = out[path].get("forward_time"), out[path].get("forward_backward_time")
    if f and fb and fb > f:
      out[path]["backward_time"] = fb - f
      out[path]["backward_flops_per_s"] = flops["backward"] / (fb - f)
  if "backward_time" in out["pallas"]:
    out["pallas"]["backward_hardware_flops_per_s"] = (
      3.5 * flops["forward"] / out["pallas"]["backward_time"]
    )
  for other in ("xla_tiles", "dot_product_attention"):
    ratio = {}
    for name in ("forward", "backward", "forward_backward"):
      a, c = out["pallas"].get(f"{name}_time"), out[other].get(f"{name}_time")
      if a and c:
        ratio[f"{name}_time"] = a / c
    out[f"pallas_over_{other}"] = ratio
  return out


def run(config, workdir: str) -> dict:
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  b = config.bench
  backend = resolve_backend("auto")
  if backend == "interpret" and not b.smoke:
    raise ValueError(
      "bench_kernel on CPU runs only as a smoke test (Pallas interpret mode times the "
      "interpreter, not a kernel): use --config=configs/bench_kernel.py:smoke"
    )
  settings = KernelSettings(b.block_q, b.block_k, backend=backend)
  os.makedirs(workdir, exist_ok=True)
  print("exactness (interpret mode, float32) ...", flush=True)
  check = check_exact(b.check)
  print(f"  max error {check['max_rel_error']:.2e}: {check['errors']}", flush=True)
  native = None
  if backend != "interpret":  # the compiled kernel too (no goal: the chip's matmul precision)
    native = check_exact(b.check, backend, tile=0)  # the backend's own tiles
    print(f"  {backend}: max error {native['max_rel_error']:.2e}: {native['errors']}", flush=True)
  device_kind = jax.devices()[0].device_kind
  peak = peak_flops(b.peaks, device_kind)
  results = {
    "smoke_only": backend == "interpret",
    "note": (
      "CPU smoke run: Pallas runs in interpret mode, so its times are the interpreter's, not a "
      "kernel's; only the exactness check is a result here"
      if backend == "interpret"
      else f"{backend} kernels on {device_kind}"
    ),
    "kernel_backend": backend,
    "device_kind": device_kind,
    "peak_flops": peak,
    "tiles": list(settings.tiles(backend)),
    "shape": {k: b[k] for k in ("batch", "heads", "kv_heads", "head_dim", "dtype")},
    "repeats": b.repeats,
    "check": check,
    "check_compiled": native,
    "by_seq_len": [],
  }
  for S in b.seq_lens:
    print(f"seq_len {S} ...", flush=True)
    r = time_seq_len(b, S, settings)
    if peak:
      for path in PATHS:
        for name in ("forward", "backward", "forward_backward"):
          if f"{name}_flops_per_s" in r[path]:
            r[path][f"{name}_fraction_of_peak"] = r[path][f"{name}_flops_per_s"] / peak
    results["by_seq_len"].append(r)
    results[f"at_{S}"] = r
    print(_row(r), flush=True)
  results = provenance.write_results(workdir, results, goals=provenance.goals_from_config(b.goals))
  md = table(results)
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(md + "\n")
  print(md, flush=True)
  print(provenance.goals_table(results["goals"]), flush=True)
  return results


def _row(r) -> str:
  cells = []
  for path in PATHS:
    for name in ("forward", "forward_backward"):
      t = r[path].get(f"{name}_time")
      cells.append(f"{path} {name} {t * 1e3:.2f} ms" if t else f"{path} {name} -")
  return "  " + "; ".join(cells) + "".join(f"\n  {k}: {v}" for k, v in r["errors"].items())


def table(results) -> str:
  head = (
    "| tokens | pass | Pallas ms | XLA tiles ms | dot_product_attention ms | Pallas TFLOP/s "
    "| Pallas / peak | Pallas / dpa |\n|---|---|---|---|---|---|---|---|"
  )
  lines = [head]
  fmt = lambda x, f: f.format(x) if x is not None else "-"
  for r in results["by_seq_len"]:
    for name in ("forward", "backward", "forward_backward"):
      t = lambda p: (lambda x: x and x * 1e3)(r[p].get(f"{name}_time"))
      flops = r["pallas"].get(f"{name}_flops_per_s")
      lines.append(
        f"| {r['seq_len']} | {name} | {fmt(t('pallas'), '{:.3f}')} "
        f"| {fmt(t('xla_tiles'), '{:.3f}')} | {fmt(t('dot_product_attention'), '{:.3f}')} "
        f"| {fmt(flops and flops / 1e12, '{:.2f}')} "
        f"| {fmt(r['pallas'].get(f'{name}_fraction_of_peak'), '{:.3f}')} "
        f"| {fmt(r['pallas_over_dot_product_attention'].get(f'{name}_time'), '{:.3f}')} |"
      )
  return f"{results['note']}\n\n" + "\n".join(lines)
