"""Default specdraft config (`make run`): a 12-layer policy with a one-layer draft, a generated
arithmetic task, CPU.

Run:  python experiments/train.py --config=configs/default.py --workdir=runs/default
Variants: --config=configs/default.py:task=countdown,layout=dp8,size=tiny,smoke
Fields:   --config.sft.steps=500 --config.model.n_layers=6

Sized so that a policy pass costs about 7 draft passes (size "bench"; the 4-layer "tiny" policy is
barely deeper than its draft). At this run's 64 rows a rollout on 2 CPU cores is close to
compute-bound, which limits what SD can gain here (docs/results.md). The arithmetic
task gives the RL phase something to learn and the sampled policy real entropy: its SFT data writes
95% of the answers in one format and 5% in another ("semicolon"), the reward pays only for the rare
one, and the scratchpad varies freely (a space may stand around every '+' and '=': about 0.35 nats
per answer token in the data).

Long-tailed task (the same as `task=longtail`):
      python experiments/train.py --config=configs/default.py:longtail --workdir=runs/longtail
tasks/longtail.py: sums of a heavy-tailed number of terms worked as a running sum, with a rare
rewarded format ("symbols") and spaces as in the arithmetic run; the reference completions' p90 is
over 3x their median, and rows and generation lengths hold the longest one.
"""

from __future__ import annotations

import ml_collections

from specdraft.config import layout_config, parse_arg
from specdraft.tasks.longtail import Longtail

SIZES = {
  # name: (d_model, n_layers, n_heads, n_kv_heads, head_dim, d_ff)
  "micro": (32, 4, 2, 1, 16, 64),
  "tiny": (128, 4, 4, 2, 32, 384),
  "small": (256, 8, 8, 2, 32, 768),
  "bench": (128, 12, 4, 2, 32, 384),  # a dozen layers: a draft pass ~1/10 of a policy pass
  "base": (512, 12, 8, 4, 64, 1536),
}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
  arg = parse_arg(
    arg, size="bench", task="arithmetic", layout="single", smoke=False, seed=0, longtail=False
  )
  if arg.size not in SIZES:
    raise ValueError(f"config arg size={arg.size!r} is unknown; expected one of {sorted(SIZES)}")
  if arg.longtail:
    if arg.task not in ("arithmetic", "longtail"):  # arithmetic: the default, not a choice
      raise ValueError(f"config arg longtail sets task=longtail; it cannot run task={arg.task!r}")
    arg.task = "longtail"
  c = ml_collections.ConfigDict()
  c.seed = arg.seed

  E, L, H, K, D, F = SIZES["micro" if arg.smoke else arg.size]
  c.model = ml_collections.ConfigDict(
    dict(
      d_model=E,
      n_layers=L,
      n_heads=H,
      n_kv_heads=K,
      head_dim=D,
      d_ff=F,
      rope_theta=10000.0,
      norm_eps=1e-6,
      tie_embeddings=True,
      init_std=0.02,
      dtype="float32",
      # A Hugging Face Llama/Qwen2/Qwen3 checkpoint directory to start from: its architecture
      # replaces the fields above (tap_layers and dtype still apply), its weights the random
      # init, and its tokenizer.json the character tokenizer (unless data.tokenizer says
      # otherwise). "" = a fresh policy of the fields above.
      init_from="",
    )
  )
  c.model.tap_layers = ml_collections.FieldReference(None, field_type=tuple)

  c.task = ml_collections.ConfigDict(
    dict(
      name=arg.task,
      seed=1234,
      num_train=20000,
      num_test=256,
      # free_order / space_prob: free variation in the scratchpad (tasks/arithmetic.py)
      arithmetic=dict(
        min_digits=1,
        max_digits=3,
        num_operands=2,
        formats="columns",
        reward_format="",
        free_order=False,
        space_prob=0.0,
      ),
      countdown=dict(num_numbers=3, max_number=20, ops="+-*", use_all=True),
      retrieval=dict(
        num_records=64, key_len=3, value_len=3, hops=1, queries=1, min_records=0, query_end=":"
      ),
      frequency=dict(
        length=512,
        num_symbols=16,
        top_k=5,
        alpha=1.75,
        min_length=0,
        label_noise=0.0,
        semicolon_share=0.0,
      ),
      # a heavy-tailed number of terms (Zipf exponent alpha), worked as a running sum; formats,
      # reward_format, free_order and space_prob as arithmetic's (tasks/longtail.py)
      longtail=dict(
        min_terms=2,
        max_terms=8,
        alpha=1.75,
        min_digits=1,
        max_digits=1,
        first_digits=2,
        formats="columns",
        reward_format="",
        free_order=False,
        space_prob=0.0,
      ),
      jsonl=dict(path=""),
    )
  )

  c.data = ml_collections.ConfigDict(
    dict(
      data_dir="runs/tfds",
      batch_size=32,
      seq_len=64,
      packing=True,
      shuffle_seed=0,
      # "" = the character tokenizer (or model.init_from's tokenizer.json); else a path to a
      # tokenizer.json or its directory. chat_template: prompts as one user turn of the
      # tokenizer's chat template, with its generation prompt.
      tokenizer="",
      chat_template=False,
    )
  )

  c.sft = ml_collections.ConfigDict(
    dict(
      steps=1200, lr=3e-3, warmup_steps=50, weight_decay=0.01, grad_clip=1.0, b2=0.98, log_every=20
    )
  )

  # The draft: kind = eagle3 (TTT steps) | dflash | dspark (a block per anchor: draft.block);
  # 0 for a dimension means "the policy's".
  c.draft = ml_collections.ConfigDict(
    dict(
      kind="eagle3",
      n_heads=0,
      n_kv_heads=0,
      head_dim=0,
      d_ff=0,
      ttt_steps=7,
      ttt_decay=0.8,
      pretrain_steps=300,
      batch_size=32,
      rollout_temperature=1.0,
      # or temperatures cycled over the distillation steps, e.g. (0.0, 1.0): greedy and sampled
      # generations on alternate steps (empty: rollout_temperature every step)
      rollout_temperatures=(),
      lr=3e-3,
      warmup_steps=20,
      weight_decay=0.0,
      grad_clip=1.0,
      b2=0.98,
      log_every=20,
      cotrain_lr=1e-3,
      # EAGLE-3's head over the `vocab_size` most frequent target tokens of the training answers
      # (0: the policy's whole vocabulary); the draft's probability is zero outside them.
      vocab_size=0,
      # ... or those of a JSON list of vocab_size target ids (e.g. the policy's own frequent
      # tokens, as experiments/real_model_sd.py writes them); "" = from the training answers
      vocab_file="",
      # DFlash / DSpark (model/dflash.py): draft layers, block size W (dflash proposes W - 1
      # tokens a round, dspark W; 0: the block that proposes decode.num_draft), loss decay
      # exp(-k / gamma) over the proposals, DSpark's Markov head rank (0: no Markov head, the
      # ablation) and its L1 term's weight. The block's MASK entries embed as a learned vector
      # (mask_token_id = -1) or as the policy's (frozen) embedding row of mask_token_id, and
      # qk_norm adds an RMSNorm over each q and k head (context keys too), as the public DFlash
      # checkpoints (Qwen3 layers) have: both are needed to export a DFlash checkpoint.
      block=dict(
        n_layers=1,
        block_size=0,
        gamma=4.0,
        markov_rank=16,
        l1_weight=0.0,
        mask_token_id=-1,
        qk_norm=False,
        # the anchor slot's residual: "token" (its embedding) or "mask" (the MASK vector; the
        # token enters through the first layer's q/k/v, as EAGLE-3's embedding does); "" = the
        # kind's default (dspark: mask, its anchor slot proposes; dflash: token)
        anchor_residual="",
      ),
    )
  )  # the draft's branch attention follows the layout: the ring over parallel.mesh.cp

  # GRPO with speculative rollouts and the co-training step L = L_RL + lam * L_draft.
  c.rl = ml_collections.ConfigDict(
    dict(
      steps=30,
      prompts_per_step=8,
      group_size=8,
      temperature=1.0,
      top_k=0,  # 0: off
      top_p=1.0,  # 1: off; rollouts and the RL loss's log-probs use the same truncation
      lr=2e-4,
      warmup_steps=0,  # the policy's lr ramps up over these steps (train/step.py)
      grad_clip=1.0,
      b2=0.98,
      weight_decay=0.0,
      advantage="grpo",
      eps_low=0.2,
      eps_high=0.28,
      aggregation="token-mean",
      beta=0.0,
      kl_estimator="k3",
      lam=1.0,
      eval_every=10,
      max_new_tokens=0,
    )
  )  # 0: decode.max_new_tokens
  # Rollout drafts: cotrained (SD, draft trained with the policy) | fixed (SD, frozen draft) |
  # none (autoregressive).
  c.rollout = ml_collections.ConfigDict(dict(draft="cotrained"))

  # Generation length everywhere (RL rollouts may override it) and G, the tokens drafted per SD
  # round. Sampling temperatures live with their use: rl.temperature (rollouts),
  # draft.rollout_temperature (distillation data), eval.sd_temperature (the SD-vs-AR report);
  # held-out accuracy is always greedy.
  #
  # speculation: "fixed" drafts num_draft tokens every round; "auto" chooses G in 0..num_draft
  # before every round from a cost model of a round calibrated on this machine (decode/cost.py,
  # cached under the workdir) and the running per-position acceptance, which starts from
  # prior_rate at prior_weight pseudo rounds and carries from rollout to rollout with weight
  # prior_keep; in a round at G = 0 the draft does not run, and when drafting resumes it takes in
  # the last catch_up_window plain steps (older ones it skips). auto_every: "round" (the above)
  # or "stage": G chosen once per compaction stage before the rollout, each stage the fixed-G
  # loop (at G = 0 the draft still takes in the emitted tokens while a later stage drafts).
  # cost_correction: the round prices carry the calibration's own timed rounds (measured over
  # fitted), not the fit alone; cost_outlier: a timed round at G >= 1 further than this (log
  # ratio) from its row count's robust line in G is taken as a timing outlier and priced by the
  # line (0 = every timed round as measured; decode/cost.py: Correction). price_feedback (with
  # auto_every = stage): each rollout's stages, timed at the host sync that ends each one, scale
  # the next plans' prices at their (rows, G) by measured / priced, shrunk toward 1 by
  # price_prior_rounds pseudo rounds, earlier evidence kept at weight price_keep
  # (decode/cost.py: StagePrices). compact: rollouts gather their unfinished rows into the next
  # power-of-two batch once no more than that many still generate, down to min_rows
  # (decode/engine.py; AR rollouts too; each bucket is a compile).
  c.decode = ml_collections.ConfigDict(
    dict(
      max_new_tokens=40,
      num_draft=5,
      speculation="fixed",
      auto_every="round",
      cost_correction=True,
      cost_outlier=0.1,
      price_feedback=True,
      price_prior_rounds=4.0,
      price_keep=0.7,
      compact=True,
      min_rows=4,
      prior_rate=0.6,
      prior_weight=4.0,
      prior_keep=0.5,
      catch_up_window=8,
    )
  )
  c.eval = ml_collections.ConfigDict(
    dict(every=400, num_examples=256, batch_size=64, sd_temperature=1.0, report_repeats=3)
  )  # report_repeats: timed repeats of the final SD-vs-AR report (0: no report)
  c.checkpoint = ml_collections.ConfigDict(dict(every=400, keep=2))
  # At the end of a run, write the policy as a Hugging Face checkpoint (with the run's tokenizer
  # files) and the draft in its serving format (EAGLE-3 or DFlash) under export.dir/{policy,draft}
  # ("" = no export; a relative path is under the workdir). A finished run given export.dir and
  # run again only exports (every phase resumes as complete).
  c.export = ml_collections.ConfigDict(dict(dir="", dtype="float32"))
  # Training steps (train/sequence.py): attention tiles (query rows and keys per tile), the
  # sequence chunk in which logits are formed (0 = the whole row at once), and per-layer
  # rematerialisation of the policy in the backward pass (saves only each layer's input).
  c.compute = ml_collections.ConfigDict(dict(attn_tile=512, vocab_chunk=256, remat=False))
  # The attention of every training step (the policy's trunk, the cp ring, the draft's branch
  # rows): kernel "xla" (the tiles above, compute.attn_tile) or "pallas" (the fused block of
  # attention/kernels: backend auto | interpret (CPU) | triton (GPU) | mosaic (TPU); block_q /
  # block_k its tiles, 0 = the backend's default; num_warps / num_stages Triton's launch).
  c.attention = ml_collections.ConfigDict(
    dict(kernel="xla", backend="auto", block_q=0, block_k=0, num_warps=4, num_stages=2)
  )
  c.parallel = layout_config(arg.layout)

  if not arg.smoke:  # the run's task and its sizes (see the docstring)
    # free_order (terms in any order) stays off: a 12-layer policy after 700 SFT steps misaligns
    # the operands' digits when they may come in any order; spaces do not change the work
    c.task.arithmetic.update(
      formats="columns:0.95,semicolon:0.05",
      reward_format="semicolon",
      free_order=False,
      space_prob=0.5,
    )
    # a spaced answer has at most 58 characters, then EOS; BOS + prompt + answer + EOS <= 68
    c.decode.max_new_tokens = 60
    c.data.seq_len = 72
    # sized for make run's 20-minute budget (its wall time is a goal of the make_run results)
    c.sft.steps, c.sft.lr = 700, 2e-3
    c.eval.every = 350
    c.draft.pretrain_steps = 120
    c.rl.eval_every = 15
    # K = 3 TTT steps: the draft's loss grows with K and the whole RL step's time feels it
    # (bench_step measures the co-training step against the RL-only step per K)
    c.draft.ttt_steps = 3
    # G = 3 proposals a round, the G that configs/bench_rollout.py:sweep measures fastest at
    # this setting: a longer proposal raises tau by less than its draft passes cost
    c.decode.num_draft = 3
    # a larger step (5e-4) makes the 12-layer policy switch format quickly and then break its
    # arithmetic: too large a step for this depth
    c.rl.lr = 2e-4
  if arg.smoke:
    c.task.num_train, c.task.num_test = 512, 32
    c.task.arithmetic.max_digits = 2
    c.data.batch_size = 8
    c.sft.steps, c.sft.log_every, c.sft.warmup_steps = 12, 4, 2
    c.eval.every, c.eval.num_examples, c.eval.batch_size = 6, 16, 8
    c.checkpoint.every = 6
    c.decode.max_new_tokens = 24
    c.draft.pretrain_steps, c.draft.batch_size, c.draft.log_every = 6, 8, 3
    c.draft.ttt_steps = 3
    c.rl.steps, c.rl.prompts_per_step, c.rl.group_size, c.rl.eval_every = 6, 2, 4, 3
  if arg.task == "longtail":
    _longtail(c, arg.smoke)
  return c


def _longtail(c: ml_collections.ConfigDict, smoke: bool) -> None:
  """The long-tailed task's settings: the format mixture, rewarded format and spaces of the
  arithmetic run (a shorter tail for smoke), and rows and generation lengths that hold its
  longest example, so no completion of the tail is cut short."""
  if smoke:
    c.task.longtail.update(max_terms=4, max_digits=1)
  else:
    # the rare format is "symbols", not the arithmetic run's "semicolon": a two-term answer has
    # one step and no separator, so ';' could not mark it (most prompts could not be paid)
    c.task.longtail.update(
      formats="columns:0.95,symbols:0.05", reward_format="symbols", space_prob=0.5
    )
    # rows of 128 tokens hold the longest example; at 30 tokens an example (arithmetic's: 40),
    # 16 of them take about as many examples a step as the arithmetic run's 32 rows of 72
    c.data.batch_size = 16
  # the tail is where speculation pays: G chosen from the round's measured cost once per
  # compaction stage, each stage the fixed-G loop (cheaper than the adaptive loop's rounds:
  # docs/results.md, bench_rollout:auto), its prices corrected by the rollouts' own stage times;
  # compaction (decode.compact, on by default) in every arm, AR's too
  c.decode.speculation = "auto"
  c.decode.auto_every = "stage"
  task = Longtail(**c.task.longtail)
  answer = task.max_length() - task.max_prompt_length() + 1  # the longest completion, EOS included
  c.decode.max_new_tokens = max(c.decode.max_new_tokens, answer)
  c.data.seq_len = max(c.data.seq_len, -(-(task.max_length() + 2) // 8) * 8)  # BOS, EOS
