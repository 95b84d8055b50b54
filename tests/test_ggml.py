"""GGUF files in (specdraft/interop/ggml.py), against `transformers`' own GGUF loader: a tiny
random Llama written as llama.cpp writes one (q/k rows permuted for its interleaved RoPE, the MLP
quantized to Q8_0, a byte-level BPE tokenizer with a chat template in the metadata), converted to
a Hugging Face directory, gives the logits (float32, <= 1e-4) and the token ids that
`transformers` reads from the same file; llama.cpp's digit-splitting pre-tokenizers split digits;
what is not supported is refused naming the field."""

import json
import os

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # the `test` extra: CPU torch, transformers, accelerate (its GGUF loader), gguf
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from specdraft.interop import ggml, hf
from specdraft.model import policy as pol
from specdraft.tasks.tokenizer import HFTokenizer

CHATML = (
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content']"
  " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
  "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TEXTS = ["12+345=357", "user\nassistant\n", "Hello, world! 2024 is here.", "What is 7*8? 56"] * 20


def _bpe(vocab_size=300):
  tk = Tokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tk.train_from_iterator(TEXTS, trainer)
  model = json.loads(tk.to_str())["model"]
  tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  return tokens, merges


def _permute(w, heads):
  """llama.cpp's writer: rotate-half rows of each head to interleaved pairs (the test's side)."""
  return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(path, *, pre="gpt2", arch="llama", tokenizer_model="gpt2"):
  tokens, merges = _bpe()
  V, E, F, H, K, L = len(tokens), 64, 96, 4, 2, 2
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
    vocab_size=V, hidden_size=E, intermediate_size=F, num_hidden_layers=L, num_attention_heads=H,
    num_key_value_heads=K, head_dim=16, rms_norm_eps=1e-5, rope_theta=5000.0,
    tie_word_embeddings=False, initializer_range=0.1,
  )  # fmt: skip
  model = transformers.LlamaForCausalLM(cfg).eval()
  sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
  w = gguf.GGUFWriter(str(path), arch)
  w.add_block_count(L)
  w.add_context_length(256)
  w.add_embedding_length(E)
  w.add_feed_forward_length(F)
  w.add_head_count(H)
  w.add_head_count_kv(K)
  w.add_rope_freq_base(5000.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_rope_dimension_count(16)
  w.add_vocab_size(V)
  w.add_tokenizer_model(tokenizer_model)
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_merges(merges)
  w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
  w.add_bos_token_id(0)
  w.add_eos_token_id(2)
  w.add_eot_token_id(1)  # an end-of-turn id: it ends a generation too
  w.add_pad_token_id(0)
  w.add_add_bos_token(False)
  w.add_chat_template(CHATML)

  def put(name, x, quantize=False):
    if quantize:
      q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
      w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    else:
      w.add_tensor(name, x)

  put("token_embd.weight", sd["model.embed_tokens.weight"])
  put("output_norm.weight", sd["model.norm.weight"] + 0.3)
  put("output.weight", sd["lm_head.weight"])
  for i in range(L):
    p = f"model.layers.{i}."
    put(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"] + 0.2 * (i + 1))
    put(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"] - 0.1)
    put(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], H))
    put(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], K))
    put(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
    put(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
    for ours, theirs in (
      ("ffn_gate", "gate_proj"),
      ("ffn_up", "up_proj"),
      ("ffn_down", "down_proj"),
    ):
      put(f"blk.{i}.{ours}.weight", sd[p + f"mlp.{theirs}.weight"], quantize=True)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return str(path)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  d = tmp_path_factory.mktemp("gguf")
  path = _write_gguf(d / "tiny.gguf")
  return path, ggml.convert(path, str(d / "hf"))


def test_logits_equal_transformers_reading_the_same_file(converted):
  path, out = converted
  ref = transformers.LlamaForCausalLM.from_pretrained(
    os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
  ).eval()
  pcfg, params = hf.load_policy(out)
  assert (pcfg.n_layers, pcfg.n_heads, pcfg.n_kv_heads, pcfg.head_dim) == (2, 4, 2, 16)
  assert not pcfg.tie_embeddings and pcfg.rope_theta == 5000.0
  assert (pcfg.eos_id, pcfg.stop_ids) == (2, (1,))  # EOS, then llama.cpp's end-of-turn
  tokens = np.random.default_rng(0).integers(3, pcfg.vocab_size, (2, 24))
  with torch.no_grad():
    want = ref(torch.tensor(tokens)).logits.float().numpy()
  T = tokens.shape[1]
  got, _ = pol.forward(
    params, pcfg, jnp.asarray(tokens), jnp.broadcast_to(jnp.arange(T), (2, T)), jnp.ones((2, T))
  )
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-4, rtol=1e-4)
  # the dequantized Q8_0 weights are the ones transformers dequantized
  ffn = hf.SafetensorsDir(out).get("model.layers.1.mlp.down_proj.weight")
  np.testing.assert_array_equal(ffn, ref.model.layers[1].mlp.down_proj.weight.detach().numpy())


def test_the_tokenizer_and_chat_template_equal_transformers_reading_the_same_file(converted):
  path, out = converted
  ref = transformers.AutoTokenizer.from_pretrained(
    os.path.dirname(path), gguf_file=os.path.basename(path)
  )
  tok = HFTokenizer(out, chat_template=True)
  assert (tok.eos_id, tok.pad_id, tok.bos_id) == (2, 0, 0)
  assert tok.vocab_size == hf.read_config(out).vocab_size == len(ref)
  for text in ["12+345=", "Hello, world! 2024 is here.", "  two  spaces\nand <|im_end|> inside"]:
    assert tok.encode(text) == list(ref(text, add_special_tokens=False)["input_ids"]), text
    turn = [{"role": "user", "content": text}]
    want = ref.apply_chat_template(turn, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert tok.encode_prompt(text) == want
    ids = tok.encode(text)
    assert tok.decode(ids, stop_at_eos=False) == ref.decode(ids, skip_special_tokens=True)
  # converting again reuses the directory (same file), a changed file is converted afresh
  stamp = os.path.join(out, "converted_from.json")
  before = os.path.getmtime(stamp)
  assert ggml.convert(path, out) == out and os.path.getmtime(stamp) == before


def test_digit_splitting_pre_tokenizers_split_digits(tmp_path):
  """llama.cpp's 'smollm' / 'starcoder' / 'refact' split each digit before the merges, so a merge
  of two digits (learned under another split) never applies."""
  plain = ggml.convert(_write_gguf(tmp_path / "a.gguf"), str(tmp_path / "a"))
  split = ggml.convert(_write_gguf(tmp_path / "b.gguf", pre="smollm"), str(tmp_path / "b"))
  a, b = HFTokenizer(plain), HFTokenizer(split)
  digits = [b.encode(c) for c in "12345"]
  assert all(len(d) == 1 for d in digits) and b.encode("12345") == sum(digits, [])
  assert len(a.encode("12345")) < 5  # the merges of "12", "34", ... apply under GPT-2's split
  assert b.decode(b.encode("x = 12345!")) == "x = 12345!"


@pytest.mark.parametrize(
  "kw,field",
  [
    ({"arch": "gemma"}, "general.architecture"),
    ({"tokenizer_model": "llama"}, "tokenizer.ggml.model"),
    ({"pre": "chatglm-bpe"}, "tokenizer.ggml.pre"),
  ],
)
def test_unsupported_files_are_refused_naming_the_field(tmp_path, kw, field):
  path = _write_gguf(tmp_path / "x.gguf", **kw)
  with pytest.raises(ValueError, match=field):
    ggml.convert(path, str(tmp_path / "out"))
