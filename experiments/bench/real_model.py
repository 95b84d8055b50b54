"""A real pretrained model offline (experiments/real_model_sd.py, configs/real_model.py).

1. The GGUF file is converted into a Hugging Face directory (`interop.ggml.convert`), which the
   run imports (`model.init_from`): weights, tokenizer.json and chat template.
2. The policy is checked against its own reference where one runs here: `transformers`' GGUF
   loader on the same file. Logits on templated held-out prompts (max |diff| / max |logit|) and
   greedy completions (token for token).
3. `loop.train_and_evaluate` distils the EAGLE-3 draft (reduced vocabulary) on the policy's own
   sampled rollouts (no SFT, no RL) and writes the run's SD-vs-AR report.
4. SD vs AR at each (temperature, batch) point of `real.report`, timed side by side on held-out
   prompts (`decode.compare.compare_rollouts`).
"""

from __future__ import annotations

import os
import time

import numpy as np

from experiments.bench import provenance
from specdraft.decode import autoregressive
from specdraft.decode.compare import compare_rollouts
from specdraft.interop import ggml
from specdraft.tasks import loader
from specdraft.train import loop, phases


def parity(ctx, params, gguf_path: str, n: int, max_new_tokens: int) -> dict:
  """Our policy against transformers reading the same GGUF file (float32)."""
  import jax
  import jax.numpy as jnp
  import torch
  import transformers

  from specdraft.model import policy as pol

  ref = transformers.AutoModelForCausalLM.from_pretrained(
    os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
  ).eval()
  fwd = jax.jit(lambda p, t: pol.forward(p, ctx.models.pcfg, t, jnp.arange(t.shape[1])[None],
                                         jnp.ones(t.shape, jnp.int32))[0])  # fmt: skip
  rel, equal, rows = [], True, []
  for ex in ctx.data.eval_examples[:n]:
    ids = ctx.data.tok.encode_prompt(ex.prompt)
    with torch.no_grad():
      want = ref(torch.tensor([ids])).logits.float().numpy()
      gen = ref.generate(
        torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
        eos_token_id=ctx.data.tok.eos_id, pad_token_id=ctx.data.tok.pad_id,
      )[0, len(ids):].tolist()  # fmt: skip
    got = np.asarray(fwd(params, jnp.asarray([ids])))
    rel.append(float(np.abs(got - want).max() / np.abs(want).max()))
    prompts, lengths = loader.prompt_batch([ex], ctx.data.tok, ctx.data.prompt_len)
    ours = autoregressive.generate(
      params, ctx.models.pcfg, prompts, lengths, jax.random.key(0),
      max_new_tokens=max_new_tokens, temperature=0.0,
    )  # fmt: skip
    ours = np.asarray(ours.tokens[0, : int(ours.lengths[0])]).tolist()
    theirs = gen[: gen.index(ctx.data.tok.eos_id) + 1] if ctx.data.tok.eos_id in gen else gen
    equal &= ours == theirs
    rows.append(
      {
        "prompt": ex.prompt,
        "ours": ctx.data.tok.decode(ours),
        "transformers": ctx.data.tok.decode(theirs),
      }
    )
  return {
    "max_rel_logit_diff": max(rel),
    "greedy_equal": bool(equal),
    "prompts": len(rel),
    "samples": rows,
  }


def own_vocabulary(config, run_dir: str, hf_dir: str) -> str:
  """The draft's reduced vocabulary from the policy's own generations: `real.vocab_prompts`
  training prompts rolled out at the draft's rollout temperatures (cycled over batches of 32), the `draft.vocab_size` most
  frequent generated ids (EOS always in), written once to <run dir>/draft_vocab.json."""
  import json

  import jax

  from specdraft.interop import hf
  from specdraft.model import eagle3

  path = os.path.join(run_dir, "draft_vocab.json")
  if os.path.isfile(path):
    return path
  probe = config.copy_and_resolve_references()
  probe.draft.vocab_size = 0  # this Context only reads the task and the tokenizer
  ctx = loop.Context(probe, run_dir)
  params = jax.device_put(hf.load_params(hf_dir, ctx.models.pcfg))
  n, B, rows = int(config.real.vocab_prompts), 32, []
  key = jax.random.key(config.seed + 7)
  temps = phases.rollout_temperatures(config.draft)
  for i, start in enumerate(range(0, n, B)):
    exs = [loader.to_example(ctx.data.train_src[i]) for i in range(start, min(start + B, n))]
    prompts, lengths = loader.prompt_batch(exs, ctx.data.tok, ctx.data.prompt_len)
    key, sub = jax.random.split(key)
    gen = autoregressive.generate(
      params, ctx.models.pcfg, prompts, lengths, sub,
      max_new_tokens=config.decode.max_new_tokens,
      temperature=temps[i % len(temps)],
    )  # fmt: skip
    toks, lens = np.asarray(gen.tokens), np.asarray(gen.lengths)
    rows += [t[:m].tolist() for t, m in zip(toks, lens)]
  ids = eagle3.frequent_tokens(
    rows,
    ctx.models.pcfg.vocab_size,
    int(config.draft.vocab_size),
    always=(ctx.data.tok.eos_id, *ctx.models.pcfg.stop_ids),
  )
  os.makedirs(run_dir, exist_ok=True)
  with open(path + ".tmp", "w") as f:
    json.dump(list(ids), f)
  os.replace(path + ".tmp", path)
  covered = np.isin(np.concatenate([np.asarray(r) for r in rows]), ids).mean()
  print(
    f"  draft vocabulary: {len(ids)} ids cover {covered:.3f} of {n} own generations", flush=True
  )
  return path


def point(ctx, params, dparams, config, temperature: float, batch: int) -> dict:
  """SD vs AR at one (temperature, batch): `real.eval_prompts` distinct held-out prompts in
  batches of `batch`, each batch timed side by side (`compare_rollouts`). tau and the rates are
  the means over batches (each prompt counts once), speedup the geometric mean of the batches'
  speedups; the per-batch rows are kept."""
  n = int(config.real.eval_prompts)
  if n % batch or n > len(ctx.data.eval_examples):
    raise ValueError(
      f"config.real.eval_prompts={n} must be a multiple of batch {batch} and at most "
      f"eval.num_examples={len(ctx.data.eval_examples)}"
    )
  rows = []
  for start in range(0, n, batch):
    exs = ctx.data.eval_examples[start : start + batch]
    prompts, lengths = loader.prompt_batch(exs, ctx.data.tok, ctx.data.prompt_len)
    rows.append(
      compare_rollouts(
        params,
        dparams,
        ctx.models.pcfg,
        ctx.models.dcfg,
        prompts,
        lengths,
        max_new_tokens=config.decode.max_new_tokens,
        num_draft=config.decode.num_draft,
        temperature=temperature,
        repeats=int(config.real.repeats),
        seed=100 + start,
      )  # fmt: skip
    )
  mean = lambda k: float(np.mean([x[k] for x in rows]))
  out = {
    "point": f"T{temperature:g}_B{batch}",
    "temperature": temperature,
    "batch": batch,
    "prompts": n,
    "tau": mean("tau"),
    "speedup": float(np.exp(np.mean([np.log(x["speedup"]) for x in rows]))),
    "ar_tokens_per_s": mean("ar_tokens_per_s"),
    "sd_tokens_per_s": mean("sd_tokens_per_s"),
    "sd_policy_passes_per_token": mean("sd_policy_passes_per_token"),
    "greedy_equal": all(x["greedy_equal"] for x in rows),
    "batches": rows,
  }
  print(f"  {out['point']}: speedup {out['speedup']:.2f}x tau {out['tau']:.2f}", flush=True)
  return out


def run(config, workdir: str) -> dict:
  provenance.check_workdir(workdir)  # before any work: repository results need a clean tree
  r = config.real
  t0 = time.time()
  gguf_path = r.gguf or ggml.packaged_model()
  run_dir = provenance.run_dir_for(workdir, "run")
  hf_dir = ggml.convert(gguf_path, r.hf_dir or os.path.join(run_dir, "hf"))
  convert_s = time.time() - t0
  config = config.copy_and_resolve_references()
  config.model.init_from = hf_dir
  config.data.data_dir = os.path.join(run_dir, "tfds")
  config.draft.vocab_file = own_vocabulary(config, run_dir, hf_dir)
  summary = loop.train_and_evaluate(config, run_dir)  # resumes / skips finished phases
  ctx = loop.Context(config, run_dir)
  params, _ = loop.sft_phase(ctx)  # 0 steps: the imported policy
  dparams, _ = loop.draft_phase(ctx, params)  # finished: restored
  check = parity(ctx, params, gguf_path, int(r.parity_prompts), config.decode.max_new_tokens)
  print(f"  parity: max rel logit diff {check['max_rel_logit_diff']:.2e}, greedy equal "
        f"{check['greedy_equal']}", flush=True)  # fmt: skip
  points = [point(ctx, params, dparams, config, float(t), int(b)) for t, b in r.report]
  payload = {
    "config": {
      "gguf": os.path.basename(gguf_path),
      "policy": {
        "layers": ctx.models.pcfg.n_layers,
        "d_model": ctx.models.pcfg.d_model,
        "vocab": ctx.models.pcfg.vocab_size,
      },
      "draft_vocab": int(config.draft.vocab_size),
      "draft_steps": int(config.draft.pretrain_steps),
      "draft_batch": int(config.draft.batch_size),
      "ttt_steps": int(config.draft.ttt_steps),
      "rollout_temperatures": list(phases.rollout_temperatures(config.draft)),
      "num_draft": int(config.decode.num_draft),
      "max_new_tokens": int(config.decode.max_new_tokens),
    },
    "convert_seconds": convert_s,
    "parity": check,
    "points": points,
    "training_summary": summary,
    "total_seconds": time.time() - t0,
  }
  measured = {
    "by_point": {p["point"]: p for p in points},
    "parity": check,
    "total_seconds": payload["total_seconds"],
  }
  results = provenance.write_results(
    workdir, payload, goals=provenance.goals_from_config(r.goals), measured=measured
  )
  print(provenance.goals_table(results["goals"]), flush=True)
  return results
