"""Frequent-symbol extraction over a long context: an aggregation task where every token counts.

Prompt: `length` symbols (lowercase letters, one token each) in random order, then `"?"`. The
answer lists the `top_k` most frequent symbols of the context, most frequent first, separated by
commas: `"qzkab...?"` -> `"q,z,k,a,b"`. The reward is the fraction of the k places that hold the
right symbol (a missing or extra item counts as wrong), so RL sees a graded signal.

The counts follow a Zipf law: the symbol of rank i (1-based) occurs about
`length * i^-alpha / sum_j j^-alpha` times, with the counts of ranks 1..top_k+1 made strictly
decreasing so the answer is unique; which letters take which rank, and the order of the context,
are random per prompt. `alpha` sets the difficulty: the counts of ranks k and k+1 differ by a
factor (1 + 1/k)^alpha, so at alpha = 0.5 ranks 4 and 5 differ by 12% and must be told apart by
reading the whole context. With `min_length = m < length` each prompt draws its length uniformly
from [m, length].

`label_noise = q` makes the reference answers (the SFT data) imperfect, as real SFT data is: each
place independently holds, with probability q, a symbol drawn uniformly from the other symbols of
the context. The reward still verifies against the prompt, so the SFT policy learns to sample a
wrong symbol about q of the time at temperature 1 while its greedy answer stays right; the RL phase
has that noise to remove (the reward of its samples can rise toward the greedy accuracy).

`semicolon_share = s` writes a share s of the reference answers with ";" between the symbols. The
reward reads only the "," form (a ";" answer is one wrong item and earns 0), so the SFT policy
answers in the unpaid form about s of the time and RL can raise the reward by dropping it: the
same mechanism as the arithmetic task's rare rewarded format, here one decision per answer that
does not depend on the context, which a policy gradient finds within a few steps.

Why this task next to key-value retrieval (tasks/retrieval.py): both need the whole context, but
the lookup of a key is an induction-style circuit that a small policy learns only after many
thousands of steps of a large batch (measured probes are in configs/long.py), while a histogram of
the context is what one attention head computes by attending uniformly. A tiny policy learns it
within minutes at 1K-token rows, and ranking close counts leaves the RL phase something to
sharpen. It is the character-level form of the frequent-words extraction task of long-context
benchmarks.
"""

from __future__ import annotations

import dataclasses
import string

import numpy as np

from specdraft.tasks.base import Example


@dataclasses.dataclass(frozen=True)
class Frequency:
  length: int = 512
  num_symbols: int = 16
  top_k: int = 5
  alpha: float = 0.5
  min_length: int = 0  # 0: every prompt has `length` symbols
  label_noise: float = 0.0  # per place of the reference answer: a wrong symbol (SFT data only)
  semicolon_share: float = 0.0  # reference answers written "a;b;c" (the reward reads only ",")
  name: str = "frequency"

  def __post_init__(self):
    if not 2 <= self.num_symbols <= 26:
      raise ValueError(f"task.frequency.num_symbols must be in [2, 26], got {self.num_symbols}")
    if not 1 <= self.top_k < self.num_symbols:
      raise ValueError(
        f"task.frequency.top_k must be in [1, num_symbols - 1] = [1, {self.num_symbols - 1}], "
        f"got {self.top_k}"
      )
    if not self.alpha > 0:
      raise ValueError(f"task.frequency.alpha must be > 0, got {self.alpha}")
    if self.length < self.num_symbols:
      raise ValueError(
        f"task.frequency.length must be >= num_symbols={self.num_symbols}, got {self.length}"
      )
    if self.min_length and not self.num_symbols <= self.min_length <= self.length:
      raise ValueError(
        f"task.frequency.min_length must be 0 (fixed) or in [num_symbols, length] = "
        f"[{self.num_symbols}, {self.length}], got {self.min_length}"
      )

    if not 0.0 <= self.label_noise < 1.0:
      raise ValueError(f"task.frequency.label_noise must be in [0, 1), got {self.label_noise}")
    if not 0.0 <= self.semicolon_share < 1.0:
      raise ValueError(
        f"task.frequency.semicolon_share must be in [0, 1), got {self.semicolon_share}"
      )

  def counts(self, n: int) -> np.ndarray:
    """Occurrences of the symbols of rank 1..num_symbols in a context of about n symbols: the
    Zipf law rounded down, then ranks 1..top_k raised where needed to stay strictly above the next
    rank (at most top_k (top_k + 1) / 2 symbols more than n)."""
    w = np.arange(1, self.num_symbols + 1, dtype=np.float64) ** -self.alpha
    c = np.floor(n * w / w.sum()).astype(np.int64)
    for i in range(self.top_k - 1, -1, -1):
      c[i] = max(c[i], c[i + 1] + 1)
    return c

  def sample(self, rng: np.random.Generator) -> Example:
    n = self.length
    if self.min_length:
      n = int(rng.integers(self.min_length, self.length + 1))
    letters = np.asarray(list(string.ascii_lowercase))
    symbols = letters[rng.permutation(26)[: self.num_symbols]]  # symbols[i] takes rank i + 1
    context = np.repeat(symbols, self.counts(n))
    context = context[rng.permutation(len(context))]
    answer = list(symbols[: self.top_k])
    if self.label_noise:  # draws nothing when off: noiseless datasets are unchanged
      for i in np.flatnonzero(rng.random(self.top_k) < self.label_noise):
        others = np.delete(symbols, i)
        answer[i] = others[rng.integers(len(others))]
    sep = ","
    if self.semicolon_share and rng.random() < self.semicolon_share:  # draws nothing when off
      sep = ";"
    return Example("".join(context) + "?", sep.join(answer))

  def solve(self, prompt: str) -> str:
    if not prompt.endswith("?") or not prompt[:-1].isalpha():
      raise ValueError(f"not a frequency prompt: {prompt[:60]!r}...")
    syms, counts = np.unique(np.asarray(list(prompt[:-1])), return_counts=True)
    order = np.argsort(-counts, kind="stable")
    return ",".join(syms[order[: self.top_k]])

  def reward(self, example: Example, completion: str) -> float:
    """The fraction of the top_k places right (in order; a missing or extra item is wrong)."""
    got, want = completion.strip().split(","), self.solve(example.prompt).split(",")
    return float(sum(g == w for g, w in zip(got, want))) / len(want) * (len(got) <= len(want))

  def format_of(self, completion: str) -> str:
    """ "semicolon" for an answer in the unpaid ";" form, else "comma" (the RL metrics report the
    share of each per step)."""
    return "semicolon" if ";" in completion else "comma"

  def max_length(self) -> int:
    return self.max_prompt_length() + 2 * self.top_k - 1

  def max_prompt_length(self) -> int:
    return self.length + self.top_k * (self.top_k + 1) // 2 + len("?")
