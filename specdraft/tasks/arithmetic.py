"""Multi-digit addition with a worked, column-by-column scratchpad.

Prompt `"57+68="`; answer `"7+8+0=15,5+6+1=12|125"`: each column lists its digits and the carry in,
then the column sum; the final answer follows the last '|'.
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
  scratchpad: bool = True
  name: str = "arithmetic"

  def __post_init__(self):
    if not 1 <= self.min_digits <= self.max_digits:
      raise ValueError(f"task.arithmetic: need 1 <= min_digits <= max_digits, got "
                       f"{self.min_digits}, {self.max_digits}")
    if self.num_operands < 2:
      raise ValueError(f"task.arithmetic.num_operands must be >= 2, got {self.num_operands}")

  def sample(self, rng: np.random.Generator) -> Example:
    nums = []
    for _ in range(self.num_operands):
      d = int(rng.integers(self.min_digits, self.max_digits + 1))
      lo = 0 if d == 1 else 10 ** (d - 1)
      nums.append(int(rng.integers(lo, 10**d)))
    prompt = "+".join(map(str, nums)) + "="
    return Example(prompt, self.solve(nums))

  def solve(self, nums: list[int]) -> str:
    total = sum(nums)
    if not self.scratchpad:
      return str(total)
    width = max(len(str(n)) for n in nums)
    digits = [str(n).zfill(width)[::-1] for n in nums]
    steps, carry = [], 0
    for col in range(width):
      ds = [int(d[col]) for d in digits]
      s = sum(ds) + carry
      steps.append("+".join(map(str, ds)) + f"+{carry}={s}")
      carry = s // 10
    if carry:
      steps.append(f"{carry}={carry}")
    return ",".join(steps) + f"|{total}"

  def reward(self, example: Example, completion: str) -> float:
    m = re.fullmatch(r"(\d+(?:\+\d+)+)=", example.prompt)
    if m is None:
      raise ValueError(f"not an arithmetic prompt: {example.prompt!r}")
    target = sum(int(x) for x in m.group(1).split("+"))
    return float(final_answer(completion) == str(target))

  def max_length(self) -> int:
    nums = [10**self.max_digits - 1] * self.num_operands
    return len("+".join(map(str, nums)) + "=") + len(self.solve(nums))
