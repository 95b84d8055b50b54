"""Grain pipelines: padded or packed SFT batches, and prompt batches for generation.

A batch is a dict of numpy arrays: tokens, positions (document-relative), segment_ids
(1-based per document, 0 = padding) and loss_mask (1 on answer tokens and EOS), all [B,S].
"""

from __future__ import annotations

import grain
import grain.experimental as gexp
import numpy as np

from specdraft.tasks.base import Example
from specdraft.tasks.datasets import to_example
from specdraft.tasks.tokenizer import CharTokenizer, HFTokenizer

Tokenizer = CharTokenizer | HFTokenizer


def encode_sft(ex: Example, tok: Tokenizer, seq_len: int) -> dict[str, np.ndarray]:
  p = tok.encode_prompt(ex.prompt)
  a = tok.encode_answer(ex.answer)
  if len(p) + len(a) > seq_len:
    raise ValueError(
      f"example of {len(p) + len(a)} tokens does not fit data.seq_len={seq_len}: "
      f"{ex.prompt!r} -> {ex.answer[:40]!r}; raise data.seq_len"
    )
  tokens = np.asarray(p + a, np.int32)
  mask = np.asarray([0] * len(p) + [1] * len(a), np.float32)
  return {"tokens": tokens, "loss_mask": mask}


def pad_row(ex: dict[str, np.ndarray], seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
  n = len(ex["tokens"])
  pad = seq_len - n
  return {
    "tokens": np.pad(ex["tokens"], (0, pad), constant_values=pad_id),
    "loss_mask": np.pad(ex["loss_mask"], (0, pad)),
    "positions": np.pad(np.arange(n, dtype=np.int32), (0, pad)),
    "segment_ids": np.pad(np.ones(n, np.int32), (0, pad)),
  }


def shard_seed(seed: int, shard: tuple[int, int]) -> int:
  """Shard j of n's shuffle seed: `seed` for one shard, else one of its own (one permutation for
  every shard would put consecutive records side by side in each global batch)."""
  j, n = shard
  return seed if n == 1 else (seed * 1_000_003 + 7_919 * (j + 1)) % 2**31


def _shard(source, shard: tuple[int, int]) -> grain.MapDataset:
  """Records j, j + n, j + 2n, ... of `source` for shard (j, n); the whole source for n = 1."""
  j, n = shard
  if not 0 <= j < n:
    raise ValueError(f"data shard {j} of {n} does not exist")
  ds = grain.MapDataset.source(source)
  if n > 1:
    if len(ds) < n:
      raise ValueError(f"{len(ds)} records cannot feed {n} data shards")
    ds = ds[j::n]
  return ds


def sft_dataset(
  source,
  tok: Tokenizer,
  *,
  batch_size: int,
  seq_len: int,
  packing: bool,
  seed: int,
  shard: tuple[int, int] = (0, 1),
) -> grain.IterDataset:
  """Endless shuffled SFT batches; iterators expose get_state/set_state for exact resume.

  `shard=(j, n)`: the stream of data shard j of n (every n-th record from the j-th), packed on
  its own; a run with n data-parallel slices builds one per slice (train/shards.py)."""
  ds = (
    _shard(source, shard)
    .seed(shard_seed(seed, shard))
    .shuffle()
    .repeat(None)
    .map(lambda r: encode_sft(to_example(r), tok, seq_len))
  )
  it = ds.to_iter_dataset()
  if packing:
    it = gexp.FirstFitPackIterDataset(
      it,
      length_struct={"tokens": seq_len, "loss_mask": seq_len},
      num_packing_bins=batch_size,
      seed=seed,
      shuffle_bins=False,
    )
    it = it.map(_rename_packed)
  else:
    it = it.map(lambda e: pad_row(e, seq_len, tok.pad_id))
  return it.batch(batch_size, drop_remainder=True)


def _rename_packed(e):
  return {
    "tokens": e["tokens"].astype(np.int32),
    "loss_mask": e["loss_mask"].astype(np.float32),
    "positions": e["tokens_positions"].astype(np.int32),
    "segment_ids": e["tokens_segment_ids"].astype(np.int32),
  }


def prompt_batch(examples: list[Example], tok: Tokenizer, prompt_len: int):
  """Right-padded prompts [B, S] (`tok.encode_prompt`: BOS + prompt, or the chat template's
  rendering) and their lengths [B]."""
  rows = [tok.encode_prompt(e.prompt) for e in examples]
  if max(map(len, rows)) > prompt_len:
    raise ValueError(f"a prompt of {max(map(len, rows))} tokens exceeds prompt_len={prompt_len}")
  out = np.full((len(rows), prompt_len), tok.pad_id, np.int32)
  for i, r in enumerate(rows):
    out[i, : len(r)] = r
  return out, np.asarray([len(r) for r in rows], np.int32)


def prompt_dataset(
  source,
  tok: Tokenizer,
  *,
  batch_size: int,
  prompt_len: int,
  seed: int,
  shard: tuple[int, int] = (0, 1),
) -> grain.IterDataset:
  """Endless shuffled prompt batches: prompts [B, S], prompt_lengths [B], prompt/answer texts
  (of data shard `shard` = (j, n), as in `sft_dataset`)."""

  def enc(r):
    ex = to_example(r)
    ids = tok.encode_prompt(ex.prompt)
    if len(ids) > prompt_len:
      raise ValueError(f"prompt of {len(ids)} tokens exceeds prompt_len={prompt_len}")
    return {
      "prompts": np.pad(
        np.asarray(ids, np.int32), (0, prompt_len - len(ids)), constant_values=tok.pad_id
      ),
      "prompt_lengths": np.int32(len(ids)),
      "prompt_text": ex.prompt,
      "answer_text": ex.answer,
    }

  ds = _shard(source, shard).seed(shard_seed(seed, shard)).shuffle().repeat(None).map(enc)
  return ds.to_iter_dataset().batch(batch_size, drop_remainder=True)
