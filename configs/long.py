"""Long-context co-training under context parallelism: a task that needs the whole context.

Run:    python experiments/train.py --config=configs/long.py --workdir=runs/long
Other layouts: --config=configs/long.py:layout=cp4_dp2 (or pp2_cp2_dp2)
The retrieval task: --config=configs/long.py:task=retrieval (`:queries=16`: multi-query)
Rollouts of >= 32 new tokens (SD timed against AR on them), 1024 tokens a row:
        --config=configs/long.py:task=retrieval,queries=8,records=96
Long rows (3 RL steps at >= 8K tokens per row, retrieval): --config=configs/long.py:long
Smoke (CI): --config=configs/long.py:smoke
With provenance (results.json with the goals below, plots):
        python experiments/long_run.py --config=configs/long.py --workdir=docs/results/long_run
        python experiments/long_run.py --config=configs/long.py:long --workdir=docs/results/long_8k
        python experiments/long_run.py --config=configs/long.py:task=retrieval,queries=8,records=96 \
          --workdir=docs/results/long_answers

The whole run (SFT -> draft distillation -> RL co-training with speculative rollouts) trains on
sequence shards over `cp` (train/sequence.py): every policy layer attends through the ring, the
draft's branch attention joins it, and the vocabulary is touched in chunks. One prompt per row
(no packing). Two tasks:

- `frequency` (the learning run's default, tasks/frequency.py): `length` letters of 8 symbols, then
  "?"; the answer lists the 2 most frequent letters, most frequent first ("q,z"), and the reward is
  the fraction of places right. Every token of the context counts: the histogram it needs is what
  one attention head computes by attending uniformly. Its SFT data writes 40% of the answers as
  "q;z", which the reward does not pay (`semicolon_share`), so the SFT policy leaves the RL phase a
  behaviour to drop, as the arithmetic task of `make run` does with its rare rewarded format.
  Why 8 symbols, alpha 1 and the top 2 (probes on one device, without results files): with 16
  symbols the SFT policy stayed near chance and RL did not move it; with 8 the most frequent
  letter is learned within a few hundred SFT steps; reference letters with noise left RL a
  correction its rollouts did not find.
- `retrieval` (tasks/retrieval.py): `records` records "key=value;" and `queries` keys asked at
  once; the answer lists their values. The tiny policy does not learn this lookup within what a
  2-core machine gives a run (SFT-only probes on one device, without results files: one-letter
  keys among a few records are partly learned in a thousand steps, longer keys among more records
  stay at the uniform-digit loss; induction-style lookups leave that plateau only after many
  thousands of large-batch steps); `:long` (which
  shows the run works at >= 8K tokens) keeps the retrieval task its committed results used.
"""

from __future__ import annotations

from configs import default
from specdraft.config import parse_arg
from specdraft.tasks.frequency import Frequency

# Read by the entry points (without importing this file) to simulate the devices on CPU.
DEFAULT_LAYOUT = "cp8"


def _goals(arg, new_tokens: int):
  """Fixed before the run (experiments/long_run.py copies them into results.json with
  pass/fail). The reward is compared between the first and the last fifth of the RL steps."""
  g = dict(
    runs_at_length=dict(
      metric="measured.tokens_per_row",
      fixed="2026-11-30",
      op=">=",
      target=8192 if arg.long else 128 if arg.smoke else 1024,
      what="tokens per row",
    ),
    losses_finite=dict(
      fixed="2026-11-30",
      metric="measured.losses_finite",
      op="==",
      target=True,
      what="every RL loss finite",
    ),
  )
  if not arg.long and not arg.smoke:  # a learning run: the reward rises, the draft keeps up
    g["reward_rises"] = dict(
      metric="measured.reward_gain",
      fixed="2026-11-30",
      op=">",
      target=0.0,
      what="RL reward, last fifth of the steps minus the first fifth",
    )
    g["accept_len_above_2"] = dict(
      metric="measured.accept_len_mean",
      fixed="2026-11-30",
      op=">",
      target=2.0,
      what="accepted length tau, mean over the RL steps",
    )
  if not arg.long and not arg.smoke and new_tokens >= 32:  # rollouts long enough to time SD on
    g["new_tokens_at_least_32"] = dict(
      metric="measured.max_new_tokens",
      fixed="2026-12-06",
      op=">=",
      target=32,
      what="new tokens per rollout (the answer's length bound)",
    )
    g["sd_faster_than_ar"] = dict(
      metric="run.rollout.speedup",
      fixed="2026-12-06",
      op=">=",
      target=1.0,
      what="SD over AR rollout tokens/s, final policy and co-trained draft, the run's rollout "
      "batch at temperature 1",
    )
  return g


def get_config(arg: str | None = None):
  arg = parse_arg(
    arg,
    layout=DEFAULT_LAYOUT,
    smoke=False,
    long=False,
    task="",  # "" = frequency, or retrieval under :long (the task of its committed results)
    records=128,
    queries=1,
    length=0,  # frequency: context letters (0: 984, a 1024-token row; :smoke 200, :long 8160)
    seed=0,
  )
  task = arg.task or ("retrieval" if arg.long else "frequency")
  if task not in ("frequency", "retrieval"):
    raise ValueError(f"config arg task={task!r} is unknown; expected 'frequency' or 'retrieval'")
  c = default.get_config(
    f"size=tiny,layout={arg.layout},seed={arg.seed}" + (",smoke" if arg.smoke else "")
  )
  c.task.name = task
  c.task.num_train, c.task.num_test = (256, 16) if arg.smoke else (20000, 64)
  step = 32 * c.parallel.mesh.cp  # rows are a multiple of 2*cp*16 tokens
  if task == "frequency":
    length = arg.length or (200 if arg.smoke else 8160 if arg.long else 984)
    c.task.frequency.update(
      length=length, num_symbols=8, top_k=2, alpha=1.0, min_length=0, semicolon_share=0.4
    )
    task_ = Frequency(**c.task.frequency)
    need = task_.max_length() + 2  # prompt and answer, BOS and EOS
    c.decode.max_new_tokens = 2 * task_.top_k  # "a,b" and EOS
  else:
    records = 16 if arg.smoke else 1024 if arg.long else arg.records
    queries = min(arg.queries, records)
    c.task.retrieval.update(num_records=records, key_len=3, value_len=3, hops=1, queries=queries)
    # ~8 characters per record and ~8 per query (key and answer)
    need = 8 * records + 8 * queries + 16
    c.decode.max_new_tokens = 4 * queries + 4  # "417,093,...": 4 characters per query, then EOS
  c.data.seq_len = -(-need // step) * step
  c.data.packing = False
  c.decode.num_draft = 3
  c.eval.num_examples = 16 if arg.smoke else 64
  c.compute.attn_tile = 256
  c.compute.vocab_chunk = 512
  c.long_run = dict(goals=_goals(arg, c.decode.max_new_tokens))
  if arg.smoke:
    c.data.batch_size = c.eval.batch_size = c.draft.batch_size = 8
    return c
  c.data.batch_size = 8
  c.sft.steps, c.sft.lr, c.sft.log_every = 300, 2e-3, 20
  c.eval.every, c.eval.batch_size = 100, 16
  c.checkpoint.every = 100
  # distillation is the run's most expensive phase per step (a 1K-token rollout, the policy's
  # forward and K = 4 TTT steps through the ring): 100 steps of 8 rows
  c.draft.pretrain_steps, c.draft.batch_size = 100, 8
  c.draft.ttt_steps = 4
  c.rl.steps, c.rl.prompts_per_step, c.rl.group_size, c.rl.eval_every = 20, 8, 4, 5
  c.rl.lr = 2e-4
  if arg.long:  # >= 8K tokens per row: a few RL steps to show the whole run works there
    c.task.num_train, c.task.num_test = 512, 16  # a few steps use a few hundred rows
    c.sft.steps, c.draft.pretrain_steps, c.rl.steps = 6, 3, 3
    c.sft.log_every = c.draft.log_every = 1
    c.eval.every = c.checkpoint.every = 6
    c.rl.eval_every = 3
    c.eval.num_examples = c.eval.batch_size = 8
    c.data.batch_size = c.draft.batch_size = 8
    c.rl.prompts_per_step, c.rl.group_size = 2, 4
  return c
