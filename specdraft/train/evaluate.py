"""Evaluation during and after a run: greedy held-out accuracy, and the SD-vs-AR report on the
final checkpoint (timed by `decode.compare.compare_rollouts`, shared with bench/rollout.py)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import PartitionSpec

from specdraft.decode import autoregressive
from specdraft.decode.compare import compare_rollouts
from specdraft.parallel import multihost
from specdraft.tasks import CharTokenizer, loader
from specdraft.tasks.base import max_prompt_length

# Long prompt buffers are padded to a multiple of this: prefill attends in tiles (up to 512 rows)
# that must divide half the prompt length, and a length like 8202 (= 2 * 3 * 1367) leaves tiles
# of 3 tokens, millions of tile pairs where a round length has a few hundred. Prompts of up to
# 1024 tokens fit in one tile per half and keep their length.
PROMPT_MULTIPLE = 128


def prompt_len_for(task, tok=None, prompts=None) -> int:
  """A safe upper bound on any prompt's tokens (the task's longest prompt, `max_prompt_length`,
  with BOS or the chat template's frame, `tok`: the character tokenizer by default); above 1024
  tokens rounded up to a multiple of PROMPT_MULTIPLE. With `prompts` (every prompt text the run
  can draw) and a tokenizer whose bound is loose (a BPE: one id per byte at worst), the longest
  of their actual encodings instead."""
  tok = tok or CharTokenizer()
  n = tok.max_prompt_tokens(max_prompt_length(task))
  if prompts is not None and not isinstance(tok, CharTokenizer):
    n = max(len(tok.encode_prompt(p)) for p in prompts)
  if n <= 1024:
    return n
  return -(-n // PROMPT_MULTIPLE) * PROMPT_MULTIPLE


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
  tok=None,
) -> dict:
  """Greedy accuracy (mean reward) on `examples`; batches are padded by repetition (`tok`: the
  run's tokenizer, the character tokenizer by default)."""
  tok = tok or CharTokenizer()
  rewards, samples = [], []
  for i in range(0, len(examples), batch_size):
    chunk = examples[i : i + batch_size]
    padded = chunk + [chunk[-1]] * (batch_size - len(chunk))
    prompts_BS, lengths_B = loader.prompt_batch(padded, tok, prompt_len)
    prompts_BS, lengths_B = _place_rows(prompts_BS, lengths_B, sharding)
    gen = autoregressive.generate(
      params,
      pcfg,
      prompts_BS,
      lengths_B,
      jax.random.key(0),
      max_new_tokens=max_new_tokens,
      temperature=0.0,
    )
    for ex, row in zip(chunk, multihost.to_host(gen.tokens)):
      completion = tok.decode(row)
      rewards.append(task.reward(ex, completion))
      if len(samples) < 4:
        samples.append({"prompt": ex.prompt, "completion": completion, "answer": ex.answer})
  return {"accuracy": float(np.mean(rewards)), "samples": samples}


def _place_rows(prompts_BS, lengths_B, sharding):
  """Rows over the layout's row axes (data, fsdp, cp): decoding rows are independent."""
  if sharding is None:
    return prompts_BS, lengths_B
  rows = sharding.update(spec=PartitionSpec(*sharding.spec[:1]))
  return multihost.put(prompts_BS, sharding), multihost.put(lengths_B, rows)


def held_out_prompts(ctx):
  """(prompts_BS, lengths_B): `eval.batch_size` held-out prompts (repeated if there are fewer),
  rows sharded as in rollouts."""
  n = ctx.config.eval.batch_size
  exs = [ctx.data.eval_examples[i % len(ctx.data.eval_examples)] for i in range(n)]
  prompts_BS, lengths_B = loader.prompt_batch(exs, ctx.data.tok, ctx.data.prompt_len)
  return _place_rows(prompts_BS, lengths_B, ctx.layout.rows_sharding(ndim=2))


def rollout_report(ctx, params, dparams, *, repeats: int = 3, as_run: bool = False) -> dict:
  """SD vs AR on `eval.batch_size` held-out prompts at `eval.sd_temperature` and G =
  `decode.num_draft` (figures defined in decode/compare.py), rows sharded as in rollouts.

  as_run=False: one loop per arm, every row riding in every pass, SD at the fixed G.
  as_run=True: both arms decode as the run's rollouts do, through `decode.engine` (finished rows
  compacted away in both arms when `decode.compact`; with `decode.speculation = auto`, G chosen
  per round or per stage from the run's cost model, the acceptance its rollouts carried and,
  per stage with `decode.price_feedback`, what their stages cost)."""
  c = ctx.config
  prompts_BS, lengths_B = held_out_prompts(ctx)
  placed = ctx.for_decoding({"policy": params, "draft": dparams})  # as the rollouts read them
  params, dparams = placed["policy"], placed["draft"]
  auto = c.decode.speculation == "auto"
  engine_kw = None
  if as_run:
    engine_kw = dict(
      ctx.engine_settings(adaptive=auto),
      cost=ctx.cost_model({"policy": params, "draft": dparams}) if auto else None,
      prior=ctx.rollouts.acceptance if auto else None,
    )
    if auto and engine_kw["per_stage"] and c.decode.get("price_feedback", False):
      engine_kw["prices"] = ctx.rollouts.stage_prices  # what the run's rollouts' stages cost
  return compare_rollouts(
    params,
    dparams,
    ctx.models.pcfg,
    ctx.models.dcfg,
    prompts_BS,
    lengths_B,
    max_new_tokens=c.decode.max_new_tokens,
    num_draft=c.decode.num_draft,
    temperature=c.eval.sd_temperature,
    repeats=repeats,
    engine_kw=engine_kw,
  )
