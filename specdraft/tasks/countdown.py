"""Countdown: reach a target from given numbers with + - * /, each number used at most once.

Prompt `"3,7,25->46:"`; answer an expression such as `"25+3*7"`. The reward parses the expression
(no `eval`), checks the numbers against the prompt and evaluates it exactly.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

import numpy as np

from specdraft.tasks.base import Example

_PREC = {"+": 1, "-": 1, "*": 2, "/": 2}


@dataclasses.dataclass(frozen=True)
class Countdown:
  num_numbers: int = 3
  max_number: int = 20
  ops: str = "+-*"
  use_all: bool = True
  name: str = "countdown"

  def __post_init__(self):
    if self.num_numbers < 2:
      raise ValueError(f"task.countdown.num_numbers must be >= 2, got {self.num_numbers}")
    if self.max_number < 1:
      raise ValueError(f"task.countdown.max_number must be >= 1, got {self.max_number}")
    if not self.ops or set(self.ops) - set(_PREC):
      raise ValueError(f"task.countdown.ops must be a non-empty subset of '+-*/', got {self.ops!r}")

  def sample(self, rng: np.random.Generator) -> Example:
    while True:
      nums = [int(x) for x in rng.integers(1, self.max_number + 1, size=self.num_numbers)]
      value, expr = nums[0], str(nums[0])
      prev_prec = 3
      ok = True
      for n in nums[1:]:
        op = self.ops[int(rng.integers(len(self.ops)))]
        if op == "/" and (n == 0 or value % n):
          ok = False
          break
        # Left-to-right chain; parenthesise the left side when precedence would regroup it.
        left = f"({expr})" if _PREC[op] > prev_prec else expr
        value = {"+": value + n, "-": value - n, "*": value * n, "/": value // max(n, 1)}[op]
        expr, prev_prec = f"{left}{op}{n}", _PREC[op]
      if ok and value > 0:
        shown = list(nums)
        rng.shuffle(shown)
        return Example(",".join(map(str, shown)) + f"->{value}:", expr)

  def reward(self, example: Example, completion: str) -> float:
    m = re.fullmatch(r"(\d+(?:,\d+)*)->(\d+):", example.prompt)
    if m is None:
      raise ValueError(f"not a countdown prompt: {example.prompt!r}")
    given = sorted(int(x) for x in m.group(1).split(","))
    target = int(m.group(2))
    try:
      value, used = evaluate(completion.strip())
    except ValueError:
      return 0.0
    pool = list(given)
    for u in used:
      if u not in pool:
        return 0.0
      pool.remove(u)
    if self.use_all and pool:
      return 0.0
    return float(value == target)

  def max_length(self) -> int:
    n = len(str(self.max_number))
    answer = self.num_numbers * (n + 1) + 2 * (self.num_numbers - 1)
    return self.max_prompt_length() + answer

  def max_prompt_length(self) -> int:
    """'a,b,c->value:' with every number at its widest; the value is at most the larger of
    max_number ** num_numbers and num_numbers * max_number (a sum of ones outgrows 1 ** k)."""
    n = len(str(self.max_number))
    value = max(self.max_number**self.num_numbers, self.num_numbers * self.max_number)
    return self.num_numbers * (n + 1) - 1 + len("->") + len(str(value)) + len(":")


def evaluate(expr: str) -> tuple[Fraction, list[int]]:
  """Exact value of an integer expression over + - * / and parentheses, and the numbers used.

  Raises ValueError on anything else (including division by zero).
  """
  toks = re.findall(r"\d+|[-+*/()]|\S", expr)
  if not toks or "".join(toks) != expr.replace(" ", ""):
    raise ValueError(f"cannot parse {expr!r}")
  pos, used = 0, []

  def peek():
    return toks[pos] if pos < len(toks) else None

  def atom():
    nonlocal pos
    t = peek()
    if t is None:
      raise ValueError("unexpected end")
    pos += 1
    if t == "(":
      v = add()
      if peek() != ")":
        raise ValueError("missing ')'")
      pos += 1
      return v
    if t.isdigit():
      used.append(int(t))
      return Fraction(int(t))
    raise ValueError(f"unexpected {t!r}")

  def mul():
    nonlocal pos
    v = atom()
    while peek() in ("*", "/"):
      op = toks[pos]
      pos += 1
      r = atom()
      if op == "/" and r == 0:
        raise ValueError("division by zero")
      v = v * r if op == "*" else v / r
    return v

  def add():
    nonlocal pos
    v = mul()
    while peek() in ("+", "-"):
      op = toks[pos]
      pos += 1
      r = mul()
      v = v + r if op == "+" else v - r
    return v

  value = add()
  if pos != len(toks):
    raise ValueError(f"trailing input in {expr!r}")
  return value, used
