"""Multi-digit addition with a worked, column-by-column scratchpad.

Prompt `"57+68="`. Answer formats:
  columns: `"7+8+0=15,5+6+1=12,1=1|125"` (each column's digits and carry in, then its sum)
  semicolon: `"7+8+0=15;5+6+1=12;1=1|125"` (the same work, other separators)
  symbols: `"7&8&0:15/5&6&1:12/1:1|125"` (the same work, every symbol of it other: '&' for '+',
    ':' for '=', '/' between columns; a rare format that differs in many tokens, so moving the
    policy to it moves most of the scratchpad's text, the drift experiment's setting)
  sums:    `"15,12,1|125"` (column sums only)
  direct:  `"125"`
`formats` is a mixture such as "columns" or "columns:0.95,sums:0.05" (SFT data mixes them);
`reward_format` (if set) pays only for correct answers written in that format, which makes RL
move the policy's output distribution (the drift experiment).

Free variation (many valid outputs, so a policy sampled at temperature 1 keeps real entropy):
  free_order: each worked column lists its terms (digits and carry in) in a random order and
    writes its equation either way round, `"8+0+7=15"` or `"15=7+0+8"`;
  space_prob: before and after every '+' and '=' in the work, and after every column separator, a
    space stands with this probability, each independently: `"7 +8+ 0= 15, 5+6 + 1=12"`.
The answer after '|' never varies and is all the reward reads (with the format). `entropy_per_token`
gives the entropy the SFT data itself has per answer token (the level a policy fit to it reaches).

`WorkedSum` holds what does not depend on how the sum is worked (the format mixture, the answer's
text and its free variation, the reward, the length bound, the entropy): a task gives its knobs and
`steps`, the worked answer as steps "terms = sum". The long-tailed running-sum task
(tasks/longtail.py) is the other one.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

from specdraft.tasks.base import Example, final_answer

FORMATS = ("columns", "semicolon", "symbols", "sums", "direct")
# the worked formats' symbols: (between a step's terms, between its terms and its sum, between
# steps)
SYMBOLS = {"columns": ("+", "=", ","), "semicolon": ("+", "=", ";"), "symbols": ("&", ":", "/")}


class WorkedSum:
  """A sum of the prompt's numbers ("a+b+...="), answered as worked steps in one of FORMATS.

  A task dataclass subclasses it with the knobs min_digits, max_digits, formats, reward_format,
  free_order, space_prob and name, and gives `steps(nums)`: the worked answer's steps, each its
  terms and their sum. A step of one term is written "s=s" and never reordered."""

  def steps(self, nums: list[int]) -> list[tuple[list[int], int]]:
    raise NotImplementedError

  @property
  def mixture(self) -> list[tuple[str, float]]:
    """`formats` ("columns:0.95,semicolon:0.05") as (format, weight) pairs (weight 1 if none)."""
    out = []
    for part in self.formats.split(","):
      name, _, w = part.partition(":")
      out.append((name.strip(), float(w) if w else 1.0))
    return out

  def check_knobs(self) -> None:
    """The shared knobs' checks; errors name `task.<name>.<knob>`, its value and what is valid."""
    field = f"task.{self.name}"
    for name, w in self.mixture:
      if name not in FORMATS or w < 0:
        raise ValueError(
          f"{field}.formats={self.formats!r}: each entry is "
          f"'<format>[:weight]' with a format in {FORMATS} and weight >= 0"
        )
    if self.reward_format and self.reward_format not in FORMATS:
      raise ValueError(
        f"{field}.reward_format={self.reward_format!r} must be '' or one of {FORMATS}"
      )
    if not 1 <= self.min_digits <= self.max_digits:
      raise ValueError(
        f"{field}: need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}"
      )
    if not 0.0 <= self.space_prob < 1.0:
      raise ValueError(f"{field}.space_prob must be in [0, 1), got {self.space_prob}")

  @staticmethod
  def draw_numbers(rng: np.random.Generator, count: int, min_digits: int, max_digits: int):
    """`count` numbers, each of a uniform number of digits in [min_digits, max_digits], then
    uniform among the numbers of that many digits (0 counts as one digit)."""
    nums = []
    for _ in range(count):
      d = int(rng.integers(min_digits, max_digits + 1))
      lo = 0 if d == 1 else 10 ** (d - 1)
      nums.append(int(rng.integers(lo, 10**d)))
    return nums

  def example_of(self, nums: list[int], rng: np.random.Generator) -> Example:
    """The prompt "a+b+...=" of `nums` and its answer in a format drawn from the mixture (no draw
    for a single format), freely varied if the task is."""
    names = [n for n, _ in self.mixture]
    w = np.asarray([w for _, w in self.mixture], float)
    fmt = names[int(rng.choice(len(names), p=w / w.sum()))] if len(names) > 1 else names[0]
    varies = self.free_order or self.space_prob > 0
    return Example("+".join(map(str, nums)) + "=", self.solve(nums, fmt, rng if varies else None))

  def solve(self, nums: list[int], fmt: str = "columns", rng=None) -> str:
    """The answer in format `fmt`; canonical (no free variation) unless `rng` is given."""
    total = sum(nums)
    if fmt == "direct":
      return str(total)
    worked = fmt in SYMBOLS
    plus, eq, sep = SYMBOLS.get(fmt, ("+", "=", ","))
    free = rng is not None and self.free_order and worked
    space = self.space_prob if rng is not None else 0.0

    def gap() -> str:
      return " " if space and rng.random() < space else ""

    def sp(sym: str) -> str:  # a separator: a space may follow; '+' and '=': precede and follow
      return (gap() if sym in (plus, eq) else "") + sym + gap()

    out = []
    for terms, s in self.steps(nums):
      if not worked:
        out.append(str(s))
        continue
      if len(terms) == 1:
        out.append(f"{s}{sp(eq)}{s}")
        continue
      if free:
        terms = [terms[i] for i in rng.permutation(len(terms))]
      lhs = str(terms[0]) + "".join(sp(plus) + str(t) for t in terms[1:])
      out.append(f"{s}{sp(eq)}{lhs}" if free and rng.random() < 0.5 else f"{lhs}{sp(eq)}{s}")
    return "".join(st + (sp(sep) if i < len(out) - 1 else "") for i, st in enumerate(out)) + (
      f"|{total}"
    )

  def longest_answer(self, nums: list[int]) -> int:
    """The longest answer to `nums` in characters over every format, a space at every place
    `space_prob` may put one."""
    longest = 0
    for f in FORMATS:
      answer = self.solve(nums, f)
      spaces = _space_slots(answer) if self.space_prob else 0
      longest = max(longest, len(answer) + spaces)
    return longest

  def entropy_per_token(self, rng: np.random.Generator, n: int = 2000) -> float:
    """Entropy of the SFT answers per answer token (EOS included), in nats: the exact entropy of
    the free variation summed over `n` sampled problems, over their expected token count. (The
    format mixture's one choice per answer is left out.) 0 without free variation."""
    h_space = 0.0
    if self.space_prob > 0:
      p = self.space_prob
      h_space = -(p * np.log(p) + (1 - p) * np.log(1 - p))
    total_h, total_len = 0.0, 0.0
    for _ in range(n):
      ex = self.sample(rng)
      nums = [int(x) for x in ex.prompt[:-1].split("+")]
      fmt = format_of(ex.answer)
      canon = self.solve(nums, fmt)
      slots = _space_slots(canon)
      total_len += len(canon) + 1 + slots * self.space_prob
      total_h += slots * h_space
      if self.free_order and fmt in SYMBOLS:
        for terms, _ in self.steps(nums):
          if len(terms) == 1:
            continue
          orders = math.factorial(len(terms))
          for c in set(terms):
            orders //= math.factorial(terms.count(c))
          total_h += np.log(orders) + np.log(2)
    return float(total_h / total_len)

  def reward(self, example: Example, completion: str) -> float:
    """1 for the sum of the prompt's numbers after the last '|' (in `reward_format`, if set)."""
    m = re.fullmatch(r"(\d+(?:\+\d+)+)=", example.prompt)
    if m is None:
      raise ValueError(f"not a prompt of the {self.name} task: {example.prompt!r}")
    target = sum(int(x) for x in m.group(1).split("+"))
    if self.reward_format and format_of(completion) != self.reward_format:
      return 0.0
    return float(final_answer(completion) == str(target))

  def format_of(self, completion: str) -> str:
    return format_of(completion)


@dataclasses.dataclass(frozen=True)
class Arithmetic(WorkedSum):
  min_digits: int = 1
  max_digits: int = 3
  num_operands: int = 2
  formats: str = "columns"
  reward_format: str = ""
  free_order: bool = False
  space_prob: float = 0.0
  name: str = "arithmetic"

  def __post_init__(self):
    self.check_knobs()
    if self.num_operands < 2:
      raise ValueError(f"task.arithmetic.num_operands must be >= 2, got {self.num_operands}")

  def sample(self, rng: np.random.Generator) -> Example:
    nums = self.draw_numbers(rng, self.num_operands, self.min_digits, self.max_digits)
    return self.example_of(nums, rng)

  def _columns(self, nums: list[int]) -> list[tuple[list[int], int]]:
    """Each column's terms (its digits, then the carry in) and its sum, lowest column first."""
    width = max(len(str(n)) for n in nums)
    digits = [str(n).zfill(width)[::-1] for n in nums]
    out, carry = [], 0
    for col in range(width):
      terms = [int(d[col]) for d in digits] + [carry]
      out.append((terms, sum(terms)))
      carry = sum(terms) // 10
    return out

  def steps(self, nums: list[int]) -> list[tuple[list[int], int]]:
    """The columns, then the carry out of the last one (a step of one term)."""
    cols = self._columns(nums)
    carry = sum(nums) // 10 ** len(cols)
    return cols + ([([carry], carry)] if carry else [])

  def max_length(self) -> int:
    nums = [10**self.max_digits - 1] * self.num_operands
    return self.max_prompt_length() + self.longest_answer(nums)

  def max_prompt_length(self) -> int:
    return len("+".join([str(10**self.max_digits - 1)] * self.num_operands) + "=")


def _space_slots(answer: str) -> int:
  """Where `space_prob` may put a space in a canonical answer: before and after each term and sum
  symbol ('+' and '=', or '&' and ':'), after each separator between steps (the final answer
  after '|' never varies)."""
  work = answer.split("|")[0]
  return 2 * sum(work.count(c) for c in "+=&:") + sum(work.count(c) for c in ",;/")


def format_of(completion: str) -> str:
  """Which answer format a completion uses."""
  if "|" not in completion:
    return "direct"
  work = completion.split("|", 1)[0]
  if ":" in work:
    return "symbols"
  if ";" in work:
    return "semicolon"
  return "columns" if "=" in work else "sums"
