"""Tasks: tokenizer, generated verifiable tasks with rewards, TFDS builders and loaders."""

from __future__ import annotations

from specdraft.tasks.arithmetic import Arithmetic
from specdraft.tasks.base import Example, Task
from specdraft.tasks.countdown import Countdown
from specdraft.tasks.frequency import Frequency
from specdraft.tasks.jsonl import JsonlTask, load_jsonl
from specdraft.tasks.longtail import Longtail
from specdraft.tasks.retrieval import Retrieval
from specdraft.tasks.tokenizer import CharTokenizer

TASKS = ("arithmetic", "countdown", "retrieval", "frequency", "longtail", "jsonl")


def make_task(task_cfg) -> Task:
  """The task named by `task_cfg.name`, built from its sub-config of difficulty knobs."""
  name = task_cfg.name
  if name == "arithmetic":
    return Arithmetic(**dict(task_cfg.arithmetic))
  if name == "countdown":
    return Countdown(**dict(task_cfg.countdown))
  if name == "retrieval":
    return Retrieval(**dict(task_cfg.retrieval))
  if name == "frequency":
    return Frequency(**dict(task_cfg.frequency))
  if name == "longtail":
    return Longtail(**dict(task_cfg.longtail))
  if name == "jsonl":
    if not task_cfg.jsonl.path:
      raise ValueError("task.jsonl.path must name a JSONL file when task.name='jsonl'")
    return JsonlTask(task_cfg.jsonl.path)
  raise ValueError(f"task.name={name!r} is unknown; expected one of {TASKS}")


__all__ = [
  "TASKS",
  "Arithmetic",
  "CharTokenizer",
  "Countdown",
  "Example",
  "Frequency",
  "JsonlTask",
  "Longtail",
  "Retrieval",
  "Task",
  "load_jsonl",
  "make_task",
]
