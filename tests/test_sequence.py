"""The training steps on sequence shards (train/sequence.py) against their oracles.

- at cp = 1 the step (tiled attention, vocabulary in chunks, shifted GRPO inputs) equals the dense
  natural-order oracle (`policy.forward(attention="dense")` with full logits and
  `oracles.cotrain_loss`) in loss, every metric and gradient, for every GRPO aggregation with
  the KL term on;
- under cp2, cp4, cp8, cp4_dp2, tp2_cp2_dp2 and pp2_cp2_dp2 (every pipeline stage through the
  trunk ring, the objective on the last stage's shards) the whole co-training step (loss,
  metrics, gradients, the Adam update) equals the single-device step, with sequences that
  straddle ranks;
- padding contributes exactly nothing; no buffer of the compiled step has S^2 elements, and none
  has S*V when the vocabulary is chunked (each with a negative control).
"""

import _tolerance as tol
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import largest_array

from configs import default as default_config
from specdraft import oracles
from specdraft.model import eagle3, pipelined
from specdraft.model import policy as pol
from specdraft.parallel import mesh as mesh_lib
from specdraft.train import draft as draft_lib
from specdraft.train import sequence
from specdraft.train import step as step_lib
from specdraft.train.spec import StepSpec

AGGREGATIONS = ("token-mean", "sequence-mean-token-mean", "sequence-mean-token-scale")


def _batch(B=4, S=24, V=99, seed=0):
  """Rollout-like rows [prompt ; completion ; padding] of different lengths (natural order)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(3, V, (B, S)).astype(np.int32)
  lengths = np.array([S, S - 5, S - 9, S - 2])[:B]
  seg = (np.arange(S)[None] < lengths[:, None]).astype(np.int32)
  mask = (seg * (np.arange(S)[None] >= 6)).astype(np.float32)
  return {
    "tokens": tokens,
    "positions": (np.arange(S)[None] * seg).astype(np.int32),
    "segment_ids": seg,
    "loss_mask": mask,
    "logprobs": (np.log(rng.uniform(0.01, 0.2, (B, S))) * mask).astype(np.float32),
    "advantages": np.asarray([1.0, -0.5, 0.3, -0.8][:B], np.float32),
  }


@pytest.fixture(scope="module")
def setup():
  c = default_config.get_config("smoke")
  c.rl.beta = 0.1  # the KL term is on everywhere below
  c.model.n_kv_heads = 2  # so that kv heads split over tensor = 2
  pcfg = pol.PolicyConfig.from_config(c.model, 99)
  dcfg = eagle3.DraftConfig.from_config(c.draft, pcfg)
  params = pol.init_params(pcfg, 0)
  trainable = {"policy": params, "draft": eagle3.init_params(dcfg, 1, params, pcfg)}
  ref = jax.tree.map(lambda x: x * 1.01, params)
  return c, pcfg, dcfg, trainable, ref, _batch()


def _rl(c, aggregation):
  rl = c.rl.copy_and_resolve_references()
  rl.aggregation = aggregation
  return rl


def _loss(c, pcfg, dcfg, ref, aggregation, mesh=None, vocab_chunk=8, pipeline=None):
  spec = StepSpec.of(
    pcfg, dcfg, _rl(c, aggregation), lam=1.0, mesh=mesh, pipeline=pipeline, max_tokens=24,
    vocab_chunk=vocab_chunk,
  )  # fmt: skip
  return lambda tr, b: step_lib.cotrain_loss(tr, b, spec, ref)


def _assert_metrics_close(got, want, rtol=1e-5, err=""):
  assert set(got) == set(want), f"{err}: metric names differ: {set(got) ^ set(want)}"
  for k in want:
    np.testing.assert_allclose(got[k], want[k], rtol=rtol, atol=1e-7, err_msg=f"{err} {k}")


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_step_at_cp1_equals_the_dense_oracle(setup, aggregation):
  c, pcfg, dcfg, tr, ref, batch = setup
  nat = {k: jnp.asarray(v) for k, v in batch.items()}

  def oracle(tr):
    args = (nat["tokens"], nat["positions"], nat["segment_ids"])
    logits, taps = pol.forward(tr["policy"], pcfg, *args, attention="dense")
    ref_logits, _ = pol.forward(ref, pcfg, *args, attention="dense")
    ref_logp = step_lib.completion_logprobs(ref_logits, nat["tokens"])
    rl = _rl(c, aggregation)
    return oracles.cotrain_loss(
      tr["policy"], tr["draft"], logits, taps, nat, ref_logp, pcfg=pcfg, dcfg=dcfg, rl_cfg=rl,
      lam=1.0,
    )  # fmt: skip

  assert batch["tokens"].shape[1] == 24  # the oracle's Dr.GRPO budget (its row length)
  (l0, m0), g0 = jax.jit(jax.value_and_grad(oracle, has_aux=True))(tr)
  step = _loss(c, pcfg, dcfg, ref, aggregation)
  laid = sequence.zigzag_order(batch, 1)
  (l1, m1), g1 = jax.jit(jax.value_and_grad(step, has_aux=True))(tr, laid)
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  _assert_metrics_close(m1, m0, err=aggregation)
  tol.assert_grads_close(g1["policy"], g0["policy"], rtol=1e-5, err="policy ")
  tol.assert_grads_close(g1["draft"], g0["draft"], rtol=1e-5, err="draft ")


def test_step_at_cp1_equals_the_dense_oracle_under_truncated_sampling(setup):
  """rl.temperature / top_k / top_p: the RL log-probs and the entropy are of the distribution the
  rollouts sample, in the sharded step and in the natural-order oracle alike (KL off: truncation
  is refused with a KL term)."""
  c, pcfg, dcfg, tr, _, batch = setup
  rl = _rl(c, "token-mean")
  rl.update(temperature=0.7, top_k=40, top_p=0.98, beta=0.0)  # a random token: ~40% in the set
  nat = {k: jnp.asarray(v) for k, v in batch.items()}

  def oracle(tr):
    args = (nat["tokens"], nat["positions"], nat["segment_ids"])
    logits, taps = pol.forward(tr["policy"], pcfg, *args, attention="dense")
    return oracles.cotrain_loss(
      tr["policy"], tr["draft"], logits, taps, nat, None, pcfg=pcfg, dcfg=dcfg, rl_cfg=rl, lam=1.0
    )

  def step(tr, b):
    spec = StepSpec.of(pcfg, dcfg, rl, lam=1.0, max_tokens=24, vocab_chunk=8)
    return step_lib.cotrain_loss(tr, b, spec)

  (l0, m0), g0 = jax.jit(jax.value_and_grad(oracle, has_aux=True))(tr)
  (l1, m1), g1 = jax.jit(jax.value_and_grad(step, has_aux=True))(
    tr, sequence.zigzag_order(batch, 1)
  )
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  _assert_metrics_close(m1, m0, err="sampling")
  tol.assert_grads_close(g1["policy"], g0["policy"], rtol=1e-5, err="policy ")
  # the settings took effect: the untruncated T = 1 entropy differs
  (_, m_plain), _ = jax.jit(
    jax.value_and_grad(_loss(c, pcfg, dcfg, None, "token-mean"), has_aux=True)
  )(tr, sequence.zigzag_order(batch, 1))
  assert abs(float(m_plain["entropy"]) - float(m1["entropy"])) > 0.1


def _mesh(layout):
  c = default_config.get_config(f"smoke,layout={layout}")
  c.parallel.devices = int(np.prod(list(c.parallel.mesh.values())))
  return mesh_lib.make_mesh(c.parallel), [tuple(r) for r in c.parallel.rules]


def _pipeline(mesh):
  """Pipeline layouts: 2 microbatches of 2 rows, tap channel on its direct path, remat on."""
  if mesh.shape.get("pp", 1) == 1:
    return None
  return pipelined.PipelineSpec(microbatches=2, tap_mode="direct", remat=True)


def _step_and_grads(c, pcfg, dcfg, ref, aggregation, tr, batch, mesh=None):
  """(loss, metrics), gradients and one co-training step's new parameters, in one program."""
  tx = step_lib.make_cotrain_optimizer(c.rl, c.draft)
  state = {"step": 0, "params": tr, "opt_state": tx.init(tr)}
  pipeline = _pipeline(mesh) if mesh is not None else None
  loss = _loss(c, pcfg, dcfg, ref, aggregation, mesh=mesh, pipeline=pipeline)

  def both(state, b):
    (value, metrics), grads = jax.value_and_grad(loss, has_aux=True)(state["params"], b)
    new, _ = step_lib.apply_update(state, grads, metrics, tx, norms=None)
    return ((value, metrics), grads), new["params"]

  return jax.device_get(jax.jit(both)(state, batch))


# Each layout runs one aggregation (every mode appears under cp), all with the KL term on; rows of
# 24 tokens (padded to 32 at cp = 8) in chunks of 2-6 tokens straddle ranks.
# cp2, cp8 and tp2_cp2_dp2 run in `make test-slow` (CI runs both suites) to keep `make test` within
# its 15 minutes (it measured 15.6 min with cp2 here: docs/results/wall_times).
CASES = [
  pytest.param("cp2", "token-mean", marks=pytest.mark.slow),
  ("cp4", "sequence-mean-token-mean"),
  pytest.param("cp8", "sequence-mean-token-scale", marks=pytest.mark.slow),
  ("cp4_dp2", "token-mean"),
  pytest.param("tp2_cp2_dp2", "sequence-mean-token-mean", marks=pytest.mark.slow),
  # pp x cp: every stage's layers through the trunk ring, the objective on the last stage's shards
  ("pp2_cp2_dp2", "sequence-mean-token-scale"),
]


@pytest.fixture(scope="module")
def single_device(setup):
  """The single-device step, computed once per aggregation for every layout."""
  c, pcfg, dcfg, tr, ref, batch = setup
  cache = {}

  def get(aggregation):
    if aggregation not in cache:
      laid = sequence.zigzag_order(batch, 1)
      cache[aggregation] = _step_and_grads(c, pcfg, dcfg, ref, aggregation, tr, laid)
    return cache[aggregation]

  return get


@pytest.mark.parametrize("layout,aggregation", CASES)
def test_whole_cotrain_step_under_cp_equals_single_device(
  setup, single_device, layout, aggregation
):
  c, pcfg, dcfg, tr, ref, batch = setup
  mesh, rules = _mesh(layout)
  cp = mesh.shape["cp"]
  one = single_device(aggregation)
  laid = sequence.shard(sequence.zigzag_order(batch, cp), mesh, rules)
  assert laid["tokens"].sharding.spec[1] == "cp"  # the sequence axis is sharded over cp
  # the policy's weights placed as the layout places them (heads over tensor, ...)
  shardings = mesh_lib.tree_shardings(
    pol.param_logical_axes(tr["policy"]), tr["policy"], rules, mesh
  )
  placed = dict(tr, policy=jax.device_put(tr["policy"], shardings))
  if mesh.shape.get("pp", 1) > 1:
    assert _pipeline(mesh) is not None  # the pipelined step, not the plain one
  if mesh.shape["tensor"] > 1:
    assert placed["policy"]["layers"]["wq"].sharding.spec[2] == "tensor"
  got = _step_and_grads(c, pcfg, dcfg, ref, aggregation, placed, laid, mesh=mesh)
  ((l1, m1), g1), p1 = one
  ((l2, m2), g2), p2 = got
  np.testing.assert_allclose(l2, l1, rtol=1e-5)
  _assert_metrics_close(m2, m1, err=layout)
  tol.assert_grads_close(g2, g1, rtol=1e-5, err=f"{layout} ")
  lr = max(c.rl.lr, c.draft.cotrain_lr)
  tol.assert_adam_update_close(tr, p2, p1, g2, g1, lr=lr, err=f"{layout} ")


@pytest.mark.slow  # two compiled cp2 steps; `make test-slow` (and CI) run it
def test_padding_contributes_exactly_nothing(setup):
  """Garbage in the padding (tokens, positions, behaviour log-probs) changes no bit of the loss,
  metrics or gradients; more padding changes them only by float32 reordering."""
  c, pcfg, dcfg, tr, ref, batch = setup
  mesh, _ = _mesh("cp2")
  laid = sequence.zigzag_order(batch, 2)
  pad = laid["segment_ids"] == 0
  rng = np.random.default_rng(1)
  noisy = dict(laid)
  noisy["tokens"] = np.where(pad, rng.integers(3, 99, pad.shape), laid["tokens"]).astype(np.int32)
  noisy["positions"] = np.where(pad, rng.integers(0, 50, pad.shape), laid["positions"]).astype(
    np.int32
  )
  noisy["logprobs"] = np.where(pad, -3.0, laid["logprobs"]).astype(np.float32)
  f = jax.jit(jax.value_and_grad(_loss(c, pcfg, dcfg, ref, "token-mean", mesh=mesh), has_aux=True))
  a, b = jax.device_get(f(tr, laid)), jax.device_get(f(tr, noisy))
  jax.tree.map(np.testing.assert_array_equal, a, b)
  more = sequence.zigzag_order(batch, 2, multiple=5)  # 40 tokens instead of 24
  assert more["tokens"].shape[1] > laid["tokens"].shape[1]
  (l3, m3), g3 = jax.device_get(f(tr, more))
  (l1, m1), g1 = a
  np.testing.assert_allclose(l3, l1, rtol=1e-5)
  _assert_metrics_close(m3, m1, err="more padding")
  tol.assert_grads_close(g3, g1, rtol=1e-5)


def test_no_quadratic_or_vocabulary_sized_buffer_in_the_step():
  """At S = 2048 (one row) no array of the compiled co-training step (forward and backward) has
  S^2 elements, and with the vocabulary chunked none has S*V; the dense oracle's forward has an
  S^2 one and the unchunked step an S*V one (negative controls)."""
  c = default_config.get_config("smoke")
  S, V = 2048, 1000
  pcfg = pol.PolicyConfig.from_config(c.model, V)
  dcfg = eagle3.DraftConfig.from_config(c.draft, pcfg)
  params = pol.init_params(pcfg, 0)
  tr = {"policy": params, "draft": eagle3.init_params(dcfg, 1, params, pcfg)}
  b = _batch(B=1, S=S, V=V)
  b["segment_ids"][:] = 1  # one document over the whole row
  b["positions"][:] = np.arange(S)

  def compiled_text(vocab_chunk):
    spec = StepSpec.of(pcfg, dcfg, c.rl, lam=1.0, vocab_chunk=vocab_chunk, attn_tile=256)
    loss = lambda t, b: step_lib.cotrain_loss(t, b, spec)[0]
    return jax.jit(jax.grad(loss)).lower(tr, b).compile().as_text()

  chunked = largest_array(compiled_text(256))
  assert chunked < S * S and chunked < S * V, chunked
  assert largest_array(compiled_text(0)) >= S * V  # negative control: whole-row logits
  dense = jax.jit(
    lambda p, t: pol.forward(p, pcfg, t, attention="dense")[0].sum()
  )  # negative control: the dense oracle materialises S^2 scores
  assert largest_array(dense.lower(params, b["tokens"]).compile().as_text()) >= S * S


def test_a_batch_not_laid_out_is_refused_before_compiling(setup):
  c, pcfg, dcfg, tr, ref, batch = setup
  mesh, _ = _mesh("cp4")
  odd = {k: v[:, :21] if v.ndim == 2 else v for k, v in batch.items()}  # 21 % 8 != 0
  with pytest.raises(ValueError, match=r"S=21 is not a multiple of 2\*cp=8.*zigzag_order"):
    _loss(c, pcfg, dcfg, ref, "token-mean", mesh=mesh)(tr, odd)
  laid = sequence.zigzag_order(odd, 4)
  assert laid["tokens"].shape[1] == 24
  # the layout is a permutation of the padded row: undoing it gives the row back
  from specdraft.parallel import zigzag

  back = np.asarray(zigzag.from_zigzag(jnp.asarray(laid["tokens"]), 4))[:, :21]
  np.testing.assert_array_equal(back, odd["tokens"])


def test_remat_changes_the_memory_not_the_step(setup):
  """compute.remat rematerialises each policy layer: same loss and gradients, less temp memory."""
  c, pcfg, dcfg, tr, ref, _ = setup
  b = sequence.zigzag_order(_batch(B=2, S=256), 1)

  def grads(remat):
    spec = StepSpec.of(pcfg, dcfg, c.rl, lam=1.0, vocab_chunk=64, remat=remat)
    loss = lambda t, b: step_lib.cotrain_loss(t, b, spec)
    f = jax.jit(jax.value_and_grad(loss, has_aux=True))
    return f.lower(tr, b).compile(), f(tr, b)

  (plain, ((l0, m0), g0)), (remat, ((l1, m1), g1)) = grads(False), grads(True)
  np.testing.assert_allclose(l1, l0, rtol=1e-6)
  _assert_metrics_close(m1, m0, rtol=1e-6, err="remat")
  tol.assert_grads_close(g1, g0, rtol=1e-5)
  saved = plain.memory_analysis().temp_size_in_bytes
  assert remat.memory_analysis().temp_size_in_bytes < saved


def test_draft_distillation_under_cp_equals_single_device(setup):
  """The distillation loss (fixed policy, draft's TTT on sequence shards) under cp4_dp2 equals
  the single-device value, and the policy gets no gradient from it."""
  c, pcfg, dcfg, tr, _, batch = setup
  mesh, rules = _mesh("cp4_dp2")

  def run(b, mesh=None):
    spec = StepSpec.of(pcfg, dcfg, mesh=mesh, vocab_chunk=8)
    loss = lambda d, p: draft_lib.draft_loss(d, p, b, spec)
    return jax.device_get(
      jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(tr["draft"], tr["policy"])
    )

  (l1, m1), (g1, gp1) = run(sequence.zigzag_order(batch, 1))
  (l4, m4), (g4, _) = run(sequence.shard(sequence.zigzag_order(batch, 4), mesh, rules), mesh)
  np.testing.assert_allclose(l4, l1, rtol=1e-5)
  _assert_metrics_close(m4, m1, err="distillation")
  tol.assert_grads_close(g4, g1, rtol=1e-5)
  assert all(float(np.abs(x).max()) == 0 for x in jax.tree.leaves(gp1))


def test_long_chunks_are_padded_to_round_lengths():
  """A chunk of a prime length (521 tokens at cp = 8) would leave attention tiles of one token;
  chunks above 256 tokens are padded to a multiple of 32, shorter rows keep their length."""
  from specdraft.attention import ring

  long_row = {"tokens": np.zeros((1, 8328), np.int32)}
  S = sequence.zigzag_order(long_row, 8)["tokens"].shape[1]
  assert S == 8704 and (S // 16) % sequence.CHUNK_MULTIPLE == 0
  assert min(ring.tile_sizes(S // 8, 0, 256)) >= 32
  assert (
    sequence.zigzag_order({"tokens": np.zeros((2, 130), np.int32)}, 1)["tokens"].shape[1] == 130
  )
