"""Key-value retrieval among distractor records: a task where the context matters.

Prompt: `num_records` records `"key=value;"` (keys of `key_len` lowercase letters, distinct within a
prompt; values of `value_len` digits), then a query `"?key:"`. With `hops = 1` the answer is the
queried key's value. With `hops = h > 1` the values are keys too (the records form chains): the
answer follows h links from the queried key, writing every key it passes, e.g. hops = 2:
`"?abc:" -> "kqz>417"` (abc's record holds kqz, kqz's record holds 417). The reward verifies the
final answer (after the last '>') from the prompt alone; written links that are wrong cost the
reward too, so it is 1 only for a correct chain.

With `queries = q > 1` the prompt asks for q distinct keys at once, `"?abc,kqz:"`, and the
answer lists their answers in order, `"417,093"` (multi-query associative recall): q times the
supervised tokens per row, and a reward with partial credit, the fraction of the q answers that
are right, so RL sees a graded signal.

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
  queries: int = 1
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
    if not 1 <= self.queries * self.hops <= self.num_records:
      raise ValueError(
        f"task.retrieval.queries must be >= 1 with queries * hops <= num_records, got "
        f"queries={self.queries}, hops={self.hops}, num_records={self.num_records}"
      )
    if 26**self.key_len < 2 * self.num_records:
      raise ValueError(
        f"task.retrieval.key_len={self.key_len} gives {26**self.key_len} keys, too few for "
        f"num_records={self.num_records} distinct keys (need >= {2 * self.num_records})"
      )

  def _strings(self, rng, alphabet: str, n: int, length: int) -> list[str]:
    """n random strings over `alphabet` (drawn in one call: long prompts have 1000s of them)."""
    codes = rng.integers(0, len(alphabet), (n, length))
    letters = np.asarray(list(alphabet))[codes]
    return ["".join(row) for row in letters]

  def sample(self, rng: np.random.Generator) -> Example:
    keys: list[str] = []
    seen = set()
    while len(keys) < self.num_records:
      for k in self._strings(rng, string.ascii_lowercase, self.num_records, self.key_len):
        if k not in seen and len(keys) < self.num_records:
          seen.add(k)
          keys.append(k)
    # query j's chain: keys[j h] -> keys[j h + 1] -> ... -> keys[j h + h - 1] -> a value
    h = self.hops
    chains = [keys[j * h : (j + 1) * h] for j in range(self.queries)]
    values = self._strings(rng, string.digits, self.num_records, self.value_len)
    table = dict(zip(keys, values))
    for chain in chains:
      for a, b in zip(chain, chain[1:]):
        table[a] = b
    order = rng.permutation(self.num_records)
    records = "".join(f"{keys[i]}={table[keys[i]]};" for i in order)
    answer = ",".join(">".join(c[1:] + [table[c[-1]]]) for c in chains)
    return Example(f"{records}?{','.join(c[0] for c in chains)}:", answer)

  def solve(self, prompt: str) -> str:
    table, queries = _parse(prompt)
    answers = []
    for k in queries:
      out = []
      for _ in range(self.hops):
        k = table.get(k, "")
        out.append(k)
      answers.append(">".join(out))
    return ",".join(answers)

  def reward(self, example: Example, completion: str) -> float:
    """1 for the right answer; with several queries, the fraction of them answered right (in
    order; a missing or extra item counts as wrong)."""
    want = self.solve(example.prompt)
    if self.queries == 1:
      return float(completion.strip() == want)
    got, want = completion.strip().split(","), want.split(",")
    return float(sum(g == w for g, w in zip(got, want))) / len(want) * (len(got) <= len(want))

  def max_length(self) -> int:
    record = self.key_len + 1 + max(self.key_len, self.value_len) + 1
    answer = (self.hops - 1) * (self.key_len + 1) + self.value_len + 1  # with its ',' separator
    return self.num_records * record + 1 + self.queries * (self.key_len + 1 + answer)


def _parse(prompt: str) -> tuple[dict[str, str], list[str]]:
  m = re.fullmatch(r"((?:[a-z]+=[a-z0-9]+;)+)\?([a-z]+(?:,[a-z]+)*):", prompt)
  if m is None:
    raise ValueError(f"not a retrieval prompt: {prompt[:60]!r}...")
  table = dict(r.split("=") for r in m.group(1).rstrip(";").split(";"))
  return table, m.group(2).split(",")
