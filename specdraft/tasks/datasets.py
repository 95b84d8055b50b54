"""TFDS builders (array_record, no TensorFlow) that generate task splits from a seed.

`prepare(task_cfg, data_dir)` builds (once) and returns the builder; `data_source(...)` returns
random-access `tfds.data_source` splits for grain. The test split is drawn first and its prompts
are held out of the train split.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import tensorflow_datasets as tfds

from specdraft.tasks import make_task
from specdraft.tasks.base import Example


def _task_spec(task_cfg) -> dict:
  spec = {
    "name": task_cfg.name,
    "seed": int(task_cfg.seed),
    "num_train": int(task_cfg.num_train),
    "num_test": int(task_cfg.num_test),
  }
  spec.update(dict(task_cfg[task_cfg.name]) if task_cfg.name in task_cfg else {})
  return spec


class SpecdraftTaskConfig(tfds.core.BuilderConfig):
  def __init__(self, *, task_cfg, **kw):
    spec = _task_spec(task_cfg)
    digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    super().__init__(name=f"{spec['name']}_{digest}", description=json.dumps(spec), **kw)
    self.task_cfg = task_cfg
    self.spec = spec


class SpecdraftTask(tfds.core.GeneratorBasedBuilder):
  """Generated verifiable task; one builder config per (task, knobs, seed, sizes)."""

  VERSION = tfds.core.Version("1.0.0")

  def _info(self):
    return tfds.core.DatasetInfo(
      builder=self,
      description="specdraft generated task: " + self.builder_config.description,
      features=tfds.features.FeaturesDict(
        {"prompt": tfds.features.Text(), "answer": tfds.features.Text()}
      ),
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    test, train = generate_splits(self.builder_config.task_cfg)
    return {"train": self._generate_examples(train), "test": self._generate_examples(test)}

  def _generate_examples(self, examples):
    for i, ex in enumerate(examples):
      yield i, {"prompt": ex.prompt, "answer": ex.answer}


def generate_splits(task_cfg) -> tuple[list[Example], list[Example]]:
  """(test, train) examples, deterministic in `task_cfg.seed`; train excludes test prompts."""
  task = make_task(task_cfg)
  if task_cfg.name == "jsonl":
    exs = task.examples
    rng = np.random.default_rng(task_cfg.seed)
    order = rng.permutation(len(exs))
    n_test = min(task_cfg.num_test, len(exs) // 2)
    return [exs[i] for i in order[:n_test]], [exs[i] for i in order[n_test:]]
  rng_test = np.random.default_rng([task_cfg.seed, 1])
  rng_train = np.random.default_rng([task_cfg.seed, 0])
  test, seen = [], set()
  for _ in range(50 * task_cfg.num_test):
    if len(test) == task_cfg.num_test:
      break
    ex = task.sample(rng_test)
    if ex.prompt not in seen:
      seen.add(ex.prompt)
      test.append(ex)
  train = []
  for _ in range(50 * task_cfg.num_train):
    if len(train) == task_cfg.num_train:
      break
    ex = task.sample(rng_train)
    if ex.prompt not in seen:
      train.append(ex)
  return test, train


def prepare(task_cfg, data_dir: str) -> SpecdraftTask:
  builder = SpecdraftTask(
    config=SpecdraftTaskConfig(task_cfg=task_cfg), data_dir=data_dir, file_format="array_record"
  )
  builder.download_and_prepare()
  return builder


def data_source(task_cfg, data_dir: str, split: str):
  """Random-access source of {'prompt': bytes, 'answer': bytes} records."""
  return prepare(task_cfg, data_dir).as_data_source(split)


def to_example(record) -> Example:
  dec = lambda x: x.decode("utf-8") if isinstance(x, bytes) else str(x)
  return Example(dec(record["prompt"]), dec(record["answer"]))
