"""Sharding layouts side by side (experiments/compare_layouts.py): for each named layout (and a
mesh given on the command line), the co-training step and the SFT step are compiled for the same
model and batch, and compared per device:

  memory       `compiled.memory_analysis()`: argument, output, temp bytes and the peak
               argument + output - aliased + temp (the state is donated, as in training)
  FLOPs        `compiled.cost_analysis()["flops"]` (XLA counts a while loop's body once) and
               `hlo.dot_flops` (matmul FLOPs with loop trip counts: what the step really runs)
  collectives  bytes one device sends per step, per kind (all-gather, reduce-scatter, all-reduce,
               collective-permute, all-to-all), read from the compiled HLO (`hlo.collective_bytes`)
  time         the co-training step on the simulated CPU devices, interleaved repeats, median,
               as a ratio to `single` (the devices share this machine's cores: for information)
  parity       loss, gradient norms and every gradient leaf against the single-device step,
               relative to the leaf's norm, read from the compiled step's first run (its
               metrics, and Adam's first moments: one step from zero leaves (1 - b1) times the
               clipped gradient; post-Adam parameters are never compared: Adam divides each
               gradient element by its own magnitude)

Every layout runs the same program, `train.step.cotrain_step` / `sft_step`: the policy's
parameters and their Adam moments are sharded by the layout's logical-axis rules
(`parallel.mesh.tree_shardings`), and so are the draft's (`model.drafts.param_logical_axes`, as in
training), the policy trunk's residual stream is pinned to rows over (data, fsdp)
(`parallel.mesh.activation_constraint`), and the batch is laid out once for the layout's cp
degree (`train.sequence`).

`plan` compiles the co-training step for abstract inputs (nothing is allocated) on a larger
simulated mesh and a model given by config, to read per-device memory and collective bytes of
layouts for a real cluster. `snapshot_text` writes the PartitionSpec of every parameter and
optimizer-state leaf of a layout (tests/snapshots/shardings/).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import time

import jax
import ml_collections
import numpy as np
import optax

from experiments.bench import hlo, provenance
from experiments.bench.step_time import synthetic_batch
from specdraft import config as config_lib
from specdraft.model import drafts
from specdraft.model import policy as pol
from specdraft.parallel import layouts
from specdraft.parallel.layout import Layout
from specdraft.tasks.tokenizer import CharTokenizer
from specdraft.train import sequence
from specdraft.train import state as state_lib
from specdraft.train import step as step_lib
from specdraft.train.spec import StepSpec

SFT_KEYS = ("tokens", "positions", "segment_ids", "loss_mask")
QUANTITIES = ("argument_bytes", "output_bytes", "temp_bytes", "peak_bytes")

# ----------------------------------------------------------------------------- layouts


def named_parallel(name: str) -> ml_collections.ConfigDict:
  """A named layout as `config.parallel`, covering exactly its own devices (dp2 uses 2 of 8)."""
  p = config_lib.layout_config(name)
  p.devices = math.prod(int(s) for s in p.mesh.values())
  return p


def custom_parallel(parallel_cfg) -> tuple[str, ml_collections.ConfigDict] | None:
  """The mesh given on the command line (`--config.parallel.mesh.tensor=2 ...`) as a named entry
  ('custom:tensor=2,data=4'), or None when every axis is 1."""
  sizes = {a: int(parallel_cfg.mesh[a]) for a in layouts.AXES}
  if math.prod(sizes.values()) == 1:
    return None
  p = parallel_cfg.copy_and_resolve_references()
  p.devices = math.prod(sizes.values())
  if "pipeline" not in p:
    p.pipeline = dict(layouts.PIPELINE_DEFAULTS, microbatches=0)
  if int(p.pipeline.microbatches) == 0:  # the named layouts' default
    p.pipeline.microbatches = 2 * sizes["pp"]
  name = "custom:" + ",".join(f"{a}={s}" for a, s in sizes.items() if s > 1)
  p.name = "custom"
  return name, p


def selected(config) -> list[tuple[str, ml_collections.ConfigDict]]:
  """(name, parallel config) of every layout to compare: `compare.layouts` ('all' or names
  separated by commas; `single` is always first, the reference) and the command line's mesh."""
  want = str(config.compare.layouts)
  names = sorted(layouts.LAYOUTS) if want == "all" else [n.strip() for n in want.split(",") if n]
  unknown = [n for n in names if n not in layouts.LAYOUTS]
  if unknown:
    raise ValueError(
      f"config.compare.layouts={want!r} is invalid: {unknown} are not layouts; expected 'all' or "
      f"names from {sorted(layouts.LAYOUTS)} separated by commas"
    )
  names = ["single"] + [n for n in names if n != "single"]
  out = [(n, named_parallel(n)) for n in names]
  custom = custom_parallel(config.parallel)
  if custom is not None:
    out.append(custom)
  return out


# ----------------------------------------------------------------------------- model and batch


@dataclasses.dataclass
class Setup:
  """What every layout shares: model configs, optimizers, the compute knobs, the host batch."""

  pcfg: pol.PolicyConfig
  dcfg: drafts.DraftConfig  # any kind (config.draft.kind)
  rl_cfg: ml_collections.ConfigDict
  cotrain_tx: optax.GradientTransformation
  sft_tx: optax.GradientTransformation
  compute: dict
  batch: dict  # natural order, numpy (laid out per layout)


def make_setup(config, *, model=None, batch_size=None, seq_len=None, host_batch=True) -> Setup:
  """The comparison's model (`config.model`, or `model`) and a rollout-shaped batch."""
  model = config.model if model is None else model
  # the run's character vocabulary unless the model names its own (the plan's)
  vocab = int(model.get("vocab_size", 0)) or CharTokenizer().vocab_size
  pcfg = pol.PolicyConfig.from_config(model, vocab)
  dcfg = drafts.draft_config(config.draft, pcfg, num_draft=int(config.decode.num_draft))
  cmp = config.compare
  B = int(cmp.batch_size if batch_size is None else batch_size)
  S = int(cmp.seq_len if seq_len is None else seq_len)
  if host_batch:
    batch = jax.tree.map(np.asarray, synthetic_batch(B, S, pcfg.vocab_size))
  else:
    batch = {k: np.zeros((B, S), np.int32) for k in ("tokens", "positions", "segment_ids")}
    batch.update(
      {k: np.zeros((B, S), np.float32) for k in ("loss_mask", "logprobs")},
      advantages=np.zeros((B,), np.float32),
    )
  cm = config.compute
  return Setup(
    pcfg=pcfg,
    dcfg=dcfg,
    rl_cfg=config.rl,
    cotrain_tx=step_lib.make_cotrain_optimizer(config.rl, config.draft),
    sft_tx=step_lib.make_optimizer(config.sft, int(config.sft.steps)),
    compute=dict(vocab_chunk=cm.vocab_chunk, attn_tile=cm.attn_tile, remat=cm.remat),
    batch=batch,
  )


def make_layout(name: str, parallel) -> Layout:
  return Layout.from_config(parallel, name=name)


def cotrain_state_shardings(s: Setup, lay: Layout):
  """(abstract state, its shardings) of the co-training step under `lay`: the trainer's own
  (`train/state.py`)."""
  return state_lib.cotrain_state_shardings(s.pcfg, s.dcfg, s.cotrain_tx, lay)


def sft_state_shardings(s: Setup, lay: Layout):
  """(abstract state, its shardings) of the SFT step under `lay`: the trainer's own."""
  return state_lib.sft_state_shardings(s.pcfg, s.sft_tx, lay)


def laid_out_batch(s: Setup, lay: Layout, *, sft: bool = False) -> tuple[dict, dict]:
  """(host batch in the layout's zigzag order, its shardings)."""
  batch = s.batch if not sft else {k: s.batch[k] for k in SFT_KEYS}
  batch = sequence.zigzag_order(batch, lay.cp)
  return batch, sequence.batch_shardings(batch, lay.mesh, lay.rules)


def _abstract(tree, shardings):
  return jax.tree.map(
    lambda x, sh: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sh), tree, shardings
  )


# ----------------------------------------------------------------------------- programs


def cotrain_spec(s: Setup, lay: Layout) -> StepSpec:
  """The co-training step's spec under `lay` (the batch's length as the aggregation's budget)."""
  return StepSpec.of(
    s.pcfg, s.dcfg, s.rl_cfg, tx=s.cotrain_tx, mesh=lay.mesh, pipeline=lay.pipeline, **s.compute
  )


def cotrain_program(s: Setup, lay: Layout, state_sh, batch_sh):
  step = functools.partial(step_lib.cotrain_step, spec=cotrain_spec(s, lay))
  return jax.jit(
    step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=0
  )


def sft_program(s: Setup, lay: Layout, state_sh, batch_sh):
  spec = StepSpec.of(s.pcfg, tx=s.sft_tx, mesh=lay.mesh, pipeline=lay.pipeline, **s.compute)
  step = functools.partial(step_lib.sft_step, spec=spec)
  return jax.jit(
    step, in_shardings=(state_sh, batch_sh), out_shardings=(state_sh, None), donate_argnums=0
  )


def compiled_figures(compiled, num_devices: int) -> dict:
  """Per-device memory, FLOPs and collective bytes of one compiled program."""
  m = compiled.memory_analysis()
  arg, out, tmp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
  alias = m.alias_size_in_bytes
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list | tuple) else cost
  text = compiled.as_text()
  coll = hlo.collective_bytes(text, num_devices)
  return {
    "argument_bytes": int(arg),
    "output_bytes": int(out),
    "alias_bytes": int(alias),
    "temp_bytes": int(tmp),
    "peak_bytes": int(arg + out - alias + tmp),
    "flops": float(cost.get("flops", float("nan"))),
    "dot_flops": int(hlo.dot_flops(text)),
    "collectives": coll,
    "collective_bytes": float(sum(v["sent_bytes"] for v in coll.values())),
  }


def _compile(fn, *args) -> tuple:
  t0 = time.perf_counter()
  compiled = fn.lower(*args).compile()
  return compiled, time.perf_counter() - t0


def compile_layout(s: Setup, lay: Layout, *, sft: bool = True) -> dict:
  """Compiles the co-training step (and the SFT step) under `lay` for abstract inputs; returns
  {"cotrain": figures, "sft": figures, "compiled": the co-training executable}."""
  abstract, state_sh = cotrain_state_shardings(s, lay)
  batch, batch_sh = laid_out_batch(s, lay)
  fn = cotrain_program(s, lay, state_sh, batch_sh)
  compiled, secs = _compile(fn, abstract, _abstract(batch, batch_sh))
  out = {"cotrain": dict(compiled_figures(compiled, lay.devices), compile_seconds=secs)}
  out["compiled"] = compiled
  if sft:
    abstract, state_sh = sft_state_shardings(s, lay)
    batch, batch_sh = laid_out_batch(s, lay, sft=True)
    fn = sft_program(s, lay, state_sh, batch_sh)
    c, secs = _compile(fn, abstract, _abstract(batch, batch_sh))
    out["sft"] = dict(compiled_figures(c, lay.devices), compile_seconds=secs)
  return out


# ----------------------------------------------------------------------------- parity


def cotrain_grads(s: Setup, lay: Layout, trainable) -> tuple[dict, dict]:
  """(metrics, gradients) of the co-training loss under `lay`, on the host.

  `trainable` ({policy, draft}, host arrays) is placed with the layout's shardings, so every
  layout starts from bit-identical parameters."""
  _, state_sh = cotrain_state_shardings(s, lay)
  batch, batch_sh = laid_out_batch(s, lay)
  loss = functools.partial(step_lib.cotrain_loss, spec=cotrain_spec(s, lay))

  def metrics_and_grads(tr, b):
    (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(tr, b)
    metrics["policy_grad_norm"] = optax.tree.norm(grads["policy"])
    metrics["draft_grad_norm"] = optax.tree.norm(grads["draft"])
    return metrics, grads

  fn = jax.jit(metrics_and_grads, in_shardings=(state_sh["params"], batch_sh))
  tr = jax.device_put(trainable, state_sh["params"])
  return jax.device_get(fn(tr, jax.device_put(batch, batch_sh)))


def initial_trainable(s: Setup) -> dict:
  """The co-training parameters every layout starts from (host arrays)."""
  return jax.device_get(jax.jit(lambda: state_lib.cotrain_params(s.pcfg, s.dcfg))())


def grad_rel_diffs(got, want) -> dict[str, float]:
  """Per gradient leaf: ||got - want|| / ||want||, a leaf whose norm is below 1e-6 of the largest
  leaf's held to that scale (as tests/_tolerance.assert_grads_close)."""
  a = jax.tree_util.tree_leaves_with_path(got)
  b = jax.tree_util.tree_leaves_with_path(want)
  scale = max(float(np.linalg.norm(np.asarray(y, np.float64))) for _, y in b)
  out = {}
  for (path, x), (_, y) in zip(a, b):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    ref = max(float(np.linalg.norm(y)), 1e-6 * scale)
    out[jax.tree_util.keystr(path)] = float(np.linalg.norm(x - y) / ref) if ref > 0 else 0.0
  return out


def parity_figures(got: tuple, want: tuple, *, rtol: float) -> dict:
  """Loss, gradient norms and the worst gradient leaf of a layout against `single`, from
  (metrics, gradients) pairs: `cotrain_grads`' or `run_steps`' (gradients there are Adam's
  first moments after one step: the clipped gradients times 1 - b1)."""
  (m, g), (m0, g0) = got, want
  rel = lambda k: abs(float(m[k]) - float(m0[k])) / max(abs(float(m0[k])), 1e-30)
  diffs = grad_rel_diffs(g, g0)
  worst = max(diffs, key=diffs.get)
  out = {
    "loss": float(m["loss"]),
    "loss_rel_diff": rel("loss"),
    "policy_grad_norm": float(m["policy_grad_norm"]),
    "policy_grad_norm_rel_diff": rel("policy_grad_norm"),
    "draft_grad_norm": float(m["draft_grad_norm"]),
    "draft_grad_norm_rel_diff": rel("draft_grad_norm"),
    "max_grad_rel_diff": diffs[worst],
    "worst_leaf": worst,
    "rtol": rtol,
  }
  out["passed"] = bool(
    max(out["loss_rel_diff"], out["policy_grad_norm_rel_diff"], out["draft_grad_norm_rel_diff"])
    <= rtol
    and out["max_grad_rel_diff"] <= rtol
    and np.isfinite(out["loss"])
  )
  return out


# ----------------------------------------------------------------------------- time


def first_moments(opt_state) -> dict[str, np.ndarray]:
  """Adam's first moments of a co-training state, keyed by their parameter's path
  ("['policy']['layers']['wq']"). One step from zero moments leaves mu = (1 - b1) * the step's
  (clipped) gradient, so comparing them relative to their norms compares the gradients."""
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(opt_state):
    names = [getattr(k, "name", None) for k in path]
    if "mu" in names:
      out[jax.tree_util.keystr(path[names.index("mu") + 1 :])] = np.asarray(x)
  return out


def run_steps(s: Setup, lays: dict[str, Layout], compiled: dict, *, repeats: int):
  """Runs every layout's compiled co-training step from the same initial state: returns
  ({layout: (metrics, first_moments)} of the first step (parity), {layout: median seconds of the
  step over `repeats` interleaved repeats after it} (a slow phase of the machine hits every
  layout; each state donated from its previous step)."""
  trainable = initial_trainable(s)
  states, batches, first = {}, {}, {}
  for name, lay in lays.items():
    _, state_sh = cotrain_state_shardings(s, lay)
    state = {
      "step": np.zeros((), np.int32),
      "params": trainable,
      "opt_state": jax.device_get(s.cotrain_tx.init(trainable)),
    }
    states[name] = jax.device_put(state, state_sh)
    batch, batch_sh = laid_out_batch(s, lay)
    batches[name] = jax.device_put(batch, batch_sh)
    states[name], metrics = jax.block_until_ready(compiled[name](states[name], batches[name]))
    first[name] = (
      jax.device_get(metrics),
      first_moments(jax.device_get(states[name]["opt_state"])),
    )
  times = {name: [] for name in lays}
  for _ in range(repeats):
    for name in lays:
      t0 = time.perf_counter()
      states[name] = jax.block_until_ready(compiled[name](states[name], batches[name]))[0]
      times[name].append(time.perf_counter() - t0)
  return first, {name: float(np.median(v)) for name, v in times.items() if v}


# ----------------------------------------------------------------------------- snapshots


def snapshot_text(s: Setup, lay: Layout) -> str:
  """One line per parameter and optimizer-state leaf of the co-training state: path, shape,
  dtype and PartitionSpec under `lay` (tests/snapshots/shardings/<layout>.txt)."""
  return render_snapshot(lay, *cotrain_state_shardings(s, lay))


def render_snapshot(lay: Layout, state, shardings) -> str:
  """The snapshot text of a state (abstract or placed) and its shardings; leaves other than the
  step, parameters and optimizer state (the RL state's key) are left out."""
  keep = ("step", "params", "opt_state")
  state = {k: state[k] for k in keep}
  lines = [f"# layout {lay.name}: " + lay.describe()]
  leaves = jax.tree_util.tree_leaves_with_path(state)
  specs = jax.tree_util.tree_leaves({k: shardings[k] for k in keep})
  for (path, x), sh in zip(leaves, specs, strict=True):
    key = jax.tree_util.keystr(path, simple=True, separator="/")
    shape = ",".join(str(d) for d in x.shape)
    lines.append(f"{key}  {x.dtype}[{shape}]  {tuple(sh.spec)}")
  return "\n".join(lines) + "\n"


def write_snapshots(config, directory: str) -> list[str]:
  """Regenerates the sharding snapshot of every named layout; returns the paths written."""
  s = make_setup(config, host_batch=False)
  os.makedirs(directory, exist_ok=True)
  paths = []
  for name in sorted(layouts.LAYOUTS):
    path = os.path.join(directory, f"{name}.txt")
    with open(path, "w") as f:
      f.write(snapshot_text(s, make_layout(name, named_parallel(name))))
    paths.append(path)
  return paths


# ----------------------------------------------------------------------------- the comparison


def compare(config) -> dict:
  """Every selected layout's figures (see the module docstring); `single` is the reference."""
  cmp = config.compare
  s = make_setup(config)
  lays, rows, compiled = {}, {}, {}
  for name, parallel in selected(config):
    lays[name] = make_layout(name, parallel)
    out = compile_layout(s, lays[name], sft=cmp.sft)
    compiled[name] = out.pop("compiled")
    rows[name] = {"devices": lays[name].devices, "mesh": layouts.describe(parallel.mesh), **out}
    c = out["cotrain"]
    print(
      f"{name:>24}: peak {c['peak_bytes'] / 2**20:8.2f} MiB, temp {c['temp_bytes'] / 2**20:8.2f} "
      f"MiB, collectives {c['collective_bytes'] / 2**20:8.3f} MiB/step "
      f"({c['compile_seconds']:.0f} s to compile)",
      flush=True,
    )
  if not (cmp.parity or cmp.repeats > 0):
    return rows
  # one run of each compiled step: the first step gives parity (its metrics and Adam's first
  # moments, no second program to compile), the repeats after it the step time
  first, med = run_steps(s, lays, compiled, repeats=cmp.repeats)
  if cmp.parity:
    for name in lays:
      rows[name]["parity"] = parity_figures(first[name], first["single"], rtol=cmp.parity_rtol)
      p = rows[name]["parity"]
      print(
        f"{name:>24}: parity {'ok' if p['passed'] else 'FAILED'} (loss {p['loss_rel_diff']:.1e}, "
        f"worst gradient leaf {p['max_grad_rel_diff']:.1e} at {p['worst_leaf']})",
        flush=True,
      )
  if cmp.repeats > 0:
    for name in lays:
      rows[name]["step_seconds"] = med[name]
      rows[name]["time_over_single"] = med[name] / med["single"]
  return rows


def summary(rows: dict) -> dict:
  with_parity = [r for r in rows.values() if "parity" in r]
  out = {
    "layouts": len(rows),
    "parity_failures": sum(not r["parity"]["passed"] for r in with_parity),
    "parity_checked": len(with_parity),
    "single_collective_bytes": rows["single"]["cotrain"]["collective_bytes"],
  }
  if with_parity:
    out["max_grad_rel_diff"] = max(r["parity"]["max_grad_rel_diff"] for r in with_parity)
  return out


def run(config, workdir: str) -> dict:
  """The comparison, written to workdir: results.json (provenance, goals), table.md, plots."""
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  os.makedirs(workdir, exist_ok=True)
  t0 = time.perf_counter()
  rows = compare(config)
  results = {
    "model": config.model.to_dict(),
    "batch_size": config.compare.batch_size,
    "seq_len": config.compare.seq_len,
    "repeats": config.compare.repeats,
    "compute": config.compute.to_dict(),
    "basis": "per device; compile-only on the CPU backend; times on simulated CPU devices that "
    "share this machine's cores (for information)",
    "layouts": rows,
  }
  results["summary"] = dict(summary(rows), wall_seconds=time.perf_counter() - t0)
  results = provenance.write_results(
    workdir, results, goals=provenance.goals_from_config(config.compare.goals)
  )
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(table(results) + "\n")
  plot(results, workdir)
  print(table(results))
  print(provenance.goals_table(results["goals"]), flush=True)
  return results


# ----------------------------------------------------------------------------- plan


def plan(config) -> dict:
  """Compiles the co-training step for abstract inputs (nothing is allocated) of
  `compare.plan.model` under every mesh of `compare.plan.meshes` (and the command line's),
  on `compare.plan.devices` devices; returns {mesh name: per-device figures}.

  With `compare.plan.isolate` each mesh compiles in a child process: XLA's partitioner aborts
  the whole process on a failed internal check (it does for fsdp x tensor meshes with pp or cp in
  jaxlib 0.10.2), and the plan must report such a mesh, not die of it."""
  p = config.compare.plan
  entries = [(name, _plan_parallel(name, sizes, p)) for name, sizes in p.meshes.items()]
  custom = custom_parallel(config.parallel)
  if custom is not None:
    entries.append(custom)
  rows = {}
  for name, parallel in entries:
    if int(parallel.devices) != int(p.devices):
      raise ValueError(
        f"config.compare.plan.meshes[{name!r}] covers {parallel.devices} devices; every planned "
        f"mesh must cover config.compare.plan.devices={p.devices}"
      )
    rows[name] = (
      _plan_isolated(config, name, parallel) if p.isolate else plan_row(config, name, parallel)
    )
    r = rows[name]
    if "error" in r:
      print(f"{name:>24}: {r['error']}", flush=True)
      continue
    print(
      f"{name:>24}: arguments {r['argument_bytes'] / 2**30:8.2f} GiB, temp "
      f"{r['temp_bytes'] / 2**30:8.2f} GiB, peak {r['peak_bytes'] / 2**30:8.2f} GiB, "
      f"collectives {r['collective_bytes'] / 2**30:8.2f} GiB/step "
      f"({r['compile_seconds']:.0f} s to compile)",
      flush=True,
    )
  return rows


def plan_row(config, name: str, parallel) -> dict:
  """One planned mesh's per-device figures, or {"error": ...} when it does not compile."""
  p = config.compare.plan
  c = config.copy_and_resolve_references()
  c.compute.update(p.compute.to_dict())
  s = make_setup(c, model=p.model, batch_size=p.batch_size, seq_len=p.seq_len, host_batch=False)
  lay = make_layout(name, parallel)
  try:
    out = compile_layout(s, lay, sft=False)
  except Exception as e:  # a layout that does not compile is reported, not hidden
    return {"mesh": layouts.describe(parallel.mesh), "error": f"{type(e).__name__}: {e}"[:400]}
  m = {a: int(parallel.mesh[a]) for a in layouts.AXES}
  # every device of a (data, fsdp) slice holds its rows; cp splits their tokens (each pipeline
  # stage sees every row of its slice)
  tokens = int(p.batch_size) // (m["data"] * m["fsdp"]) * int(p.seq_len) // m["cp"]
  return {
    "devices": lay.devices,
    "mesh": layouts.describe(parallel.mesh),
    "tokens_per_device": tokens,
    **out["cotrain"],
  }


def _plan_isolated(config, name: str, parallel) -> dict:
  """`plan_row` in a fresh (spawned) process with this process's environment (XLA_FLAGS: the
  simulated device count) and import path."""
  import concurrent.futures
  import multiprocessing

  ctx = multiprocessing.get_context("spawn")
  with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
    try:
      return pool.submit(plan_row, config, name, parallel).result()
    except concurrent.futures.process.BrokenProcessPool:
      return {
        "mesh": layouts.describe(parallel.mesh),
        "error": "the compiler aborted the process (an XLA internal check failed; its message "
        "is on stderr above)",
      }


def _plan_parallel(name: str, sizes, plan_cfg) -> ml_collections.ConfigDict:
  p = config_lib.layout_config("single")
  sizes = dict(sizes)
  if "shard_weights_over_cp" in sizes:
    p.shard_weights_over_cp = bool(sizes.pop("shard_weights_over_cp"))
  for axis, size in sizes.items():
    if axis not in layouts.AXES:
      raise ValueError(
        f"config.compare.plan.meshes[{name!r}] has axis {axis!r}; valid axes are {layouts.AXES}"
      )
    p.mesh[axis] = int(size)
  p.name, p.devices = "custom", int(plan_cfg.devices)
  p.pipeline.microbatches = int(plan_cfg.get("microbatches", 0)) or 2 * int(p.mesh.pp)
  # "every layer rematerialised" holds for pipelined meshes too: their stage bodies
  p.pipeline.remat = bool(plan_cfg.compute.get("remat", False))
  return p


def run_plan(config, workdir: str) -> dict:
  """`plan`, written to workdir/plan.json (provenance) and plan.md."""
  provenance.check_workdir(workdir)
  os.makedirs(workdir, exist_ok=True)
  p = config.compare.plan
  t0 = time.perf_counter()
  rows = plan(config)
  n_params = sum(
    math.prod(x.shape)
    for x in jax.tree.leaves(jax.eval_shape(lambda: pol.init_params(_plan_pcfg(config), 0)))
  )
  results = {
    "model": p.model.to_dict(),
    "policy_parameters": n_params,
    "batch_size": p.batch_size,
    "seq_len": p.seq_len,
    "compute": p.compute.to_dict(),
    "basis": "per device; compile-only on the CPU backend for abstract inputs",
    "meshes": rows,
    "summary": {
      "wall_seconds": time.perf_counter() - t0,
      "meshes_compiled": sum("error" not in r for r in rows.values()),
      **_plan_summary(rows, p.get("baseline", {})),
    },
  }
  results = provenance.write_results(
    workdir, results, filename="plan.json", goals=provenance.goals_from_config(p.get("goals", {}))
  )
  text = plan_table(results)
  with open(os.path.join(workdir, "plan.md"), "w") as f:
    f.write(text + "\n")
  print(text, flush=True)
  print(provenance.goals_table(results["goals"]), flush=True)
  return results


def _plan_summary(rows: dict, baseline) -> dict:
  """The figures the plan's goals read: the least arguments + temp per device over the compiled
  meshes with cp = 8 (weights sharded over cp), and fsdp8_cp8's collective and reduction bytes
  over `baseline`'s."""
  out = {}
  cp8 = {
    n: r["argument_bytes"] + r["temp_bytes"]
    for n, r in rows.items()
    if "error" not in r and "cp=8" in r["mesh"] and not n.endswith("_replicated")
  }
  if cp8:
    best = min(cp8, key=cp8.get)
    out.update(cp8_least_arguments_plus_temp_bytes=cp8[best], cp8_least_mesh=best)
  r = rows.get("fsdp8_cp8", {})
  if "error" not in r and r and baseline:
    reduce = sum(r["collectives"].get(k, {}).get("sent_bytes", 0.0) for k in REDUCTIONS)
    out.update(
      fsdp8_cp8_collective_ratio=r["collective_bytes"] / baseline["fsdp8_cp8_collective_bytes"],
      fsdp8_cp8_reduction_ratio=reduce / baseline["fsdp8_cp8_all_reduce_bytes"],
    )
  return out


REDUCTIONS = ("all-reduce", "reduce-scatter")


def _plan_pcfg(config) -> pol.PolicyConfig:
  m = config.compare.plan.model
  return pol.PolicyConfig.from_config(m, int(m.vocab_size))


# ----------------------------------------------------------------------------- table and plots


def _mib(n) -> str:
  return f"{n / 2**20:.2f}"


def table(results) -> str:
  """Per device, the co-training step: memory (MiB), FLOPs, collectives (MiB sent per step by
  kind), time over single and parity (worst gradient leaf relative to its norm)."""
  kinds = hlo.COLLECTIVE_KINDS
  head = (
    "| layout | devices | argument | output | temp | peak | GFLOP (XLA) | GFLOP (dot) | "
    + " | ".join(kinds)
    + " | time / single | parity: worst grad | sft: peak | sft: collectives |"
  )
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for name, r in results["layouts"].items():
    c = r["cotrain"]
    cells = [name, str(r["devices"])]
    cells += [_mib(c[k]) for k in QUANTITIES]
    cells += [f"{c['flops'] / 1e9:.3f}", f"{c['dot_flops'] / 1e9:.3f}"]
    cells += [_mib(c["collectives"][k]["sent_bytes"]) for k in kinds]
    cells.append(f"{r['time_over_single']:.2f}" if "time_over_single" in r else "-")
    if "parity" in r:
      p = r["parity"]
      cells.append(f"{p['max_grad_rel_diff']:.1e} ({'ok' if p['passed'] else 'FAILED'})")
    else:
      cells.append("-")
    sft = r.get("sft")
    cells += [_mib(sft["peak_bytes"]), _mib(sft["collective_bytes"])] if sft else ["-", "-"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def plan_table(results) -> str:
  kinds = hlo.COLLECTIVE_KINDS
  head = (
    "| mesh | tokens/device | argument | temp | peak | argument + temp | H100 80 GB | H200 141 GB | "
    + " | ".join(kinds)
    + " |"
  )
  lines = [
    f"policy parameters: {results['policy_parameters'] / 1e9:.1f} B; GiB per device",
    "",
    head,
    "|" + "---|" * (head.count("|") - 1),
  ]
  gib = lambda n: f"{n / 2**30:.2f}"
  for name, r in results["meshes"].items():
    if "error" in r:
      lines.append(f"| {name} | {r['error'][:60]} |" + " |" * (len(kinds) + 6))
      continue
    cells = [name, str(r.get("tokens_per_device", "-"))]
    cells += [gib(r[k]) for k in ("argument_bytes", "temp_bytes", "peak_bytes")]
    need = r["argument_bytes"] + r["temp_bytes"]
    cells += [gib(need)] + [("fits" if need <= hbm else "over") for hbm in (80e9, 141e9)]
    cells += [gib(r["collectives"][k]["sent_bytes"]) for k in kinds]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


PLOTS = {
  # file: (ylabel, value of a row or None)
  "peak_memory.png": ("peak MiB per device", lambda r: r["cotrain"]["peak_bytes"] / 2**20),
  "argument_memory.png": (
    "argument MiB per device",
    lambda r: r["cotrain"]["argument_bytes"] / 2**20,
  ),
  "temp_memory.png": ("temp MiB per device", lambda r: r["cotrain"]["temp_bytes"] / 2**20),
  "flops.png": ("matmul GFLOP per device (dot)", lambda r: r["cotrain"]["dot_flops"] / 1e9),
  "time.png": ("step time / single", lambda r: r.get("time_over_single")),
  "parity.png": (
    "worst gradient leaf, ||g - g_single|| / ||g_single||",
    lambda r: r["parity"]["max_grad_rel_diff"] if "parity" in r else None,
  ),
}


def plot(results, directory: str) -> list[str]:
  """One bar chart per quantity across layouts (PLOTS), and collectives stacked by kind."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = results["layouts"]
  names = list(rows)
  paths = []
  for filename, (ylabel, value) in PLOTS.items():
    vals = [value(rows[n]) for n in names]
    if all(v is None for v in vals):
      continue
    fig, ax = plt.subplots(figsize=(max(5.0, 0.45 * len(names)), 3.6))
    ax.bar(names, [np.nan if v is None else v for v in vals])
    if filename == "parity.png":
      ax.set_yscale("log")
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(axis="x", rotation=60, labelsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths.append(os.path.join(directory, filename))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
  fig, ax = plt.subplots(figsize=(max(5.0, 0.45 * len(names)), 3.6))
  bottom = np.zeros(len(names))
  for kind in hlo.COLLECTIVE_KINDS:
    v = np.array([rows[n]["cotrain"]["collectives"][kind]["sent_bytes"] / 2**20 for n in names])
    ax.bar(names, v, bottom=bottom, label=kind)
    bottom += v
  ax.set_ylabel("MiB sent per device per step", fontsize=8)
  ax.tick_params(axis="x", rotation=60, labelsize=7)
  ax.legend(fontsize=7)
  ax.grid(axis="y", alpha=0.3)
  fig.tight_layout()
  paths.append(os.path.join(directory, "collectives.png"))
  fig.savefig(paths[-1], dpi=110)
  plt.close(fig)
  return paths
