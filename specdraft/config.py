"""Config helpers: `:arg` parsing and validation that runs before anything compiles."""

from __future__ import annotations

import math
import os

import ml_collections

from specdraft.parallel import layouts
from specdraft.parallel.mesh import check_mesh
from specdraft.tasks import TASKS, make_task
from specdraft.tasks import tokenizer as tok_lib

ROLLOUT_DRAFTS = ("cotrained", "fixed", "none")


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses 'size=tiny,layout=dp8,smoke' into a ConfigDict over `defaults`.

  A bare word sets a boolean flag; values are cast to the default's type.
  """
  out = ml_collections.ConfigDict(dict(defaults))
  for part in filter(None, (arg or "").split(",")):
    key, eq, val = part.partition("=")
    key = key.strip()
    if key not in defaults:
      raise ValueError(f"config arg {key!r} is unknown; valid args: {sorted(defaults)}")
    if not eq:
      out[key] = True
      continue
    d = defaults[key]
    if isinstance(d, bool):
      out[key] = val.lower() in ("1", "true", "yes")
    elif isinstance(d, int):
      out[key] = int(val)
    elif isinstance(d, float):
      out[key] = float(val)
    else:
      out[key] = val
  return out


def layout_config(name: str) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(layouts.layout(name))


def invalid(field, value, valid):
  """Raises the config error every check gives: the field, its value and what would be valid."""
  raise ValueError(f"config.{field}={value!r} is invalid: {valid}")


def _real(x) -> bool:
  """A finite int or float (not a bool)."""
  return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def validate(config, *, num_devices: int | None = None) -> None:
  """Checks every knob the run depends on; raises ValueError naming the field, its value and
  what is valid."""
  path = config.model.get("init_from", "") or ""
  if path and not os.path.isfile(os.path.join(path, "config.json")):
    invalid(
      "model.init_from", path, "expected a Hugging Face checkpoint directory with config.json"
    )
  tok = _tokenizer(config)
  pcfg = _policy(config, tok)
  _validate_model(config.model, pcfg)
  _validate_task_and_data(config, tok)
  _validate_decoding(config)
  _validate_draft(config, pcfg, tok)
  _validate_rl(config)
  _validate_compute(config)
  _validate_attention(config)
  _validate_export(config, pcfg, tok)
  _validate_layout(config, num_devices, pcfg)


def _tokenizer(config):
  """The run's tokenizer; a missing or unreadable tokenizer.json names the field that chose it."""
  field = "data.tokenizer" if config.data.get("tokenizer", "") else "model.init_from"
  try:
    return tok_lib.make_tokenizer(config)
  except (OSError, ValueError) as e:
    path = tok_lib.tokenizer_path(config)
    if not path:  # the character tokenizer refused a setting (data.chat_template)
      raise
    invalid(field, path, f"its tokenizer cannot be used: {e}")


def _policy(config, tok):
  """The policy's config; with `model.init_from`, the checkpoint is checked (architecture, every
  tensor's presence and shape) before anything is compiled."""
  path = config.model.get("init_from", "") or ""
  if path:
    from specdraft.interop import hf

    try:
      m = config.model
      taps = tuple(m.tap_layers) if m.tap_layers is not None else None
      pcfg = hf.read_config(path, eos_id=tok.eos_id, dtype=m.dtype, tap_layers=taps)
      if m.dtype not in ("float32", "bfloat16"):
        invalid("model.dtype", m.dtype, "expected 'float32' or 'bfloat16'")
      _check_taps(m.tap_layers, pcfg.n_layers, "the checkpoint's num_hidden_layers")
      hf.check_checkpoint(path, pcfg)
    except (OSError, KeyError, ValueError) as e:
      if str(e).startswith("config."):
        raise
      invalid("model.init_from", path, str(e))
  else:
    pcfg = None
  if path and tok.vocab_size > pcfg.vocab_size:
    invalid(
      "model.init_from",
      path,
      f"its vocab_size {pcfg.vocab_size} is smaller than the tokenizer's {tok.vocab_size} "
      f"({tok_lib.tokenizer_path(config)})",
    )
  return pcfg


def _check_taps(tap_layers, n_layers: int, what: str) -> None:
  if tap_layers is not None:
    taps = tuple(tap_layers)
    if not taps or any(not 0 <= int(t) < n_layers for t in taps):
      invalid("model.tap_layers", taps, f"each tap layer must be in [0, {n_layers}) ({what})")
    if len(set(taps)) != len(taps):
      invalid("model.tap_layers", taps, "tap layers must be distinct")


def _validate_model(m, imported) -> None:
  if imported is not None:  # the architecture is the checkpoint's (checked by _policy)
    return
  for f in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "d_ff"):
    if int(m[f]) < 1:
      invalid(f"model.{f}", m[f], "must be >= 1")
  if m.n_heads % m.n_kv_heads:
    invalid(
      "model.n_kv_heads", m.n_kv_heads, f"model.n_heads={m.n_heads} must be a multiple of it (GQA)"
    )
  if m.head_dim % 2:
    invalid("model.head_dim", m.head_dim, "must be even (RoPE rotates pairs)")
  if m.dtype not in ("float32", "bfloat16"):
    invalid("model.dtype", m.dtype, "expected 'float32' or 'bfloat16'")
  _check_taps(m.tap_layers, m.n_layers, f"model.n_layers={m.n_layers}")


def _validate_task_and_data(config, tok) -> None:
  """The task (its difficulty knobs are checked by the task itself) and the SFT batches."""
  t, d = config.task, config.data
  if t.name not in TASKS:
    invalid("task.name", t.name, f"expected one of {TASKS}")
  task = make_task(t)
  if t.num_train < 1 or t.num_test < 1:
    invalid("task.num_train/num_test", (t.num_train, t.num_test), "must be >= 1")
  if d.batch_size < 1:
    invalid("data.batch_size", d.batch_size, "must be >= 1")
  # BOS + prompt + answer + EOS, bounded from the characters (a pretrained tokenizer's rows are
  # measured on the data instead, before anything compiles: train/phases.Context)
  need = tok.max_prompt_tokens(task.max_length()) + tok.max_answer_tokens(0)
  if isinstance(tok, tok_lib.CharTokenizer) and d.seq_len < need:
    invalid("data.seq_len", d.seq_len, f"the task's longest example needs {need} tokens")
  if t.name == "longtail" and isinstance(tok, tok_lib.CharTokenizer):
    # the task is its tail: a completion cut short of its end earns nothing
    most = tok.max_answer_tokens(task.max_length() - task.max_prompt_length())
    for field, value in (
      ("decode.max_new_tokens", config.decode.max_new_tokens),
      ("rl.max_new_tokens", config.rl.max_new_tokens),  # 0: decode's
    ):
      if 0 < value < most:
        invalid(field, value, f"task.longtail's completions run to {most} tokens (EOS included)")
  s = config.sft
  if s.steps < 0 or s.lr <= 0:
    invalid("sft", (s.steps, s.lr), "need steps >= 0 and lr > 0")


SPECULATION = ("fixed", "auto")


def _validate_decoding(config) -> None:
  dec = config.decode
  if dec.max_new_tokens < 1:
    invalid("decode.max_new_tokens", dec.max_new_tokens, "must be >= 1")
  if dec.num_draft < 1:
    invalid("decode.num_draft", dec.num_draft, "must be >= 1 (tokens drafted per round)")
  if dec.get("speculation", "fixed") not in SPECULATION:
    invalid("decode.speculation", dec.speculation, f"expected one of {SPECULATION}")
  if dec.get("catch_up_window", 8) < 1:
    invalid(
      "decode.catch_up_window",
      dec.catch_up_window,
      "must be >= 1 (plain-step entries the draft takes in when drafting resumes)",
    )
  if dec.get("min_rows", 1) < 1:
    invalid("decode.min_rows", dec.min_rows, "must be >= 1 (rows of the smallest compacted batch)")
  if not 0.0 <= dec.get("prior_rate", 0.6) <= 1.0:
    invalid("decode.prior_rate", dec.prior_rate, "must be an acceptance rate in [0, 1]")
  if dec.get("prior_weight", 4.0) < 0 or not 0.0 <= dec.get("prior_keep", 0.5) <= 1.0:
    invalid(
      "decode.prior_weight/prior_keep",
      (dec.prior_weight, dec.prior_keep),
      "need prior_weight >= 0 (pseudo rounds) and prior_keep in [0, 1]",
    )
  outlier = dec.get("cost_outlier", 0.0)
  if isinstance(outlier, bool) or not isinstance(outlier, (int, float)) or not outlier >= 0:
    invalid(
      "decode.cost_outlier",
      outlier,
      "expected a log ratio >= 0: how far a timed round may lie from its row count's robust line "
      "in G before the line prices it (0 = every timed round as measured)",
    )
  feedback = dec.get("price_feedback", False)
  if not isinstance(feedback, bool):
    invalid("decode.price_feedback", feedback, "expected True or False")
  pseudo, keep = dec.get("price_prior_rounds", 4.0), dec.get("price_keep", 0.7)
  if not (_real(pseudo) and pseudo >= 0 and _real(keep) and 0.0 <= keep <= 1.0):
    invalid(
      "decode.price_prior_rounds/price_keep",
      (pseudo, keep),
      "need price_prior_rounds >= 0 (pseudo rounds at the planned price) and price_keep in "
      "[0, 1] (the weight of earlier stages' evidence at each new observation)",
    )
  # Sampling temperatures: RL rollouts, draft distillation and the SD-vs-AR report.
  for field, value in (
    ("rl.temperature", config.rl.temperature),
    ("draft.rollout_temperature", config.draft.rollout_temperature),
    ("eval.sd_temperature", config.eval.sd_temperature),
  ):
    if value < 0:
      invalid(field, value, "must be >= 0 (0 = greedy)")
  temps = config.draft.get("rollout_temperatures", ()) or ()
  if not isinstance(temps, (tuple, list)) or any(
    isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0 for t in temps
  ):
    invalid(
      "draft.rollout_temperatures",
      temps,
      "must be a tuple of temperatures >= 0 cycled over the draft's distillation steps "
      "(empty: draft.rollout_temperature every step)",
    )
  repeats = config.eval.get("report_repeats", 3)
  if not isinstance(repeats, int) or repeats < 0:
    invalid("eval.report_repeats", repeats, "must be an integer >= 0 (0 = no SD-vs-AR report)")
  rl = config.rl
  top_k, top_p = rl.get("top_k", 0), rl.get("top_p", 1.0)
  if int(top_k) != top_k or top_k < 0:
    invalid("rl.top_k", top_k, "must be an integer >= 0 (0 = off)")
  if not 0.0 < top_p <= 1.0:
    invalid("rl.top_p", top_p, "must be in (0, 1] (1 = off)")
  if (top_k or top_p < 1.0) and rl.beta > 0:
    invalid(
      "rl.top_k/rl.top_p",
      (top_k, top_p),
      "truncated sampling cannot be combined with a KL term (rl.beta > 0): the reference policy's "
      "truncated distribution may give a sampled token zero mass; set rl.beta = 0 or turn "
      "truncation off (top_k = 0, top_p = 1)",
    )


def _validate_draft(config, imported, tok) -> None:
  """`imported`: the PolicyConfig of a `model.init_from` checkpoint (its heads and vocabulary are
  the draft's defaults), else None (config.model's, over the tokenizer's vocabulary)."""
  from specdraft.model import drafts

  dr = config.draft
  m = imported or config.model
  kind = dr.get("kind", "eagle3")
  if kind not in drafts.KINDS:
    invalid("draft.kind", kind, f"expected one of {drafts.KINDS}")
  V = imported.vocab_size if imported else tok.vocab_size
  if kind != "eagle3":
    _validate_block_draft(config, V)
  if dr.ttt_steps < 1:
    invalid("draft.ttt_steps", dr.ttt_steps, "must be >= 1")
  if not 0 < dr.ttt_decay <= 1:
    invalid("draft.ttt_decay", dr.ttt_decay, "must be in (0, 1]")
  dh, dk = dr.n_heads or m.n_heads, dr.n_kv_heads or m.n_kv_heads
  if dh % dk:
    invalid("draft.n_kv_heads", dk, f"draft heads {dh} must be a multiple of it (GQA)")
  if dr.pretrain_steps < 0:
    invalid("draft.pretrain_steps", dr.pretrain_steps, "must be >= 0")
  nv = dr.get("vocab_size", 0)
  if not isinstance(nv, int) or not 0 <= nv <= V:
    invalid(
      "draft.vocab_size",
      nv,
      f"must be an integer in [0, {V}]: the draft head's vocabulary (0 = the policy's {V})",
    )
  vocab_file = dr.get("vocab_file", "")
  if vocab_file:
    if not nv:
      invalid("draft.vocab_file", vocab_file, "needs draft.vocab_size > 0 (its number of ids)")
    try:
      read_draft_vocab(vocab_file, nv, V)
    except (OSError, ValueError) as e:
      invalid("draft.vocab_file", vocab_file, str(e))
  if nv and kind != "eagle3":
    invalid(
      "draft.vocab_size",
      nv,
      f"a reduced draft vocabulary is an EAGLE-3 option; draft.kind={kind!r} uses the policy's "
      "head (set it to 0)",
    )


def _validate_block_draft(config, vocab_size: int) -> None:
  bl = config.draft.block
  mask_id = bl.get("mask_token_id", -1)
  if not isinstance(mask_id, int) or not -1 <= mask_id < vocab_size:
    invalid(
      "draft.block.mask_token_id",
      mask_id,
      f"must be -1 (a learned mask embedding) or a token id in [0, {vocab_size}) whose policy "
      "embedding row is the block's MASK input",
    )
  if bl.n_layers < 1:
    invalid("draft.block.n_layers", bl.n_layers, "must be >= 1")
  least = 2 if config.draft.kind == "dflash" else 1  # dflash's slot 0 is the anchor, no proposal
  if bl.block_size and bl.block_size < least:
    invalid(
      "draft.block.block_size",
      bl.block_size,
      f"must be >= {least} for {config.draft.kind} (a block that proposes at least one token), "
      "or 0 (the block that proposes decode.num_draft)",
    )
  if bl.gamma <= 0:
    invalid("draft.block.gamma", bl.gamma, "must be > 0 (loss decay exp(-k / gamma))")
  if bl.get("anchor_residual", "") not in ("", "token", "mask"):
    invalid(
      "draft.block.anchor_residual",
      bl.anchor_residual,
      "must be 'token' (the anchor slot's residual starts at its embedding), 'mask' (at the MASK "
      "vector) or '' (the kind's default: mask for dspark, token for dflash)",
    )
  if config.draft.kind == "dspark":
    if bl.markov_rank < 0:
      invalid(
        "draft.block.markov_rank",
        bl.markov_rank,
        "must be >= 1 (the Markov head's rank), or 0 (DSpark without its Markov head)",
      )
    if bl.l1_weight < 0:
      invalid("draft.block.l1_weight", bl.l1_weight, "must be >= 0")
  proposals = bl.block_size - 1 if config.draft.kind == "dflash" else bl.block_size
  if bl.block_size and config.decode.num_draft > proposals:
    invalid(
      "decode.num_draft",
      config.decode.num_draft,
      f"a {config.draft.kind} draft with block_size {bl.block_size} proposes {proposals} tokens "
      f"a round: num_draft must be <= {proposals} (or raise draft.block.block_size)",
    )


def _validate_rl(config) -> None:
  from specdraft.rl import grpo

  rl = config.rl
  if rl.advantage not in grpo.ADVANTAGES:
    invalid("rl.advantage", rl.advantage, f"expected one of {grpo.ADVANTAGES}")
  if rl.aggregation not in grpo.AGGREGATIONS:
    invalid("rl.aggregation", rl.aggregation, f"expected one of {grpo.AGGREGATIONS}")
  if rl.kl_estimator not in grpo.KL_ESTIMATORS:
    invalid("rl.kl_estimator", rl.kl_estimator, f"expected one of {grpo.KL_ESTIMATORS}")
  if rl.group_size < 1 or (rl.advantage == "rloo" and rl.group_size < 2):
    invalid("rl.group_size", rl.group_size, "must be >= 1 (>= 2 for rloo)")
  if rl.prompts_per_step < 1 or rl.steps < 0:
    invalid("rl.prompts_per_step/steps", (rl.prompts_per_step, rl.steps), "need >= 1 and >= 0")
  if rl.lam < 0 or rl.beta < 0:
    invalid("rl.lam/beta", (rl.lam, rl.beta), "must be >= 0")
  warmup = rl.get("warmup_steps", 0)
  if int(warmup) != warmup or warmup < 0:
    invalid("rl.warmup_steps", warmup, "must be an integer >= 0 (0 = the full rl.lr from step 1)")
  if config.rollout.draft not in ROLLOUT_DRAFTS:
    invalid("rollout.draft", config.rollout.draft, f"expected one of {ROLLOUT_DRAFTS}")
  if config.rollout.draft != "none" and config.draft.pretrain_steps == 0 and rl.steps > 0:
    print("note: rollout.draft uses an untrained draft (draft.pretrain_steps=0)")


def _validate_export(config, pcfg, tok) -> None:
  ex = config.get("export", None)
  if ex is None or not ex.get("dir", ""):
    return
  from specdraft.interop import export, hf
  from specdraft.model import policy as pol

  if not isinstance(ex.dir, str):
    invalid("export.dir", ex.dir, "expected a directory path (a string; '' for no export)")
  if ex.get("dtype", "float32") not in export.DTYPES:
    invalid("export.dtype", ex.dtype, f"expected one of {export.DTYPES}")
  taps = (pcfg or pol.PolicyConfig.from_config(config.model, tok.vocab_size)).taps
  dr = config.draft
  bl = dr.get("block", {})
  problem = hf.export_problem(
    dr.get("kind", "eagle3"), len(taps), bl.get("mask_token_id", -1), bl.get("qk_norm", False),
    bl.get("anchor_residual", ""),
  )  # fmt: skip
  if problem is not None:
    field, value, why = problem
    invalid(field, value, f"export.dir={ex.dir!r} asks for a serving checkpoint, but {why}")


def _validate_compute(config) -> None:
  cm = config.compute
  if cm.attn_tile < 1:
    invalid("compute.attn_tile", cm.attn_tile, "must be >= 1 (query rows and keys per tile)")
  if cm.vocab_chunk < 0:
    invalid("compute.vocab_chunk", cm.vocab_chunk, "must be >= 0 (tokens per chunk; 0 = whole row)")


ATTENTION_KERNELS = ("xla", "pallas")


def _validate_attention(config) -> None:
  """attention.kernel and the fused block's settings (attention/kernels/flash.py)."""
  at = config.get("attention")
  if at is None:
    return
  if at.kernel not in ATTENTION_KERNELS:
    invalid(
      "attention.kernel",
      at.kernel,
      f"expected one of {ATTENTION_KERNELS} (xla: the tiled XLA path; pallas: the fused block)",
    )
  from specdraft.attention.kernels import flash

  if at.backend not in flash.BACKENDS:
    invalid("attention.backend", at.backend, f"expected one of {flash.BACKENDS}")
  for name in ("block_q", "block_k"):
    if at[name] < 0:
      invalid(f"attention.{name}", at[name], "must be >= 0 (rows per tile; 0 = the default)")
  for name in ("num_warps", "num_stages"):
    if at[name] < 1:
      invalid(f"attention.{name}", at[name], "must be >= 1")
  if at.kernel != "pallas":
    return
  backend = at.backend
  if backend == "auto":
    try:
      backend = flash.resolve_backend("auto")
    except ValueError as e:
      invalid("attention.backend", at.backend, str(e))
  if backend == "triton":
    for name in ("block_q", "block_k"):
      b = at[name]
      if b and (b < 16 or b & (b - 1)):
        invalid(f"attention.{name}", b, "Triton tiles are powers of two >= 16 (or 0)")
  rows = {a: int(config.parallel.mesh.get(a, 1)) for a in ("data", "fsdp", "tensor")}
  rows = {a: n for a, n in rows.items() if n > 1}
  if backend != "interpret" and rows:
    invalid(
      "attention.kernel",
      at.kernel,
      f"on {backend} the fused block is one custom call per device, which the compiler cannot "
      f"split by rows or heads, and a training step leaves the mesh's row and head axes to it "
      f"(this layout: {rows}); use kernel='xla' under such layouts, or a layout whose data, "
      "fsdp and tensor axes are 1",
    )


def _validate_layout(config, num_devices: int | None, imported=None) -> None:
  """The mesh covers the devices, and every batch splits over the data-parallel axes."""
  p, rl = config.parallel, config.rl
  m = imported or config.model  # an imported policy's heads and layers are its checkpoint's
  if p.name not in layouts.LAYOUTS and p.name != "custom":
    invalid("parallel.name", p.name, f"expected one of {sorted(layouts.LAYOUTS)} or 'custom'")
  check_mesh(p, num_devices)
  dp = int(p.mesh.data) * int(p.mesh.fsdp)
  if config.data.batch_size % dp:
    invalid(
      "data.batch_size",
      config.data.batch_size,
      f"must be divisible by data*fsdp={dp} (parallel.layout={p.name!r})",
    )
  # decoding rows (rollouts, distillation, evaluation) are sharded over data, fsdp and cp
  rows = dp * int(p.mesh.get("cp", 1))
  if (rl.prompts_per_step * rl.group_size) % rows:
    invalid(
      "rl.prompts_per_step",
      rl.prompts_per_step,
      f"prompts_per_step * group_size must be divisible by data*fsdp*cp={rows} (rollout rows)",
    )
  for field, value in (
    ("eval.batch_size", config.eval.batch_size),
    ("draft.batch_size", config.draft.batch_size),
  ):
    if value % rows:
      invalid(field, value, f"must be divisible by data*fsdp*cp={rows} (decoding rows)")
  cp, tp = int(p.mesh.get("cp", 1)), int(p.mesh.get("tensor", 1))
  if config.data.seq_len < 2 * cp:
    invalid("data.seq_len", config.data.seq_len, f"must be >= 2*cp={2 * cp} (two zigzag chunks)")
  for field, hf_name in (("n_heads", "num_attention_heads"), ("n_kv_heads", "num_key_value_heads")):
    if getattr(m, field) % tp:
      name = f"model.{field}" if imported is None else f"model.init_from's {hf_name}"
      invalid(name, getattr(m, field), f"must be divisible by tensor={tp}")
  over_cp = p.get("shard_weights_over_cp", True)
  if not isinstance(over_cp, bool):
    invalid("parallel.shard_weights_over_cp", over_cp, "must be True or False")
  width = int(p.mesh.fsdp) * (cp if over_cp else 1)
  if m.d_model % width:
    why = (
      f"fsdp*cp={width} (parallel.shard_weights_over_cp=True)"
      if over_cp and cp > 1
      else (f"fsdp={width}")
    )
    invalid(
      "model.d_model", m.d_model, f"must be divisible by {why}: the weights' width is sharded"
    )
  pp = int(p.mesh.get("pp", 1))
  if pp > 1:
    _validate_pipeline(config, pp, m)


def _validate_pipeline(config, pp: int, m) -> None:
  """Pipeline layouts: stages divide the layers, taps exist, microbatches divide the batches."""
  from specdraft.model import pipelined
  from specdraft.model.policy import default_tap_layers

  p = config.parallel
  if "pipeline" not in p:
    invalid(
      "parallel.pipeline",
      None,
      "pipeline layouts need a parallel.pipeline section "
      "(microbatches, tap_mode, tap_delay, remat)",
    )
  try:
    spec = pipelined.PipelineSpec.from_config(p.pipeline)
  except ValueError as e:
    raise ValueError(f"config.{e}") from None
  taps = tuple(m.tap_layers) if m.tap_layers is not None else default_tap_layers(m.n_layers)
  try:
    from specdraft.parallel.tap import TapPlan

    plan = TapPlan(taps, int(m.n_layers), pp)
  except ValueError as e:
    raise ValueError(f"config.parallel.mesh.pp={pp} is invalid: {e}") from None
  M = spec.microbatches
  for field, rows in (
    ("data.batch_size", config.data.batch_size),
    ("draft.batch_size", config.draft.batch_size),
    ("rl.prompts_per_step * rl.group_size", config.rl.prompts_per_step * config.rl.group_size),
  ):
    if rows % M:
      invalid("parallel.pipeline.microbatches", M, f"must divide {field}={rows}")
  if spec.tap_mode == "off" and plan.sources and config.rollout.draft == "cotrained":
    invalid(
      "parallel.pipeline.tap_mode",
      "off",
      f"the co-trained draft reads taps held by stages {plan.sources} ({plan.describe()}); "
      "use 'direct' or 'bulk' ('off' is a timing control only)",
    )


def read_draft_vocab(path: str, size: int, vocab_size: int) -> tuple[int, ...]:
  """The reduced draft vocabulary of a JSON file: a list of `size` distinct target ids in
  [0, vocab_size) (sorted on reading)."""
  import json

  with open(path) as f:
    ids = json.load(f)
  if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
    raise ValueError(f"{path}: expected a JSON list of integer token ids")
  ids = sorted(ids)
  if len(ids) != size or len(set(ids)) != size or ids[0] < 0 or ids[-1] >= vocab_size:
    raise ValueError(
      f"{path}: expected {size} distinct ids in [0, {vocab_size}) (draft.vocab_size={size}); "
      f"got {len(ids)} ({len(set(ids))} distinct) from {ids[:1]} to {ids[-1:]}"
    )
  return tuple(ids)
