"""`train_and_evaluate(config, workdir)`: SFT of the policy, draft pretraining, and a speculative
decoding report, with evaluation, metrics, plots and exact resume."""

from __future__ import annotations

import functools
import json
import os
import sys
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
from specdraft.decode.compare import compare_rollouts
from specdraft.decode.sampling import join_prompt_completion
from specdraft.model import eagle3
from specdraft.model import policy as pol
from specdraft.parallel import mesh as mesh_lib
from specdraft.rl import grpo
from specdraft.tasks import CharTokenizer, Example, loader, make_task
from specdraft.tasks import datasets as task_data
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
    tx,
    lambda _, s: s,
    jax.eval_shape(tx.init, abstract),
    shardings,
    transform_non_params=lambda _: replicated,
  )
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


def evaluate(
  params,
  pcfg,
  task,
  examples,
  *,
  batch_size: int,
  max_new_tokens: int,
  prompt_len: int,
  sharding=None,
) -> dict:
  """Greedy accuracy (mean reward) on `examples`; batches are padded by repetition."""
  tok = CharTokenizer()
  rewards, samples = [], []
  for i in range(0, len(examples), batch_size):
    chunk = examples[i : i + batch_size]
    padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
    prompts, lengths = loader.prompt_batch(padded, tok, prompt_len)
    if sharding is not None:
      prompts, lengths = jax.device_put(
        (prompts, lengths), (sharding, sharding.update(spec=P(*sharding.spec[:1])))
      )
    gen = autoregressive.generate(
      params,
      pcfg,
      prompts,
      lengths,
      jax.random.key(0),
      max_new_tokens=max_new_tokens,
      temperature=0.0,
    )
    toks = np.asarray(gen.tokens)
    for ex, row in zip(chunk, toks):
      completion = tok.decode(row)
      rewards.append(task.reward(ex, completion))
      if len(samples) < 4:
        samples.append({"prompt": ex.prompt, "completion": completion, "answer": ex.answer})
  return {"accuracy": float(np.mean(rewards)), "samples": samples}


# ----------------------------------------------------------------------------- run files


def progress(iterable, **kw):
  """tqdm that redraws often on a terminal and rarely in a log file."""
  return tqdm(iterable, dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 10.0, **kw)


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
    # Pipeline layouts (pp > 1): training steps run the policy as a pipeline over 'pp' with the
    # draft on the last stage; rollouts and evaluation run the unpipelined decoder.
    self.pipeline = None
    if int(config.parallel.mesh.get("pp", 1)) > 1:
      from specdraft.model.pipelined import PipelineSpec

      self.pipeline = PipelineSpec.from_config(config.parallel.pipeline)
    self.prompt_len = prompt_len_for(self.task)
    os.makedirs(os.path.join(workdir, "plots"), exist_ok=True)

  def checkpointer(self, phase: str) -> ckpt_lib.Checkpointer:
    return ckpt_lib.Checkpointer(
      os.path.join(os.path.abspath(self.workdir), "checkpoints", phase),
      keep=self.config.checkpoint.keep,
    )

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
  batches = loader.sft_dataset(
    ctx.train_src,
    ctx.tok,
    batch_size=c.data.batch_size,
    seq_len=c.data.seq_len,
    packing=c.data.packing,
    seed=c.data.shuffle_seed,
  )
  data_iter = iter(batches)
  tx = step_lib.make_optimizer(c.sft, c.sft.steps)
  state = init_state(ctx.pcfg, tx, ctx.mesh, ctx.rules, c.seed)
  sh = state_shardings(state)
  train_step = jax.jit(
    functools.partial(step_lib.sft_step, cfg=ctx.pcfg, tx=tx, mesh=ctx.mesh, pipeline=ctx.pipeline),
    in_shardings=(sh, ctx.batch_sh),
    out_shardings=(sh, None),
    donate_argnums=0,
  )
  mlog, elog = ctx.log("sft_metrics.jsonl"), ctx.log("eval.jsonl")
  ckpt = ctx.checkpointer("sft")
  start, state = _restore(ckpt, state, data_iter, mlog, elog)
  eval_kw = dict(
    batch_size=c.eval.batch_size,
    max_new_tokens=c.decode.max_new_tokens,
    prompt_len=ctx.prompt_len,
    sharding=ctx.batch_sh,
  )

  def run_eval(step):
    res = evaluate(state["params"], ctx.pcfg, ctx.task, ctx.eval_examples, **eval_kw)
    elog.write({"step": step, "accuracy": res["accuracy"], "samples": res["samples"]})
    return res["accuracy"]

  if start == 0:
    run_eval(0)
  steps = c.sft.steps
  last = min(steps, stop_after) if stop_after is not None else steps
  bar = progress(range(start, last), desc="sft", initial=start, total=steps)
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
    return {
      "step": jnp.zeros((), jnp.int32),
      "params": dparams,
      "opt_state": tx.init(dparams),
      "key": jax.random.key_data(jax.random.key(c.seed + 2)),
    }

  state = jax.jit(init, out_shardings=replicated)(params)
  prompts = iter(
    loader.prompt_dataset(
      ctx.train_src,
      ctx.tok,
      batch_size=dc.batch_size,
      prompt_len=ctx.prompt_len,
      seed=c.data.shuffle_seed + 1,
    )
  )
  step_fn = jax.jit(
    functools.partial(
      draft_lib.draft_iteration,
      pcfg=ctx.pcfg,
      dcfg=ctx.dcfg,
      tx=tx,
      max_new_tokens=c.decode.max_new_tokens,
      temperature=dc.rollout_temperature,
      mesh=ctx.mesh,
      pipeline=ctx.pipeline,
    ),
    out_shardings=(replicated, None),
    donate_argnums=0,
  )
  mlog = ctx.log("draft_metrics.jsonl")
  ckpt = ctx.checkpointer("draft")
  start, state = _restore(ckpt, state, prompts, mlog)
  steps = dc.pretrain_steps
  last = min(steps, stop_after) if stop_after is not None else steps
  bar = progress(range(start, last), desc="draft", initial=start, total=steps)
  for i in bar:
    pb = next(prompts)
    state, metrics = step_fn(
      state,
      params,
      *mesh_lib.shard_batch((pb["prompts"], pb["prompt_lengths"]), ctx.mesh, ctx.rules),
    )
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


def _rollout_fn(ctx: Context, mode: str, max_new_tokens: int, temperature: float):
  """(params, dparams, prompts, lengths, key) -> Generation, for rollout.draft = mode."""
  if mode == "none":
    return lambda p, d, pr, ln, k: autoregressive.generate(
      p, ctx.pcfg, pr, ln, k, max_new_tokens=max_new_tokens, temperature=temperature
    )
  return lambda p, d, pr, ln, k: speculative.generate(
    p,
    d,
    ctx.pcfg,
    ctx.dcfg,
    pr,
    ln,
    k,
    max_new_tokens=max_new_tokens,
    temperature=temperature,
    num_draft=ctx.config.decode.num_draft,
  )


def _scalar_metrics(metrics) -> dict:
  return {k: float(v) for k, v in jax.device_get(metrics).items() if np.ndim(v) == 0}


def rl_phase(ctx: Context, params, dparams, stop_after: int | None = None):
  """GRPO with speculative rollouts and the one-step co-training of policy and draft.

  rollout.draft: cotrained (SD; the draft trains with the policy), fixed (SD; frozen draft),
  none (autoregressive rollouts; the draft is not trained). Returns (state, finished).
  """
  c, rl = ctx.config, ctx.config.rl
  mode = c.rollout.draft
  train_draft = mode == "cotrained"
  G, n_prompts = rl.group_size, rl.prompts_per_step
  N = rl.max_new_tokens or c.decode.max_new_tokens
  tx = step_lib.make_cotrain_optimizer(rl, c.draft, train_draft=train_draft)
  replicated = NamedSharding(ctx.mesh, P())

  def init(p, d):
    trainable = {"policy": p, "draft": d}
    return {
      "step": jnp.zeros((), jnp.int32),
      "params": trainable,
      "opt_state": tx.init(trainable),
      "key": jax.random.key_data(jax.random.key(c.seed + 3)),
    }

  state = jax.jit(init)(params, dparams)
  ref_params = params if rl.beta > 0 else None
  step_fn = jax.jit(
    functools.partial(
      step_lib.cotrain_step,
      pcfg=ctx.pcfg,
      dcfg=ctx.dcfg,
      rl_cfg=rl,
      tx=tx,
      lam=rl.lam,
      train_draft=train_draft,
      ref_params=ref_params,
      attn_impl=c.draft.attn_impl,
      mesh=ctx.mesh,
      pipeline=ctx.pipeline,
    ),
    donate_argnums=0,
  )
  rollout = _rollout_fn(ctx, mode, N, rl.temperature)

  @jax.jit
  def rollout_step(trainable, key_data, prompts, lengths):
    key, sub = jax.random.split(jax.random.wrap_key_data(key_data))
    gen = rollout(trainable["policy"], trainable["draft"], prompts, lengths, sub)
    return gen, join_prompt_completion(prompts, lengths, gen), jax.random.key_data(key)

  prompts = iter(
    loader.prompt_dataset(
      ctx.train_src,
      ctx.tok,
      batch_size=n_prompts,
      prompt_len=ctx.prompt_len,
      seed=c.data.shuffle_seed + 2,
    )
  )
  mlog, elog = ctx.log("metrics.jsonl"), ctx.log("rl_eval.jsonl")
  ckpt = ctx.checkpointer("rl")
  start, state = _restore(ckpt, state, prompts, mlog, elog)
  eval_kw = dict(
    batch_size=c.eval.batch_size,
    max_new_tokens=c.decode.max_new_tokens,
    prompt_len=ctx.prompt_len,
    sharding=ctx.batch_sh,
  )
  if start == 0:
    res = evaluate(state["params"]["policy"], ctx.pcfg, ctx.task, ctx.eval_examples, **eval_kw)
    elog.write({"step": 0, "accuracy": res["accuracy"]})
  last = min(rl.steps, stop_after) if stop_after is not None else rl.steps
  bar = progress(range(start, last), desc=f"rl ({mode})", initial=start, total=rl.steps)
  for i in bar:
    pb = next(prompts)
    pr = np.repeat(pb["prompts"], G, axis=0)
    ln = np.repeat(pb["prompt_lengths"], G, axis=0)
    t0 = time.perf_counter()
    gen, batch, key_data = jax.block_until_ready(
      rollout_step(state["params"], state["key"], *jax.device_put((pr, ln), replicated))
    )
    rollout_s = time.perf_counter() - t0
    texts = [ctx.tok.decode(row) for row in np.asarray(gen.tokens)]
    exs = [
      Example(str(p), str(a))
      for p, a in zip(np.repeat(pb["prompt_text"], G), np.repeat(pb["answer_text"], G))
    ]
    rewards = np.asarray([ctx.task.reward(e, t) for e, t in zip(exs, texts)], np.float32)
    batch = dict(
      batch, advantages=grpo.group_advantages(jnp.asarray(rewards), G, mode=rl.advantage)
    )
    state = dict(state, key=key_data)
    t1 = time.perf_counter()
    state, metrics = jax.block_until_ready(
      step_fn(state, mesh_lib.shard_batch(batch, ctx.mesh, ctx.rules))
    )
    train_s = time.perf_counter() - t1
    st = jax.device_get(gen.stats)
    ntok = int(np.sum(gen.lengths))
    m = _scalar_metrics(metrics)
    m.update(
      step=i + 1,
      reward_mean=float(rewards.mean()),
      accuracy=float(np.mean(rewards > 0)),
      rollout_seconds=rollout_s,
      train_seconds=train_s,
      policy_passes_per_token=int(st["policy_passes"]) * len(rewards) / max(ntok, 1),
      mean_length=ntok / len(rewards),
    )
    if "tau_sum" in st:
      m["accept_len"] = float(st["tau_sum"] / max(st["row_rounds"], 1))
      m["accept_per_position"] = (st["accept_counts"] / np.maximum(st["reach_counts"], 1)).tolist()
    else:
      m["accept_len"], m["accept_per_position"] = 1.0, []
    m.setdefault("draft_loss", None)
    if hasattr(ctx.task, "format_of"):
      fmts = [ctx.task.format_of(t) for t in texts]
      m["format_share"] = {f: fmts.count(f) / len(fmts) for f in sorted(set(fmts))}
    mlog.write(m)
    bar.set_postfix(reward=f"{m['reward_mean']:.2f}", tau=f"{m['accept_len']:.2f}")
    step = i + 1
    if step % rl.eval_every == 0 or step == rl.steps:
      res = evaluate(state["params"]["policy"], ctx.pcfg, ctx.task, ctx.eval_examples, **eval_kw)
      elog.write({"step": step, "accuracy": res["accuracy"]})
      bar.write(f"rl step {step}: greedy test accuracy {res['accuracy']:.3f}")
    if step % c.checkpoint.every == 0 or step == rl.steps:
      ckpt.save(step, state, {"data_iter": prompts.get_state()})
  bar.close()
  ckpt.close()
  return state, last == rl.steps


def rollout_report(ctx: Context, params, dparams, *, temperature: float, repeats: int = 3):
  """SD vs AR on the held-out prompts (`decode.compare.compare_rollouts`)."""
  c = ctx.config
  B = c.eval.batch_size
  exs = [ctx.eval_examples[i % len(ctx.eval_examples)] for i in range(B)]
  prompts_BS, lengths_B = loader.prompt_batch(exs, ctx.tok, ctx.prompt_len)
  return compare_rollouts(
    params,
    dparams,
    ctx.pcfg,
    ctx.dcfg,
    prompts_BS,
    lengths_B,
    max_new_tokens=c.decode.max_new_tokens,
    num_draft=c.decode.num_draft,
    temperature=temperature,
    repeats=repeats,
  )


def _plots(ctx: Context):
  mrows, erows = ctx.log("sft_metrics.jsonl").read(), ctx.log("eval.jsonl").read()
  drows = ctx.log("draft_metrics.jsonl").read()
  pdir = os.path.join(ctx.workdir, "plots")
  if mrows:
    plot_curves(
      os.path.join(pdir, "sft_loss.png"),
      {"loss": ([r["step"] for r in mrows], [r["loss"] for r in mrows])},
      title="SFT loss",
      ylabel="cross-entropy (answer tokens)",
    )
  if erows:
    plot_curves(
      os.path.join(pdir, "eval_accuracy.png"),
      {"greedy": ([r["step"] for r in erows], [r["accuracy"] for r in erows])},
      title=f"held-out greedy accuracy ({ctx.config.task.name})",
      ylabel="accuracy",
    )
  rrows = ctx.log("metrics.jsonl").read()
  if rrows:
    steps = [r["step"] for r in rrows]
    plot_curves(
      os.path.join(pdir, "reward.png"),
      {"reward": (steps, [r["reward_mean"] for r in rrows])},
      title=f"RL reward (rollout.draft={ctx.config.rollout.draft})",
      ylabel="mean reward",
    )
    plot_curves(
      os.path.join(pdir, "accept_len.png"),
      {"tau": (steps, [r["accept_len"] for r in rrows])},
      title="accepted length per SD round (tau)",
      ylabel="tau",
    )
  if drows:
    K = ctx.dcfg.ttt_steps
    plot_curves(
      os.path.join(pdir, "draft_ttt_acc.png"),
      {
        f"step {k}": ([r["step"] for r in drows], [r[f"ttt_acc_{k}"] for r in drows])
        for k in range(0, K, max(1, K // 4))
      },
      title="draft agreement with the policy (TTT steps)",
      ylabel="top-1 agreement",
    )


def train_and_evaluate(config, workdir: str, *, stop_after: tuple[str, int] | None = None) -> dict:
  """SFT -> draft pretraining -> RL with (co-trained) speculative rollouts -> SD report.

  Each phase checkpoints on its own and is skipped when already complete, so a killed run
  resumes where it stopped. `stop_after=(phase, step)` ends the run early (to test resumption).
  Writes metrics, evals, plots and checkpoints; returns the run summary (also in
  `workdir/summary.json`).
  """
  t_start = time.time()
  ctx = Context(config, workdir)
  stop = dict([stop_after]) if stop_after else {}
  params, done = sft_phase(ctx, stop.get("sft"))
  dparams = jax.jit(lambda p: eagle3.init_params(ctx.dcfg, config.seed + 1, p, ctx.pcfg))(params)
  if done and config.draft.pretrain_steps > 0:
    dparams, done = draft_phase(ctx, params, stop.get("draft"))
  if done and config.rl.steps > 0:
    state, done = rl_phase(ctx, params, dparams, stop.get("rl"))
    params, dparams = state["params"]["policy"], state["params"]["draft"]
  summary = {
    "task": config.task.name,
    "layout": config.parallel.name,
    "rollout_draft": config.rollout.draft,
  }
  if done and (config.draft.pretrain_steps > 0 or config.rl.steps > 0):
    summary["rollout"] = rollout_report(
      ctx, params, dparams, temperature=config.eval.sd_temperature
    )
  _plots(ctx)
  read = lambda name: ctx.log(name).read()
  erows, mrows, drows = read("eval.jsonl"), read("sft_metrics.jsonl"), read("draft_metrics.jsonl")
  rrows, rerows = read("metrics.jsonl"), read("rl_eval.jsonl")
  summary.update(
    {
      "sft_steps": mrows[-1]["step"] if mrows else 0,
      "accuracy_before": erows[0]["accuracy"] if erows else None,
      "accuracy_after_sft": erows[-1]["accuracy"] if erows else None,
      "draft_steps": drows[-1]["step"] if drows else 0,
      "draft_loss": drows[-1]["draft_loss"] if drows else None,
      "rl_steps": rrows[-1]["step"] if rrows else 0,
    }
  )
  if rrows:
    k = max(1, len(rrows) // 5)  # average the first and last fifth: single steps are noisy
    mean = lambda rows, key: float(np.mean([r[key] for r in rows]))
    summary.update(
      {
        "reward_first": mean(rrows[:k], "reward_mean"),
        "reward_last": mean(rrows[-k:], "reward_mean"),
        "tau_first": mean(rrows[:k], "accept_len"),
        "tau_last": mean(rrows[-k:], "accept_len"),
        "accuracy_after_rl": rerows[-1]["accuracy"] if rerows else None,
      }
    )
  summary["wall_seconds"] = time.time() - t_start
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary


def summary_table(summary: dict) -> str:
  """A human-readable table of a run's summary."""
  f = lambda v: "-" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
  rows = [
    ("task", summary.get("task")),
    ("rollout draft", summary.get("rollout_draft")),
    ("greedy accuracy: before SFT", summary.get("accuracy_before")),
    ("greedy accuracy: after SFT", summary.get("accuracy_after_sft")),
    ("greedy accuracy: after RL", summary.get("accuracy_after_rl")),
    ("RL reward: first steps", summary.get("reward_first")),
    ("RL reward: last steps", summary.get("reward_last")),
    ("tau: first RL steps", summary.get("tau_first")),
    ("tau: last RL steps", summary.get("tau_last")),
  ]
  r = summary.get("rollout")
  if r:
    rows += [
      (f"SD vs AR (T={r['temperature']}): tau", r["tau"]),
      ("SD vs AR: rollout speedup", r["speedup"]),
      (
        "SD vs AR: policy passes/token",
        f"{r['sd_policy_passes_per_token']:.3f} vs {r['ar_policy_passes_per_token']:.3f}",
      ),
      ("greedy SD == AR (every row)", "yes" if r["greedy_equal"] else "NO"),
    ]
  rows.append(("wall time (s)", summary.get("wall_seconds")))
  w = max(len(k) for k, _ in rows)
  return "\n".join(["", "Summary", "-" * (w + 14)] + [f"{k:<{w}}  {f(v)}" for k, v in rows])
