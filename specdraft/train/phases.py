"""The run's three phases, each an instance of one skeleton, `run_phase`:

  restore the newest checkpoint (or keep the fresh state), evaluate once at step 0, then for
  each step: next batch -> step -> log every `log_every` -> evaluate every `eval_every` ->
  checkpoint every `checkpoint.every`; returns (state, finished).

  sft_phase    the policy learns the task (cross-entropy on answer tokens)
  draft_phase  the EAGLE-3 draft distils the fixed SFT policy on the policy's own generations
  rl_phase     GRPO with speculative rollouts; the policy and the draft train in one step

A phase differs from the others only in its state, its data and its step function, so a killed
run resumes every phase the same way (checkpoint, data iterator, truncated logs).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import tensorflow_datasets as tfds

from specdraft import config as config_lib
from specdraft.attention.kernels.flash import KernelSettings
from specdraft.decode import cost, engine
from specdraft.decode.compare import decoding_figures
from specdraft.decode.sampling import join_prompt_completion
from specdraft.model import drafts, eagle3
from specdraft.parallel import multihost
from specdraft.parallel.layout import Layout
from specdraft.rl import grpo
from specdraft.tasks import Example, loader, make_task
from specdraft.tasks import datasets as task_data
from specdraft.tasks import tokenizer as tok_lib
from specdraft.train import checkpoint as ckpt_lib
from specdraft.train import draft as draft_lib
from specdraft.train import sequence, shards
from specdraft.train import state as state_lib
from specdraft.train import step as step_lib
from specdraft.train.evaluate import evaluate, prompt_len_for
from specdraft.train.report import RunLog, progress
from specdraft.train.spec import StepSpec


@dataclasses.dataclass(frozen=True)
class Models:
  """The run's model configs: the policy's and its draft's (None: no draft)."""

  pcfg: Any  # model.policy.PolicyConfig
  dcfg: Any  # eagle3.DraftConfig | dflash.BlockDraftConfig | None


class RunData:
  """The run's task and its data, built once from the config: the task, the tokenizer, the
  training split, the held-out examples and the prompt bound. It depends only on the fields of
  `KEYS` and the tokenizer (`key_of`), so runs whose configs agree there (a benchmark's arms) can
  share one (`Context(data=)`).
  Process 0 generates the task's files (once per data_dir); the others then read them."""

  # the config fields a RunData is built from (a shared one must agree on all of them), besides
  # the tokenizer (`tokenizer.tokenizer_path`: data.tokenizer, else model.init_from's, and
  # data.chat_template), which `key_of` reads as the tokenizer does
  KEYS = ("task", "data.data_dir", "data.seq_len", "eval.num_examples", "sft.steps")

  def __init__(self, config):
    tfds.disable_progress_bar()
    self.key = self.key_of(config)
    self.task = make_task(config.task)
    self.tok = tok_lib.make_tokenizer(config)
    if not multihost.is_primary():
      multihost.sync("specdraft: task data prepared")
    self.train_src = task_data.data_source(config.task, config.data.data_dir, "train")
    test_src = task_data.data_source(config.task, config.data.data_dir, "test")
    if multihost.is_primary():
      multihost.sync("specdraft: task data prepared")
    n_eval = min(config.eval.num_examples, len(test_src))
    self.eval_examples = [task_data.to_example(test_src[i]) for i in range(n_eval)]
    # a pretrained tokenizer's bound from characters is loose: its prompts are measured instead
    prompts = None
    if not isinstance(self.tok, tok_lib.CharTokenizer):
      srcs = (self.train_src, test_src)
      prompts = [task_data.to_example(s[i]).prompt for s in srcs for i in range(len(s))]
      if config.sft.steps > 0:
        self._check_sft_rows(config.data.seq_len)
    self.prompt_len = prompt_len_for(self.task, self.tok, prompts)

  @classmethod
  def key_of(cls, config) -> str:
    """What a RunData is built from, as one string (two configs agreeing on it share data): the
    fields of `KEYS` (each must exist) and the tokenizer as `tokenizer.make_tokenizer` finds it."""
    out = [
      f"tokenizer={tok_lib.tokenizer_path(config)!r}",
      f"chat_template={bool(config.data.get('chat_template', False))}",
    ]
    for path in cls.KEYS:
      v = config
      for part in path.split("."):
        if not hasattr(v, "get") or part not in v:
          raise ValueError(f"config.{path} is missing: a run's data is built from it")
        v = v[part]
      out.append(f"{path}={v.to_json() if hasattr(v, 'to_json') else v!r}")
    return "; ".join(out)

  def shared_with(self, config) -> RunData | None:
    """This data for a run of `config` when it agrees on every field of `KEYS`, else None (the
    run builds its own): `Context(config, workdir, data=base.data.shared_with(config))`."""
    return self if self.key == self.key_of(config) else None

  def _check_sft_rows(self, seq_len: int):
    """A pretrained tokenizer's rows, measured on the training split before anything compiles
    (validation's bound from characters is loose for a BPE): each must fit data.seq_len."""
    longest, where = 0, None
    for i in range(len(self.train_src)):
      ex = task_data.to_example(self.train_src[i])
      n = len(self.tok.encode_prompt(ex.prompt)) + len(self.tok.encode_answer(ex.answer))
      if n > longest:
        longest, where = n, ex
    if longest > seq_len:
      config_lib.invalid(
        "data.seq_len",
        seq_len,
        f"the longest training example is {longest} tokens with {self.tok.path} "
        f"({where.prompt!r} -> {where.answer[:40]!r})",
      )

  def draft_vocab(self, draft_cfg, pcfg):
    """A reduced draft vocabulary (draft.vocab_size > 0): the user's file (draft.vocab_file),
    else the most frequent tokens of the training split's answers (EOS and the stop tokens always
    in); None for the policy's whole vocabulary."""
    n = int(draft_cfg.get("vocab_size", 0))
    if not n or n >= pcfg.vocab_size:
      return None
    path = draft_cfg.get("vocab_file", "")
    if path:  # the user's own choice (e.g. from the policy's own generations), checked
      return config_lib.read_draft_vocab(path, n, pcfg.vocab_size)
    rows = (
      self.tok.encode_answer(task_data.to_example(self.train_src[i]).answer)
      for i in range(len(self.train_src))
    )
    stops = (self.tok.eos_id, *pcfg.stop_ids)  # a draft must be able to stop
    return eagle3.frequent_tokens(rows, pcfg.vocab_size, n, always=stops)


@dataclasses.dataclass
class RolloutState:
  """What the RL rollouts carry from one to the next (decode.speculation = auto): the acceptance
  each rollout's G choices start from, what the rollouts' stages cost against their plan's prices
  (decode.price_feedback; G chosen per stage), the last rollout's stage records (metrics.jsonl)
  and the cost model of a round, calibrated on first use (`Context.cost_model`)."""

  acceptance: cost.Acceptance
  stage_prices: cost.StagePrices
  stage_times: list = dataclasses.field(default_factory=list)
  cost_model: cost.CostModel | None = None

  @classmethod
  def from_config(cls, dec) -> RolloutState:
    return cls(
      cost.Acceptance.prior(dec.num_draft, dec.prior_rate, dec.prior_weight),
      cost.StagePrices(dec.get("price_prior_rounds", 4.0), dec.get("price_keep", 0.7)),
    )


class Context:
  """What a run's phases share, in parts: `data` (RunData: task, tokenizer, splits, prompt
  bound), `models` (the policy's and draft's configs), `layout` (parallel/layout.py: mesh, rules,
  pipeline, cp and the shardings they give) and `rollouts` (RolloutState), with the config and
  the workdir; its methods join them (batches placed on the mesh, the phase's StepSpec,
  checkpoints and logs under the workdir, the calibrated cost model)."""

  def __init__(self, config, workdir: str, *, validated: bool = False, data: RunData | None = None):
    if not validated:  # (train_and_evaluate validates before it checks the workdir)
      config_lib.validate(config)
    if config.decode.get("auto_every", "round") not in cost.AUTO_EVERY:
      config_lib.invalid(
        "decode.auto_every",
        config.decode.auto_every,
        f"expected one of {cost.AUTO_EVERY} (auto G chosen before every round, or once per "
        "compaction stage)",
      )
    if config.decode.get("auto_every", "round") == "stage" and config.decode.speculation != "auto":
      config_lib.invalid(
        "decode.auto_every",
        config.decode.auto_every,
        f"'stage' chooses an auto G once per compaction stage: it needs decode.speculation='auto' "
        f"(got {config.decode.speculation!r}); with a fixed G leave it 'round'",
      )
    if "://" in workdir:
      raise ValueError(
        f"workdir={workdir!r} is invalid: logs, plots and checkpoints are written with local file "
        "operations; use a local directory (a shared mount for a multi-process run)"
      )
    if jax.process_count() > 1 and config.parallel.get("devices", 0):
      raise ValueError(
        f"config.parallel.devices={config.parallel.devices!r} is invalid in a multi-process run "
        f"({jax.process_count()} processes): the mesh must cover every process's devices (0)"
      )
    if data is not None and data.key != RunData.key_of(config):
      raise ValueError(
        f"data= was built from another task or data config ({data.key}) than this run's "
        f"({RunData.key_of(config)}): build the run's own (data=None)"
      )
    self.config, self.workdir = config, workdir
    self.data = data if data is not None else RunData(config)
    pcfg = state_lib.policy_config(config, self.data.tok)
    vocab_ids = self.data.draft_vocab(config.draft, pcfg)
    self.models = Models(
      pcfg, drafts.draft_config(config.draft, pcfg, config.decode.num_draft, vocab_ids=vocab_ids)
    )
    # The one owner of placement: mesh, rules, pipeline, cp (parallel/layout.py). Pipeline
    # layouts (pp > 1) train the policy as a pipeline over 'pp' with the draft on the last stage;
    # rollouts and evaluation run the unpipelined decoder. Training steps run on sequence shards
    # over 'cp' (train/sequence.py), their rows padded so that the attention kernel's tiles
    # divide them (config.attention).
    self.layout = Layout.from_config(config.parallel)
    self.row_multiple = sequence.row_multiple(KernelSettings.from_config(config.get("attention")))
    self._jit_cache = {}
    self.rollouts = RolloutState.from_config(config.decode)
    os.makedirs(os.path.join(workdir, "plots"), exist_ok=True)

  def training_batch(self, blocks: dict[int, dict], num_shards: int) -> dict:
    """The global training batch from this process's data shards ({shard j: host batch}), each
    laid out (padded, zigzag order over cp) on the host and placed on the mesh."""
    keep = lambda b: {k: v for k, v in b.items() if k in sequence.TOKEN_KEYS or k == "advantages"}
    laid = {
      j: sequence.zigzag_order(keep(b), self.layout.cp, multiple=self.row_multiple)
      for j, b in blocks.items()
    }
    first = next(iter(laid.values()))
    rows = len(first["tokens"])
    shardings = sequence.batch_shardings(first, self.layout.mesh, self.layout.rules)
    return {
      k: multihost.assemble({j: b[k] for j, b in laid.items()}, rows, num_shards, shardings[k])
      for k in first
    }

  def device_training_batch(self, batch: dict) -> dict:
    """A training batch already on the mesh (rollouts) laid out there and resharded."""
    keep = {k: v for k, v in batch.items() if k in sequence.TOKEN_KEYS or k == "advantages"}
    key = tuple((k, v.shape) for k, v in sorted(keep.items()))
    if key not in self._jit_cache:
      lay = functools.partial(sequence.zigzag_order, cp=self.layout.cp, multiple=self.row_multiple)
      out = sequence.batch_shardings(jax.eval_shape(lay, keep), self.layout.mesh, self.layout.rules)
      self._jit_cache[key] = jax.jit(lay, out_shardings=out)
    return self._jit_cache[key](keep)

  def prompt_stream(self, units: int, *, seed_offset: int, rows_per_unit: int = 1):
    """Endless shuffled prompt batches of the training split in data shards (a resumable
    stream; `units` prompts a batch, each rolled out `rows_per_unit` times)."""
    c = self.config
    make = lambda j, n: loader.prompt_dataset(
      self.data.train_src,
      self.data.tok,
      batch_size=units // n,
      prompt_len=self.data.prompt_len,
      seed=c.data.shuffle_seed + seed_offset,
      shard=(j, n),
    )
    return shards.ShardedStream(
      make,
      units=units,
      mesh=self.layout.mesh,
      rules=self.layout.rules,
      sharding=self.layout.rows_sharding(ndim=2),
      rows_per_unit=rows_per_unit,
    )

  def place_prompts(self, stream, pb: dict[int, dict], repeat: int = 1):
    """(prompts [rows, P], lengths [rows]) on the mesh from this process's prompt shards, each
    prompt repeated `repeat` times (a rollout group)."""
    n, per = stream.num_shards, stream.rows_per_shard
    prompts = {j: np.repeat(b["prompts"], repeat, axis=0) for j, b in pb.items()}
    lengths = {j: np.repeat(b["prompt_lengths"], repeat, axis=0) for j, b in pb.items()}
    return (
      multihost.assemble(prompts, per, n, self.layout.rows_sharding(ndim=2)),
      multihost.assemble(lengths, per, n, self.layout.rows_sharding()),
    )

  def step_spec(self, phase: str, tx) -> StepSpec:
    """The training step of `phase` ("sft", "draft", "rl") on this run's layout, with optimizer
    `tx` (`train.spec.StepSpec.from_config`)."""
    return StepSpec.from_config(
      self.config, phase, pcfg=self.models.pcfg, dcfg=self.models.dcfg, tx=tx,
      mesh=self.layout.mesh, pipeline=self.layout.pipeline,
    )  # fmt: skip

  def checkpointer(self, phase: str) -> ckpt_lib.Checkpointer:
    return ckpt_lib.Checkpointer(
      os.path.join(os.path.abspath(self.workdir), "checkpoints", phase),
      keep=self.config.checkpoint.keep,
    )

  def log(self, name: str) -> RunLog:
    return RunLog(os.path.join(self.workdir, name))

  def engine_settings(self, *, adaptive: bool) -> dict:
    """The decoding engine's settings every rollout-shaped decode of this run shares (the RL
    rollouts, the final report's as-run arms): compaction, the smallest bucket, adaptive G and
    its catch-up window, and the rows' placement on the mesh."""
    d = self.config.decode
    return dict(
      adaptive=adaptive,
      per_stage=d.get("auto_every", "round") == "stage",
      compact=d.compact,
      min_rows=d.min_rows,
      window=d.get("catch_up_window", 8),
      rows=engine.Rows(self.layout.mesh, self.layout.rows_sharding().spec[0])
      if self.layout.mesh.size > 1
      else None,
    )

  def for_decoding(self, params):
    """`params` placed as a decoding loop reads them (`Layout.decode_shardings`: gathered over
    fsdp, cp and pp, split over tensor only), once per call: a rollout gathers its weights once,
    not on every round of its loop."""
    if self.layout.mesh.size == 1:
      return params
    sh = self.layout.decode_shardings(jax.tree.map(lambda x: x.sharding, params))
    key = ("decode", jax.tree.structure(params))
    if key not in self._jit_cache:
      self._jit_cache[key] = jax.jit(lambda p: p, out_shardings=sh)
    return self._jit_cache[key](params)

  def cost_model(self, trainable) -> cost.CostModel:
    """The cost model of a rollout round, calibrated on first use at this run's rollout shapes
    (cached under workdir/cost; in a multi-process run process 0's coefficients are everyone's,
    so every process chooses the same G)."""
    if self.rollouts.cost_model is None:
      c = self.config
      correct = c.decode.get("cost_correction", True)
      every = c.decode.get("auto_every", "round")
      rows = c.rl.prompts_per_step * c.rl.group_size
      G, O = c.decode.num_draft, c.rl.max_new_tokens or c.decode.max_new_tokens
      grid = cost.Grid(
        rows=tuple(sorted({4**i for i in range(8) if 4**i < rows} | {rows})),
        tokens=tuple(sorted({1, (G + 2) // 2, G + 1})),
        round_rows=tuple(sorted({4**i for i in range(8) if 4**i < rows} | {rows})),
        round_G=tuple(sorted({max(1, (G + 1) // 2), G})),
        capacity=self.data.prompt_len + O + G + 2,
        prompt_len=self.data.prompt_len,
        adaptive=correct and every == "round",  # a G per stage runs the fixed loop's rounds
        stage=correct and every == "stage",  # ... at every G, as its stages run them
      )
      cache_dir = os.path.join(self.workdir, "cost")
      model, _ = cost.calibrate(
        trainable["policy"],
        trainable["draft"],
        self.models.pcfg,
        self.models.dcfg,
        grid=grid,
        cache_dir=cache_dir,
        correct=correct,
        every=every,
        outlier=c.decode.get("cost_outlier", 0.0),
      )
      if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        coef = np.asarray(dataclasses.astuple(model.machine), np.float64)
        coef = multihost_utils.broadcast_one_to_all(coef)
        *coef, overlap = map(float, coef)
        machine = cost.Machine(*coef, overlap=bool(overlap))
        model = dataclasses.replace(model, machine=machine)
        if model.correction is not None:  # its shape is the grid's, the same in every process
          k = model.correction
          table = multihost_utils.broadcast_one_to_all(np.asarray(k.log_ratio, np.float64))
          correction = dataclasses.replace(k, log_ratio=tuple(map(tuple, table.tolist())))
          model = dataclasses.replace(model, correction=correction)
      self.rollouts.cost_model = model
    return self.rollouts.cost_model

  def greedy_accuracy(self, params, *, samples: bool = False) -> dict:
    """Greedy held-out accuracy of the policy `params` (with a few samples if asked)."""
    c = self.config
    res = evaluate(
      params,
      self.models.pcfg,
      self.data.task,
      self.data.eval_examples,
      batch_size=c.eval.batch_size,
      max_new_tokens=c.decode.max_new_tokens,
      prompt_len=self.data.prompt_len,
      sharding=self.layout.rows_sharding(ndim=2),
      tok=self.data.tok,
    )
    return res if samples else {"accuracy": res["accuracy"]}


# ----------------------------------------------------------------------------- the skeleton


@dataclasses.dataclass
class Phase:
  """One phase as the skeleton sees it."""

  name: str  # checkpoints/<name>/
  label: str  # progress bar and messages
  steps: int
  data: Any  # iterator with get_state / set_state (grain)
  step: Callable  # (state, host batch) -> (state, metrics)
  log_every: int
  metrics_log: str  # JSONL file in the workdir
  postfix: dict[str, str]  # progress-bar name -> metrics key
  evaluate: Callable | None = None  # state -> record with "accuracy"
  eval_every: int = 0
  eval_log: str | None = None


def run_phase(ctx: Context, phase: Phase, state, stop_after: int | None = None):
  """Resume-or-init, iterate, log, evaluate, checkpoint; returns (state, finished)."""
  mlog = ctx.log(phase.metrics_log)
  elog = ctx.log(phase.eval_log) if phase.eval_log else None
  ckpt = ctx.checkpointer(phase.name)
  start, state = state_lib.restore(ckpt, state, phase.data, *filter(None, (mlog, elog)))
  if jax.process_count() > 1 and hasattr(phase.data, "shards"):
    print(
      f"{phase.label}: process {jax.process_index()} builds data shards {phase.data.shards} "
      f"of {phase.data.num_shards}",
      flush=True,
    )
  if start == 0 and phase.evaluate is not None:
    elog.write({"step": 0, **phase.evaluate(state)})
  last = phase.steps if stop_after is None else min(phase.steps, stop_after)
  bar = progress(
    range(start, last),
    desc=phase.label,
    initial=start,
    total=phase.steps,
    disable=not multihost.is_primary(),
  )
  t_logged, step_logged = time.perf_counter(), start
  for i in bar:
    state, metrics = phase.step(state, next(phase.data))
    step = i + 1
    due = lambda every: (every > 0 and step % every == 0) or step == phase.steps
    if due(phase.log_every):
      now = time.perf_counter()
      m = host_metrics(metrics)
      m.update(step=step, seconds_per_step=(now - t_logged) / (step - step_logged))
      t_logged, step_logged = now, step
      mlog.write(m)
      bar.set_postfix({name: f"{m[key]:.3f}" for name, key in phase.postfix.items()})
    if phase.evaluate is not None and due(phase.eval_every):
      record = phase.evaluate(state)
      elog.write({"step": step, **record})
      if multihost.is_primary():
        bar.write(f"{phase.label} step {step}: greedy test accuracy {record['accuracy']:.3f}")
    if due(ctx.config.checkpoint.every):
      # every shard's iterator state, gathered from the processes that build them
      ckpt.save(step, state, {"data_iter": phase.data.global_state()})
  bar.close()
  ckpt.close()
  return state, last == phase.steps


def host_metrics(metrics) -> dict:
  """Metrics on the host: array scalars as floats (other arrays dropped), the rest as is."""
  out = {}
  fetch = lambda x: multihost.to_host(x) if isinstance(x, jax.Array) else x
  for k, v in jax.tree.map(fetch, metrics).items():
    if isinstance(v, np.ndarray | np.generic):
      if np.ndim(v) == 0:
        out[k] = float(v)
    else:
      out[k] = v
  return out


# ----------------------------------------------------------------------------- SFT


def sft_phase(ctx: Context, stop_after: int | None = None):
  """Supervised fine-tuning of the policy; returns (params, finished)."""
  c = ctx.config
  make = lambda j, n: loader.sft_dataset(
    ctx.data.train_src,
    ctx.data.tok,
    batch_size=c.data.batch_size // n,
    seq_len=c.data.seq_len,
    packing=c.data.packing,
    seed=c.data.shuffle_seed,
    shard=(j, n),
  )
  data = shards.ShardedStream(
    make,
    units=c.data.batch_size,
    mesh=ctx.layout.mesh,
    rules=ctx.layout.rules,
    sharding=ctx.layout.batch_sharding(ndim=2),
  )
  tx = step_lib.make_optimizer(c.sft, c.sft.steps)
  state = state_lib.init_state(
    ctx.models.pcfg, tx, ctx.layout, c.seed, init_from=c.model.get("init_from", "") or ""
  )
  sh = state_lib.state_shardings(state)
  spec = ctx.step_spec("sft", tx)
  train_step = jax.jit(
    functools.partial(step_lib.sft_step, spec=spec), out_shardings=(sh, None), donate_argnums=0
  )
  phase = Phase(
    name="sft",
    label="sft",
    steps=c.sft.steps,
    data=data,
    step=lambda state, batch: train_step(state, ctx.training_batch(batch, data.num_shards)),
    log_every=c.sft.log_every,
    metrics_log="sft_metrics.jsonl",
    postfix={"loss": "loss", "tok_acc": "token_accuracy"},
    evaluate=lambda state: ctx.greedy_accuracy(state["params"], samples=True),
    eval_every=c.eval.every,
    eval_log="eval.jsonl",
  )
  state, finished = run_phase(ctx, phase, state, stop_after)
  return state["params"], finished


# ----------------------------------------------------------------------------- draft


def init_draft(ctx: Context, params):
  """The draft's initial parameters (`state.init_draft`: EAGLE-3's head and every kind's final
  norm start from the policy's), sharded by the layout's rules."""
  return state_lib.init_draft(
    ctx.models.dcfg, ctx.models.pcfg, params, ctx.layout, ctx.config.seed + 1
  )


def rollout_temperatures(dc) -> tuple[float, ...]:
  """The distillation rollouts' temperatures, cycled over the draft phase's steps:
  `draft.rollout_temperatures` when set (e.g. (0.0, 1.0): greedy and sampled generations on
  alternate steps, for a draft that serves both), else `draft.rollout_temperature` every step."""
  temps = tuple(float(t) for t in dc.get("rollout_temperatures", ()) or ())
  return temps or (float(dc.rollout_temperature),)


def draft_phase(ctx: Context, params, stop_after: int | None = None):
  """Distils the draft from the fixed SFT policy; returns (draft params, finished)."""
  c, dc = ctx.config, ctx.config.draft
  tx = step_lib.make_optimizer(dc, dc.pretrain_steps)
  state, sh = state_lib.keyed_state(tx, init_draft(ctx, params), ctx.layout, c.seed + 2)
  temps = rollout_temperatures(dc)
  spec = ctx.step_spec("draft", tx)
  step_fns = {
    t: jax.jit(
      functools.partial(
        draft_lib.draft_iteration,
        spec=spec,
        max_new_tokens=c.decode.max_new_tokens,
        temperature=t,
      ),
      out_shardings=(sh, None),
      donate_argnums=0,
    )
    for t in sorted(set(temps))
  }
  data = ctx.prompt_stream(dc.batch_size, seed_offset=1)

  def step(state, pb):  # step i's rollouts at temps[i % len(temps)] (the step count is state)
    t = temps[int(state["step"]) % len(temps)] if len(temps) > 1 else temps[0]
    return step_fns[t](state, params, *ctx.place_prompts(data, pb))

  phase = Phase(
    name="draft",
    label="draft",
    steps=dc.pretrain_steps,
    data=data,
    step=step,
    log_every=dc.log_every,
    metrics_log="draft_metrics.jsonl",
    postfix={"loss": "draft_loss", "acc0": "ttt_acc_0"},
  )
  state, finished = run_phase(ctx, phase, state, stop_after)
  return state["params"], finished


# ----------------------------------------------------------------------------- RL


def rl_phase(ctx: Context, params, dparams, stop_after: int | None = None):
  """GRPO with speculative rollouts and the one-step co-training of policy and draft.

  rollout.draft: cotrained (SD; the draft trains with the policy), fixed (SD; frozen draft),
  none (autoregressive rollouts; the draft is not trained). Returns (state, finished).
  """
  c, rl = ctx.config, ctx.config.rl
  train_draft = c.rollout.draft == "cotrained"
  tx = step_lib.make_cotrain_optimizer(rl, c.draft, train_draft=train_draft)
  state, sh = rl_state(ctx, tx, params, dparams)
  spec = ctx.step_spec("rl", tx)  # the draft trains in it exactly when train_draft
  train_step = jax.jit(
    functools.partial(step_lib.cotrain_step, spec=spec, ref=params if rl.beta > 0 else None),
    out_shardings=(sh, None),
    donate_argnums=0,
  )
  rollout_step = _rollout_step(ctx)
  data = ctx.prompt_stream(rl.prompts_per_step, seed_offset=2, rows_per_unit=rl.group_size)
  phase = Phase(
    name="rl",
    label=f"rl ({c.rollout.draft})",
    steps=rl.steps,
    data=data,
    step=lambda state, pb: _rl_iteration(ctx, data, rollout_step, train_step, state, pb),
    log_every=1,
    metrics_log="metrics.jsonl",
    postfix={"reward": "reward_mean", "tau": "accept_len"},
    evaluate=lambda state: ctx.greedy_accuracy(state["params"]["policy"]),
    eval_every=rl.eval_every,
    eval_log="rl_eval.jsonl",
  )
  return run_phase(ctx, phase, state, stop_after)


def rl_state(ctx: Context, tx, params, dparams):
  """The RL phase's initial state {step, params: {policy, draft}, opt_state, key} and its
  shardings: the parameters keep theirs (the policy's and the draft's rules), their moments follow
  them, counters and the key are replicated. The co-training step returns its state with the same
  shardings, so it compiles once, and under fsdp no device ever holds the whole optimizer state
  (left to the compiler, the zero moments of `tx.init` came out replicated)."""
  params = {"policy": params, "draft": dparams}
  return state_lib.keyed_state(tx, params, ctx.layout, ctx.config.seed + 3)


def _rollout_step(ctx: Context):
  """(trainable, key_data, prompts, lengths) -> (Generation, training batch, key_data): SD
  rollouts (rollout.draft = cotrained | fixed; decode.speculation = fixed | auto) or AR rollouts
  (none), through `decode.engine` (finished rows compacted away when decode.compact)."""
  c = ctx.config
  sd = c.rollout.draft != "none"
  auto = sd and c.decode.speculation == "auto"
  kw = dict(
    max_new_tokens=c.rl.max_new_tokens or c.decode.max_new_tokens,
    temperature=c.rl.temperature,
    top_k=c.rl.top_k,
    top_p=c.rl.top_p,
    num_draft=c.decode.num_draft if sd else 0,
    **ctx.engine_settings(adaptive=auto),
  )

  @jax.jit
  def split(key_data):
    key, sub = jax.random.split(jax.random.wrap_key_data(key_data))
    return jax.random.key_data(key), sub

  @jax.jit
  def join(gen, prompts_BS, lengths_B):
    # rows stay where their prompts were: each process scores the rows of its data shards
    gen = gen._replace(
      tokens=jax.lax.with_sharding_constraint(gen.tokens, ctx.layout.rows_sharding(ndim=2))
    )
    return gen, join_prompt_completion(prompts_BS, lengths_B, gen)

  feedback = auto and kw["per_stage"] and c.decode.get("price_feedback", False)

  def rollout_step(trainable, key_data, prompts_BS, lengths_B):
    key_data, sub = split(key_data)
    trainable = ctx.for_decoding(trainable)
    cost = ctx.cost_model(trainable) if auto else None
    timings = [] if feedback else None
    gen = engine.generate(
      trainable["policy"],
      trainable["draft"] if sd else None,
      ctx.models.pcfg,
      ctx.models.dcfg,
      prompts_BS,
      lengths_B,
      sub,
      cost=cost,
      prior=ctx.rollouts.acceptance,
      prices=ctx.rollouts.stage_prices if feedback else None,
      timings=timings,
      **kw,
    )
    if auto:  # the next rollout starts from this one's acceptance (geometric forgetting)
      stats = {k: multihost.to_host(gen.stats[k]) for k in ("accept_counts", "reach_counts")}
      ctx.rollouts.acceptance = ctx.rollouts.acceptance.updated(stats, keep=c.decode.prior_keep)
    if feedback:  # ... and plans with what this one's stages cost
      ctx.rollouts.stage_times = _agreed_stage_times(timings)
      ctx.rollouts.stage_prices = ctx.rollouts.stage_prices.updated(ctx.rollouts.stage_times)
    gen, batch = join(gen, prompts_BS, lengths_B)
    return gen, batch, key_data

  return rollout_step


def _agreed_stage_times(timings: list[dict]) -> list[dict]:
  """A rollout's stage records as process 0 timed them, in every process (each process times
  its own wall clock; every process must plan the same stages, so all take one's). The stages
  run are the same in every process (compaction follows the global `done`)."""
  if jax.process_count() == 1 or not timings:
    return timings
  from jax.experimental import multihost_utils

  seconds = np.asarray([[r["seconds"], float(r["compiled"])] for r in timings], np.float64)
  seconds = multihost_utils.broadcast_one_to_all(seconds)
  return [dict(r, seconds=float(s), compiled=bool(k)) for r, (s, k) in zip(timings, seconds)]


def _rl_iteration(ctx: Context, stream, rollout_step, train_step, state, pb):
  """One RL step: group rollouts -> rewards -> group advantages -> co-training step.

  Rows are sharded over (data, fsdp, cp): every device decodes its own rows, and every process
  decodes and scores (host code) the rows its devices hold. The rewards are gathered, so the
  advantages are taken over whole groups even when a group spans processes."""
  rl = ctx.config.rl
  group = rl.group_size  # rollouts per prompt
  t0 = time.perf_counter()
  inputs = ctx.place_prompts(stream, pb, repeat=group)
  gen, batch, key_data = jax.block_until_ready(rollout_step(state["params"], state["key"], *inputs))
  rollout_s = time.perf_counter() - t0
  per = stream.rows_per_shard
  scored = {}
  for r, row in multihost.host_rows(gen.tokens).items():
    j, i = divmod(r, per)
    b = pb[j]
    text = ctx.data.tok.decode(row)
    ex = Example(str(b["prompt_text"][i // group]), str(b["answer_text"][i // group]))
    fmt = ctx.data.task.format_of(text) if hasattr(ctx.data.task, "format_of") else None
    scored[r] = (float(ctx.data.task.reward(ex, text)), fmt)
  scored = multihost.gather_rows(scored)
  rows = stream.num_shards * per
  rewards = np.asarray([scored[r][0] for r in range(rows)], np.float32)
  formats = [scored[r][1] for r in range(rows)]
  advantages = np.asarray(grpo.group_advantages(jnp.asarray(rewards), group, mode=rl.advantage))
  adv = multihost.put(advantages, ctx.layout.rows_sharding())
  batch = ctx.device_training_batch(dict(batch, advantages=adv))
  t1 = time.perf_counter()
  state, metrics = jax.block_until_ready(train_step(dict(state, key=key_data), batch))
  m = _rollout_metrics(ctx, gen, rewards, formats)
  m.update(host_metrics(metrics), rollout_seconds=rollout_s, train_seconds=time.perf_counter() - t1)
  return state, m


def _rollout_metrics(ctx: Context, gen, rewards, formats) -> dict:
  """Reward, accuracy, tau (accept_len), passes/token, length and answer formats of a batch."""
  fig = decoding_figures(gen)
  m = {
    "reward_mean": float(rewards.mean()),
    "accuracy": float(np.mean(rewards > 0)),
    "policy_passes_per_token": fig["policy_passes_per_token"],
    "mean_length": fig["tokens"] / len(rewards),
    # AR rollouts have one token per pass: tau = 1 and no drafted positions.
    "accept_len": fig.get("tau", 1.0),
    "accept_per_position": fig.get("accept_per_position", []),
    "draft_loss": None,  # overwritten by the step's metrics when the draft trains
  }
  st = {k: multihost.to_host(v) for k, v in gen.stats.items()}
  rounds = int(st.get("rounds", st["policy_passes"] - 1))
  # the tail profile: rows still generating at each round (AR: each step)
  m["active_trace"] = st["active_trace"][:rounds].tolist()
  if "num_draft_counts" in st:  # SD: the G each round drafted (decode.speculation = auto)
    m["num_draft_counts"] = st["num_draft_counts"].tolist()
    m["num_draft_trace"] = st["num_draft_trace"][:rounds].tolist()
  if ctx.rollouts.stage_times:  # G per stage with price feedback: what each stage cost
    m["stage_times"] = [
      {k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}
      for r in ctx.rollouts.stage_times
    ]
    m["stage_price_factors"] = ctx.rollouts.stage_prices.summary()
  if hasattr(ctx.data.task, "format_of"):
    m["format_share"] = {f: formats.count(f) / len(formats) for f in sorted(set(formats))}
  return m
