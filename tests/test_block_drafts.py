"""DFlash and DSpark block drafts: what a block sees, the loss against its natural-order oracle
(one device, and under context parallelism through the ring), train/inference consistency of the
block pass, and the co-training contract (no cross-gradients, lambda = 0 is RL-only)."""

import dataclasses

import _tolerance as tol
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_speculative import _two_sample_pvalue, assert_behaviour_logprobs, broken_rejection_sample

from configs import default as default_config
from specdraft import oracles
from specdraft.decode import autoregressive, speculative
from specdraft.model import dflash, drafts
from specdraft.model import policy as pol
from specdraft.parallel import mesh as mesh_lib
from specdraft.train import draft as draft_lib
from specdraft.train import sequence
from specdraft.train import step as step_lib
from specdraft.train.spec import StepSpec

KINDS = ("dflash", "dspark")
# `make test` runs every test for DFlash; the DSpark variants (the same code plus the Markov head)
# run in `make test-slow` (CI runs both), as do the greedy and inference-pass tests of both kinds.
KIND_PARAMS = ["dflash", pytest.param("dspark", marks=pytest.mark.slow)]


def _batch(B=4, S=24, V=99, seed=0):
  """Rollout-like rows [prompt ; completion ; padding]; row 3 packs two documents."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, V, (B, S)).astype(np.int32)
  lengths = np.array([S, S - 5, S - 9, S - 2])[:B]
  seg = (np.arange(S)[None] < lengths[:, None]).astype(np.int32)
  seg[3, 10:] = np.where(seg[3, 10:] > 0, 2, 0)
  positions = np.zeros((B, S), np.int32)
  for b in range(B):
    for s in np.unique(seg[b][seg[b] > 0]):
      idx = np.where(seg[b] == s)[0]
      positions[b, idx] = np.arange(len(idx))
  mask = (seg > 0) & (positions >= 4)
  return {
    "tokens": tokens,
    "positions": positions,
    "segment_ids": seg,
    "loss_mask": mask.astype(np.float32),
    "logprobs": (np.log(rng.uniform(0.01, 0.2, (B, S))) * mask).astype(np.float32),
    "advantages": np.asarray([1.0, -0.5, 0.3, -0.8][:B], np.float32),
  }


def _setup(kind, block_size=4, n_layers=2):
  """DFlash with the options of the public DFlash checkpoints (MASK = the policy's embedding row
  of a token id, q/k norms with non-trivial weights); DSpark with a learned MASK vector."""
  c = default_config.get_config("smoke")
  c.model.n_kv_heads = 2
  c.draft.kind = kind
  c.draft.block.update(block_size=block_size, n_layers=n_layers, markov_rank=8, l1_weight=0.5)
  if kind == "dflash":
    c.draft.block.update(mask_token_id=4, qk_norm=True)
  pcfg = pol.PolicyConfig.from_config(c.model, 99)
  dcfg = drafts.draft_config(c.draft, pcfg)
  params = pol.init_params(pcfg, 0)
  dparams = drafts.init_params(dcfg, 1, params, pcfg)
  if dcfg.qk_norm:
    for i, name in enumerate(("q_norm", "k_norm")):
      w = dparams["layers"][name]
      dparams["layers"][name] = w + 0.3 * jax.random.normal(jax.random.key(7 + i), w.shape)
  if kind == "dspark":  # a live Markov head (it starts at zero)
    dparams["markov_out"] = 0.3 * jax.random.normal(jax.random.key(5), dparams["markov_out"].shape)
  return c, pcfg, dcfg, {"policy": params, "draft": dparams}


@pytest.fixture(scope="module", params=KIND_PARAMS)
def setup(request):
  return _setup(request.param)


def test_block_sees_only_the_context_before_its_anchor(setup):
  """Changing tokens and taps at and after position t + 1 (and taps at t) leaves the blocks
  anchored at positions <= t unchanged; changing another document changes nothing of this one."""
  _, pcfg, dcfg, tr = setup
  batch = {k: jnp.asarray(v) for k, v in _batch().items()}
  rng = np.random.default_rng(3)
  taps = jnp.asarray(rng.normal(size=(len(pcfg.taps), 4, 24, pcfg.d_model)), jnp.float32)
  attend = dflash.attend_dense(batch["segment_ids"])
  hidden = lambda tok, tp: dflash.block_hidden(
    tr["draft"], dcfg, tr["policy"]["embed"], tp, tok, batch["positions"], attend=attend
  )
  h0 = hidden(batch["tokens"], taps)
  t = 9
  tok2 = batch["tokens"].at[:, t + 1 :].set(5)
  taps2 = taps.at[:, :, t:].set(1.0)
  h1 = hidden(tok2, taps2)
  np.testing.assert_allclose(h1[:, : t + 1], h0[:, : t + 1], rtol=1e-6, atol=1e-6)
  assert not np.allclose(h1[:, t + 1 :], h0[:, t + 1 :])
  # the taps at t itself are context only for anchors after t
  h2 = hidden(batch["tokens"], taps.at[:, :, t].set(-2.0))
  np.testing.assert_allclose(h2[:, : t + 1], h0[:, : t + 1], rtol=1e-6, atol=1e-6)
  assert not np.allclose(h2[:, t + 1], h0[:, t + 1])
  # row 3 packs a second document from position 10: the first one never sees it
  h3 = hidden(batch["tokens"].at[3, 10:].set(7), taps.at[:, 3, 10:].set(3.0))
  np.testing.assert_allclose(h3[3, :10], h0[3, :10], rtol=1e-6, atol=1e-6)


def test_targets_and_weights_by_hand():
  """Proposal g at anchor t is scored against the policy's distribution at t + g (the one over
  x_{t+1+g}), weighted by exp(-g / gamma) and by x_{t+1+g} being a completion token of t's
  document: a one-hot target at one position moves exactly the expected terms."""
  _, pcfg, dcfg, tr = _setup("dflash", block_size=3, n_layers=1)
  B, S, V = 1, 8, 99
  tokens = jnp.arange(3, 3 + S, dtype=jnp.int32)[None]
  pos = jnp.arange(S, dtype=jnp.int32)[None]
  seg = jnp.ones((B, S), jnp.int32)
  mask = (pos >= 5).astype(jnp.float32)  # completion tokens x_5 .. x_7
  taps = jnp.zeros((len(pcfg.taps), B, S, pcfg.d_model))
  logits = jnp.zeros((B, S, V))

  @jax.jit
  def loss(logits):
    return oracles.block_loss(
      tr["draft"], dcfg, tr["policy"]["embed"], pol.head_weight(tr["policy"], pcfg), taps,
      logits, tokens, pos, seg, mask,
    )  # fmt: skip

  _, m = loss(logits)
  assert set(m) == {"draft_loss", "ttt_acc_0", "ttt_acc_1"}
  # d(loss)/d(policy logits) is zero: the targets are under stop_gradient
  g = jax.grad(lambda z: loss(z)[0])(logits)
  assert float(jnp.abs(g).max()) == 0.0
  # proposal 0 at anchors 4, 5, 6 (targets x_5, x_6, x_7 at positions 4, 5, 6); proposal 1 at
  # anchors 3, 4, 5 (targets x_5 .. x_7 at positions 4 .. 6): only positions 4..6 matter
  base = loss(logits)[0]
  for p in range(S):
    moved = loss(logits.at[0, p, 10].set(30.0))[0]
    assert (abs(float(moved - base)) > 1e-4) == (4 <= p <= 6), p


def _draft_loss(dcfg, pcfg, tr, b, mesh=None):
  spec = StepSpec.of(pcfg, dcfg, mesh=mesh, vocab_chunk=8)
  loss = lambda d, p: draft_lib.draft_loss(d, p, b, spec)
  return jax.device_get(
    jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(tr["draft"], tr["policy"])
  )


def _mesh(layout):
  c = default_config.get_config(f"smoke,layout={layout}")
  c.parallel.devices = int(np.prod(list(c.parallel.mesh.values())))
  return mesh_lib.make_mesh(c.parallel), [tuple(r) for r in c.parallel.rules]


def test_distillation_loss_on_shards_equals_the_dense_oracle(setup):
  """cp = 1 shards (tiled trunk, ring code path with no collectives) against natural-order rows
  through the dense branch-attention oracle, in value and gradient."""
  _, pcfg, dcfg, tr = setup
  batch = _batch()
  nat = {k: jnp.asarray(v) for k, v in batch.items()}

  def oracle(d):
    logits, taps = pol.forward(
      tr["policy"], pcfg, nat["tokens"], nat["positions"], nat["segment_ids"], attention="dense"
    )
    return oracles.draft_loss(d, dcfg, tr["policy"], pcfg, taps.layers, logits, nat)

  (l0, m0), g0 = jax.jit(jax.value_and_grad(oracle, has_aux=True))(tr["draft"])
  (l1, m1), (g1, gp1) = _draft_loss(dcfg, pcfg, tr, sequence.zigzag_order(batch, 1))
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  for k in m0:
    np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-7, err_msg=k)
  tol.assert_grads_close(g1, g0, rtol=1e-5)
  assert all(float(np.abs(x).max()) == 0 for x in jax.tree.leaves(gp1))  # nothing reaches theta


@pytest.mark.parametrize("layout", ["cp4_dp2", pytest.param("cp8", marks=pytest.mark.slow)])
def test_distillation_loss_under_cp_equals_single_device(setup, layout):
  """The block loss under the ring (block queries ride the trunk ring, block keys stay local;
  rows of 24 tokens padded to 32 at cp = 8) equals cp = 1 in value and gradient."""
  _, pcfg, dcfg, tr = setup
  batch = _batch()
  mesh, rules = _mesh(layout)
  cp = mesh.shape["cp"]
  (l1, m1), (g1, _) = _draft_loss(dcfg, pcfg, tr, sequence.zigzag_order(batch, 1))
  laid = sequence.shard(sequence.zigzag_order(batch, cp), mesh, rules)
  (l2, m2), (g2, gp2) = _draft_loss(dcfg, pcfg, tr, laid, mesh)
  np.testing.assert_allclose(l2, l1, rtol=1e-5)
  for k in m1:
    np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
  tol.assert_grads_close(g2, g1, rtol=1e-5, err=f"{layout} ")
  assert all(float(np.abs(x).max()) == 0 for x in jax.tree.leaves(gp2))


def test_cotrain_step_contract(setup):
  """One policy forward: the draft loss sends no gradient to theta and the RL loss none to phi;
  with lambda = 0 the policy's update is bit-identical to the RL-only step's."""
  c, pcfg, dcfg, tr = setup
  laid = sequence.zigzag_order(_batch(), 1)

  def loss(tr, lam, train_draft=True, part=None):
    spec = StepSpec.of(
      pcfg, dcfg, c.rl, lam=lam, train_draft=train_draft, max_tokens=24, vocab_chunk=8
    )
    total, m = step_lib.cotrain_loss(tr, laid, spec)
    return {"total": total, "draft": m["draft_loss"] if train_draft else 0.0}[part], m

  grad = lambda f: jax.jit(jax.grad(f, has_aux=True))(tr)[0]
  g_draft = grad(lambda t: loss(t, 1.0, part="draft"))
  assert all(float(np.abs(x).max()) == 0 for x in jax.tree.leaves(g_draft["policy"]))
  assert any(float(np.abs(x).max()) > 0 for x in jax.tree.leaves(g_draft["draft"]))
  g_rl_only = grad(lambda t: loss(t, 0.0, False, part="total"))
  assert all(float(np.abs(x).max()) == 0 for x in jax.tree.leaves(g_rl_only["draft"]))
  g_lam0 = grad(lambda t: loss(t, 0.0, True, part="total"))
  for a, b in zip(jax.tree.leaves(g_lam0["policy"]), jax.tree.leaves(g_rl_only["policy"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_config_errors_name_the_field():
  from specdraft import config as config_lib

  c = default_config.get_config("smoke")
  c.parallel.devices = 1
  c.draft.kind = "medusa"
  with pytest.raises(ValueError, match=r"draft\.kind='medusa'.*eagle3"):
    config_lib.validate(c)
  c.draft.kind = "dflash"
  c.draft.block.block_size = 1
  with pytest.raises(ValueError, match=r"draft\.block\.block_size=1"):
    config_lib.validate(c)
  c.draft.block.block_size = 0  # the block that proposes decode.num_draft tokens
  config_lib.validate(c)
  c.draft.block.block_size = 4
  c.decode.num_draft = 4  # dflash proposes block_size - 1 = 3
  with pytest.raises(ValueError, match=r"decode\.num_draft=4.*<= 3"):
    config_lib.validate(c)
  c.decode.num_draft = 3
  c.draft.block.mask_token_id = 99  # the smoke policy's vocabulary is the char tokenizer's
  with pytest.raises(ValueError, match=r"draft\.block\.mask_token_id=99.*\[0, \d+\)"):
    config_lib.validate(c)
  c.draft.block.mask_token_id = -1
  c.decode.num_draft = 4
  c.draft.kind = "dspark"  # dspark proposes block_size = 4
  config_lib.validate(c)
  # the benchmarks that build EAGLE-3 drafts directly refuse another kind instead of ignoring it
  from specdraft.model import eagle3

  pcfg = pol.PolicyConfig.from_config(c.model, 99)
  with pytest.raises(ValueError, match=r"draft\.kind='dspark'.*EAGLE-3 draft only"):
    eagle3.DraftConfig.from_config(c.draft, pcfg)
  c.draft.block.block_size, c.decode.num_draft = 1, 1  # one proposal: a valid dspark block
  config_lib.validate(c)
  c.draft.block.block_size = -1
  with pytest.raises(ValueError, match=r"draft\.block\.block_size=-1.*>= 1 for dspark"):
    config_lib.validate(c)


# ----------------------------------------------------------------------------- drafting


def test_block_pass_at_inference_equals_the_training_block(setup):
  """The decoding path (context written into the draft's cache from the policy's taps, cache
  length n, one block pass anchored at n) gives the hidden states the training path computes for
  the block anchored at n, with anchors differing per row (n = 0: no context at all)."""
  _assert_inference_block_equals_training(*setup[1:])


def _assert_inference_block_equals_training(pcfg, dcfg, tr):
  B, S = 2, 12
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(3, 99, (B, S)), jnp.int32)
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  seg = jnp.ones((B, S), jnp.int32)
  taps = jnp.asarray(rng.normal(size=(len(pcfg.taps), B, S, pcfg.d_model)), jnp.float32)
  embed = tr["policy"]["embed"]
  train_h = dflash.block_hidden(
    tr["draft"], dcfg, embed, taps, tokens, pos, attend=dflash.attend_dense(seg)
  )

  @jax.jit
  def block_at(n_B):
    # every position's context is written; entries at and past the lengths n must go unread
    cache = dflash.init_cache(dcfg, B, S + dcfg.block_size)
    cache = dflash.write_context(tr["draft"], dcfg, cache, taps, jnp.zeros((B,), jnp.int32), n_B)
    anchor = jnp.take_along_axis(tokens, n_B[:, None], 1)[:, 0]
    return dflash.propose_hidden(tr["draft"], dcfg, embed, cache, anchor)

  for n in ((1, 5), (11, 0)):  # one anchor per row
    h = block_at(jnp.asarray(n, jnp.int32))
    for b in range(B):
      np.testing.assert_allclose(
        h[b], train_h[b, n[b]], rtol=1e-5, atol=1e-5, err_msg=f"row {b} anchor {n[b]}"
      )


def test_anchor_residual_mask_starts_the_anchor_slot_at_the_mask_vector():
  """`anchor_residual="mask"`: with the layer's outputs zeroed the anchor slot's hidden state is
  the MASK vector ("token": the anchor's embedding), its token still reaches the block through
  the first layer's keys and values, and the inference pass equals the training pass."""
  c, pcfg, _, tr = _setup("dspark", n_layers=1)
  c.draft.block.anchor_residual = "mask"
  dcfg = drafts.draft_config(c.draft, pcfg)
  B, S = 1, 6
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.integers(3, 99, (B, S)), jnp.int32)
  pos = jnp.arange(S, dtype=jnp.int32)[None]
  seg = jnp.ones((B, S), jnp.int32)
  taps = jnp.asarray(rng.normal(size=(len(pcfg.taps), B, S, pcfg.d_model)), jnp.float32)
  embed = tr["policy"]["embed"]
  hidden = lambda cfg, dp, t: dflash.block_hidden(
    dp, cfg, embed, taps, t, pos, attend=dflash.attend_dense(seg)
  )
  silent = dict(tr["draft"], layers=dict(tr["draft"]["layers"]))
  for k in ("wo", "w_down"):
    silent["layers"][k] = jnp.zeros_like(silent["layers"][k])
  mask_h = hidden(dcfg, silent, tokens)[0, :, 0]
  np.testing.assert_allclose(mask_h, np.broadcast_to(silent["mask_embed"], mask_h.shape))
  token_cfg = dataclasses.replace(dcfg, anchor_residual="token")
  np.testing.assert_allclose(hidden(token_cfg, silent, tokens)[0, :, 0], embed[tokens[0]])
  # the anchor token still matters, through attention: another token changes every slot
  other = tokens.at[0, 2].set((tokens[0, 2] + 1 - 3) % 96 + 3)
  h, h2 = hidden(dcfg, tr["draft"], tokens), hidden(dcfg, tr["draft"], other)
  assert np.all(np.abs(np.asarray(h2[0, 2] - h[0, 2])).max(-1) > 1e-4)
  np.testing.assert_array_equal(h2[0, :2], h[0, :2])  # earlier anchors do not see it
  _assert_inference_block_equals_training(pcfg, dcfg, tr)
  with pytest.raises(ValueError, match=r"anchor_residual='both'"):
    dataclasses.replace(dcfg, anchor_residual="both")
  c.draft.block.anchor_residual = "both"
  from specdraft import config as config_lib

  with pytest.raises(ValueError, match=r"draft\.block\.anchor_residual"):
    config_lib.validate(c)


def _decode_models(kind):
  """A spread-out policy and a block draft whose proposals are accepted often but not always."""
  V = 6
  pcfg = pol.PolicyConfig(
    vocab_size=V, d_model=32, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64,
    init_std=0.3, tie_embeddings=False,
  )  # fmt: skip
  dcfg = dflash.BlockDraftConfig(
    kind=kind, d_model=32, vocab_size=V, n_taps=len(pcfg.taps), n_heads=2, n_kv_heads=1,
    head_dim=16, d_ff=64, block_size=3 if kind == "dflash" else 2, markov_rank=4, init_std=0.3,
  )  # fmt: skip
  params = pol.init_params(pcfg, 4)
  params["head"] = jax.random.normal(jax.random.key(9), params["head"].shape) * 0.3
  dparams = dflash.init_params(dcfg, 5, params, pcfg)
  if kind == "dspark":
    dparams["markov_out"] = 0.5 * jax.random.normal(jax.random.key(6), dparams["markov_out"].shape)
  return pcfg, dcfg, params, dparams


def _decode_setup(kind):
  pcfg, dcfg, params, dparams = _decode_models(kind)
  B = 12_000
  prompts = jnp.broadcast_to(jnp.array([1, 4, 5], jnp.int32), (B, 3))
  lengths = jnp.full((B,), 3, jnp.int32)
  ar = autoregressive.generate(
    params, pcfg, prompts, lengths, jax.random.key(0), max_new_tokens=3, temperature=1.0
  )
  return pcfg, dcfg, params, dparams, prompts, lengths, ar


@pytest.fixture(scope="module", params=KIND_PARAMS)
def decode_setup(request):
  return _decode_setup(request.param)


def _sd(decode_setup, key, **kw):
  pcfg, dcfg, params, dparams, prompts, lengths, _ = decode_setup
  kw = dict(dict(max_new_tokens=3, temperature=1.0, num_draft=2), **kw)
  return speculative.generate(params, dparams, pcfg, dcfg, prompts, lengths, key, **kw)


def test_block_sd_samples_the_policy_distribution(decode_setup):
  """Two-sample test of SD rows against AR rows (both acceptance and rejection exercised), and
  the broken sampler (resampling from p after a rejection) as the control it must catch."""
  ar = decode_setup[-1]
  sd = _sd(decode_setup, jax.random.key(1))
  st = jax.device_get(sd.stats)
  for g in range(2):
    rate = st["accept_counts"][g] / st["reach_counts"][g]
    assert 0.1 < rate < 0.95, (g, rate)
  assert int(st["draft_passes"]) == int(st["rounds"])  # one block pass a round
  assert _two_sample_pvalue(ar.tokens, sd.tokens) > 1e-3
  bad = _sd(decode_setup, jax.random.key(1), sampler=broken_rejection_sample)
  assert _two_sample_pvalue(ar.tokens, bad.tokens) < 1e-6


def test_block_sd_under_truncated_sampling_and_its_logprobs(decode_setup):
  """Temperature, top-k and top-p together: SD and AR sample one distribution, and the behaviour
  log-probs are of it (recomputed from a full forward)."""

  pcfg, dcfg, params, dparams, prompts, lengths, _ = decode_setup
  setting = (1.3, 4, 0.9)
  kw = dict(max_new_tokens=3, temperature=setting[0], top_k=setting[1], top_p=setting[2])
  ar = autoregressive.generate(params, pcfg, prompts, lengths, jax.random.key(2), **kw)
  sd = _sd(decode_setup, jax.random.key(3), **kw)
  assert _two_sample_pvalue(ar.tokens, sd.tokens) > 1e-3
  assert_behaviour_logprobs(params, pcfg, prompts, lengths, sd, setting)


def test_block_sd_refuses_more_proposals_than_the_block_holds(decode_setup):
  dcfg = decode_setup[1]
  with pytest.raises(ValueError, match=rf"num_draft={dcfg.num_proposals + 1}.*at most"):
    _sd(decode_setup, jax.random.key(0), num_draft=dcfg.num_proposals + 1)


def test_dspark_without_its_markov_head_is_the_zero_head():
  """markov_rank = 0 (the ablation) drops the Markov parameters; with the same backbone it equals
  DSpark whose head is zero: the loss in value and in the shared parameters' gradients, and SD
  rollouts token for token (the parallel proposal path against the serial Markov walk)."""
  import dataclasses

  pcfg, dcfg, params, dparams = _decode_models("dspark")
  zero = dict(dparams, markov_out=jnp.zeros_like(dparams["markov_out"]))
  dcfg0 = dataclasses.replace(dcfg, markov_rank=0)
  assert dcfg0.kind == "dspark" and not dcfg0.has_markov and dcfg.has_markov
  bare = dflash.init_params(dcfg0, 5, params, pcfg)
  assert set(bare) == set(dparams) - {"markov_in", "markov_out"}
  bare = {k: dparams[k] for k in bare}  # the same backbone
  prompts = jnp.broadcast_to(jnp.array([1, 4, 5], jnp.int32), (64, 3))
  lengths = jnp.full((64,), 3, jnp.int32)
  kw = dict(max_new_tokens=4, temperature=1.0, num_draft=2)
  gen = lambda dp, cfg: speculative.generate(
    params, dp, pcfg, cfg, prompts, lengths, jax.random.key(4), **kw
  )
  a, b = gen(zero, dcfg), gen(bare, dcfg0)
  np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
  np.testing.assert_array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
  st = jax.device_get(a.stats)
  assert 0 < st["accept_counts"][0] < st["reach_counts"][0]  # accepts and rejects both happen

  nat = {k: jnp.asarray(v) for k, v in _batch(V=pcfg.vocab_size).items()}
  logits, taps = pol.forward(
    params, pcfg, nat["tokens"], nat["positions"], nat["segment_ids"], attention="dense"
  )
  loss = lambda dp, cfg: oracles.draft_loss(dp, cfg, params, pcfg, taps.layers, logits, nat)[0]

  vg = jax.jit(jax.value_and_grad(loss), static_argnums=1)  # op by op it is ~20 s more
  (la, ga), (lb, gb) = vg(zero, dcfg), vg(bare, dcfg0)
  np.testing.assert_allclose(float(la), float(lb), rtol=1e-6)
  tol.assert_grads_close({k: ga[k] for k in gb}, gb, rtol=1e-5)


@pytest.mark.slow  # two smoke runs (~3 min); `make test-slow` (and CI) run it
def test_block_draft_run_resumes_exactly(smoke_config, tmp_path):
  """The whole run (SFT, distillation, co-trained RL with block-draft rollouts, the SD report)
  with a DSpark draft proposing decode.num_draft tokens; stopped after RL step 3 and resumed from
  its checkpoints, it writes the same RL metrics as the uninterrupted run."""
  import json
  import os

  from specdraft.train import loop

  c = smoke_config
  c.draft.kind = "dspark"
  c.checkpoint.every = 3
  full = str(tmp_path / "full")
  summary = loop.train_and_evaluate(c, full)
  assert summary["rollout"]["num_draft"] == c.decode.num_draft
  assert summary["rollout"]["greedy_equal"]
  # and decoded as the run decodes (finished rows compacted away in both arms)
  assert summary["rollout"]["as_run"]["engine"]["compact"]
  assert summary["rollout"]["as_run"]["greedy_equal"]
  part = str(tmp_path / "part")
  loop.train_and_evaluate(c, part, stop_after=("rl", 3))
  loop.train_and_evaluate(c, part)
  timing = {"rollout_seconds", "train_seconds", "seconds_per_step"}

  def read(wd):
    with open(os.path.join(wd, "metrics.jsonl")) as f:
      rows = [json.loads(ln) for ln in f if ln.strip()]
    return [{k: v for k, v in r.items() if k not in timing} for r in rows]

  a, b = read(full), read(part)
  assert [r["step"] for r in b] == list(range(1, c.rl.steps + 1))
  assert a == b
  assert all(r["accept_len"] > 1.0 for r in a)  # the block draft's proposals were accepted


@pytest.mark.slow  # one SFT, three distillations and the timing at smoke size (~3 min)
def test_drafts_benchmark_smoke_and_its_readme_section(tmp_path):
  """experiments/bench_drafts.py at smoke size: every kind distilled from one SFT policy and timed
  against one AR baseline at the same G; the goals evaluate and the README section renders."""
  from configs import bench_drafts
  from experiments import results_doc as readme
  from experiments.bench import drafts as bench

  c = bench_drafts.get_config("smoke")
  c.data.data_dir = str(tmp_path / "tfds")
  c.parallel.devices = 1
  out = bench.run(c, str(tmp_path / "bd"))
  assert [r["batch"] for r in out["rows"]] == list(c.bench.batch_sizes)
  for r in out["rows"]:
    assert set(r["by_draft"]) == set(c.bench.kinds)
    ar = {d["ar_tokens_per_s"] for d in r["by_draft"].values()}
    assert len(ar) == 1  # one AR baseline for every draft
    for d in r["by_draft"].values():
      assert 1.0 <= d["tau"] <= c.bench.num_draft + 1 and d["greedy_equal"]
      assert len(d["accept_per_position"]) == c.bench.num_draft
  assert set(out["goals"]) == {"dflash_tau", "dflash_speedup", "markov_head", "greedy_equal"}
  assert out["goals"]["greedy_equal"]["met"]
  text = readme.drafts_compare(out)
  assert "DFlash with blocks of 4" in text and "| batch | eagle3 speedup" in text


@pytest.mark.slow  # a pipelined, context-parallel step against the single device (~1 min)
def test_cotrain_step_on_the_last_pipeline_stage_equals_single_device():
  """pp2_cp2_dp2: the policy as a pipeline whose stages attend through the ring, the taps on the
  TapChannel to the last stage, the DFlash loss on that stage's sequence shards: the whole
  co-training loss and its gradients equal the single-device step."""
  from specdraft.model import pipelined

  c, pcfg, dcfg, tr = _setup("dflash")
  batch = _batch()
  mesh, rules = _mesh("pp2_cp2_dp2")
  spec = pipelined.PipelineSpec(microbatches=2, tap_mode="direct", remat=True)

  def value_and_grad(b, mesh=None, pipeline=None):
    spec = StepSpec.of(
      pcfg, dcfg, c.rl, lam=1.0, mesh=mesh, pipeline=pipeline, max_tokens=24, vocab_chunk=8
    )
    loss = lambda t: step_lib.cotrain_loss(t, b, spec)
    return jax.device_get(jax.jit(jax.value_and_grad(loss, has_aux=True))(tr))

  (l1, m1), g1 = value_and_grad(sequence.zigzag_order(batch, 1))
  laid = sequence.shard(sequence.zigzag_order(batch, 2), mesh, rules)
  (l2, m2), g2 = value_and_grad(laid, mesh, spec)
  np.testing.assert_allclose(l2, l1, rtol=1e-5)
  for k in ("draft_loss", "ttt_acc_0", "ttt_acc_1", "ttt_acc_2"):
    np.testing.assert_allclose(m2[k], m1[k], rtol=1e-5, atol=1e-7, err_msg=k)
  tol.assert_grads_close(g2, g1, rtol=1e-5, err="pp2_cp2_dp2 ")


def test_benchmark_entries_name_a_kind_and_optional_block_overrides():
  """configs/bench_drafts.py:markov compares DSpark with and without its Markov head; an entry is
  a kind with draft.block overrides, and a bad one fails naming it."""
  from configs import bench_drafts
  from experiments.bench import drafts as bench

  c = bench_drafts.get_config("markov,smoke")
  assert bench.NO_MARKOV in c.bench.kinds and "markov_head_isolated" in c.bench.goals
  block = c.draft.block
  assert bench.parse_variant("dspark:markov_rank=0", block) == ("dspark", {"markov_rank": 0})
  assert bench.parse_variant("dflash:gamma=7,n_layers=2", block) == (
    "dflash",
    {"gamma": 7.0, "n_layers": 2},
  )
  assert bench.parse_variant("eagle3", block) == ("eagle3", {})
  for bad in ("medusa", "eagle3:gamma=2", "dspark:rank=0", "dspark:markov_rank"):
    with pytest.raises(ValueError, match="config.bench.kinds has"):
      bench.parse_variant(bad, block)
  rows = [
    {"by_draft": {k: {"tau": t, "greedy_equal": True, "speedup": 1.0} for k, t in taus.items()}}
    for taus in ({"dspark": 3.0, bench.NO_MARKOV: 2.0}, {"dspark": 2.0, bench.NO_MARKOV: 2.0})
  ]
  out = bench.over_batches(rows, ["dspark", bench.NO_MARKOV])
  assert out["dspark_over_no_markov_tau"] == pytest.approx(2.5 / 2.0)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_bench_step_cotraining_adds_only_the_block_drafts_matmul_work(kind):
  """bench_step's cases name a kind; for a block draft the co-training step's compiled matmul
  FLOPs are at most RL-only's plus the draft loss's alone (the step shares the policy's
  logits with the draft's targets) and not less than 95% of that sum (no draft work dropped)."""
  from configs import bench_step
  from experiments.bench import hlo, step_time

  c = bench_step.get_config("drafts")
  assert [case[2] for case in c.bench_step.cases] == ["eagle3", "dflash", "dspark"] * 2
  assert "by_case.L32_dspark_G7.ratio_over_bound" in {g.metric for g in c.bench_step.goals.values()}
  with pytest.raises(ValueError, match=r"cases: \(12, 7, 'medusa'\) is invalid"):
    step_time.check_cases(((12, 7, "medusa"),))
  c = bench_step.get_config("drafts,smoke")
  c.draft.kind, c.draft.block.block_size = kind, 0
  pcfg = pol.PolicyConfig.from_config(c.model, 99)
  dcfg = drafts.draft_config(c.draft, pcfg, num_draft=2)
  batch = sequence.zigzag_order(step_time.synthetic_batch(4, 16, pcfg.vocab_size), 1)
  batch = jax.tree.map(jnp.asarray, batch)
  fns, args = step_time._programs(c, pcfg, dcfg, batch, vocab_chunk=0, attn_tile=512)
  flops = {k: hlo.dot_flops(f.lower(*args[k]).compile().as_text()) for k, f in fns.items()}
  both = flops["rl_only"] + flops["draft_alone"]
  assert 0.95 * both <= flops["cotrain"] <= both, flops
