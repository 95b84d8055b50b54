"""Long-context co-training: key-value retrieval among distractors, under context parallelism.

Run:    python experiments/train.py --config=configs/long.py --workdir=runs/long
Other layouts: --config=configs/long.py:layout=cp4_dp2
Long rows (2-3 RL steps at >= 8K tokens per row): --config=configs/long.py:long
Smoke (CI): --config=configs/long.py:smoke

The whole run (SFT -> draft distillation -> RL co-training with speculative rollouts) trains on
sequence shards over `cp` (train/sequence.py): every policy layer attends through the ring, the
draft's branch attention joins it, and the vocabulary is touched in chunks. Rows hold one prompt of
`num_records` records "key=value;" and a query; the answer is the queried value (task/retrieval).
"""

from __future__ import annotations

from configs import default
from specdraft.config import parse_arg

# Read by the entry points (without importing this file) to simulate the devices on CPU.
DEFAULT_LAYOUT = "cp8"


def get_config(arg: str | None = None):
  arg = parse_arg(arg, layout=DEFAULT_LAYOUT, smoke=False, long=False, records=128, seed=0)
  c = default.get_config(f"layout={arg.layout},seed={arg.seed}" + (",smoke" if arg.smoke else ""))
  records = 16 if arg.smoke else 1024 if arg.long else arg.records
  c.task.name = "retrieval"
  c.task.retrieval.update(num_records=records, key_len=3, value_len=3, hops=1)
  c.task.num_train, c.task.num_test = (256, 16) if arg.smoke else (20000, 64)
  # one row per prompt (no packing): ~8 characters per record, rounded up to a multiple of 2*cp*16
  need = 8 * records + 16
  step = 32 * c.parallel.mesh.cp
  c.data.seq_len = -(-need // step) * step
  c.data.packing = False
  c.decode.max_new_tokens = 8  # the answer is a few characters
  c.decode.num_draft = 3
  c.eval.num_examples = 16 if arg.smoke else 64
  c.compute.attn_tile = 256
  c.compute.vocab_chunk = 512
  if arg.smoke:
    c.data.batch_size = c.eval.batch_size = c.draft.batch_size = 8
    return c
  c.data.batch_size = 8
  c.sft.steps, c.sft.lr, c.sft.log_every = 600, 2e-3, 20
  c.eval.every, c.eval.batch_size = 200, 16
  c.checkpoint.every = 200
  c.draft.pretrain_steps, c.draft.batch_size = 200, 16
  c.draft.ttt_steps = 4
  c.rl.steps, c.rl.prompts_per_step, c.rl.group_size, c.rl.eval_every = 20, 4, 4, 10
  if arg.long:  # >= 8K tokens per row: a few RL steps to show the whole run works there
    c.sft.steps, c.draft.pretrain_steps, c.rl.steps = 20, 10, 3
    c.eval.every = c.checkpoint.every = 10
    c.eval.num_examples = c.eval.batch_size = 8
    c.data.batch_size = c.draft.batch_size = 8
    c.rl.prompts_per_step, c.rl.group_size = 2, 4
  return c
