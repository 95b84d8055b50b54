import json

import numpy as np
import pytest

from specdraft.tasks import CharTokenizer, load_jsonl, loader
from specdraft.tasks import datasets as task_data
from specdraft.tasks.tokenizer import EOS


def _records(src):
  return [task_data.to_example(src[i]) for i in range(len(src))]


def test_tfds_splits_are_deterministic_and_disjoint(smoke_config, tmp_path):
  t = smoke_config.task
  a_train = _records(task_data.data_source(t, str(tmp_path / "a"), "train"))
  b_train = _records(task_data.data_source(t, str(tmp_path / "b"), "train"))
  test = _records(task_data.data_source(t, str(tmp_path / "a"), "test"))
  assert len(a_train) == t.num_train and len(test) == t.num_test
  assert a_train == b_train
  assert not {e.prompt for e in test} & {e.prompt for e in a_train}
  t.seed += 1
  c_train = _records(task_data.data_source(t, str(tmp_path / "a"), "train"))
  assert c_train != a_train


def test_padded_batches(smoke_config):
  src = task_data.data_source(smoke_config.task, smoke_config.data.data_dir, "train")
  tok = CharTokenizer()
  it = iter(loader.sft_dataset(src, tok, batch_size=4, seq_len=40, packing=False, seed=0))
  b = next(it)
  for k in ("tokens", "positions", "segment_ids", "loss_mask"):
    assert b[k].shape == (4, 40)
  for row in range(4):
    n = int((b["segment_ids"][row] > 0).sum())
    assert np.all(b["segment_ids"][row, :n] == 1) and np.all(b["segment_ids"][row, n:] == 0)
    np.testing.assert_array_equal(b["positions"][row, :n], np.arange(n))
    text = tok.decode(b["tokens"][row, :n])
    prompt, _, answer = text.partition("=")
    assert b["tokens"][row, n - 1] == EOS
    # loss on the answer and EOS only
    assert b["loss_mask"][row].sum() == len(answer) + 1
    assert b["loss_mask"][row, : len(prompt) + 2].sum() == 0


def test_packed_batches_and_resume(smoke_config):
  src = task_data.data_source(smoke_config.task, smoke_config.data.data_dir, "train")
  tok = CharTokenizer()
  ds = loader.sft_dataset(src, tok, batch_size=2, seq_len=64, packing=True, seed=3)
  it = iter(ds)
  b = next(it)
  assert b["segment_ids"].max() >= 2  # several documents per row
  for row in range(2):
    seg, pos = b["segment_ids"][row], b["positions"][row]
    for s in set(seg.tolist()) - {0}:
      np.testing.assert_array_equal(pos[seg == s], np.arange((seg == s).sum()))
  state = it.get_state()
  expected = [next(it) for _ in range(3)]
  it2 = iter(ds)
  it2.set_state(state)
  for e in expected:
    got = next(it2)
    for k in e:
      np.testing.assert_array_equal(got[k], e[k])


def test_example_too_long_is_a_clear_error(smoke_config):
  src = task_data.data_source(smoke_config.task, smoke_config.data.data_dir, "train")
  it = iter(
    loader.sft_dataset(src, CharTokenizer(), batch_size=2, seq_len=5, packing=False, seed=0)
  )
  with pytest.raises(ValueError, match="data.seq_len=5"):
    next(it)


def test_jsonl_loader(tmp_path):
  path = tmp_path / "data.jsonl"
  recs = [{"prompt": f"{i}*2=", "answer": str(2 * i)} for i in range(5)]
  path.write_text("\n".join(json.dumps(r) for r in recs) + "\n\n")
  exs = load_jsonl(str(path))
  assert [(e.prompt, e.answer) for e in exs] == [(r["prompt"], r["answer"]) for r in recs]


@pytest.mark.parametrize(
  "line,msg",
  [
    ('{"prompt": "a"', "not valid JSON"),
    ('{"prompt": "a"}', "missing field 'answer'"),
    ('{"prompt": "a", "answer": 3}', "'answer' must be a string"),
    ("[1, 2]", "expected an object"),
  ],
)
def test_jsonl_malformed_record_names_file_and_line(tmp_path, line, msg):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"prompt": "x", "answer": "y"}\n' + line + "\n")
  with pytest.raises(ValueError, match=rf"bad.jsonl:2: .*{msg}"):
    load_jsonl(str(path))


def test_jsonl_task_through_tfds(smoke_config, tmp_path):
  path = tmp_path / "mine.jsonl"
  path.write_text(
    "".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(20))
  )
  t = smoke_config.task
  t.name, t.jsonl.path, t.num_test = "jsonl", str(path), 5
  test, train = task_data.generate_splits(t)
  assert len(test) == 5 and len(train) == 15
  src = task_data.data_source(t, str(tmp_path / "tfds"), "train")
  assert len(src) == 15
