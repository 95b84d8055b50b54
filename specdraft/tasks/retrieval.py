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

With `query_end = "="` a single query is written like a record's start, `"?abc="`, so the answer
continues a copy of the record's own text (`"abc=" -> "417"`): the pattern an induction head
completes, which a small model learns far sooner than matching a key against `"?abc:"`.

With `min_records = m < num_records` each prompt draws its record count uniformly from
[m, num_records] (a mixture of easy and hard rows: with few records the right one is found by a
weak match, which is how the lookup circuit starts to form; see configs/long.py).
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
  min_records: int = 0  # 0: every prompt has num_records records
  query_end: str = ":"  # ":" or "=" (one query only)
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
    if self.query_end not in (":", "=") or (self.query_end == "=" and self.queries > 1):
      raise ValueError(
        f"task.retrieval.query_end must be ':' or '=' ('=' with queries=1), got "
        f"{self.query_end!r} with queries={self.queries}"
      )
    if self.min_records and not self.queries * self.hops <= self.min_records <= self.num_records:
      raise ValueError(
        f"task.retrieval.min_records must be 0 (fixed) or in [queries * hops, num_records] = "
        f"[{self.queries * self.hops}, {self.num_records}], got {self.min_records}"
      )
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
    n = self.num_records
    if self.min_records:
      n = int(rng.integers(self.min_records, self.num_records + 1))
    keys: list[str] = []
    seen = set()
    while len(keys) < n:
      for k in self._strings(rng, string.ascii_lowercase, n, self.key_len):
        if k not in seen and len(keys) < n:
          seen.add(k)
          keys.append(k)
    # query j's chain: keys[j h] -> keys[j h + 1] -> ... -> keys[j h + h - 1] -> a value
    h = self.hops
    chains = [keys[j * h : (j + 1) * h] for j in range(self.queries)]
    values = self._strings(rng, string.digits, n, self.value_len)
    table = dict(zip(keys, values))
    for chain in chains:
      for a, b in zip(chain, chain[1:]):
        table[a] = b
    order = rng.permutation(n)
    records = "".join(f"{keys[i]}={table[keys[i]]};" for i in order)
    answer = ",".join(">".join(c[1:] + [table[c[-1]]]) for c in chains)
    return Example(f"{records}?{','.join(c[0] for c in chains)}{self.query_end}", answer)

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
    answer = (self.hops - 1) * (self.key_len + 1) + self.value_len + 1  # with its ',' separator
    return self.max_prompt_length() + self.queries * answer

  def max_prompt_length(self) -> int:
    """The records, '?', the queried keys with their commas and the query's end mark."""
    record = self.key_len + 1 + max(self.key_len, self.value_len) + 1
    return self.num_records * record + 1 + self.queries * (self.key_len + 1)


def _parse(prompt: str) -> tuple[dict[str, str], list[str]]:
  m = re.fullmatch(r"((?:[a-z]+=[a-z0-9]+;)+)\?([a-z]+(?:,[a-z]+)*)[:=]", prompt)
  if m is None:
    raise ValueError(f"not a retrieval prompt: {prompt[:60]!r}...")
  table = dict(r.split("=") for r in m.group(1).rstrip(";").split(";"))
  return table, m.group(2).split(",")
