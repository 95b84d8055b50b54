"""`train.spec.StepSpec`: one frozen value per phase carries every setting the step reads, from
the config or from loose keywords (the steps under it are held to the oracles in
test_sequence.py, test_pipeline.py, test_block_drafts.py and test_grpo_cotrain.py)."""

import dataclasses

import pytest

from configs import default as default_config
from specdraft.decode.sampling import Sampling
from specdraft.train.spec import Compute, RLLoss, StepSpec


def test_from_config_carries_every_setting_of_the_phase():
  c = default_config.get_config("smoke")
  c.rl.update(
    temperature=0.7, top_k=5, top_p=0.9, eps_low=0.1, eps_high=0.3, beta=0.05, lam=0.5,
    aggregation="sequence-mean-token-scale", kl_estimator="k1", max_new_tokens=0,
  )  # fmt: skip
  c.decode.max_new_tokens = 20
  c.rollout.draft = "fixed"  # the draft does not train in this run's RL step
  c.compute.update(vocab_chunk=64, attn_tile=32, remat=True)
  rl = StepSpec.from_config(c, "rl", pcfg="P", dcfg="D", tx="T", mesh="M", pipeline="PP")
  assert rl.rl == RLLoss(
    eps_low=0.1, eps_high=0.3, aggregation="sequence-mean-token-scale", beta=0.05,
    kl_estimator="k1", sampling=Sampling(0.7, 5, 0.9), lam=0.5, train_draft=False, max_tokens=20,
  )  # fmt: skip
  assert rl.compute == Compute(vocab_chunk=64, attn_tile=32, remat=True, attn_kernel=None)
  assert (rl.pcfg, rl.dcfg, rl.tx, rl.mesh, rl.pipeline) == ("P", "D", "T", "M", "PP")
  assert rl.stop_tap_gradient
  c.rl.max_new_tokens = 12  # the aggregation's budget: rl.max_new_tokens when set
  assert StepSpec.from_config(c, "rl", pcfg="P").rl.max_tokens == 12
  sft = StepSpec.from_config(c, "sft", pcfg="P", dcfg="D", tx="T")
  assert sft.dcfg is None and sft.rl is None and sft.compute == rl.compute
  draft = StepSpec.from_config(c, "draft", pcfg="P", dcfg="D", tx="T")
  assert draft.dcfg == "D" and draft.rl is None
  with pytest.raises(ValueError, match=r"phase='eval': expected one of"):
    StepSpec.from_config(c, "eval", pcfg="P")
  with pytest.raises(dataclasses.FrozenInstanceError):
    rl.tx = None


def test_of_takes_the_loose_settings_and_keeps_a_traced_lam():
  c = default_config.get_config("smoke")
  s = StepSpec.of("P", "D", c.rl, lam=0.25, train_draft=False, max_tokens=9, vocab_chunk=8)
  assert s.rl.lam == 0.25 and not s.rl.train_draft and s.rl.max_tokens == 9
  assert s.compute.vocab_chunk == 8 and s.compute.attn_tile == 512
  assert StepSpec.of("P", "D", c.rl).rl.lam == float(c.rl.lam)  # rl.lam by default
  assert StepSpec.of("P").rl is None
  marker = object()  # a traced scalar stands where the float would (one program, several lam)
  assert StepSpec.of("P", "D", c.rl, lam=marker).rl.lam is marker
  assert s.replace(mesh="M").mesh == "M" and s.mesh is None
  k = StepSpec.of(
    "P", stop_tap_gradient=False, pipeline="PP", remat=True, attn_tile=16, attn_kernel="K"
  )
  assert not k.stop_tap_gradient and k.pipeline == "PP"
  assert k.compute == Compute(vocab_chunk=0, attn_tile=16, remat=True, attn_kernel="K")
