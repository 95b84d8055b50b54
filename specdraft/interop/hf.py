"""Hugging Face checkpoints in and out: a Llama, Qwen2 or Qwen3 directory (config.json, *.safetensors, possibly
sharded with model.safetensors.index.json) becomes a `PolicyConfig` and policy parameters.

  pcfg, params = hf.load_policy("path/to/checkpoint")                       # host arrays
  pcfg, params = hf.load_policy(path, shardings=state_shardings["policy"])  # placed as they load
  hf.save_policy("out/dir", pcfg, params)                                   # and back out

The safetensors files are read by this module (an 8-byte header length, a JSON header, raw
little-endian tensors), memory-mapped: nothing needs torch, and with `shardings` every device's
shard is cut from the mapped file by `jax.make_array_from_callback`, so no device's copy of the
whole model passes through host memory at once (one decoder layer's tensor at a time).

Conventions, checked against `transformers` by tests/test_interop.py:
- HF Linear weights are [out, in]; the policy's are [in, out] with heads split out: q_proj
  [H*D, E] -> wq [E, H, D], o_proj [E, H*D] -> wo [H, D, E], gate/up [F, E] -> [E, F], down
  [E, F] -> [F, E]; decoder layers are stacked on a leading layer axis.
- RoPE: HF Llama rotates halves (`rotate_half`), the policy's convention (policy.rope), so q and
  k need no permutation; theta from `rope_theta`; linear, llama3 and YaRN scaling from
  `rope_scaling` / `rope_parameters` (`policy.RopeScaling`), other kinds refused.
- RMSNorm: y = w * x / sqrt(mean(x^2) + eps) in float32, eps from `rms_norm_eps`.
- `tie_word_embeddings`: a tied model has no lm_head tensor (the head is embed^T).
- Qwen2: biases on q/k/v (not o) -> bq [H, D], bk/bv [K, D] (`PolicyConfig.qkv_bias`).
- Qwen3: RMSNorm of each q and k head (over D) before RoPE -> q_norm/k_norm [D]
  (`PolicyConfig.qk_norm`), no biases.
Sliding-window attention, attention biases on o_proj, partial rotary factors and RoPE scalings
other than linear, llama3 and YaRN are refused, naming the field.
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specdraft.model import policy as pol

SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# Architectures a user is likely to bring, and what the policy lacks for them.
NOT_YET = {
  "MistralForCausalLM": "sliding-window attention",
  "Gemma2ForCausalLM": "logit soft-capping and sliding-window attention",
}

_DTYPES = {
  "F32": np.float32,
  "F16": np.float16,
  "BF16": jnp.bfloat16,
  "F64": np.float64,
  "I64": np.int64,
  "I32": np.int32,
  "BOOL": np.bool_,
}


# ----------------------------------------------------------------------------- safetensors


def _read_header(path: str) -> tuple[dict, int]:
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
    n = int.from_bytes(raw, "little")
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  return header, 8 + n


class SafetensorsDir:
  """The tensors of a checkpoint directory by name, memory-mapped on first use."""

  def __init__(self, path: str):
    self.path = path
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
      with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    else:
      files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not files:
      raise FileNotFoundError(f"{path}: no *.safetensors file (and no index naming one)")
    self._where: dict[str, tuple[str, dict, int]] = {}
    for name in files:
      fp = os.path.join(path, name)
      header, offset = _read_header(fp)
      for key, info in header.items():
        self._where[key] = (fp, info, offset)
    self._maps: dict[str, np.memmap] = {}

  def keys(self):
    return self._where.keys()

  def __contains__(self, key: str) -> bool:
    return key in self._where

  def get(self, key: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """The tensor `key` (a read-only view of the mapped file); `shape`, when given, is checked."""
    if key not in self._where:
      raise KeyError(
        f"{self.path}: tensor {key!r} is missing" + (f" (expected shape {shape})" if shape else "")
      )
    fp, info, offset = self._where[key]
    if info["dtype"] not in _DTYPES:
      raise ValueError(
        f"{fp}: tensor {key!r} has dtype {info['dtype']}, not one of {sorted(_DTYPES)}"
      )
    if fp not in self._maps:
      self._maps[fp] = np.memmap(fp, dtype=np.uint8, mode="r")
    start, stop = info["data_offsets"]
    buf = self._maps[fp][offset + start : offset + stop]
    arr = buf.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    if shape is not None and tuple(arr.shape) != tuple(shape):
      raise ValueError(
        f"{self.path}: tensor {key!r} has shape {tuple(arr.shape)}, expected {tuple(shape)}"
      )
    return arr


# ----------------------------------------------------------------------------- config


def read_config(path: str, **overrides) -> pol.PolicyConfig:
  """The policy config of a checkpoint's config.json (`overrides`: PolicyConfig fields the file
  does not decide, such as `tap_layers` or `dtype`). Unsupported architectures and features
  raise naming the field and what is supported."""
  with open(os.path.join(path, "config.json")) as f:
    hc = json.load(f)
  archs = hc.get("architectures") or []
  arch = archs[0] if archs else hc.get("model_type", "?")
  if arch in NOT_YET:
    raise ValueError(
      f"{path}: architecture {arch} needs {NOT_YET[arch]}, which the policy does not have yet; "
      f"supported: {sorted(SUPPORTED)}"
    )
  if arch not in SUPPORTED:
    raise ValueError(
      f"{path}: architecture {arch!r} is not supported; supported: {sorted(SUPPORTED)}"
    )

  def refuse(field, value, valid):
    raise ValueError(f"{path}: config.json {field}={value!r} is not supported: {valid}")

  family = SUPPORTED[arch]
  if hc.get("hidden_act", "silu") != "silu":
    refuse("hidden_act", hc["hidden_act"], "the policy's MLP is SwiGLU (silu)")
  for field in ("attention_bias", "mlp_bias"):
    if hc.get(field):
      refuse(field, hc[field], "the policy's output and MLP projections have no bias")
  if hc.get("use_sliding_window"):
    refuse("use_sliding_window", hc["use_sliding_window"], "full causal attention only")
  params = hc.get("rope_parameters") or {}  # newer configs keep theta here
  theta = hc.get("rope_theta", params.get("rope_theta", 10000.0))
  heads = hc["num_attention_heads"]
  kw: dict[str, Any] = dict(
    vocab_size=hc["vocab_size"],
    d_model=hc["hidden_size"],
    n_layers=hc["num_hidden_layers"],
    n_heads=heads,
    n_kv_heads=hc.get("num_key_value_heads") or heads,
    head_dim=hc.get("head_dim") or hc["hidden_size"] // heads,
    d_ff=hc["intermediate_size"],
    rope_theta=float(theta),
    rope_scaling=rope_scaling_of(hc, refuse),
    norm_eps=float(hc.get("rms_norm_eps", 1e-6)),
    tie_embeddings=bool(hc.get("tie_word_embeddings", False)),
    init_std=float(hc.get("initializer_range", 0.02)),
    qkv_bias=family == "qwen2",
    qk_norm=family == "qwen3",
  )
  stops = checkpoint_stop_ids(path)
  if stops:  # the first is EOS, the others stop generation too
    kw["eos_id"], kw["stop_ids"] = stops[0], tuple(stops[1:])
  if "eos_id" in overrides and "stop_ids" not in overrides:  # another EOS (the tokenizer's):
    kw["stop_ids"] = tuple(i for i in stops if i != overrides["eos_id"])  # the rest still stop
  kw.update(overrides)
  return pol.PolicyConfig(**kw)


def rope_scaling_of(hc: dict, refuse) -> pol.RopeScaling | None:
  """The RoPE scaling of a config.json: `rope_scaling` (older files) or `rope_parameters`
  (newer), rope_type linear, llama3 or yarn (None for default). The pretraining length is the
  config's `original_max_position_embeddings`, else the scaling's, else `max_position_embeddings`;
  YaRN's factor defaults to max / original and its attention factor to 0.1 ln(factor) + 1 (or
  the ratio of the mscale terms when both are given), as `transformers` reads them. Other
  kinds (dynamic NTK, longrope, ...) and partial rotary factors are refused by `refuse`."""
  field = "rope_scaling" if hc.get("rope_scaling") else "rope_parameters"
  spec = hc.get(field) or {}
  partial = spec.get("partial_rotary_factor", hc.get("partial_rotary_factor", 1.0))
  if partial != 1.0:
    refuse("partial_rotary_factor", partial, "RoPE over the whole head (1.0)")
  kind = spec.get("rope_type", spec.get("type")) or "default"
  if kind == "default":
    return None
  if kind not in pol.RopeScaling.KINDS:
    refuse(field, spec, f"rope_type default or one of {pol.RopeScaling.KINDS}")
  orig = (
    hc.get("original_max_position_embeddings")
    or spec.get("original_max_position_embeddings")
    or hc.get("max_position_embeddings")
    or 0
  )
  factor = spec.get("factor")
  if factor is None and kind == "yarn" and orig:
    factor = hc.get("max_position_embeddings", orig) / orig
  if factor is None:
    refuse(field, spec, f"rope_type {kind} needs a factor")
  kw: dict[str, Any] = dict(kind=kind, factor=float(factor))
  if kind != "linear":  # (linear scaling has no pretraining length)
    kw["original_max_position_embeddings"] = int(orig)
  if kind == "llama3":
    kw.update(
      low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
      high_freq_factor=float(spec.get("high_freq_factor", 4.0)),
    )
  if kind == "yarn":
    mscale = lambda scale, m=1.0: 0.1 * m * np.log(scale) + 1.0 if scale > 1 else 1.0
    att = spec.get("attention_factor")
    if att is None:
      m, m_all = spec.get("mscale"), spec.get("mscale_all_dim")
      att = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    kw.update(
      beta_fast=float(spec.get("beta_fast") or 32.0),
      beta_slow=float(spec.get("beta_slow") or 1.0),
      attention_factor=float(att),
      truncate=bool(spec.get("truncate", True)),
    )
  try:
    return pol.RopeScaling(**kw)
  except ValueError as e:
    refuse(field, spec, str(e))


def rope_scaling_json(sc: pol.RopeScaling | None) -> dict | None:
  """config.json's `rope_scaling` for `sc` (what `rope_scaling_of` reads back)."""
  if sc is None:
    return None
  out: dict[str, Any] = {"rope_type": sc.kind, "factor": sc.factor}
  if sc.kind != "linear":
    out["original_max_position_embeddings"] = sc.original_max_position_embeddings
  if sc.kind == "llama3":
    out.update(low_freq_factor=sc.low_freq_factor, high_freq_factor=sc.high_freq_factor)
  if sc.kind == "yarn":
    out.update(
      beta_fast=sc.beta_fast, beta_slow=sc.beta_slow, attention_factor=sc.attention_factor,
      truncate=sc.truncate,
    )  # fmt: skip
  return out


def checkpoint_stop_ids(path: str) -> list[int]:
  """The token ids that end a generation, as the checkpoint names them: generation_config.json's
  eos_token_id (an id or a list), else config.json's; first the main one."""
  out: list[int] = []
  for name in ("generation_config.json", "config.json"):
    file = os.path.join(path, name)
    if not os.path.isfile(file):
      continue
    with open(file) as f:
      eos = json.load(f).get("eos_token_id")
    for i in eos if isinstance(eos, list) else [] if eos is None else [eos]:
      if int(i) not in out:
        out.append(int(i))
    if out:
      break
  return out


# ----------------------------------------------------------------------------- weights


def _layer_tensors(cfg: pol.PolicyConfig):
  """policy layer key -> (HF key template, HF shape, HF -> policy transform)."""
  E, H, K, D, F = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.d_ff
  p = "model.layers.{i}."
  return {
    "attn_norm": (p + "input_layernorm.weight", (E,), lambda w: w),
    "wq": (p + "self_attn.q_proj.weight", (H * D, E), lambda w: w.T.reshape(E, H, D)),
    "wk": (p + "self_attn.k_proj.weight", (K * D, E), lambda w: w.T.reshape(E, K, D)),
    "wv": (p + "self_attn.v_proj.weight", (K * D, E), lambda w: w.T.reshape(E, K, D)),
    "wo": (p + "self_attn.o_proj.weight", (E, H * D), lambda w: w.T.reshape(H, D, E)),
    "mlp_norm": (p + "post_attention_layernorm.weight", (E,), lambda w: w),
    "w_gate": (p + "mlp.gate_proj.weight", (F, E), lambda w: w.T),
    "w_up": (p + "mlp.up_proj.weight", (F, E), lambda w: w.T),
    "w_down": (p + "mlp.down_proj.weight", (E, F), lambda w: w.T),
  } | _bias_and_norm_tensors(cfg)


def _bias_and_norm_tensors(cfg: pol.PolicyConfig):
  H, K, D = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
  p, out = "model.layers.{i}.self_attn.", {}
  if cfg.qkv_bias:
    out["bq"] = (p + "q_proj.bias", (H * D,), lambda b: b.reshape(H, D))
    out["bk"] = (p + "k_proj.bias", (K * D,), lambda b: b.reshape(K, D))
    out["bv"] = (p + "v_proj.bias", (K * D,), lambda b: b.reshape(K, D))
  if cfg.qk_norm:
    out["q_norm"] = (p + "q_norm.weight", (D,), lambda w: w)
    out["k_norm"] = (p + "k_norm.weight", (D,), lambda w: w)
  return out


def _top_tensors(cfg: pol.PolicyConfig):
  E, V = cfg.d_model, cfg.vocab_size
  out = {
    "embed": ("model.embed_tokens.weight", (V, E), lambda w: w),
    "final_norm": ("model.norm.weight", (E,), lambda w: w),
  }
  if not cfg.tie_embeddings:
    out["head"] = ("lm_head.weight", (V, E), lambda w: w.T)
  return out


def expected_tensors(cfg: pol.PolicyConfig) -> dict[str, tuple[int, ...]]:
  """Every HF tensor name a checkpoint of `cfg` must hold, with its shape."""
  out = {k: s for k, s, _ in _top_tensors(cfg).values()}
  for key, shape, _ in _layer_tensors(cfg).values():
    out.update({key.format(i=i): shape for i in range(cfg.n_layers)})
  return out


def check_checkpoint(path: str, cfg: pol.PolicyConfig) -> None:
  """Raises, naming the key and the expected shape, unless the checkpoint at `path` holds every
  tensor of `cfg` (the safetensors headers and memory maps only: no tensor is read)."""
  st = SafetensorsDir(path)
  for key, shape in expected_tensors(cfg).items():
    st.get(key, shape)


def load_params(path: str, cfg: pol.PolicyConfig, *, dtype=np.float32, shardings=None):
  """The policy parameters of a checkpoint, cast to `dtype` (float32 by default; bfloat16 to
  keep bf16 storage). `shardings`: a pytree of `jax.sharding.Sharding` shaped like the
  parameters (e.g. the layout's state shardings' "policy" entry): each array is then built
  shard by shard from the mapped files; without it, host numpy arrays are returned. Every
  expected tensor is checked for presence and shape before anything is converted."""
  st = SafetensorsDir(path)
  for key, shape in expected_tensors(cfg).items():
    st.get(key, shape)  # raises naming the key and the expected shape
  dtype = np.dtype(dtype)

  def top(name):
    key, shape, fn = _top_tensors(cfg)[name]
    full = lambda: np.asarray(fn(st.get(key, shape)), dtype)
    out_shape = fn(np.empty(shape, np.int8)).shape
    return out_shape, lambda idx: full()[idx]

  def stacked(name):
    key, shape, fn = _layer_tensors(cfg)[name]
    inner = fn(np.empty(shape, np.int8)).shape

    def read(idx):  # idx: a tuple of slices over (L, *inner)
      layers = range(cfg.n_layers)[idx[0]]
      return np.stack(
        [np.asarray(fn(st.get(key.format(i=i), shape)), dtype)[idx[1:]] for i in layers]
      )

    return (cfg.n_layers, *inner), read

  specs = {name: top(name) for name in _top_tensors(cfg)}
  specs["layers"] = {name: stacked(name) for name in _layer_tensors(cfg)}

  def build(spec, sharding):
    shape, read = spec
    if sharding is None:
      return read(tuple(slice(None) for _ in shape))
    return jax.make_array_from_callback(shape, sharding, lambda idx: read(_full_slices(idx, shape)))

  if shardings is None:
    return jax.tree.map(lambda s: build(s, None), specs, is_leaf=_is_spec)
  return jax.tree.map(build, specs, shardings, is_leaf=_is_spec)


def _is_spec(x) -> bool:
  return isinstance(x, tuple) and len(x) == 2 and callable(x[1])


def _full_slices(idx, shape):
  idx = tuple(idx) + (slice(None),) * (len(shape) - len(idx))
  return tuple(i if isinstance(i, slice) else slice(i, i + 1) for i in idx)


def load_policy(path: str, *, dtype=np.float32, shardings=None, **config_overrides):
  """(PolicyConfig, parameters) of a Hugging Face Llama-family checkpoint directory."""
  cfg = read_config(path, **config_overrides)
  return cfg, load_params(path, cfg, dtype=dtype, shardings=shardings)


# ----------------------------------------------------------------------------- out

_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict | None = None):
  """Writes `tensors` (name -> array) as one safetensors file, atomically (a temporary file
  renamed into place)."""
  header, offset, arrays = {}, 0, []
  for name in sorted(tensors):
    a = np.ascontiguousarray(tensors[name])
    if a.dtype not in _NAMES:
      raise ValueError(
        f"tensor {name!r} has dtype {a.dtype}, not one of {sorted(map(str, _NAMES))}"
      )
    n = a.nbytes
    header[name] = {
      "dtype": _NAMES[a.dtype],
      "shape": list(a.shape),
      "data_offsets": [offset, offset + n],
    }
    offset += n
    arrays.append(a)
  if metadata:
    header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
  raw = json.dumps(header, separators=(",", ":")).encode()
  raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for a in arrays:
      f.write(a.tobytes())
  os.replace(tmp, path)


def hf_config(cfg: pol.PolicyConfig, *, dtype=np.float32) -> dict:
  """config.json of the Llama (Qwen2 with q/k/v biases, Qwen3 with q/k norms) model that
  computes what `cfg` computes."""
  if cfg.qkv_bias and cfg.qk_norm:
    raise ValueError("a policy with both q/k/v biases and q/k norms has no Hugging Face family")
  arch, kind = (
    ("Qwen2ForCausalLM", "qwen2")
    if cfg.qkv_bias
    else ("Qwen3ForCausalLM", "qwen3")
    if cfg.qk_norm
    else ("LlamaForCausalLM", "llama")
  )
  return {
    "architectures": [arch],
    "model_type": kind,
    "vocab_size": cfg.vocab_size,
    "hidden_size": cfg.d_model,
    "intermediate_size": cfg.d_ff,
    "num_hidden_layers": cfg.n_layers,
    "num_attention_heads": cfg.n_heads,
    "num_key_value_heads": cfg.n_kv_heads,
    "head_dim": cfg.head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": cfg.norm_eps,
    "rope_theta": cfg.rope_theta,
    "rope_scaling": rope_scaling_json(cfg.rope_scaling),
    "attention_bias": False,
    "mlp_bias": False,
    "use_sliding_window": False,
    "tie_word_embeddings": cfg.tie_embeddings,
    "initializer_range": cfg.init_std,
    "eos_token_id": [cfg.eos_id, *cfg.stop_ids] if cfg.stop_ids else cfg.eos_id,
    "torch_dtype": {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[
      np.dtype(dtype).name
    ],
  }


def save_policy(path: str, cfg: pol.PolicyConfig, params, *, dtype=np.float32):
  """Writes the policy as a Hugging Face checkpoint (config.json, model.safetensors) of its
  family (`hf_config`) that `transformers`' from_pretrained and `load_policy` read back."""
  os.makedirs(path, exist_ok=True)
  dtype = np.dtype(dtype)
  host = jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float32), params)
  # Every layer transform in _layer_tensors transposes a 2-D HF weight (then splits heads) or
  # reshapes a 1-D one, so its inverse follows from the HF shape alone.
  to_hf = lambda w, shape: w.reshape(shape[::-1]).T if len(shape) == 2 else w.reshape(shape)
  out = {}
  for name, (key, shape, _) in _layer_tensors(cfg).items():
    for i in range(cfg.n_layers):
      out[key.format(i=i)] = to_hf(host["layers"][name][i], shape)
  out["model.embed_tokens.weight"] = host["embed"]
  out["model.norm.weight"] = host["final_norm"]
  if not cfg.tie_embeddings:
    out["lm_head.weight"] = host["head"].T
  out = {k: np.ascontiguousarray(v).astype(dtype) for k, v in out.items()}
  write_safetensors(os.path.join(path, "model.safetensors"), out, {"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config(cfg, dtype=dtype), f, indent=2)


# ----------------------------------------------------------------------------- EAGLE-3 drafts

# The tensors of an EAGLE-3 draft checkpoint as the public EAGLE-3 training and serving code
# names them (E width, H/K heads, D head dim, F MLP width, V target vocabulary, Vd draft
# vocabulary): one decoder layer `midlayer` whose q/k/v read [input_layernorm(embed(token));
# hidden_norm(fc(taps))] (width 2E) with the residual on fc's output, `norm` before `lm_head`,
# and the draft-to-target vocabulary maps. The embedding is the target's and is not saved.
EAGLE3_TENSORS = {
  "fc.weight": ("E", "3E"),
  "midlayer.input_layernorm.weight": ("E",),
  "midlayer.hidden_norm.weight": ("E",),
  "midlayer.self_attn.q_proj.weight": ("H*D", "2E"),
  "midlayer.self_attn.k_proj.weight": ("K*D", "2E"),
  "midlayer.self_attn.v_proj.weight": ("K*D", "2E"),
  "midlayer.self_attn.o_proj.weight": ("E", "H*D"),
  "midlayer.post_attention_layernorm.weight": ("E",),
  "midlayer.mlp.gate_proj.weight": ("F", "E"),
  "midlayer.mlp.up_proj.weight": ("F", "E"),
  "midlayer.mlp.down_proj.weight": ("E", "F"),
  "norm.weight": ("E",),
  "lm_head.weight": ("Vd", "E"),
  "d2t": ("Vd",),  # int64: target id = draft id + d2t[draft id]
  "t2d": ("V",),  # bool: the target token is in the draft vocabulary
}


def _draft_layer_fields(dcfg, pcfg: pol.PolicyConfig, n_layers: int, dtype, max_positions: int):
  """The config.json fields a draft's decoder layers share across formats (Llama / Qwen3 names;
  no biases, its own RoPE theta, the target's vocabulary, no head tied to an embedding)."""
  return {
    "hidden_size": dcfg.d_model,
    "intermediate_size": dcfg.d_ff,
    "num_hidden_layers": n_layers,
    "num_attention_heads": dcfg.n_heads,
    "num_key_value_heads": dcfg.n_kv_heads,
    "head_dim": dcfg.head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": dcfg.norm_eps,
    "rope_theta": dcfg.rope_theta,
    "rope_scaling": rope_scaling_json(dcfg.rope_scaling),
    "max_position_embeddings": max_positions,
    "vocab_size": pcfg.vocab_size,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": np.dtype(dtype).name,
  }


def eagle3_config(dcfg, pcfg: pol.PolicyConfig, *, dtype=np.float32, max_positions: int = 2048):
  """config.json of an EAGLE-3 draft (the fields EAGLE-3 serving loaders read)."""
  return {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    **_draft_layer_fields(dcfg, pcfg, 1, dtype, max_positions),
    "target_hidden_size": pcfg.d_model,
    "draft_vocab_size": dcfg.draft_vocab,
    "mlp_bias": False,
    # the tapped target layers (0-indexed layer outputs), low to high: fc's input order
    "eagle_config": {
      "use_aux_hidden_state": True,
      "eagle_aux_hidden_state_layer_ids": sorted(pcfg.taps),  # (run_layers taps in order)
    },
  }


def export_problem(
  kind: str, n_taps: int, mask_token_id: int = -1, qk_norm: bool = False, anchor_residual: str = ""
):
  """(config field, value, why) when a draft of these settings has no serving checkpoint format
  (config validation reports it before any work; the writers below raise it), else None."""
  if kind == "eagle3" and n_taps != 3:
    return (
      "model.tap_layers",
      n_taps,
      "an EAGLE-3 checkpoint fuses exactly 3 tapped layers (fc is [E, 3E]); set 3 tap layers",
    )
  if kind == "dspark":
    return ("draft.kind", kind, "DSpark's Markov head has no public checkpoint format")
  if kind == "dflash" and mask_token_id < 0:
    return (
      "draft.block.mask_token_id",
      mask_token_id,
      "a DFlash checkpoint embeds MASK as the target's embedding row of a token id, not a "
      "learned vector; train with draft.block.mask_token_id set to a token id of the policy",
    )
  if kind == "dflash" and not qk_norm:
    return (
      "draft.block.qk_norm",
      qk_norm,
      "DFlash checkpoints are Qwen3 layers with q/k norms; train with draft.block.qk_norm=True",
    )
  if kind == "dflash" and anchor_residual == "mask":
    return (
      "draft.block.anchor_residual",
      anchor_residual,
      "the DFlash forward starts the anchor slot's residual at its token's embedding; train "
      "with draft.block.anchor_residual='token' (DFlash's default)",
    )
  return None


def _raise_export_problem(*args) -> None:
  problem = export_problem(*args)
  if problem is not None:
    field, value, why = problem
    raise ValueError(f"{field}={value!r}: {why}")


def save_eagle3(path: str, dcfg, dparams, pcfg: pol.PolicyConfig, *, dtype=np.float32, **config):
  """Writes a trained EAGLE-3 draft (model/eagle3.py) as an EAGLE-3 checkpoint: config.json and
  model.safetensors with the names and shapes of `EAGLE3_TENSORS`. With the whole target
  vocabulary d2t is all zeros and t2d all true; with a reduced one (`dcfg.vocab_ids`), draft id
  i is target id i + d2t[i] and t2d marks the target ids the draft covers."""
  _raise_export_problem("eagle3", dcfg.n_taps)
  E, H, K, D = dcfg.d_model, dcfg.n_heads, dcfg.n_kv_heads, dcfg.head_dim
  d = {k: np.asarray(jax.device_get(v), np.float32) for k, v in dparams.items()}
  known = {"fc", "embed_norm", "hidden_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate"}
  known |= {"w_up", "w_down", "final_norm", "head"}
  if set(d) != known:
    raise ValueError(f"not EAGLE-3 draft parameters: keys {sorted(d)}, expected {sorted(known)}")
  out = {
    "fc.weight": d["fc"].T,
    "midlayer.input_layernorm.weight": d["embed_norm"],
    "midlayer.hidden_norm.weight": d["hidden_norm"],
    "midlayer.self_attn.q_proj.weight": d["wq"].reshape(2 * E, H * D).T,
    "midlayer.self_attn.k_proj.weight": d["wk"].reshape(2 * E, K * D).T,
    "midlayer.self_attn.v_proj.weight": d["wv"].reshape(2 * E, K * D).T,
    "midlayer.self_attn.o_proj.weight": d["wo"].reshape(H * D, E).T,
    "midlayer.post_attention_layernorm.weight": d["mlp_norm"],
    "midlayer.mlp.gate_proj.weight": d["w_gate"].T,
    "midlayer.mlp.up_proj.weight": d["w_up"].T,
    "midlayer.mlp.down_proj.weight": d["w_down"].T,
    "norm.weight": d["final_norm"],
    "lm_head.weight": d["head"].T,
  }
  out = {k: np.ascontiguousarray(v).astype(np.dtype(dtype)) for k, v in out.items()}
  if dcfg.vocab_ids is None:
    out["d2t"] = np.zeros((dcfg.vocab_size,), np.int64)
    out["t2d"] = np.ones((pcfg.vocab_size,), np.bool_)
  else:
    ids = np.asarray(dcfg.vocab_ids, np.int64)
    out["d2t"] = ids - np.arange(len(ids), dtype=np.int64)
    out["t2d"] = np.zeros((pcfg.vocab_size,), np.bool_)
    out["t2d"][ids] = True
  os.makedirs(path, exist_ok=True)
  write_safetensors(os.path.join(path, "model.safetensors"), out, {"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(eagle3_config(dcfg, pcfg, dtype=dtype, **config), f, indent=2)


# ----------------------------------------------------------------------------- DFlash drafts

# The tensors of a DFlash draft checkpoint as the public DFlash reference code names them (N
# tapped target layers, L draft layers; Qwen3 decoder layers): `fc` fuses the tapped layers
# into the context feature hidden_norm(fc(taps)); each layer's queries read the block only,
# its keys and values [context; block] through the same k/v projections, q/k RMS-normalised
# per head before RoPE; `norm` before the target's LM head. Neither the embedding (the block
# embeds [anchor token, mask_token_id x (W - 1)] with the target's) nor the head is saved.
DFLASH_TENSORS = {
  "fc.weight": ("E", "N*E"),
  "hidden_norm.weight": ("E",),
  "norm.weight": ("E",),
}
DFLASH_LAYER_TENSORS = {
  "layers.{i}.input_layernorm.weight": ("E",),
  "layers.{i}.self_attn.q_proj.weight": ("H*D", "E"),
  "layers.{i}.self_attn.k_proj.weight": ("K*D", "E"),
  "layers.{i}.self_attn.v_proj.weight": ("K*D", "E"),
  "layers.{i}.self_attn.o_proj.weight": ("E", "H*D"),
  "layers.{i}.self_attn.q_norm.weight": ("D",),
  "layers.{i}.self_attn.k_norm.weight": ("D",),
  "layers.{i}.post_attention_layernorm.weight": ("E",),
  "layers.{i}.mlp.gate_proj.weight": ("F", "E"),
  "layers.{i}.mlp.up_proj.weight": ("F", "E"),
  "layers.{i}.mlp.down_proj.weight": ("E", "F"),
}


def dflash_tensors(n_layers: int) -> dict[str, tuple[str, ...]]:
  """Every tensor name of an `n_layers`-layer DFlash checkpoint with its symbolic shape."""
  out = dict(DFLASH_TENSORS)
  for i in range(n_layers):
    out |= {k.format(i=i): s for k, s in DFLASH_LAYER_TENSORS.items()}
  return out


def _check_dflash_exportable(dcfg) -> None:
  kind = getattr(dcfg, "kind", "eagle3")
  if kind != "dflash":
    _raise_export_problem(kind, dcfg.n_taps)  # DSpark: named as such
    raise ValueError(f"draft.kind={kind!r}: only DFlash drafts export to the DFlash format")
  _raise_export_problem(kind, dcfg.n_taps, dcfg.mask_token_id, dcfg.qk_norm, dcfg.anchor_residual)


def dflash_config(dcfg, pcfg: pol.PolicyConfig, *, dtype=np.float32, max_positions: int = 2048):
  """config.json of a DFlash draft (the fields the public DFlash loader reads: a Qwen3 config
  with block_size, the target's layer count and `dflash_config`)."""
  _check_dflash_exportable(dcfg)
  L = dcfg.n_layers
  return {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    **_draft_layer_fields(dcfg, pcfg, L, dtype, max_positions),
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "layer_types": ["full_attention"] * L,  # non-causal: the block sees itself bidirectionally
    "block_size": dcfg.block_size,
    "num_target_layers": pcfg.n_layers,
    # the tapped target layers (0-indexed layer outputs), low to high: fc's input order
    "dflash_config": {
      "mask_token_id": dcfg.mask_token_id,
      "target_layer_ids": sorted(pcfg.taps),
    },
  }


def save_dflash(path: str, dcfg, dparams, pcfg: pol.PolicyConfig, *, dtype=np.float32, **config):
  """Writes a trained DFlash draft (model/dflash.py) as a DFlash checkpoint: config.json and
  model.safetensors with the names and shapes of `dflash_tensors`. Refuses, naming the config
  field, a draft the format cannot express: DSpark, a learned MASK vector, no q/k norms."""
  _check_dflash_exportable(dcfg)
  E, H, K, D = dcfg.d_model, dcfg.n_heads, dcfg.n_kv_heads, dcfg.head_dim
  d = jax.tree.map(lambda a: np.asarray(jax.device_get(a), np.float32), dparams)
  want = {"fc", "ctx_norm", "layers", "final_norm"}
  if set(d) != want:
    raise ValueError(f"not DFlash draft parameters: keys {sorted(d)}, expected {sorted(want)}")
  out = {
    "fc.weight": d["fc"].T,
    "hidden_norm.weight": d["ctx_norm"],
    "norm.weight": d["final_norm"],
  }
  ly = d["layers"]
  for i in range(dcfg.n_layers):
    p, a = f"layers.{i}.", f"layers.{i}.self_attn."
    out |= {
      p + "input_layernorm.weight": ly["attn_norm"][i],
      a + "q_proj.weight": ly["wq"][i].reshape(E, H * D).T,
      a + "k_proj.weight": ly["wk"][i].reshape(E, K * D).T,
      a + "v_proj.weight": ly["wv"][i].reshape(E, K * D).T,
      a + "o_proj.weight": ly["wo"][i].reshape(H * D, E).T,
      a + "q_norm.weight": ly["q_norm"][i],
      a + "k_norm.weight": ly["k_norm"][i],
      p + "post_attention_layernorm.weight": ly["mlp_norm"][i],
      p + "mlp.gate_proj.weight": ly["w_gate"][i].T,
      p + "mlp.up_proj.weight": ly["w_up"][i].T,
      p + "mlp.down_proj.weight": ly["w_down"][i].T,
    }
  out = {k: np.ascontiguousarray(v).astype(np.dtype(dtype)) for k, v in out.items()}
  os.makedirs(path, exist_ok=True)
  write_safetensors(os.path.join(path, "model.safetensors"), out, {"format": "pt"})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(dflash_config(dcfg, pcfg, dtype=dtype, **config), f, indent=2)
