"""Train states: sharded initialisation, their shardings, and restoring the newest checkpoint.

A state is a dict pytree `{"step", "params", "opt_state", ...}`; every phase of the run
(`train/phases.py`) builds one, restores it if a checkpoint exists, and donates it to its step.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp

from specdraft.model import drafts
from specdraft.model import policy as pol
from specdraft.parallel.layout import Layout
from specdraft.tasks import tokenizer as tok_lib


def policy_config(config, tok=None) -> pol.PolicyConfig:
  """The policy's config: `config.model`'s fields over the tokenizer's vocabulary, or, with
  `model.init_from` set, the architecture of that Hugging Face checkpoint (config.json) with
  `model.tap_layers` and `model.dtype` applied. Generation stops at the tokenizer's EOS and at
  the checkpoint's other EOS ids (generation_config.json / config.json)."""
  tok = tok or tok_lib.make_tokenizer(config)
  path = config.model.get("init_from", "") or ""
  if path:
    from specdraft.interop import hf

    taps = config.model.tap_layers
    return hf.read_config(
      path,
      tap_layers=tuple(taps) if taps is not None else None,
      dtype=config.model.dtype,
      eos_id=tok.eos_id,
    )
  cfg = pol.PolicyConfig.from_config(config.model, tok.vocab_size)
  return dataclasses.replace(cfg, eos_id=tok.eos_id)


def init_state(pcfg: pol.PolicyConfig, tx, layout: Layout, seed: int, *, init_from: str = ""):
  """Abstract init -> shardings -> materialise sharded (never whole on one device). With
  `init_from` (a Hugging Face checkpoint directory of `pcfg`'s architecture) the parameters are
  that checkpoint's, each device's shard read from the files as it is placed."""
  abstract = jax.eval_shape(lambda: pol.init_params(pcfg, seed))
  shardings = policy_shardings(abstract, layout)
  if init_from:
    from specdraft.interop import hf

    (dtype,) = {x.dtype for x in jax.tree.leaves(abstract)}  # master weights (float32)
    params = hf.load_params(init_from, pcfg, dtype=dtype, shardings=shardings)
  else:
    params = jax.jit(lambda: pol.init_params(pcfg, seed), out_shardings=shardings)()
  sh = phase_state_shardings(tx, abstract, shardings, layout)
  return jax.jit(
    lambda p: {"step": jnp.zeros((), jnp.int32), "params": p, "opt_state": tx.init(p)},
    out_shardings=sh,
  )(params)


def policy_shardings(abstract_params, layout: Layout):
  """The policy's parameter shardings under the layout's rules (`policy.param_logical_axes`)."""
  return layout.tree_shardings(pol.param_logical_axes(abstract_params), abstract_params)


def draft_shardings(abstract_dparams, layout: Layout):
  """The draft's parameter shardings under the layout's rules (`drafts.param_logical_axes`:
  width over fsdp, heads and MLP over tensor, like the policy's layers)."""
  return layout.tree_shardings(drafts.param_logical_axes(abstract_dparams), abstract_dparams)


def init_draft(dcfg, pcfg: pol.PolicyConfig, params, layout: Layout, seed: int):
  """The draft's initial parameters (EAGLE-3's head and every kind's final norm start from the
  policy's `params`), placed with `draft_shardings`."""
  init = lambda p: drafts.init_params(dcfg, seed, p, pcfg)
  return jax.jit(init, out_shardings=draft_shardings(jax.eval_shape(init, params), layout))(params)


def opt_shardings(tx, abstract_params, param_shardings, layout: Layout):
  """Optimizer-state shardings: moments follow their parameters, counters are replicated.

  A leaf of the state is a parameter's moment when its path ends with that parameter's path and
  its shape is the parameter's (Adam's mu and nu, also inside `optax.chain`, `masked` and
  `multi_transform` states, whose path names the parameter last); anything else is replicated
  (left to the compiler, the zero moments of `tx.init` come out replicated, so under fsdp every
  device would hold the whole optimizer state)."""
  by_path = {
    tuple(path): (x.shape, sh)
    for (path, x), sh in zip(
      jax.tree_util.tree_flatten_with_path(abstract_params)[0],
      jax.tree.leaves(param_shardings),
      strict=True,
    )
  }
  depths = sorted({len(p) for p in by_path}, reverse=True)

  def follow(path, leaf):
    for n in depths:
      match = by_path.get(tuple(path[-n:])) if len(path) >= n else None
      if match is not None and match[0] == leaf.shape:
        return match[1]
    return layout.replicated()

  return jax.tree_util.tree_map_with_path(follow, jax.eval_shape(tx.init, abstract_params))


def phase_state_shardings(tx, abstract_params, param_shardings, layout: Layout, *scalars: str):
  """Shardings of a phase's state {step, params, opt_state, *scalars}: the parameters',
  their moments' (`opt_shardings`), and the step and every named scalar replicated."""
  rep = layout.replicated()
  return {
    "step": rep,
    "params": param_shardings,
    "opt_state": opt_shardings(tx, abstract_params, param_shardings, layout),
    **{k: rep for k in scalars},
  }


def keyed_state(tx, params, layout: Layout, seed: int):
  """({step, params, opt_state, key}, its shardings) for placed `params`: they keep their
  shardings, their moments follow them, the step and the key (from `seed`) are replicated. A step
  that returns its state with these shardings compiles once."""
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
  sh = phase_state_shardings(tx, abstract, state_shardings(params), layout, "key")
  state = jax.jit(
    lambda p: {
      "step": jnp.zeros((), jnp.int32),
      "params": p,
      "opt_state": tx.init(p),
      "key": jax.random.key_data(jax.random.key(seed)),
    },
    out_shardings=sh,
  )(params)
  return state, sh


def cotrain_params(pcfg: pol.PolicyConfig, dcfg, seed: int = 0) -> dict:
  """{policy, draft}: fresh co-training parameters (the policy from `seed`, the draft from
  `seed + 1`, as `init_state` and `init_draft` draw them)."""
  theta = pol.init_params(pcfg, seed)
  return {"policy": theta, "draft": drafts.init_params(dcfg, seed + 1, theta, pcfg)}


def cotrain_state_shardings(pcfg: pol.PolicyConfig, dcfg, tx, layout: Layout, seed: int = 0):
  """(abstract state, its shardings) of the co-training step's {step, params: {policy, draft},
  opt_state}: what the trainer's RL phase places (`init_state`'s policy, `init_draft`'s draft,
  `keyed_state`'s moments), without materialising it (layout comparisons, sharding snapshots)."""

  def init():
    tr = cotrain_params(pcfg, dcfg, seed)
    return {"step": jnp.zeros((), jnp.int32), "params": tr, "opt_state": tx.init(tr)}

  abstract = jax.eval_shape(init)
  params = {
    "policy": policy_shardings(abstract["params"]["policy"], layout),
    "draft": draft_shardings(abstract["params"]["draft"], layout),
  }
  return abstract, phase_state_shardings(tx, abstract["params"], params, layout)


def sft_state_shardings(pcfg: pol.PolicyConfig, tx, layout: Layout, seed: int = 0):
  """(abstract state, its shardings) of the SFT step: `init_state`'s, abstract."""
  abstract = jax.eval_shape(
    lambda: {
      "step": jnp.zeros((), jnp.int32),
      "params": (p := pol.init_params(pcfg, seed)),
      "opt_state": tx.init(p),
    }
  )
  shardings = policy_shardings(abstract["params"], layout)
  return abstract, phase_state_shardings(tx, abstract["params"], shardings, layout)


def state_shardings(state):
  return jax.tree.map(lambda x: x.sharding, state)


def abstract_like(state):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


def restore(ckpt, state, data_iter, *logs):
  """(start step, state) from the newest readable checkpoint, else (0, state) unchanged.

  Puts the data iterator back where the checkpoint left it and truncates `logs` (RunLogs) to
  the restored step, so a resumed run writes the same files as an uninterrupted one.
  """
  restored = ckpt.restore_latest(abstract_like(state))
  start = 0
  if restored is not None:
    start, state, extra = restored
    if data_iter is not None:
      data_iter.set_state(extra["data_iter"])
    print(f"Resumed {os.path.basename(ckpt.mngr.directory)} from step {start}", flush=True)
  # From scratch (no checkpoint: a phase killed before its first one, or one of 0 steps run
  # again) every row goes, the step-0 evaluation included, which the phase writes again.
  for log in logs:
    log.truncate_after(start if start > 0 else -1)
  return start, state
