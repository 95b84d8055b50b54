"""SD on a briefly trained tiny policy and distilled draft: greedy equality and real acceptance."""

import jax
import numpy as np
import pytest

from specdraft.decode import autoregressive, speculative
from specdraft.tasks import loader
from specdraft.train import loop


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  from configs import default as default_config

  c = default_config.get_config("smoke")
  c.data.data_dir = str(tmp_path_factory.mktemp("tfds"))
  c.parallel.devices = 1
  c.sft.steps, c.sft.lr, c.data.batch_size = 250, 1e-2, 16
  c.draft.pretrain_steps, c.draft.batch_size, c.draft.lr = 80, 16, 1e-2
  c.eval.every = c.checkpoint.every = 1000
  ctx = loop.Context(c, str(tmp_path_factory.mktemp("run")))
  params, _ = loop.sft_phase(ctx)
  dparams, _ = loop.draft_phase(ctx, params)
  return ctx, params, dparams


@pytest.mark.slow
def test_greedy_sd_equals_greedy_ar_token_for_token(trained):
  ctx, params, dparams = trained
  exs = ctx.data.eval_examples[:16]
  prompts, lengths = loader.prompt_batch(exs, ctx.data.tok, ctx.data.prompt_len)
  assert len(set(lengths.tolist())) > 1  # prompts of different lengths
  ar = autoregressive.generate(
    params, ctx.models.pcfg, prompts, lengths, jax.random.key(0), max_new_tokens=24, temperature=0.0
  )
  for G in (1, 3, 5):
    sd = speculative.generate(
      params,
      dparams,
      ctx.models.pcfg,
      ctx.models.dcfg,
      prompts,
      lengths,
      jax.random.key(0),
      max_new_tokens=24,
      temperature=0.0,
      num_draft=G,
    )
    np.testing.assert_array_equal(np.asarray(sd.tokens), np.asarray(ar.tokens))
    np.testing.assert_array_equal(np.asarray(sd.lengths), np.asarray(ar.lengths))
    # Tokens are discrete and asserted exactly; log-probs come from the verification pass (G + 1
    # positions at once) and from one-token decoding, whose float32 sums differ in the last bits:
    # a tolerance that scales with the value, plus an absolute floor for log-probs near 0.
    np.testing.assert_allclose(sd.logprobs, ar.logprobs, rtol=1e-4, atol=1e-4)
    st = jax.device_get(sd.stats)
    assert st["accept_counts"][0] > 0  # the draft is right often enough to be exercised
    assert st["policy_passes"] < int(ar.stats["policy_passes"])


@pytest.mark.slow
def test_distilled_draft_accepts_at_temperature_one(trained):
  ctx, params, dparams = trained
  prompts, lengths = loader.prompt_batch(
    ctx.data.eval_examples[:16], ctx.data.tok, ctx.data.prompt_len
  )
  sd = speculative.generate(
    params,
    dparams,
    ctx.models.pcfg,
    ctx.models.dcfg,
    prompts,
    lengths,
    jax.random.key(1),
    max_new_tokens=24,
    temperature=1.0,
    num_draft=4,
  )
  st = jax.device_get(sd.stats)
  tau = st["tau_sum"] / st["row_rounds"]
  assert tau > 1.5, st
