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

  def max_prompt_length(self) -> int:
    """Upper bound on len(prompt) in characters: the width rollouts and evaluation pad prompts
    to (`train.evaluate.prompt_len_for`). A bound loosened by the answer's length widens every
    rollout's prefill, its KV cache and every RL training row."""
    ...


def max_prompt_length(task) -> int:
  """`task.max_prompt_length()`, or `task.max_length()` (prompt and answer: loose, but safe) for a
  task written without it."""
  bound = getattr(task, "max_prompt_length", None)
  return bound() if bound is not None else task.max_length()


def final_answer(completion: str) -> str:
  """The text after the last '|' (scratchpad separator), stripped."""
  return completion.rsplit("|", 1)[-1].strip()
