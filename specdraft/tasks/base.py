"""Verifiable tasks: examples, the task protocol and the registry."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np


@dataclasses.dataclass(frozen=True)
class Example:
  prompt: str
  answer: str


class Task(Protocol):
  """A generated, verifiable task. `reward` checks a completion; generated tasks verify from the
  prompt alone (the reference answer is only for SFT)."""

  name: str

  def sample(self, rng: np.random.Generator) -> Example: ...

  def reward(self, example: Example, completion: str) -> float: ...

  def max_length(self) -> int:
    """Upper bound on len(prompt) + len(answer) in characters."""
    ...


def final_answer(completion: str) -> str:
  """The text after the last '|' (scratchpad separator), stripped."""
  return completion.rsplit("|", 1)[-1].strip()
