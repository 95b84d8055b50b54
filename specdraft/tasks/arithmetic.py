"""Multi-digit addition with a worked, column-by-column scratchpad.

Prompt `"57+68="`. Answer formats:
  columns: `"7+8+0=15,5+6+1=12,1=1|125"` (each column's digits and carry in, then its sum)
  semicolon: `"7+8+0=15;5+6+1=12;1=1|125"` (the same work, other separators)
  sums:    `"15,12,1|125"` (column sums only)
  direct:  `"125"`
`formats` is a mixture such as "columns" or "columns:0.95,sums:0.05" (SFT data mixes them);
`reward_format` (if set) pays only for correct answers written in that format, which makes RL
move the policy's output distribution (the drift experiment).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from specdraft.tasks.base import Example, final_answer


@dataclasses.dataclass(frozen=True)
class Arithmetic:
  min_digits: int = 1
  max_digits: int = 3
  num_operands: int = 2
  formats: str = "columns"
  reward_format: str = ""
  name: str = "arithmetic"

  @property
  def mixture(self) -> list[tuple[str, float]]:
    out = []
    for part in self.formats.split(","):
      name, _, w = part.partition(":")
      out.append((name.strip(), float(w) if w else 1.0))
    return out

  def __post_init__(self):
    for name, w in self.mixture:
      if name not in FORMATS or w < 0:
        raise ValueError(
          f"task.arithmetic.formats={self.formats!r}: each entry is "
          f"'<format>[:weight]' with a format in {FORMATS} and weight >= 0"
        )
    if self.reward_format and self.reward_format not in FORMATS:
      raise ValueError(
        f"task.arithmetic.reward_format={self.reward_format!r} must be '' or one of {FORMATS}"
      )
    if not 1 <= self.min_digits <= self.max_digits:
      raise ValueError(
        f"task.arithmetic: need 1 <= min_digits <= max_digits, got "
        f"{self.min_digits}, {self.max_digits}"
      )
    if self.num_operands < 2:
      raise ValueError(f"task.arithmetic.num_operands must be >= 2, got {self.num_operands}")

  def sample(self, rng: np.random.Generator) -> Example:
    nums = []
    for _ in range(self.num_operands):
      d = int(rng.integers(self.min_digits, self.max_digits + 1))
      lo = 0 if d == 1 else 10 ** (d - 1)
      nums.append(int(rng.integers(lo, 10**d)))
    prompt = "+".join(map(str, nums)) + "="
    names = [n for n, _ in self.mixture]
    w = np.asarray([w for _, w in self.mixture], float)
    fmt = names[int(rng.choice(len(names), p=w / w.sum()))] if len(names) > 1 else names[0]
    return Example(prompt, self.solve(nums, fmt))

  def solve(self, nums: list[int], fmt: str = "columns") -> str:
    total = sum(nums)
    if fmt == "direct":
      return str(total)
    width = max(len(str(n)) for n in nums)
    digits = [str(n).zfill(width)[::-1] for n in nums]
    steps, carry = [], 0
    for col in range(width):
      ds = [int(d[col]) for d in digits]
      s = sum(ds) + carry
      worked = fmt in ("columns", "semicolon")
      steps.append("+".join(map(str, ds)) + f"+{carry}={s}" if worked else str(s))
      carry = s // 10
    if carry:
      steps.append(f"{carry}={carry}" if worked else str(carry))
    return (";" if fmt == "semicolon" else ",").join(steps) + f"|{total}"

  def reward(self, example: Example, completion: str) -> float:
    m = re.fullmatch(r"(\d+(?:\+\d+)+)=", example.prompt)
    if m is None:
      raise ValueError(f"not an arithmetic prompt: {example.prompt!r}")
    target = sum(int(x) for x in m.group(1).split("+"))
    if self.reward_format and format_of(completion) != self.reward_format:
      return 0.0
    return float(final_answer(completion) == str(target))

  def format_of(self, completion: str) -> str:
    return format_of(completion)

  def max_length(self) -> int:
    nums = [10**self.max_digits - 1] * self.num_operands
    return len("+".join(map(str, nums)) + "=") + max(len(self.solve(nums, f)) for f in FORMATS)


FORMATS = ("columns", "semicolon", "sums", "direct")


def format_of(completion: str) -> str:
  """Which answer format a completion uses."""
  if "|" not in completion:
    return "direct"
  work = completion.split("|", 1)[0]
  if ";" in work:
    return "semicolon"
  return "columns" if "=" in work else "sums"
