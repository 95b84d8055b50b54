"""Key-value retrieval among distractor records: a task where the context matters.

Prompt: `num_records` records `"key=value;"` (keys of `key_len` lowercase letters, distinct within a
prompt; values of `value_len` digits), then a query `"?key:"`. With `hops = 1` the answer is the
queried key's value. With `hops = h > 1` the values are keys too (the records form chains): the
answer follows h links from the queried key, writing every key it passes, e.g. hops = 2:
`"?abc:" -> "kqz>417"` (abc's record holds kqz, kqz's record holds 417). The reward verifies the
final answer (after the last '>') from the prompt alone; written links that are wrong cost the
reward too, so it is 1 only for a correct chain.

A prompt's length grows linearly in `num_records` (about (key_len + value_len + 2) characters per
record): 128 records of 3+3 characters are about 1K tokens, 4K records about 32K.
"""

from __future__ import annotations

import dataclasses
import re
import string

import numpy as np

from specdraft.tasks.base import Example


@dataclasses.dataclass(frozen=True)
class Retrieval:
  num_records: int = 64
  key_len: int = 3
  value_len: int = 3
  hops: int = 1
  name: str = "retrieval"

  def __post_init__(self):
    if self.num_records < 1:
      raise ValueError(f"task.retrieval.num_records must be >= 1, got {self.num_records}")
    if self.key_len < 1 or self.value_len < 1:
      raise ValueError(
        f"task.retrieval.key_len and value_len must be >= 1, got {self.key_len}, {self.value_len}"
      )
    if not 1 <= self.hops <= self.num_records:
      raise ValueError(f"task.retrieval.hops must be in [1, num_records], got {self.hops}")
    if 26**self.key_len < 2 * self.num_records:
      raise ValueError(
        f"task.retrieval.key_len={self.key_len} gives {26**self.key_len} keys, too few for "
        f"num_records={self.num_records} distinct keys (need >= {2 * self.num_records})"
      )

  def _key(self, rng) -> str:
    return "".join(rng.choice(list(string.ascii_lowercase), self.key_len))

  def _value(self, rng) -> str:
    return "".join(str(int(d)) for d in rng.integers(0, 10, self.value_len))

  def sample(self, rng: np.random.Generator) -> Example:
    keys: list[str] = []
    seen = set()
    while len(keys) < self.num_records:
      k = self._key(rng)
      if k not in seen:
        seen.add(k)
        keys.append(k)
    # the queried chain: keys[0] -> keys[1] -> ... -> keys[hops - 1] -> a value
    chain = keys[: self.hops]
    table = {k: self._value(rng) for k in keys}
    for a, b in zip(chain, chain[1:]):
      table[a] = b
    order = rng.permutation(self.num_records)
    records = "".join(f"{keys[i]}={table[keys[i]]};" for i in order)
    answer = ">".join(chain[1:] + [table[chain[-1]]])
    return Example(f"{records}?{chain[0]}:", answer)

  def solve(self, prompt: str) -> str:
    table, query = _parse(prompt)
    out, k = [], query
    for _ in range(self.hops):
      k = table.get(k, "")
      out.append(k)
    return ">".join(out)

  def reward(self, example: Example, completion: str) -> float:
    return float(completion.strip() == self.solve(example.prompt))

  def max_length(self) -> int:
    record = self.key_len + 1 + max(self.key_len, self.value_len) + 1
    answer = (self.hops - 1) * (self.key_len + 1) + self.value_len
    return self.num_records * record + 2 + self.key_len + answer


def _parse(prompt: str) -> tuple[dict[str, str], str]:
  m = re.fullmatch(r"((?:[a-z]+=[a-z0-9]+;)+)\?([a-z]+):", prompt)
  if m is None:
    raise ValueError(f"not a retrieval prompt: {prompt[:60]!r}...")
  table = dict(r.split("=") for r in m.group(1).rstrip(";").split(";"))
  return table, m.group(2)
