"""A long-tailed task: sums of a heavy-tailed number of terms, worked as a running sum.

Prompt `"38+7+5="`. The worked answer adds one term per step, so its length grows linearly with
the number of terms: `"38+7=45,45+5=50|50"` (each step: the sum so far, the next term, the new
sum). The answer formats, their symbols and the free variation are arithmetic's (`WorkedSum`,
tasks/arithmetic.py), here over running-sum steps instead of columns:
  columns:   `"38+7=45,45+5=50|50"`   semicolon: `"38+7=45;45+5=50|50"`
  symbols:   `"38&7:45/45&5:50|50"`   sums:      `"45,50|50"`   direct: `"50"`
`formats` mixes them for the SFT data ("columns:0.95,symbols:0.05"), `reward_format` (if set)
pays only for correct answers in that format, and `space_prob` / `free_order` vary the steps'
text (a space around '+' and '=' and after a separator; the two terms of a step in either order
and the step either way round). The reward reads the final answer after '|' and the format, not
the steps. A two-term answer is one step with no separator, so "semicolon" cannot be told from
"columns" there and is refused as the `reward_format` unless min_terms >= 3.

The number of terms n is heavy-tailed: n - min_terms + 1 follows a Zipf law of exponent `alpha`
truncated to [1, max_terms - min_terms + 1], so most prompts add two or three numbers and a few
add `max_terms`. A batch of rollouts then runs as long as its longest completion, several times
the median one: the setting where a rollout's time is set by its tail.

The first term is uniform in [0, 10 ** first_digits), the others have min_digits to max_digits
digits (as arithmetic's operands). At the defaults (a first term below 100, then one digit each)
a step adds one digit to the sum so far, which the 12-layer policy learns in the run's 700 SFT
steps (greedy accuracy 0.96 in any format, configs/default.py:longtail); with two-digit terms
every step is a two-digit addition written in one go, and 700 SFT steps left the policy's sums
wrong (`86+2=92`, accuracy near 0). The wide first term keeps prompts distinct: with every term one
digit there are only 100 two-term prompts, and holding the test split's out of the train split
(tasks/datasets.py) would leave the train split few short examples and no longer long-tailed.

At the defaults (up to 8 terms, alpha 1.75: 60% of the prompts have 2 terms, 2% have 8) and the
`configs/default.py:longtail` run's formats and spaces, the reference completions (answer and EOS,
in character tokens) have a median of 14 tokens and a p90 of 45 over 2000 examples (the train
split: 14 and 47), the longest 91 of a possible 107 (`tests/test_longtail.py` checks p90 / median
>= 3).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from specdraft.tasks.arithmetic import WorkedSum
from specdraft.tasks.base import Example


@dataclasses.dataclass(frozen=True)
class Longtail(WorkedSum):
  min_terms: int = 2
  max_terms: int = 8
  alpha: float = 1.75  # the Zipf exponent of the number of terms (0: uniform)
  min_digits: int = 1  # digits of every term after the first
  max_digits: int = 1
  first_digits: int = 2  # the first term: uniform in [0, 10 ** first_digits)
  formats: str = "columns"
  reward_format: str = ""
  free_order: bool = False
  space_prob: float = 0.0
  name: str = "longtail"

  def __post_init__(self):
    self.check_knobs()
    if not 2 <= self.min_terms <= self.max_terms:
      raise ValueError(
        f"task.longtail: need 2 <= min_terms <= max_terms, got {self.min_terms}, {self.max_terms}"
      )
    if not self.alpha >= 0:
      raise ValueError(f"task.longtail.alpha must be >= 0 (0: uniform), got {self.alpha}")
    if self.first_digits < 1:
      raise ValueError(f"task.longtail.first_digits must be >= 1, got {self.first_digits}")
    if self.reward_format == "semicolon" and self.min_terms < 3:
      raise ValueError(
        f"task.longtail.reward_format='semicolon' is invalid with min_terms={self.min_terms}: "
        "a two-term answer is one step, with no separator, so it reads as 'columns' and could "
        "never be paid; use 'symbols' (every step's symbols differ) or min_terms >= 3"
      )

  def term_probs(self) -> np.ndarray:
    """P(n) for n = min_terms .. max_terms: proportional to (n - min_terms + 1) ** -alpha."""
    p = np.arange(1, self.max_terms - self.min_terms + 2, dtype=np.float64) ** -self.alpha
    return p / p.sum()

  def sample(self, rng: np.random.Generator) -> Example:
    p = self.term_probs()
    n = self.min_terms + int(rng.choice(len(p), p=p))
    first = int(rng.integers(10**self.first_digits))
    rest = self.draw_numbers(rng, n - 1, self.min_digits, self.max_digits)
    return self.example_of([first] + rest, rng)

  def steps(self, nums: list[int]) -> list[tuple[list[int], int]]:
    """The running sum: ([sum so far, next term], new sum) for each term after the first."""
    out, total = [], nums[0]
    for t in nums[1:]:
      out.append(([total, t], total + t))
      total += t
    return out

  def _largest(self) -> list[int]:
    """The prompt of every term at its largest: the longest prompt, steps and answer."""
    return [10**self.first_digits - 1] + [10**self.max_digits - 1] * (self.max_terms - 1)

  def max_length(self) -> int:
    return self.max_prompt_length() + self.longest_answer(self._largest())

  def max_prompt_length(self) -> int:
    return len("+".join(map(str, self._largest())) + "=")
