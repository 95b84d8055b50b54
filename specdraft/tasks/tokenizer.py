"""Character-level tokenizer: PAD/BOS/EOS plus printable ASCII and newline."""

from __future__ import annotations

import numpy as np

PAD, BOS, EOS = 0, 1, 2
_SPECIALS = ("<pad>", "<bos>", "<eos>")
_CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


class CharTokenizer:
  """Maps each character of `_CHARS` to one id; ids 0..2 are PAD, BOS, EOS."""

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

  def decode(self, ids, *, stop_at_eos: bool = True) -> str:
    """Text of `ids`; stops at the first EOS (if asked) and skips PAD/BOS and negative ids."""
    out = []
    for i in np.asarray(ids).tolist():
      if i == EOS and stop_at_eos:
        break
      if i in self._to_ch:
        out.append(self._to_ch[i])
    return "".join(out)
