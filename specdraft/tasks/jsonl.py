"""The user's own data: a JSONL file of {"prompt", "answer"} records."""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from specdraft.tasks.base import Example, final_answer


def load_jsonl(path: str) -> list[Example]:
  """Reads records; a malformed one raises ValueError naming the file and the line."""
  out = []
  with open(path, encoding="utf-8") as f:
    for lineno, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path}:{lineno}"
      try:
        rec = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
      if not isinstance(rec, dict):
        raise ValueError(
          f"{where}: expected an object with 'prompt' and 'answer', got {type(rec).__name__}"
        )
      for key in ("prompt", "answer"):
        if key not in rec:
          raise ValueError(f"{where}: missing field {key!r}")
        if not isinstance(rec[key], str):
          raise ValueError(
            f"{where}: field {key!r} must be a string, got {type(rec[key]).__name__}"
          )
      out.append(Example(rec["prompt"], rec["answer"]))
  if not out:
    raise ValueError(f"{path}: no records")
  return out


@dataclasses.dataclass(frozen=True)
class JsonlTask:
  """Examples drawn from a JSONL file; reward is an exact match of the final answer."""

  path: str
  name: str = "jsonl"

  @property
  def examples(self) -> list[Example]:
    return load_jsonl(self.path)

  def sample(self, rng: np.random.Generator) -> Example:
    ex = self.examples
    return ex[int(rng.integers(len(ex)))]

  def reward(self, example: Example, completion: str) -> float:
    return float(final_answer(completion) == final_answer(example.answer))

  def max_length(self) -> int:
    return max(len(e.prompt) + len(e.answer) for e in self.examples)

  def max_prompt_length(self) -> int:
    return max(len(e.prompt) for e in self.examples)
