"""`train_and_evaluate(config, workdir)`: SFT of the policy with evaluation, metrics, plots and
exact resume. Later phases (draft pretraining, RL co-training) plug in after SFT."""

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
from specdraft.decode import autoregressive
from specdraft.model import policy as pol
from specdraft.parallel import mesh as mesh_lib
from specdraft.tasks import CharTokenizer, make_task
from specdraft.tasks import datasets as task_data
from specdraft.tasks import loader
from specdraft.train import checkpoint as ckpt_lib
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


def train_and_evaluate(config, workdir: str, *, stop_after: int | None = None) -> dict:
  """SFT the policy on the configured task; writes metrics, evals, plots and checkpoints.

  `stop_after` ends the process-level loop early at that step (to test resumption).
  Returns the run summary (also written to `workdir/summary.json`).
  """
  config_lib.validate(config)
  os.makedirs(os.path.join(workdir, "plots"), exist_ok=True)
  t_start = time.time()

  # --- data
  tfds.disable_progress_bar()
  task = make_task(config.task)
  tok = CharTokenizer()
  train_src = task_data.data_source(config.task, config.data.data_dir, "train")
  test_src = task_data.data_source(config.task, config.data.data_dir, "test")
  n_eval = min(config.eval.num_examples, len(test_src))
  eval_examples = [task_data.to_example(test_src[i]) for i in range(n_eval)]
  batches = loader.sft_dataset(train_src, tok, batch_size=config.data.batch_size,
                               seq_len=config.data.seq_len, packing=config.data.packing,
                               seed=config.data.shuffle_seed)
  data_iter = iter(batches)

  # --- model, mesh, state
  pcfg = policy_config(config)
  mesh = mesh_lib.make_mesh(config.parallel)
  rules = [tuple(r) for r in config.parallel.rules]
  batch_sh = mesh_lib.batch_sharding(mesh, rules)
  tx = step_lib.make_optimizer(config.sft, config.sft.steps)
  state = init_state(pcfg, tx, mesh, rules, config.seed)
  shardings = state_shardings(state)
  train_step = jax.jit(functools.partial(step_lib.sft_step, cfg=pcfg, tx=tx),
                       in_shardings=(shardings, batch_sh), out_shardings=(shardings, None),
                       donate_argnums=0)

  metrics_log = RunLog(os.path.join(workdir, "metrics.jsonl"))
  eval_log = RunLog(os.path.join(workdir, "eval.jsonl"))
  ckpt = ckpt_lib.Checkpointer(os.path.join(os.path.abspath(workdir), "checkpoints"),
                               keep=config.checkpoint.keep)
  restored = ckpt.restore_latest(abstract_like(state))
  start = 0
  if restored is not None:
    start, state, extra = restored
    data_iter.set_state(extra["data_iter"])
    print(f"Resumed from step {start} in {workdir}", flush=True)
  metrics_log.truncate_after(start)
  eval_log.truncate_after(start)

  eval_kw = dict(batch_size=config.eval.batch_size, max_new_tokens=config.decode.max_new_tokens,
                 prompt_len=prompt_len_for(task), sharding=batch_sh)

  def run_eval(step):
    res = evaluate(state["params"], pcfg, task, eval_examples, **eval_kw)
    eval_log.write({"step": step, "accuracy": res["accuracy"], "samples": res["samples"]})
    return res["accuracy"]

  if start == 0:
    run_eval(0)

  # --- SFT
  steps = config.sft.steps
  last = min(steps, stop_after) if stop_after is not None else steps
  bar = tqdm(range(start, last), desc="sft", initial=start, total=steps, dynamic_ncols=True)
  t_last = time.time()
  for i in bar:
    batch = jax.device_put(next(data_iter), batch_sh)
    state, metrics = train_step(state, batch)
    step = i + 1
    if step % config.sft.log_every == 0 or step == steps:
      m = {k: float(v) for k, v in jax.device_get(metrics).items()}
      now = time.time()
      m.update(step=step, seconds_per_step=(now - t_last) / config.sft.log_every)
      t_last = now
      metrics_log.write(m)
      bar.set_postfix(loss=f"{m['loss']:.3f}", tok_acc=f"{m['token_accuracy']:.3f}")
    if step % config.eval.every == 0 or step == steps:
      acc = run_eval(step)
      bar.write(f"step {step}: greedy test accuracy {acc:.3f}")
    if step % config.checkpoint.every == 0 or step == steps:
      ckpt.save(step, state, {"data_iter": data_iter.get_state()})
  bar.close()
  ckpt.close()

  # --- summary and plots
  mrows, erows = metrics_log.read(), eval_log.read()
  if mrows:
    plot_curves(os.path.join(workdir, "plots", "sft_loss.png"),
                {"loss": ([r["step"] for r in mrows], [r["loss"] for r in mrows])},
                title="SFT loss", ylabel="cross-entropy (answer tokens)")
  if erows:
    plot_curves(os.path.join(workdir, "plots", "eval_accuracy.png"),
                {"greedy": ([r["step"] for r in erows], [r["accuracy"] for r in erows])},
                title=f"held-out greedy accuracy ({config.task.name})", ylabel="accuracy")
  summary = {
    "task": config.task.name,
    "sft_steps": int(jax.device_get(state["step"])),
    "accuracy_before": erows[0]["accuracy"] if erows else None,
    "accuracy_after": erows[-1]["accuracy"] if erows else None,
    "final_loss": mrows[-1]["loss"] if mrows else None,
    "wall_seconds": time.time() - t_start,
    "layout": config.parallel.name,
  }
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
  return summary
