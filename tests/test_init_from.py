"""A pretrained model's own tokenizer, and co-training from an imported policy
(`model.init_from`), against the reference implementation (`transformers`, nothing downloaded):

- `HFTokenizer` (tokenizer.json through `tokenizers`, the chat template through jinja) gives the
  ids `transformers` gives: chat-templated prompts, plain prompts, answers, BOS where a Llama-style
  tokenizer adds one (never twice), the special ids; decoding inverts encoding;
- bad settings (no checkpoint, no tokenizer.json, a template the tokenizer lacks, tap layers the
  checkpoint does not have, a tokenizer larger than the model's vocabulary) fail in validation
  naming the field;
- a co-training run from a tiny Llama saved by `transformers` with a byte-level BPE tokenizer and
  a ChatML template starts from exactly that model: its step-0 greedy completions of the
  templated prompts are `transformers`' own `generate`, text for text; then every phase runs.
"""

import json
import os

import jax
import numpy as np
import optax
import pytest
import torch  # the `test` extra installs CPU torch and transformers (make test)
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from configs import default as default_config
from specdraft import config as config_lib
from specdraft.interop import hf
from specdraft.parallel.layout import Layout
from specdraft.tasks import make_task
from specdraft.tasks.tokenizer import CharTokenizer, HFTokenizer, make_tokenizer
from specdraft.train import loop
from specdraft.train import state as state_lib

V = 96  # the task's characters (byte-level symbols), 3 specials and merges

CHATML = (
  "{% for message in messages %}"
  "{% if loop.first and messages[0]['role'] != 'system' %}"
  "{{ '<|im_start|>system\\nYou add numbers.<|im_end|>\\n' }}{% endif %}"
  "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
  "{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _texts(n=300):
  task = make_task(default_config.get_config("smoke").task)
  rng = np.random.default_rng(0)
  out = ["system\nYou add numbers.\n", "user\n", "assistant\n", "[user] [assistant] "]
  for _ in range(n):
    ex = task.sample(rng)
    out += [ex.prompt, ex.answer]
  return task, out


def _save_tokenizer(path, *, specials, bos=None, config=None, added=()):
  """A byte-level BPE trained on task text, its alphabet the text's own characters (so that any
  id decodes to printable text), V ids; `bos`: a post-processor that prepends it."""
  os.makedirs(path, exist_ok=True)
  tk = Tokenizer(models.BPE())
  tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tk.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=V, special_tokens=specials)
  tk.train_from_iterator(_texts()[1], trainer)
  assert tk.get_vocab_size() == V
  tk.add_tokens(list(added))  # added tokens that are not special: text, matched whole
  if bos is not None:
    tk.post_processor = processors.TemplateProcessing(
      single=f"{bos} $A", special_tokens=[(bos, tk.token_to_id(bos))]
    )
  tk.save(os.path.join(path, "tokenizer.json"))
  cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, **(config or {})}
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(cfg, f)
  return str(path)


def _chatml(path):
  return _save_tokenizer(
    path,
    specials=["<|endoftext|>", "<|im_end|>", "<|im_start|>"],  # EOS = 1, not the char EOS
    config={"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML},
  )


def _ids(x):
  return list(x["input_ids"] if hasattr(x, "keys") else x)


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
  return _chatml(tmp_path_factory.mktemp("chatml"))


def test_chat_templated_prompts_and_answers_are_the_ids_transformers_gives(chatml):
  ref = transformers.AutoTokenizer.from_pretrained(chatml)
  tok = HFTokenizer(chatml, chat_template=True)
  plain = HFTokenizer(chatml)
  assert (tok.eos_id, tok.pad_id, tok.bos_id) == (ref.eos_token_id, ref.pad_token_id, None)
  assert tok.eos_id != CharTokenizer.eos_id and tok.vocab_size == V
  task, _ = _texts(0)
  rng = np.random.default_rng(1)
  for _ in range(20):
    ex = task.sample(rng)
    turn = [{"role": "user", "content": ex.prompt}]
    want = _ids(ref.apply_chat_template(turn, add_generation_prompt=True, tokenize=True))
    assert tok.encode_prompt(ex.prompt) == want
    assert plain.encode_prompt(ex.prompt) == _ids(ref(ex.prompt))  # no BOS for this model
    answer = tok.encode_answer(ex.answer)
    assert answer == _ids(ref(ex.answer, add_special_tokens=False)) + [ref.eos_token_id]
    # decoding stops at EOS and skips specials (padding after the end included)
    assert tok.decode(answer + [tok.pad_id] * 3 + answer) == ex.answer
    assert len(tok.encode_prompt(ex.prompt)) <= tok.max_prompt_tokens(len(ex.prompt))
  # the bound from characters holds for text that merges badly too
  for text in ("9" * 40, "+=|,0" * 7, ""):
    assert len(tok.encode_prompt(text)) <= tok.max_prompt_tokens(len(text))
    assert len(tok.encode_answer(text)) <= tok.max_answer_tokens(len(text))


def test_a_llama_style_tokenizer_prepends_bos_once(tmp_path):
  path = _save_tokenizer(
    tmp_path / "llama",
    specials=["<unk>", "<s>", "</s>"],
    bos="<s>",
    added=["<think>", "</think>"],
    config={
      "bos_token": "<s>",
      "eos_token": "</s>",
      "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
      "{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}",
    },
  )
  ref = transformers.AutoTokenizer.from_pretrained(path)
  tok, chat = HFTokenizer(path), HFTokenizer(path, chat_template=True)
  assert tok.bos_id == ref.bos_token_id == 1 and tok.pad_id == tok.eos_id == 2  # no PAD: EOS
  prompt = "12+7="
  assert tok.encode_prompt(prompt) == _ids(ref(prompt)) and tok.encode_prompt(prompt)[0] == 1
  turn = [{"role": "user", "content": prompt}]
  want = _ids(ref.apply_chat_template(turn, add_generation_prompt=True, tokenize=True))
  got = chat.encode_prompt(prompt)
  assert got == want and got[:2] != [1, 1]  # the template writes BOS; it is not added again
  # an added token that is not special is text: encoded whole, kept when decoding
  ids = tok.encode("<think>12</think>")
  assert ids == _ids(ref("<think>12</think>", add_special_tokens=False)) and V in ids
  assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True) == "<think>12</think>"


def _save_model(path, tokenizer_dir):
  """A tiny random Llama over the tokenizer's vocabulary, saved beside a copy of the tokenizer."""
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
    vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6,
    tie_word_embeddings=True, max_position_embeddings=512, initializer_range=0.1,
    eos_token_id=1, pad_token_id=0,
  )  # fmt: skip
  model = transformers.LlamaForCausalLM(cfg).eval()
  model.save_pretrained(str(path))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    with open(os.path.join(tokenizer_dir, name)) as src, open(os.path.join(path, name), "w") as dst:
      dst.write(src.read())
  return model


def _config(init_from, data_dir, **extra):
  c = default_config.get_config("smoke")
  c.model.init_from = init_from
  c.data.chat_template = True
  c.data.data_dir = data_dir
  c.parallel.devices = 1
  # the chat template's frame (about 25 tokens) joins every prompt
  c.data.seq_len = 96
  for key, value in extra.items():
    section, field = key.split(".")
    c[section][field] = value
  return c


def test_bad_tokenizer_and_checkpoint_settings_are_named_before_any_work(tmp_path, chatml):
  model_dir = tmp_path / "model"
  _save_model(model_dir, chatml)
  d = str(tmp_path / "tfds")
  # generation_config.json's EOS list: the tokenizer's EOS, and the others stop generation too
  with open(model_dir / "generation_config.json", "w") as f:
    json.dump({"eos_token_id": [5, 1]}, f)
  pcfg = state_lib.policy_config(_config(str(model_dir), d))
  assert (pcfg.eos_id, pcfg.stop_ids) == (1, (5,))

  def refused(c, *words):
    with pytest.raises(ValueError) as e:
      config_lib.validate(c)
    for w in words:
      assert w in str(e.value), str(e.value)

  refused(_config(str(tmp_path / "nowhere"), d), "config.model.init_from", "config.json")
  bare = tmp_path / "bare"  # a checkpoint without its tokenizer
  _save_model(bare, chatml)
  os.remove(bare / "tokenizer.json")
  refused(_config(str(bare), d), "config.model.init_from", "tokenizer.json")
  refused(_config(str(model_dir), d, **{"model.tap_layers": (1, 7)}), "config.model.tap_layers")
  # rows of a pretrained tokenizer are measured on the data, before anything compiles
  with pytest.raises(ValueError, match="config.data.seq_len=20 is invalid: the longest"):
    loop.Context(_config(str(model_dir), d, **{"data.seq_len": 20}), str(tmp_path / "run"))
  big = _save_tokenizer(
    tmp_path / "big", specials=["<|im_end|>"], added=["<x>"], config={"eos_token": "<|im_end|>"}
  )  # V + 1 ids for a model of V
  refused(
    _config(str(model_dir), d, **{"data.tokenizer": big, "data.chat_template": False}),
    "config.model.init_from",
    "smaller than the tokenizer's",
  )
  os.remove(model_dir / "model.safetensors")
  refused(_config(str(model_dir), d), "config.model.init_from", "safetensors")
  c = default_config.get_config("smoke")
  c.parallel.devices = 1
  c.data.chat_template = True  # the character tokenizer has no template
  refused(c, "chat_template")
  no_template = _save_tokenizer(
    tmp_path / "plain", specials=["<|im_end|>"], config={"eos_token": "<|im_end|>"}
  )
  c.data.tokenizer = no_template
  refused(c, "config.data.tokenizer", "chat_template")
  c.data.chat_template = False
  c.data.tokenizer = chatml  # a fresh policy over its V = 96 ids (the characters: 99)
  assert make_tokenizer(c).vocab_size == V
  config_lib.validate(c)  # a tokenizer alone sizes the fresh policy's vocabulary


def test_cotraining_starts_from_the_imported_policy(tmp_path, chatml):
  model_dir = tmp_path / "model"
  model = _save_model(model_dir, chatml)
  c = _config(
    str(model_dir),
    str(tmp_path / "tfds"),
    **{
      "sft.steps": 2,
      "sft.log_every": 1,
      "eval.every": 2,
      "draft.pretrain_steps": 2,
      "draft.vocab_size": 64,  # EAGLE-3's reduced vocabulary over the BPE's frequent tokens
      "rl.steps": 2,
      "rl.eval_every": 2,
      "eval.report_repeats": 0,
      "model.tap_layers": (0, 1, 2),  # an EAGLE-3 checkpoint fuses 3 taps
      "export.dir": "export",  # the trained policy and draft written out for serving
    },
  )
  config_lib.validate(c)
  pcfg = state_lib.policy_config(c)
  assert (pcfg.vocab_size, pcfg.n_layers, pcfg.eos_id) == (V, 4, 1)
  # the state the run builds holds the checkpoint's weights, placed as the layout places them
  st = state_lib.init_state(
    pcfg, optax.sgd(0.1), Layout.from_config(c.parallel), 0, init_from=str(model_dir)
  )
  jax.tree.map(np.testing.assert_array_equal, st["params"], hf.load_params(str(model_dir), pcfg))
  wd = str(tmp_path / "run")
  loop.train_and_evaluate(c, wd)
  with open(os.path.join(wd, "eval.jsonl")) as f:
    first = json.loads(f.readline())
  assert first["step"] == 0 and first["samples"]
  ref = transformers.AutoTokenizer.from_pretrained(str(model_dir))
  for s in first["samples"]:
    turn = [{"role": "user", "content": s["prompt"]}]
    ids = _ids(ref.apply_chat_template(turn, add_generation_prompt=True, tokenize=True))
    with torch.no_grad():
      out = model.generate(
        torch.tensor([ids]), max_new_tokens=c.decode.max_new_tokens, do_sample=False,
        eos_token_id=ref.eos_token_id, pad_token_id=ref.pad_token_id,
      )[0, len(ids):].tolist()  # fmt: skip
    if ref.eos_token_id in out:
      out = out[: out.index(ref.eos_token_id)]
    assert s["completion"] and s["completion"] == ref.decode(out, skip_special_tokens=True), s
  with open(os.path.join(wd, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [1, 2]
  assert all(np.isfinite(r["draft_loss"]) and np.isfinite(r["rl_loss"]) for r in rows), rows
  # The export: the policy written out is the run's final checkpoint, exactly; `transformers`
  # loads it with the copied tokenizer files, which encode as the checkpoint's own tokenizer.
  import orbax.checkpoint as ocp

  out = os.path.join(wd, "export")
  ck = os.path.join(wd, "checkpoints", "rl")
  last = max(int(d) for d in os.listdir(ck) if d.isdigit())
  assert last == 2
  saved = ocp.StandardCheckpointer().restore(os.path.join(ck, str(last), "state"))
  _, back = hf.load_policy(os.path.join(out, "policy"))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(saved["params"]["policy"]), back)
  trained = dict(model.named_parameters())["model.layers.0.mlp.up_proj.weight"].detach().numpy()
  assert not np.array_equal(back["layers"]["w_up"][0], trained.T)  # trained, not the import
  exported = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "policy"))
  assert exported.config.num_hidden_layers == 4
  tok_out = transformers.AutoTokenizer.from_pretrained(os.path.join(out, "policy"))
  prompt = [{"role": "user", "content": "12+7="}]
  assert _ids(tok_out.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)) == (
    _ids(ref.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True))
  )
  from safetensors import safe_open

  with safe_open(os.path.join(out, "draft", "model.safetensors"), framework="np") as f:
    assert set(f.keys()) == set(hf.EAGLE3_TENSORS)
    assert f.get_tensor("lm_head.weight").shape[0] == 64 and f.get_tensor("t2d").sum() == 64
    fc = np.asarray(jax.device_get(saved["params"]["draft"]["fc"]))
    np.testing.assert_array_equal(f.get_tensor("fc.weight"), fc.T)  # the final draft
  with open(os.path.join(out, "draft", "config.json")) as f:
    assert json.load(f)["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]


def test_a_draft_vocabulary_file_is_checked_and_used(tmp_path):
  """draft.vocab_file: the reduced vocabulary as a JSON list of target ids (e.g. the policy's own
  frequent tokens), checked in validation and used as given."""
  c = default_config.get_config("smoke")
  c.parallel.devices = 1
  c.data.data_dir = str(tmp_path / "tfds")
  c.draft.vocab_size = 8
  path = str(tmp_path / "ids.json")

  def write(ids):
    with open(path, "w") as f:
      json.dump(ids, f)

  c.draft.vocab_file = path
  for bad, words in (([2, 3, 4], "expected 8 distinct ids"), ([2] * 8, "8 distinct"),
                     (list(range(95, 103)), "[0, 99)"), ("x", "JSON list")):  # fmt: skip
    write(bad)
    with pytest.raises(ValueError, match="config.draft.vocab_file") as e:
      config_lib.validate(c)
    assert words in str(e.value)
  ids = [2, 40, 17, 3, 5, 60, 98, 11]
  write(ids)
  config_lib.validate(c)
  ctx = loop.Context(c, str(tmp_path / "run"))
  assert ctx.models.dcfg.vocab_ids == tuple(sorted(ids))
