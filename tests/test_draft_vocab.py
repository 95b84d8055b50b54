"""EAGLE-3 with a reduced draft vocabulary (draft.vocab_size): the head covers the most frequent
target tokens, its TTT loss is the soft cross-entropy to the policy's distribution restricted to
them, and SD with it stays exact (the draft's probability is zero outside its vocabulary)."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from specdraft import config as config_lib
from specdraft import oracles
from specdraft.decode import autoregressive, speculative
from specdraft.model import drafts, eagle3
from specdraft.model import policy as pol
from specdraft.tasks import CharTokenizer
from specdraft.tasks.tokenizer import EOS

V = 40
IDS = tuple(sorted({2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37}))


def _models(ids=IDS):
  pcfg = pol.PolicyConfig(
    vocab_size=V, d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64
  )
  dcfg = eagle3.DraftConfig(
    d_model=32,
    vocab_size=V,
    n_taps=len(pcfg.taps),
    n_heads=2,
    n_kv_heads=1,
    head_dim=16,
    d_ff=48,
    ttt_steps=3,
    init_std=0.2,
    vocab_ids=ids,
  )
  params = pol.init_params(pcfg, 0)
  return pcfg, dcfg, params, eagle3.init_params(dcfg, 1, params, pcfg)


def test_frequent_tokens_keeps_the_most_counted_ids_and_eos():
  rows = [[5, 5, 5, 9, 9, 4], [9, 7, 7, 3]]
  # counts: 9:3, 5:3, 7:2, then 3 and 4 once each (ties to the lower id); EOS forced in
  assert eagle3.frequent_tokens(rows, 12, 3) == (5, 7, 9)
  assert eagle3.frequent_tokens(rows, 12, 4, always=(EOS,)) == (2, 5, 7, 9)
  assert eagle3.frequent_tokens(rows, 12, 5) == (3, 4, 5, 7, 9)
  with pytest.raises(ValueError, match="0 < size <= 12"):
    eagle3.frequent_tokens(rows, 12, 13)


def test_the_head_starts_as_the_policy_columns_and_is_minus_infinity_outside():
  pcfg, dcfg, params, dp = _models()
  assert dp["head"].shape == (32, len(IDS))
  np.testing.assert_array_equal(dp["head"], params["embed"].T[:, np.asarray(IDS)])
  h = jax.random.normal(jax.random.key(0), (2, 3, 32))
  full = eagle3.logits_of(dp, h, dcfg)
  assert full.shape == (2, 3, V)
  outside = np.setdiff1d(np.arange(V), IDS)
  assert np.all(np.isneginf(np.asarray(full)[..., outside]))
  np.testing.assert_array_equal(full[..., np.asarray(IDS)], eagle3.head_logits(dp, h, dcfg))
  bad = ml_collections.ConfigDict(
    dict(kind="eagle3", n_heads=0, n_kv_heads=0, head_dim=0, d_ff=0, ttt_steps=1, ttt_decay=1.0)
  )
  with pytest.raises(ValueError, match="distinct sorted target ids"):
    eagle3.DraftConfig.from_config(bad, pcfg, vocab_ids=(5, 3))


def _assert_same_loss(want_out, got_loss_metrics, g_got, dcfg, rtol):
  """A TTT loss's value, per-step agreement and gradients (relative to their norms) against the
  oracle's ((loss, metrics), grads)."""
  (want, wm), g_want = want_out
  got, gm = got_loss_metrics
  np.testing.assert_allclose(got, want, rtol=rtol)
  for k in range(dcfg.ttt_steps):
    np.testing.assert_allclose(gm[f"ttt_acc_{k}"], wm[f"ttt_acc_{k}"])
  for name in g_got:
    a, b = np.asarray(g_got[name]), np.asarray(g_want[name])
    assert np.linalg.norm(a - b) <= 1e-5 * max(np.linalg.norm(b), 1e-12), name


def test_the_ttt_loss_is_the_loss_over_the_restricted_policy_distribution():
  """Oracle: the same parameters as a full-vocabulary draft over a target vocabulary of just the
  draft's tokens, fed the policy's logits at those ids (value and gradient)."""
  pcfg, dcfg, params, dp = _models()
  B, S = 2, 12
  key = jax.random.key(3)
  tokens = jax.random.randint(key, (B, S), 0, V)
  positions = jnp.tile(jnp.arange(S), (B, 1))
  seg = jnp.ones((B, S), jnp.int32).at[1, 8:].set(2)
  mask = jnp.ones((B, S))
  taps = jax.random.normal(jax.random.key(4), (dcfg.n_taps, B, S, 32))
  policy_logits = 3.0 * jax.random.normal(jax.random.key(5), (B, S, V))
  ids = np.asarray(IDS)
  oracle_cfg = eagle3.DraftConfig(**{**dcfg.__dict__, "vocab_size": V, "vocab_ids": None})

  def loss(d, cfg, logits):
    return oracles.ttt_loss(d, cfg, params["embed"], taps, logits, tokens, positions, seg, mask)

  # jitted: op by op, the TTT loop's backward dispatches (and compiles) every small op
  vg = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (got, gm), g_got = vg(dp, dcfg, policy_logits)
  # the oracle's "target vocabulary" is the draft's: its head [E, N] covers all of it
  _assert_same_loss(vg(dp, oracle_cfg, policy_logits[..., ids]), (got, gm), g_got, dcfg, 1e-6)
  # and it is not the full-vocabulary loss (the restriction matters)
  full_dp = dict(dp, head=params["embed"].T)
  full = jax.jit(loss, static_argnums=1)(full_dp, oracle_cfg, policy_logits)[0]
  assert abs(float(full) - float(got)) > 1e-3


def test_targets_from_the_hidden_state_use_only_the_draft_columns_of_the_head():
  """The training steps give the TTT loss the policy's final hidden state and its head: with a
  reduced vocabulary only the head's columns of the draft's ids are multiplied (the targets need
  no other logits). Value, agreement and gradients equal the loss fed the whole logits."""
  pcfg, dcfg, params, dp = _models()
  B, S = 2, 12
  tokens = jax.random.randint(jax.random.key(3), (B, S), 0, V)
  positions = jnp.tile(jnp.arange(S), (B, 1))
  seg = jnp.ones((B, S), jnp.int32).at[1, 8:].set(2)
  mask = jnp.ones((B, S))
  taps = jax.random.normal(jax.random.key(4), (dcfg.n_taps, B, S, 32))
  h = jax.random.normal(jax.random.key(5), (B, S, 32))
  w = 0.5 * jax.random.normal(jax.random.key(6), (32, V))
  attend = eagle3.attend_by_branch(
    lambda *a: eagle3.branch_attention(*a, seg, branch="ttt", impl="dense")
  )

  def loss(d, x, head):
    return eagle3.ttt_loss_on_shard(
      d, dcfg, params["embed"], taps, x, tokens, positions, seg, mask,
      shift=eagle3.natural_shift, attend=attend, total=jnp.sum, policy_head=head, vocab_chunk=4,
    )  # fmt: skip

  vg = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (got, gm), g_got = vg(dp, h, w)
  _assert_same_loss(vg(dp, jnp.einsum("bse,ev->bsv", h, w), None), (got, gm), g_got, dcfg, 1e-5)


def test_sd_with_a_reduced_draft_is_greedy_exact_and_samples_only_what_the_policy_allows():
  pcfg, dcfg, params, dp = _models()
  B, P = 4, 6
  prompts = jax.random.randint(jax.random.key(7), (B, P), 3, V)
  lengths = jnp.full((B,), P, jnp.int32)
  kw = dict(max_new_tokens=12)
  greedy = dict(kw, temperature=0.0)
  ar = autoregressive.generate(params, pcfg, prompts, lengths, jax.random.key(0), **greedy)
  sd = speculative.generate(
    params, dp, pcfg, dcfg, prompts, lengths, jax.random.key(0), num_draft=3, **greedy
  )
  np.testing.assert_array_equal(ar.tokens, sd.tokens)
  # at T = 1 the draft proposes only its own tokens, and the policy's tokens outside the draft
  # vocabulary still appear (rejection's residual samples them): the target is not truncated
  hot = speculative.generate(
    params,
    dp,
    pcfg,
    dcfg,
    jnp.tile(prompts, (8, 1)),
    jnp.tile(lengths, 8),
    jax.random.key(1),
    num_draft=3,
    temperature=1.0,
    **kw,
  )
  seen = set(np.unique(np.asarray(hot.tokens)).tolist())
  assert seen - set(IDS) - {0}, "no token outside the draft vocabulary was ever sampled"
  assert float(hot.stats["tau_sum"]) / max(int(hot.stats["row_rounds"]), 1) >= 1.0


def test_the_config_field_is_validated_and_needs_the_training_data():
  from configs import default as default_config

  c = default_config.get_config("smoke")
  c.parallel.devices = 1
  c.draft.vocab_size = -1
  with pytest.raises(ValueError, match="config.draft.vocab_size=-1 is invalid"):
    config_lib.validate(c)
  c.draft.vocab_size, c.draft.kind = 16, "dflash"
  with pytest.raises(ValueError, match="a reduced draft vocabulary is an EAGLE-3 option"):
    config_lib.validate(c)
  c.draft.kind = "eagle3"
  pcfg = pol.PolicyConfig.from_config(c.model, CharTokenizer().vocab_size)
  with pytest.raises(ValueError, match="needs the draft's token ids"):
    drafts.draft_config(c.draft, pcfg)
