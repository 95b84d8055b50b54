"""The whole co-training step at long context: per-device memory as cp grows (compile-only), next
to the same step with the dense attention it replaces, and measured step time at a size that runs
here.

What is compiled is `train.step.cotrain_step` itself: the policy forward and backward (every layer
through the trunk ring, the vocabulary in chunks), the draft's TTT loss with its ring branch
attention, and the optimizer update, for abstract inputs (nothing is allocated). Memory comes from
`compiled.memory_analysis()` per device: argument bytes (parameters and optimizer state, replicated
over cp, so constant in cp), output bytes, temp bytes (the step's activations and workspace) and
the peak argument + output - aliased + temp. The dense step (`dense_step`) is what the sequence
path replaced: the oracle's dense attention (a [B, S, S] mask and scores) in every policy layer and
in the draft's branch attention, and whole-row logits, on one device at the same total S.
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from experiments.bench import provenance
from specdraft import oracles
from specdraft.model import drafts
from specdraft.model import policy as pol
from specdraft.parallel.layouts import AXES
from specdraft.train import sequence
from specdraft.train import step as step_lib
from specdraft.train.spec import StepSpec


def _configs(config):
  b = config.bench_long
  pcfg = pol.PolicyConfig.from_config(b.model, int(b.model.vocab_size))
  dcfg = drafts.draft_config(config.draft, pcfg, num_draft=int(config.decode.num_draft))
  return pcfg, dcfg


def cp_mesh(cp: int):
  """The training mesh with every axis but 'cp' of size 1, over the first cp devices (the step's
  rows-local vocabulary loops and shardings name the batch axes, so they must be in the mesh)."""
  shape = tuple(cp if a == "cp" else 1 for a in AXES)
  return jax.make_mesh(
    shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=jax.devices()[:cp]
  )


def _abstract_state(pcfg, dcfg, tx, sharding):
  """Abstract {step, params, opt_state} (float32 weights and Adam moments)."""

  def init():
    theta = pol.init_params(pcfg, 0)
    tr = {"policy": theta, "draft": drafts.init_params(dcfg, 1, theta, pcfg)}
    return {"step": jnp.zeros((), jnp.int32), "params": tr, "opt_state": tx.init(tr)}

  shapes = jax.eval_shape(init)
  return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)


def _abstract_batch(B, S, mesh, cp):
  tok = NamedSharding(mesh, PartitionSpec(None, "cp" if cp > 1 else None))
  rows = NamedSharding(mesh, PartitionSpec())
  i32, f32 = jnp.int32, jnp.float32
  per_token = {"tokens": i32, "positions": i32, "segment_ids": i32, "loss_mask": f32}
  batch = {k: jax.ShapeDtypeStruct((B, S), dt, sharding=tok) for k, dt in per_token.items()}
  batch["logprobs"] = jax.ShapeDtypeStruct((B, S), f32, sharding=tok)
  batch["advantages"] = jax.ShapeDtypeStruct((B,), f32, sharding=rows)
  return batch


def _step_fn(config, pcfg, dcfg, tx, *, mesh, dense: bool):
  b = config.bench_long
  if not dense:
    spec = StepSpec.of(
      pcfg, dcfg, config.rl, tx=tx, mesh=mesh, vocab_chunk=b.vocab_chunk, attn_tile=b.attn_tile,
      remat=b.remat,
    )  # fmt: skip
    return functools.partial(step_lib.cotrain_step, spec=spec)
  return functools.partial(dense_step, pcfg=pcfg, dcfg=dcfg, rl_cfg=config.rl, tx=tx)


def remat_rows(config) -> list[dict]:
  """The ring step with every policy layer rematerialised, at each cp (for information)."""
  c = config.copy_and_resolve_references()
  c.bench_long.remat = True
  rows = []
  for cp in c.bench_long.cps:
    r = compile_memory(c, cp=cp, dense=False)
    rows.append(dict(r, remat=True))
    note = r.get("error") or f"temp {_gib(r['temp_bytes'])} GiB, peak {_gib(r['peak_bytes'])} GiB"
    print(f"S={r['S']:>7} ring cp={cp} remat: {note}", flush=True)
  return rows


def dense_step(state, batch, *, pcfg, dcfg, rl_cfg, tx):
  """The step the sequence path replaces: dense attention (a [B, S, S] mask and scores) in every
  policy layer and in the draft's branch attention, and whole-row [B, S, V] logits."""
  import optax

  def loss(trainable):
    theta, phi = trainable["policy"], trainable["draft"]
    args = (batch["tokens"], batch["positions"], batch["segment_ids"])
    logits, taps = pol.forward(theta, pcfg, *args, attention="dense")
    return oracles.cotrain_loss(
      theta, phi, logits, taps, batch, pcfg=pcfg, dcfg=dcfg, rl_cfg=rl_cfg, lam=1.0
    )

  (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(state["params"])
  updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
  params = optax.apply_updates(state["params"], updates)
  return {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics


def compile_memory(config, *, cp: int, dense: bool) -> dict:
  """Per-device memory of one compiled co-training step at S = tokens_per_rank * cp."""
  b = config.bench_long
  pcfg, dcfg = _configs(config)
  S = b.tokens_per_rank * cp
  mesh = cp_mesh(1 if dense else cp)
  tx = step_lib.make_cotrain_optimizer(config.rl, config.draft)
  state = _abstract_state(pcfg, dcfg, tx, NamedSharding(mesh, PartitionSpec()))
  batch = _abstract_batch(b.batch, S, mesh, 1 if dense else cp)
  fn = jax.jit(_step_fn(config, pcfg, dcfg, tx, mesh=mesh, dense=dense), donate_argnums=0)
  t0 = time.perf_counter()
  try:
    compiled = fn.lower(state, batch).compile()
  except Exception as e:  # a compile that fails is reported, not hidden
    return {"cp": cp, "S": S, "dense": dense, "error": f"{type(e).__name__}: {e}"[:400]}
  m = compiled.memory_analysis()
  arg, out, tmp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
  alias = m.alias_size_in_bytes
  return {
    "cp": cp,
    "S": S,
    "dense": dense,
    "argument_bytes": int(arg),
    "output_bytes": int(out),
    "alias_bytes": int(alias),
    "temp_bytes": int(tmp),
    "peak_bytes": int(arg + out - alias + tmp),
    "compile_seconds": time.perf_counter() - t0,
  }


def measure_time(config) -> dict:
  """Step time of the small model, cp = 1 against cp = max (interleaved repeats, median)."""
  t = config.bench_long.timing
  pcfg = pol.PolicyConfig.from_config(t.model, int(t.model.vocab_size))
  dcfg = drafts.draft_config(config.draft, pcfg, num_draft=int(config.decode.num_draft))
  tx = step_lib.make_cotrain_optimizer(config.rl, config.draft)
  theta = pol.init_params(pcfg, 0)
  tr = {"policy": theta, "draft": drafts.init_params(dcfg, 1, theta, pcfg)}
  rng = np.random.default_rng(0)
  S = t.tokens
  batch = {
    "tokens": rng.integers(3, pcfg.vocab_size, (t.batch, S)).astype(np.int32),
    "positions": np.broadcast_to(np.arange(S, dtype=np.int32), (t.batch, S)).copy(),
    "segment_ids": np.ones((t.batch, S), np.int32),
    "loss_mask": (np.arange(S)[None] >= S // 4).repeat(t.batch, 0).astype(np.float32),
    "logprobs": -rng.uniform(0.1, 3.0, (t.batch, S)).astype(np.float32),
    "advantages": rng.normal(size=t.batch).astype(np.float32),
  }
  spec = StepSpec.of(
    pcfg, dcfg, config.rl, tx=tx, vocab_chunk=config.bench_long.vocab_chunk,
    attn_tile=t.attn_tile,
  )  # fmt: skip
  fns, args = {}, {}
  for cp in t.cps:
    mesh = cp_mesh(cp)
    rules = [("batch", None), ("length", "cp")]
    fns[cp] = jax.jit(functools.partial(step_lib.cotrain_step, spec=spec.replace(mesh=mesh)))
    state = {"step": jnp.zeros((), jnp.int32), "params": tr, "opt_state": tx.init(tr)}
    args[cp] = (state, sequence.shard(sequence.zigzag_order(batch, cp), mesh, rules))
    jax.block_until_ready(fns[cp](*args[cp]))  # compile + warm-up
  times = {cp: [] for cp in t.cps}
  for _ in range(t.repeats):
    for cp in t.cps:
      t0 = time.perf_counter()
      jax.block_until_ready(fns[cp](*args[cp]))
      times[cp].append(time.perf_counter() - t0)
  med = {str(cp): float(np.median(v)) for cp, v in times.items()}
  lo, hi = min(t.cps), max(t.cps)
  return {
    "tokens": S,
    "batch": t.batch,
    "median_seconds": med,
    f"cp{hi}_over_cp{lo}": med[str(hi)] / med[str(lo)],
    "basis": "8 simulated CPU devices share this machine's cores: for information only",
  }


def summary(rows) -> dict:
  ring = {r["cp"]: r for r in rows if not r["dense"] and "error" not in r}
  dense = {r["cp"]: r for r in rows if r["dense"] and "error" not in r}
  out: dict = {}
  multi = [ring[c]["temp_bytes"] for c in ring if c > 1]
  if multi:
    out["temp_max_over_min_cp_ge_2"] = max(multi) / min(multi)
  if 1 in ring and multi:
    out["temp_max_cp_ge_2_over_cp1"] = max(multi) / ring[1]["temp_bytes"]
  if ring:
    args = [ring[c]["argument_bytes"] for c in ring]
    out["argument_bytes_max_over_min"] = max(args) / min(args)
  common = sorted(set(ring) & set(dense))
  if common:
    out["dense_over_ring_temp"] = {
      str(c): dense[c]["temp_bytes"] / ring[c]["temp_bytes"] for c in common
    }
    out["dense_over_ring_temp_min"] = min(out["dense_over_ring_temp"].values())
  return out


def run(config, workdir: str) -> dict:
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  os.makedirs(workdir, exist_ok=True)
  b = config.bench_long
  rows = []
  for cp in b.cps:
    for dense in (False, True) if b.dense else (False,):
      r = compile_memory(config, cp=cp, dense=dense)
      rows.append(r)
      label = "dense" if dense else f"ring cp={cp}"
      note = r.get("error") or (
        f"args {_gib(r['argument_bytes'])} GiB, temp {_gib(r['temp_bytes'])} GiB, "
        f"peak {_gib(r['peak_bytes'])} GiB ({r['compile_seconds']:.0f} s to compile)"
      )
      print(f"S={r['S']:>7} {label:>10}: {note}", flush=True)
  pcfg, dcfg = _configs(config)
  results = {
    "model": dict(b.model),
    "draft": {"ttt_steps": dcfg.ttt_steps, "n_heads": dcfg.n_heads, "n_kv_heads": dcfg.n_kv_heads},
    "batch": b.batch,
    "tokens_per_rank": b.tokens_per_rank,
    "vocab_chunk": b.vocab_chunk,
    "attn_tile": b.attn_tile,
    "memory": rows,
    "remat": remat_rows(config) if b.remat_rows else [],
    "timing": measure_time(config),
  }
  results["summary"] = summary(rows)
  return provenance.publish(
    workdir, results, b.goals, table=table, plot=plot, plot_name="long_memory.png"
  )


def _gib(n) -> str:
  return f"{n / 2**30:.2f}"


def table(results) -> str:
  """Per-device GiB by S: the ring step (argument, temp, peak) beside the dense step."""
  lines = [
    "| cp | S | ring: argument | ring: temp | ring: peak | ring + remat: temp | dense step: temp "
    "| dense step: peak |",
    "|---|---|---|---|---|---|---|---|",
  ]
  by = {(r["cp"], r["dense"]): r for r in results["memory"]}
  remat = {r["cp"]: r for r in results.get("remat", [])}
  for cp in sorted({r["cp"] for r in results["memory"]}):
    ring, dense = by.get((cp, False), {}), by.get((cp, True), {})
    cell = lambda r, k: r.get("error", "failed")[:40] if "error" in r else _gib(r[k]) if r else "-"
    lines.append(
      f"| {cp} | {ring.get('S', dense.get('S'))} | {cell(ring, 'argument_bytes')} | "
      f"{cell(ring, 'temp_bytes')} | {cell(ring, 'peak_bytes')} | "
      f"{cell(remat.get(cp, {}), 'temp_bytes')} | "
      f"{cell(dense, 'temp_bytes')} | {cell(dense, 'peak_bytes')} |"
    )
  return "\n".join(lines)


def plot(results, path):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(5.5, 3.8))
  series = (
    ("ring step: temp", [r for r in results["memory"] if not r["dense"]]),
    ("ring step + remat: temp", results.get("remat", [])),
    ("dense step: temp", [r for r in results["memory"] if r["dense"]]),
  )
  for label, rows in series:
    rows = sorted((r for r in rows if "error" not in r), key=lambda r: r["S"])
    if rows:
      ax.plot([r["S"] for r in rows], [r["temp_bytes"] / 2**30 for r in rows], "o-", label=label)
  ring = sorted(
    (r for r in results["memory"] if not r["dense"] and "error" not in r), key=lambda r: r["S"]
  )
  if ring:
    ax.plot(
      [r["S"] for r in ring],
      [r["argument_bytes"] / 2**30 for r in ring],
      "k--",
      lw=1,
      label="arguments (params + Adam)",
    )
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  ax.set_xlabel("sequence length S (S/cp fixed; cp = S / tokens per rank)")
  ax.set_ylabel("GiB per device")
  ax.set_title("whole co-training step, compile-only")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
