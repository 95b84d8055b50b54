"""`train_and_evaluate(config, workdir)`: SFT of the policy, draft pretraining, and a speculative
decoding report, with evaluation, metrics, plots and exact resume."""

from __future__ import annotations

import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tensorflow_datasets as tfds
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from specdraft import config as config_lib
from specdraft.decode import autoregressive, speculative
from specdraft.model import eagle3
from specdraft.model import policy as pol
from specdraft.parallel import mesh as mesh_lib
from specdraft.tasks import CharTokenizer, make_task
from specdraft.tasks import datasets as task_data
from specdraft.tasks import loader
from specdraft.train import checkpoint as ckpt_lib
from specdraft.train import draft as draft_lib
from specdraft.train import step as step_lib


# ----------------------------------------------------------------------------- setup


def policy_config(config) -> pol.PolicyConfig:
  return pol.PolicyConfig.from_config(config.model, CharTokenizer().vocab_size)


def init_state(pcfg: pol.PolicyConfig, tx, mesh, rules, seed: int):
  """Abstract init -> shardings -> materialise sharded (never whole on one device)."""
  abstract = jax.eval_shape(lambda: pol.init_params(pcfg, seed))
  shardings = mesh_lib.tree_shardings(pol.param_logical_axes(abstract), abstract, rules, mesh)
  params = jax.jit(lambda: pol.init_params(pcfg, seed), out_shardings=shardings)()
  replicated = NamedSharding(mesh, P())
  # Moments follow their parameters; counters and other scalars are replicated on the mesh.
  opt_shardings = optax.tree_map_params(
    tx, lambda _, s: s, jax.eval_shape(tx.init, abstract), shardings,
    transform_non_params=lambda _: replicated)
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings)(params)
  step = jax.device_put(jnp.zeros((), jnp.int32), replicated)
  return {"step": step, "params": params, "opt_state": opt_state}


def state_shardings(state):
  return jax.tree.map(lambda x: x.sharding, state)


def abstract_like(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


# ----------------------------------------------------------------------------- evaluation


def prompt_len_for(task) -> int:
  return task.max_length() + 1  # BOS; a safe upper bound on any prompt


def evaluate(params, pcfg, task, examples, *, batch_size: int, max_new_tokens: int,
             prompt_len: int, sharding=None) -> dict:
  """Greedy accuracy (mean reward) on `examples`; batches are padded by repetition."""
  tok = CharTokenizer()
  rewards, samples = [], []
  for i in range(0, len(examples), batch_size):
    chunk = examples[i:i + batch_size]
    padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
    prompts, lengths = loader.prompt_batch(padded, tok, prompt_len)
    if sharding is not None:
      prompts, lengths = jax.device_put((prompts, lengths), (sharding, sharding.update(
        spec=P(sharding.spec[0]))))
    gen = autoregressive.generate(params, pcfg, prompts, lengths, jax.random.key(0),
                                  max_new_tokens=max_new_tokens, temperature=0.0)
    toks = np.asarray(gen.tokens)
    for ex, row in zip(chunk, toks):
      completion = tok.decode(row)
      rewards.append(task.reward(ex, completion))
      if len(samples) < 4:
        samples.append({"prompt": ex.prompt, "completion": completion, "answer": ex.answer})
  return {"accuracy": float(np.mean(rewards)), "samples": samples}


# ----------------------------------------------------------------------------- run files


class RunLog:
  """Append-only JSONL metrics that a resumed run truncates back to its checkpoint step."""

  def __init__(self, path: str):
    self.path = path

  def truncate_after(self, step: int) -> None:
    if not os.path.exists(self.path):
      return
    with open(self.path) as f:
      keep = [ln for ln in f if ln.strip() and json.loads(ln)["step"] <= step]
    with open(self.path, "w") as f:
      f.writelines(keep)

  def write(self, record: dict) -> None:
    with open(self.path, "a") as f:
      f.write(json.dumps(record) + "\n")

  def read(self) -> list[dict]:
    if not os.path.exists(self.path):
      return []
    with open(self.path) as f:
      return [json.loads(ln) for ln in f if ln.strip()]


def plot_curves(path: str, series: dict[str, tuple[list, list]], *, title: str, ylabel: str):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 3.5))
  for label, (x, y) in series.items():
    ax.plot(x, y, label=label, marker="o" if len(x) < 20 else None)
  ax.set_xlabel("step")
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  if len(series) > 1:
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


# ----------------------------------------------------------------------------- the loop


class Context:
  """Everything a run's phases share: task, data sources, model configs, mesh and layouts."""

  def __init__(self, config, workdir: str):
    config_lib.validate(config)
    tfds.disable_progress_bar()
    self.config, self.workdir = config, workdir
    self.task = make_task(config.task)
    self.tok = CharTokenizer()
    self.train_src = task_data.data_source(config.task, config.data.data_dir, "train")
    test_src = task_data.data_source(config.task, config.data.data_dir, "test")
    n_eval = min(config.eval.num_examples, len(test_src))
    self.eval_examples = [task_data.to_example(test_src[i]) for i in range(n_eval)]
    self.pcfg = policy_config(config)
    self.dcfg = eagle3.DraftConfig.from_config(config.draft, self.pcfg)
    self.mesh = mesh_lib.make_mesh(config.parallel)
    self.rules = [tuple(r) for r in config.parallel.rules]
    self.batch_sh = mesh_lib.batch_sharding(self.mesh, self.rules)
    self.prompt_len = prompt_len_for(self.task)
    os.makedirs(os.path.join(workdir, "plots"), exist_ok=True)

  def checkpointer(self, phase: str) -> ckpt_lib.Checkpointer:
    return ckpt_lib.Checkpointer(
      os.path.join(os.path.abspath(self.workdir), "checkpoints", phase),
      keep=self.config.checkpoint.keep)

  def log(self, name: str) -> RunLog:
    return RunLog(os.path.join(self.workdir, name))


def _restore(ckpt, state, data_iter, *logs):
  """Restores the newest readable checkpoint (if any) and truncates logs back to it."""
  restored = ckpt.restore_latest(abstract_like(state))
  start = 0
  if restored is not None:
    start, state, extra = restored
    if data_iter is not None:
      data_iter.set_state(extra["data_iter"])
    print(f"Resumed {os.path.basename(ckpt.mngr.directory)} from step {start}", flush=True)
  for lg in logs:
    lg.truncate_after(start)
  return start, state


def sft_phase(ctx: Context, stop_after: int | None = None):
  """Supervised fine-tuning of the policy; returns (params, finished)."""
  c = ctx.config
  batches = loader.sft_dataset(ctx.train_src, ctx.tok, batch_size=c.data.batch_size,
                               seq_len=c.data.seq_len, packing=c.data.packing,
                               seed=c.data.shuffle_seed)
  data_iter = iter(batches)
  tx = step_lib.make_optimizer(c.sft, c.sft.steps)
  state = init_state(ctx.pcfg, tx, ctx.mesh, ctx.rules, c.seed)
  sh = state_shardings(state)
  train_step = jax.jit(functools.partial(step_lib.sft_step, cfg=ctx.pcfg, tx=tx),
                       in_shardings=(sh, ctx.batch_sh), out_shardings=(sh, None),
                       donate_argnums=0)
  mlog, elog = ctx.log("sft_metrics.jsonl"), ctx.log("eval.jsonl")
  ckpt = ctx.checkpointer("sft")
  start, state = _restore(ckpt, state, data_iter, mlog, elog)
  eval_kw = dict(batch_size=c.eval.batch_size, max_new_tokens=c.decode.max_new_tokens,
                 prompt_len=ctx.prompt_len, sharding=ctx.batch_sh)

  def run_eval(step):
    res = evaluate(state["params"], ctx.pcfg, ctx.task, ctx.eval_examples, **eval_kw)
    elog.write({"step": step, "accuracy": res["accuracy"], "samples": res["samples"]})
    return res["accuracy"]

  if start == 0:
    run_eval(0)
  steps = c.sft.steps
  last = min(steps, stop_after) if stop_after is not None else steps
  bar = tqdm(range(start, last), desc="sft", initial=start, total=steps, dynamic_ncols=True)
  t_last = time.time()
  for i in bar:
    batch = jax.device_put(next(data_iter), ctx.batch_sh)
    state, metrics = train_step(state, batch)
    step = i + 1
    if step % c.sft.log_every == 0 or step == steps:
      m = {k: float(v) for k, v in jax.device_get(metrics).items()}
      now = time.time()
      m.update(step=step, seconds_per_step=(now - t_last) / c.sft.log_every)
      t_last = now
      mlog.write(m)
      bar.set_postfix(loss=f"{m['loss']:.3f}", tok_acc=f"{m['token_accuracy']:.3f}")
    if step % c.eval.every == 0 or step == steps:
      bar.write(f"sft step {step}: greedy test accuracy {run_eval(step):.3f}")
    if step % c.checkpoint.every == 0 or step == steps:
      ckpt.save(step, state, {"data_iter": data_iter.get_state()})
  bar.close()
  ckpt.close()
  return state["params"], last == steps


def draft_phase(ctx: Context, params, stop_after: int | None = None):
  """Distils the draft from the fixed SFT policy on the policy's own generations."""
  c, dc = ctx.config, ctx.config.draft
  tx = step_lib.make_optimizer(dc, dc.pretrain_steps)
  replicated = NamedSharding(ctx.mesh, P())

  def init(p):
    dparams = eagle3.init_params(ctx.dcfg, c.seed + 1, p, ctx.pcfg)
    return {"step": jnp.zeros((), jnp.int32), "params": dparams, "opt_state": tx.init(dparams),
            "key": jax.random.key_data(jax.random.key(c.seed + 2))}

  state = jax.jit(init, out_shardings=replicated)(params)
  prompts = iter(loader.prompt_dataset(ctx.train_src, ctx.tok, batch_size=dc.batch_size,
                                       prompt_len=ctx.prompt_len, seed=c.data.shuffle_seed + 1))
  step_fn = jax.jit(functools.partial(
    draft_lib.draft_iteration, pcfg=ctx.pcfg, dcfg=ctx.dcfg, tx=tx,
    max_new_tokens=c.decode.max_new_tokens, temperature=dc.rollout_temperature),
    out_shardings=(replicated, None), donate_argnums=0)
  mlog = ctx.log("draft_metrics.jsonl")
  ckpt = ctx.checkpointer("draft")
  start, state = _restore(ckpt, state, prompts, mlog)
  steps = dc.pretrain_steps
  last = min(steps, stop_after) if stop_after is not None else steps
  bar = tqdm(range(start, last), desc="draft", initial=start, total=steps, dynamic_ncols=True)
  for i in bar:
    pb = next(prompts)
    state, metrics = step_fn(state, params, *jax.device_put(
      (pb["prompts"], pb["prompt_lengths"]), (ctx.batch_sh, ctx.batch_sh.update(
        spec=P(ctx.batch_sh.spec[0])))))
    step = i + 1
    if step % dc.log_every == 0 or step == steps:
      m = {k: float(v) for k, v in jax.device_get(metrics).items()}
      m["step"] = step
      mlog.write(m)
      bar.set_postfix(loss=f"{m['draft_loss']:.3f}", acc0=f"{m['ttt_acc_0']:.3f}")
    if step % c.checkpoint.every == 0 or step == steps:
      ckpt.save(step, state, {"data_iter": prompts.get_state()})
  bar.close()
  ckpt.close()
  return state["params"], last == steps


def rollout_report(ctx: Context, params, dparams, *, temperature: float, repeats: int = 3):
  """SD vs AR on the held-out prompts: tau, acceptance, tokens/s and greedy equality."""
  c = ctx.config
  B = c.eval.batch_size
  exs = ctx.eval_examples[:B] + [ctx.eval_examples[-1]] * max(0, B - len(ctx.eval_examples))
  prompts, lengths = loader.prompt_batch(exs, ctx.tok, ctx.prompt_len)
  kw = dict(max_new_tokens=c.decode.max_new_tokens)
  run_ar = lambda key, t: autoregressive.generate(params, ctx.pcfg, prompts, lengths, key,
                                                  temperature=t, **kw)
  run_sd = lambda key, t: speculative.generate(params, dparams, ctx.pcfg, ctx.dcfg, prompts,
                                               lengths, key, temperature=t,
                                               num_draft=c.decode.num_draft, **kw)
  greedy_equal = float(np.mean(np.all(np.asarray(run_ar(jax.random.key(0), 0.0).tokens) ==
                                      np.asarray(run_sd(jax.random.key(0), 0.0).tokens), axis=1)))
  times = {"ar": [], "sd": []}
  outs = {}
  jax.block_until_ready(run_ar(jax.random.key(1), temperature))  # compile
  jax.block_until_ready(run_sd(jax.random.key(1), temperature))
  for r in range(repeats):  # interleaved
    for name, fn in (("ar", run_ar), ("sd", run_sd)):
      t0 = time.perf_counter()
      outs[name] = jax.block_until_ready(fn(jax.random.key(10 + r), temperature))
      times[name].append(time.perf_counter() - t0)
  st = jax.device_get(outs["sd"].stats)
  n_ar, n_sd = int(np.sum(outs["ar"].lengths)), int(np.sum(outs["sd"].lengths))
  return {
    "temperature": temperature,
    "tau": float(st["tau_sum"] / max(st["row_rounds"], 1)),
    "accept_per_position": (st["accept_counts"] / np.maximum(st["reach_counts"], 1)).tolist(),
    "ar_tokens_per_s": n_ar / float(np.median(times["ar"])),
    "sd_tokens_per_s": n_sd / float(np.median(times["sd"])),
    "speedup": (n_sd / float(np.median(times["sd"]))) / (n_ar / float(np.median(times["ar"]))),
    "sd_policy_passes_per_token": int(st["policy_passes"]) * B / max(n_sd, 1),
    "ar_policy_passes_per_token": int(outs["ar"].stats["policy_passes"]) * B / max(n_ar, 1),
    "greedy_equal": greedy_equal,
  }


def _plots(ctx: Context):
  mrows, erows = ctx.log("sft_metrics.jsonl").read(), ctx.log("eval.jsonl").read()
  drows = ctx.log("draft_metrics.jsonl").read()
  pdir = os.path.join(ctx.workdir, "plots")
  if mrows:
    plot_curves(os.path.join(pdir, "sft_loss.png"),
                {"loss": ([r["step"] for r in mrows], [r["loss"] for r in mrows])},
                title="SFT loss", ylabel="cross-entropy (answer tokens)")
  if erows:
    plot_curves(os.path.join(pdir, "eval_accuracy.png"),
                {"greedy": ([r["step"] for r in erows], [r["accuracy"] for r in erows])},
                title=f"held-out greedy accuracy ({ctx.config.task.name})", ylabel="accuracy")
  if drows:
    K = ctx.dcfg.ttt_steps
    plot_curves(os.path.join(pdir, "draft_ttt_acc.png"),
                {f"step {k}": ([r["step"] for r in drows], [r[f"ttt_acc_{k}"] for r in drows])
                 for k in range(0, K, max(1, K // 4))},
                title="draft agreement with the policy (TTT steps)", ylabel="top-1 agreement")


def train_and_evaluate(config, workdir: str, *, stop_after: tuple[str, int] | None = None) -> dict:
  """SFT -> draft pretraining -> SD report. Writes metrics, evals, plots and checkpoints.

  Each phase checkpoints on its own and is skipped when already complete, so a killed run
  resumes where it stopped. `stop_after=(phase, step)` ends the run early (to test resumption).
  Returns the run summary (also written to `workdir/summary.json`).
  """
  t_start = time.time()
  ctx = Context(config, workdir)
  stop = dict([stop_after]) if stop_after else {}
  params, done = sft_phase(ctx, stop.get("sft"))
  summary = {"task": config.task.name, "layout": config.parallel.name}
  dparams = None
  if done and config.draft.pretrain_steps > 0:
    dparams, done = draft_phase(ctx, params, stop.get("draft"))
  if done and dparams is not None:
    summary["rollout"] = rollout_report(ctx, params, dparams,
                                        temperature=config.eval.sd_temperature)
  _plots(ctx)
  erows = ctx.log("eval.jsonl").read()
  mrows = ctx.log("sft_metrics.jsonl").read()
  drows = ctx.log("draft_metrics.jsonl").read()
  summary.update({
    "sft_steps": mrows[-1]["step"] if mrows else 0,
    "accuracy_before": erows[0]["accuracy"] if erows else None,
    "accuracy_after": erows[-1]["accuracy"] if erows else None,
    "final_loss": mrows[-1]["loss"] if mrows else None,
    "draft_steps": drows[-1]["step"] if drows else 0,
    "draft_loss": drows[-1]["draft_loss"] if drows else None,
    "wall_seconds": time.time() - t_start,
  })
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary
