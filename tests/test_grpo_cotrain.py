"""GRPO against hand-computed values; the co-training step's gradient isolation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default as default_config
from specdraft.model import eagle3
from specdraft.model import policy as pol
from specdraft.rl import grpo
from specdraft.train import step as step_lib
from specdraft.train.spec import StepSpec


def test_group_advantages_by_hand():
  r = jnp.array([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
  g = grpo.group_advantages(r, 4, mode="grpo")
  # group 1: mean 0.5, std 0.5 -> +-1 (up to eps); group 2: constant -> 0
  np.testing.assert_allclose(g, [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-5)
  np.testing.assert_allclose(
    grpo.group_advantages(r, 4, mode="drgrpo"), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]
  )
  # rloo: r_i - mean of the other three
  np.testing.assert_allclose(
    grpo.group_advantages(r, 4, mode="rloo"),
    [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, 0, 0, 0, 0],
    atol=1e-6,
  )
  with pytest.raises(ValueError, match="whole number of groups"):
    grpo.group_advantages(r, 3)
  with pytest.raises(ValueError, match="rl.advantage='ppo'"):
    grpo.group_advantages(r, 4, mode="ppo")


def test_clipped_loss_and_aggregations_by_hand():
  # two sequences; seq 0 has 2 tokens, seq 1 has 1 token
  logp = jnp.log(jnp.array([[0.5, 0.6, 0.1], [0.9, 0.1, 0.1]]))
  old = jnp.log(jnp.array([[0.25, 0.6, 0.1], [0.3, 0.1, 0.1]]))
  mask = jnp.array([[1, 1, 0], [1, 0, 0]], jnp.float32)
  adv = jnp.array([1.0, -1.0])
  # ratios: seq0 = (2.0, 1.0), seq1 = (3.0,). eps 0.2 / 0.28
  # seq0 tok0: A=1, r=2 -> max(-2, -1.28) = -1.28 ; tok1: r=1 -> -1
  # seq1 tok0: A=-1, r=3 -> max(3, 1.28) = 3
  kw = dict(eps_low=0.2, eps_high=0.28)
  tm, m = grpo.policy_loss(logp, old, adv, mask, aggregation="token-mean", **kw)
  np.testing.assert_allclose(tm, (-1.28 - 1 + 3) / 3, rtol=1e-5)
  sm, _ = grpo.policy_loss(logp, old, adv, mask, aggregation="sequence-mean-token-mean", **kw)
  np.testing.assert_allclose(sm, ((-1.28 - 1) / 2 + 3) / 2, rtol=1e-5)
  ss, _ = grpo.policy_loss(
    logp, old, adv, mask, aggregation="sequence-mean-token-scale", max_tokens=4, **kw
  )
  np.testing.assert_allclose(ss, ((-1.28 - 1) / 4 + 3 / 4) / 2, rtol=1e-5)
  np.testing.assert_allclose(m["clip_frac"], 1 / 3, rtol=1e-5)  # only seq0 tok0 is clipped
  # KL: k1 = logp - ref ; k3 = exp(ref - logp) - (ref - logp) - 1
  ref = jnp.log(jnp.array([[0.25, 0.3, 0.1], [0.45, 0.1, 0.1]]))
  k1 = grpo.kl_penalty(logp, ref, "k1")
  np.testing.assert_allclose(k1[0, :2], [np.log(2), np.log(2)], rtol=1e-5)
  k3 = grpo.kl_penalty(logp, ref, "k3")
  np.testing.assert_allclose(k3[1, 0], 0.5 - np.log(0.5) - 1, rtol=1e-5)
  kl_loss, km = grpo.policy_loss(
    logp,
    old,
    adv,
    mask,
    aggregation="token-mean",
    ref_logp_BS=ref,
    beta=0.1,
    kl_estimator="k1",
    **kw,
  )
  np.testing.assert_allclose(kl_loss - tm, 0.1 * (np.log(2) * 2 + np.log(2)) / 3, rtol=1e-5)


def test_log_ratio_is_clipped():
  logp = jnp.array([[0.0]])
  old = jnp.array([[-100.0]])
  loss, _ = grpo.policy_loss(
    logp,
    old,
    jnp.array([-1.0]),
    jnp.ones((1, 1)),
    eps_low=0.2,
    eps_high=0.2,
    aggregation="token-mean",
  )
  np.testing.assert_allclose(loss, np.exp(20.0), rtol=1e-5)


@pytest.fixture(scope="module")
def setup():
  c = default_config.get_config("smoke")
  pcfg = pol.PolicyConfig.from_config(c.model, 99)
  dcfg = eagle3.DraftConfig.from_config(c.draft, pcfg)
  params = pol.init_params(pcfg, 0)
  dparams = eagle3.init_params(dcfg, 1, params, pcfg)
  rng = np.random.default_rng(0)
  B, S = 4, 20
  tokens = rng.integers(3, 99, (B, S)).astype(np.int32)
  lengths = np.array([20, 16, 12, 18])
  seg = (np.arange(S)[None] < lengths[:, None]).astype(np.int32)
  mask = (seg * (np.arange(S)[None] >= 6)).astype(np.float32)
  batch = {
    "tokens": jnp.asarray(tokens),
    "positions": jnp.asarray(np.arange(S)[None] * seg),
    "segment_ids": jnp.asarray(seg),
    "loss_mask": jnp.asarray(mask),
    "logprobs": jnp.asarray(np.log(rng.uniform(0.01, 0.2, (B, S))) * mask, jnp.float32),
    "advantages": jnp.asarray([1.0, -0.5, 0.3, -0.8]),
  }
  return c, pcfg, dcfg, params, dparams, batch


def _parts(c, pcfg, dcfg, batch, **kw):
  """(dL_RL, dL_draft) w.r.t. {policy, draft}, computed separately."""

  def rl_only(tr):
    spec = StepSpec.of(pcfg, dcfg, c.rl, lam=0.0, train_draft=False, **kw)
    return step_lib.cotrain_loss(tr, batch, spec)[0]

  def draft_only(tr):
    _, m = step_lib.cotrain_loss(tr, batch, StepSpec.of(pcfg, dcfg, c.rl, lam=1.0, **kw))
    return m["draft_loss"]

  return rl_only, draft_only


def _maxabs(tree):
  return max(float(jnp.abs(x).max()) for x in jax.tree.leaves(tree))


def test_cross_gradients_are_exactly_zero(setup):
  c, pcfg, dcfg, params, dparams, batch = setup
  tr = {"policy": params, "draft": dparams}
  rl_only, draft_only = _parts(c, pcfg, dcfg, batch)
  g_rl, g_draft = jax.jit(lambda t: (jax.grad(rl_only)(t), jax.grad(draft_only)(t)))(tr)
  assert _maxabs(g_draft["policy"]) == 0.0  # dL_draft/dtheta
  assert _maxabs(g_rl["draft"]) == 0.0  # dL_RL/dphi
  assert _maxabs(g_rl["policy"]) > 0 and _maxabs(g_draft["draft"]) > 0


def test_negative_control_without_stop_gradient(setup):
  c, pcfg, dcfg, params, dparams, batch = setup
  tr = {"policy": params, "draft": dparams}
  _, draft_only = _parts(c, pcfg, dcfg, batch, stop_tap_gradient=False)
  assert _maxabs(jax.jit(jax.grad(draft_only))(tr)["policy"]) > 0


def test_lambda_zero_policy_update_is_bit_identical_to_rl_only(setup):
  c, pcfg, dcfg, params, dparams, batch = setup
  outs, steps = {}, {}
  for name, train_draft, lam in (("co", True, 0.0), ("rl", False, 0.0), ("co1", True, 1.0)):
    tx = step_lib.make_cotrain_optimizer(c.rl, c.draft, train_draft=train_draft)
    tr = {"policy": params, "draft": dparams}
    st = {"step": 0, "params": tr, "opt_state": tx.init(tr)}
    if train_draft not in steps:  # lam is an argument: "co" and "co1" share one program
      steps[train_draft] = jax.jit(
        lambda s, b, lam, tx=tx, td=train_draft: step_lib.cotrain_step(
          s, b, StepSpec.of(pcfg, dcfg, c.rl, tx=tx, lam=lam, train_draft=td)
        )
      )
    for _ in range(2):
      st, m = steps[train_draft](st, batch, jnp.float32(lam))
    outs[name] = jax.device_get(st["params"])
  jax.tree.map(np.testing.assert_array_equal, outs["co"]["policy"], outs["rl"]["policy"])
  # and with lam = 1 the policy update is still the same (taps carry no gradient) ...
  jax.tree.map(np.testing.assert_array_equal, outs["co1"]["policy"], outs["rl"]["policy"])
  # ... while the draft moved only when it is trained with lam > 0
  jax.tree.map(np.testing.assert_array_equal, outs["rl"]["draft"], dparams)
  assert _maxabs(jax.tree.map(lambda a, b: a - b, outs["co1"]["draft"], dparams)) > 0


def test_rl_warmup_ramps_the_policy_step_only():
  """rl.warmup_steps = w: the policy's Adam steps are lr / (w + 1), ..., lr (linear), then lr; the
  draft's rate is untouched. A constant gradient makes each Adam step about its learning rate."""
  c = default_config.get_config("size=tiny,smoke")
  c.rl.lr, c.draft.cotrain_lr, c.rl.grad_clip = 1e-2, 1e-3, 1e9
  params = {"policy": {"w": jnp.zeros(3)}, "draft": {"w": jnp.zeros(3)}}
  grads = jax.tree.map(jnp.ones_like, params)

  def steps(warmup, n):
    c.rl.warmup_steps = warmup
    tx = step_lib.make_cotrain_optimizer(c.rl, c.draft)
    st, out = tx.init(params), []
    for _ in range(n):
      upd, st = tx.update(grads, st, params)
      out.append((-float(upd["policy"]["w"][0]), -float(upd["draft"]["w"][0])))
    return np.asarray(out)

  flat, ramp = steps(0, 6), steps(3, 6)
  np.testing.assert_allclose(flat[:, 0], 1e-2, rtol=1e-4)
  np.testing.assert_allclose(ramp[:, 0], 1e-2 * np.array([0.25, 0.5, 0.75, 1, 1, 1]), rtol=1e-4)
  np.testing.assert_allclose(ramp[:, 1], flat[:, 1], rtol=1e-6)
  np.testing.assert_allclose(flat[:, 1], 1e-3, rtol=1e-4)


def _count_scans(jaxpr, layer_ff):
  """Scans over stacked policy layers in a jaxpr: scan primitives that take a [n, E, F] operand
  (the layers' stacked MLP weights, `layer_ff` = (E, F)). Other loops (attention tiles, the
  draft's) carry no such operand; wrappers such as pjit and custom_vjp are entered."""
  n = 0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "scan" and any(
      getattr(v.aval, "shape", ())[1:] == layer_ff and len(v.aval.shape) == 3 for v in eqn.invars
    ):
      n += 1
      continue
    for p in eqn.params.values():
      for sub in p if isinstance(p, (list, tuple)) else [p]:
        if hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
          n += _count_scans(sub.jaxpr, layer_ff)
        elif hasattr(sub, "eqns"):
          n += _count_scans(sub, layer_ff)
  return n


def test_cotrain_step_runs_one_policy_forward(setup):
  """The co-training step's program holds exactly as many layer scans as the RL-only step."""
  c, pcfg, dcfg, params, dparams, batch = setup
  tr = {"policy": params, "draft": dparams}

  def scans(train_draft, lam):
    spec = StepSpec.of(pcfg, dcfg, c.rl, lam=lam, train_draft=train_draft)
    loss = lambda t: step_lib.cotrain_loss(t, batch, spec)[0]
    fwd = jax.make_jaxpr(loss)(tr).jaxpr
    bwd = jax.make_jaxpr(jax.grad(loss))(tr).jaxpr
    ff = (pcfg.d_model, pcfg.d_ff)
    return _count_scans(fwd, ff), _count_scans(bwd, ff)

  n_segments = len(set(t + 1 for t in pcfg.taps) | {pcfg.n_layers})
  rl_fwd, rl_bwd = scans(False, 0.0)
  co_fwd, co_bwd = scans(True, 1.0)
  assert rl_fwd == n_segments  # one forward: one scan per tap segment
  assert co_fwd == rl_fwd and co_bwd == rl_bwd

  def twice(t):  # negative control: a second policy forward shows up in the count
    a = step_lib.cotrain_loss(t, batch, StepSpec.of(pcfg, dcfg, c.rl, lam=1.0))[0]
    logits, _ = pol.forward(t["policy"], pcfg, batch["tokens"])
    return a + logits.mean()

  ff = (pcfg.d_model, pcfg.d_ff)
  assert _count_scans(jax.make_jaxpr(twice)(tr).jaxpr, ff) == 2 * n_segments
