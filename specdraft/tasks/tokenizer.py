"""Tokenizers: the built-in character tokenizer, and a pretrained model's own (tokenizer.json).

Both give the task and reward code the same interface:

  tok.encode_prompt(prompt)   ids of a prompt as the policy reads it (BOS + prompt, or the chat
                              template's rendering of one user turn with its generation prompt)
  tok.encode_answer(answer)   ids of an answer as the policy writes it (answer + EOS)
  tok.decode(ids)             text of generated ids, up to the first EOS, specials skipped
  tok.pad_id / bos_id / eos_id / vocab_size, tok.max_prompt_tokens(n) / max_answer_tokens(n)

`max_*_tokens(n)` bound the ids of any text of n characters: one id per character for the
character tokenizer (buffers are sized from it before any data is read); for a byte-level BPE
every id covers at least one byte, so 4 per character (UTF-8) plus the fixed tokens around it, a
bound loose enough that a run measures its actual prompts and rows instead.
`make_tokenizer(config)` picks one: `data.tokenizer` = "" (the character tokenizer, or the
`model.init_from` checkpoint's tokenizer.json when a policy is imported) or a path to a
tokenizer.json or to the directory holding it.
"""

from __future__ import annotations

import json
import os

import numpy as np

PAD, BOS, EOS = 0, 1, 2
_SPECIALS = ("<pad>", "<bos>", "<eos>")
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


class CharTokenizer:
  """Maps each character of `_CHARS` to one id; ids 0..2 are PAD, BOS, EOS."""

  name = "char"
  pad_id, bos_id, eos_id = PAD, BOS, EOS

  def __init__(self):
    self._to_id = {ch: i + len(_SPECIALS) for i, ch in enumerate(_CHARS)}
    self._to_ch = {i: ch for ch, i in self._to_id.items()}

  @property
  def vocab_size(self) -> int:
    return len(_SPECIALS) + len(_CHARS)

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    try:
      ids = [self._to_id[ch] for ch in text]
    except KeyError as e:
      raise ValueError(
        f"character {e.args[0]!r} in {text[:60]!r} is not in the tokenizer's "
        "alphabet (printable ASCII and newline)"
      ) from None
    return ([BOS] if bos else []) + ids + ([EOS] if eos else [])

  def encode_prompt(self, prompt: str) -> list[int]:
    return self.encode(prompt, bos=True)

  def encode_answer(self, answer: str) -> list[int]:
    return self.encode(answer, eos=True)

  def max_prompt_tokens(self, chars: int) -> int:
    return chars + 1

  def max_answer_tokens(self, chars: int) -> int:
    return chars + 1

  def decode(self, ids, *, stop_at_eos: bool = True) -> str:
    """Text of `ids`; stops at the first EOS (if asked) and skips PAD/BOS and negative ids."""
    out = []
    for i in np.asarray(ids).tolist():
      if i == EOS and stop_at_eos:
        break
      if i in self._to_ch:
        out.append(self._to_ch[i])
    return "".join(out)


def _token_text(tok) -> str | None:
  """A special token's text as tokenizer_config.json writes it (a string or an AddedToken dict)."""
  if isinstance(tok, dict):
    return tok.get("content")
  return tok


class HFTokenizer:
  """A Hugging Face tokenizer.json (the `tokenizers` library, no `transformers`), with the special
  tokens of tokenizer_config.json (else config.json's ids) and, when `chat_template` is on, the
  model's chat template (jinja, as tokenizer_config.json stores it) around every prompt.

  BOS is prepended where the model expects it (`add_bos_token`, Llama-style; Qwen-style models
  have none) and never twice (a chat template that writes BOS itself keeps its own). PAD, when the
  model names none, is EOS: padding is masked everywhere, its id only fills buffers."""

  name = "hf"

  def __init__(self, path: str, *, chat_template: bool = False):
    try:
      import tokenizers
    except ImportError as e:  # an optional extra: pip install -e '.[hf]'
      raise ImportError(
        "a tokenizer.json needs the `tokenizers` package: pip install -e '.[hf]'"
      ) from e
    file = path if path.endswith(".json") else os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
      raise FileNotFoundError(f"no tokenizer.json at {file!r}")
    self.path = file
    folder = os.path.dirname(file)
    self._tok = tokenizers.Tokenizer.from_file(file)
    tc = _read_json(os.path.join(folder, "tokenizer_config.json"))
    mc = _read_json(os.path.join(folder, "config.json"))

    def special(name: str) -> int | None:
      text = _token_text(tc.get(f"{name}_token"))
      if text is not None:
        i = self._tok.token_to_id(text)
        if i is None:
          raise ValueError(f"{file}: {name}_token {text!r} is not in the vocabulary")
        return i
      i = mc.get(f"{name}_token_id")
      return int(i[0] if isinstance(i, list) else i) if i is not None else None

    eos = special("eos")
    if eos is None:
      raise ValueError(
        f"{folder}: no EOS token (tokenizer_config.json eos_token or config.json eos_token_id): "
        "generation could not stop"
      )
    self.eos_id = eos
    self.bos_id = special("bos")
    pad = special("pad")
    self.pad_id = eos if pad is None else pad
    # Whether the model reads a BOS: tokenizer_config.json's flag, else what tokenizer.json's own
    # post-processor does with special tokens on.
    probe = self._tok.encode("a", add_special_tokens=True).ids
    adds = bool(probe) and probe[0] == self.bos_id
    self._add_bos = bool(tc.get("add_bos_token", adds)) and self.bos_id is not None
    self._texts = {k: _token_text(tc.get(f"{k}_token")) or "" for k in ("bos", "eos", "pad", "unk")}
    self._template = None
    if chat_template:
      template = tc.get("chat_template")
      jinja_file = os.path.join(folder, "chat_template.jinja")  # where newer checkpoints keep it
      if not template and os.path.isfile(jinja_file):
        with open(jinja_file) as f:
          template = f.read()
      if isinstance(template, list):  # named templates: the default one
        template = {t["name"]: t["template"] for t in template}.get("default")
      if not template:
        raise ValueError(
          f"data.chat_template=True but {folder} has no chat template (tokenizer_config.json "
          "chat_template or chat_template.jinja)"
        )
      try:
        self._template = _compile_template(template)
      except ImportError:
        raise
      except Exception as e:  # jinja's TemplateSyntaxError
        raise ValueError(f"{folder}: its chat template does not compile: {e}") from None
    # decoding skips special tokens only: added tokens that are not special (Qwen3's <think>,
    # tool-call markers, whitespace runs) are text the reward reads
    added = self._tok.get_added_tokens_decoder()
    self._specials = {int(i) for i, t in added.items() if t.special} | {
      i for i in (self.eos_id, self.bos_id, self.pad_id) if i is not None
    }

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size(with_added_tokens=True)

  def _ids(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    ids = self._ids(text)
    return ([self.bos_id] if bos and self._add_bos else []) + ids + ([self.eos_id] if eos else [])

  def render_prompt(self, prompt: str) -> str:
    """The text the policy reads for `prompt`: the chat template's rendering of one user turn
    with the generation prompt, or the prompt itself without a template."""
    if self._template is None:
      return prompt
    try:
      return self._render(prompt)
    except Exception as e:  # jinja's TemplateError (a template's raise_exception) and others
      raise ValueError(f"{self.path}: the chat template fails on a prompt: {e}") from None

  def _render(self, prompt: str) -> str:
    return self._template.render(
      messages=[{"role": "user", "content": prompt}],
      add_generation_prompt=True,
      bos_token=self._texts["bos"],
      eos_token=self._texts["eos"],
      pad_token=self._texts["pad"],
      unk_token=self._texts["unk"],
    )

  def encode_prompt(self, prompt: str) -> list[int]:
    text = self.render_prompt(prompt)
    ids = self._ids(text)
    if self._add_bos and not (ids and ids[0] == self.bos_id):
      ids = [self.bos_id] + ids
    return ids

  def encode_answer(self, answer: str) -> list[int]:
    return self._ids(answer) + [self.eos_id]

  def max_prompt_tokens(self, chars: int) -> int:
    """At most one id per byte: the template's own bytes, 4 per character (UTF-8), BOS. Loose:
    runs measure their actual prompts (`train.evaluate.prompt_len_for`)."""
    frame = len(self.render_prompt("").encode("utf-8"))
    return frame + 4 * chars + 1

  def max_answer_tokens(self, chars: int) -> int:
    return 4 * chars + 1

  def decode(self, ids, *, stop_at_eos: bool = True) -> str:
    out = []
    for i in np.asarray(ids).tolist():
      if i == self.eos_id and stop_at_eos:
        break
      # padding rows of a model vocabulary larger than the tokenizer's have no text
      if 0 <= i < self.vocab_size and i not in self._specials:
        out.append(i)
    return self._tok.decode(out, skip_special_tokens=True)


def _read_json(path: str) -> dict:
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _compile_template(template: str):
  """A chat template compiled as Hugging Face renders them: a sandboxed jinja environment with
  `trim_blocks` and `lstrip_blocks`, `raise_exception` and `strftime_now` available."""
  try:
    import jinja2
    from jinja2 import sandbox
  except ImportError as e:
    raise ImportError("a chat template needs the `jinja2` package: pip install -e '.[hf]'") from e
  import datetime

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = sandbox.ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
  )
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(x, indent=indent, **kw)
  return env.from_string(template)


def tokenizer_path(config) -> str:
  """The tokenizer.json (or its directory) a config names, or "" for the character tokenizer."""
  explicit = config.data.get("tokenizer", "")
  if explicit:
    return explicit
  return config.model.get("init_from", "") or ""


def make_tokenizer(config):
  """The run's tokenizer (see the module docstring)."""
  path = tokenizer_path(config)
  chat = bool(config.data.get("chat_template", False))
  if not path:
    if chat:
      raise ValueError(
        "config.data.chat_template=True is invalid with the character tokenizer: a chat template "
        "comes with a pretrained model's tokenizer (set data.tokenizer or model.init_from)"
      )
    return CharTokenizer()
  return HFTokenizer(path, chat_template=chat)
