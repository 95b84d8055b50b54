"""Train states: sharded initialisation, their shardings, and restoring the newest checkpoint.

A state is a dict pytree `{"step", "params", "opt_state", ...}`; every phase of the run
(`train/phases.py`) builds one, restores it if a checkpoint exists, and donates it to its step.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from specdraft.model import policy as pol
from specdraft.parallel import mesh as mesh_lib
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


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def init_state(pcfg: pol.PolicyConfig, tx, mesh, rules, seed: int, *, init_from: str = ""):
  """Abstract init -> shardings -> materialise sharded (never whole on one device). With
  `init_from` (a Hugging Face checkpoint directory of `pcfg`'s architecture) the parameters are
  that checkpoint's, each device's shard read from the files as it is placed."""
  abstract = jax.eval_shape(lambda: pol.init_params(pcfg, seed))
  shardings = mesh_lib.tree_shardings(pol.param_logical_axes(abstract), abstract, rules, mesh)
  if init_from:
    from specdraft.interop import hf

    (dtype,) = {x.dtype for x in jax.tree.leaves(abstract)}  # master weights (float32)
    params = hf.load_params(init_from, pcfg, dtype=dtype, shardings=shardings)
  else:
    params = jax.jit(lambda: pol.init_params(pcfg, seed), out_shardings=shardings)()
  # Moments follow their parameters; counters and other scalars are replicated on the mesh.
  opt_state = jax.jit(tx.init, out_shardings=opt_shardings(tx, abstract, shardings, mesh))(params)
  step = jax.jit(lambda: jnp.zeros((), jnp.int32), out_shardings=replicated(mesh))()
  return {"step": step, "params": params, "opt_state": opt_state}


def draft_shardings(dcfg, abstract_dparams, mesh, rules):
  """The draft's parameter shardings under the layout's rules (`drafts.param_logical_axes`:
  width over fsdp, heads and MLP over tensor, like the policy's layers)."""
  from specdraft.model import drafts

  logical = drafts.param_logical_axes(abstract_dparams)
  return mesh_lib.tree_shardings(logical, abstract_dparams, rules, mesh)


def opt_shardings(tx, abstract_params, param_shardings, mesh):
  """Optimizer-state shardings: moments follow their parameters, counters are replicated.

  A leaf of the state is a parameter's moment when its path ends with that parameter's path and
  its shape is the parameter's (Adam's mu and nu, also inside `optax.chain`, `masked` and
  `multi_transform` states, whose path names the parameter last); anything else is replicated."""
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
    return replicated(mesh)

  return jax.tree_util.tree_map_with_path(follow, jax.eval_shape(tx.init, abstract_params))


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
