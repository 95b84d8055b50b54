"""Pipeline parallelism and the TapChannel against the unpipelined model (8 simulated devices)."""

import _tolerance as tol
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import default as default_config
from experiments.bench import hlo as hlo_lib
from specdraft import config as config_lib
from specdraft.model import eagle3, pipelined
from specdraft.model import policy as pol
from specdraft.parallel import layouts
from specdraft.parallel import mesh as mesh_lib
from specdraft.parallel import pipeline as pipe
from specdraft.parallel.tap import TapChannel, TapPlan
from specdraft.train import sequence
from specdraft.train import step as step_lib
from specdraft.train.spec import StepSpec

TAPS = (1, 3, 4, 6)  # P=2: stage 0 holds two taps (one buffer), stage 1 one of its own
#                      P=4: one tap on every stage, the last stage's never travels


def mesh_for(name):
  lay = layouts.layout(name)
  lay["devices"] = int(np.prod(list(lay["mesh"].values())))
  return mesh_lib.make_mesh(ml_collections.ConfigDict(lay))


@pytest.fixture(scope="module")
def setup():
  pcfg = pol.PolicyConfig(
    vocab_size=99,
    d_model=32,
    n_layers=8,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=64,
    tap_layers=TAPS,
  )
  theta = pol.init_params(pcfg, 0)
  rng = np.random.default_rng(0)
  B, S = 8, 16
  tokens = rng.integers(3, 99, (B, S)).astype(np.int32)
  # packed rows: several documents, length-1 documents, padding, one all-padding row
  seg = np.ones((B, S), np.int32)
  seg[1, 5:] = 2
  seg[1, 6:] = 3  # a length-1 document at position 5
  seg[2, 10:] = 0
  seg[3] = 0  # nothing to do
  seg[4, :1] = 1
  seg[4, 1:9] = 2
  seg[4, 9:] = 0
  pos = np.zeros((B, S), np.int32)
  for b in range(B):
    for t in range(1, S):
      pos[b, t] = pos[b, t - 1] + 1 if seg[b, t] == seg[b, t - 1] else 0
  pos = pos * (seg > 0)
  mask = ((seg > 0) & (np.arange(S)[None] >= 3)).astype(np.float32)
  batch = {
    "tokens": jnp.asarray(tokens),
    "positions": jnp.asarray(pos),
    "segment_ids": jnp.asarray(seg),
    "loss_mask": jnp.asarray(mask),
    "logprobs": jnp.asarray(np.log(rng.uniform(0.01, 0.2, (B, S))) * mask, jnp.float32),
    "advantages": jnp.asarray(rng.normal(size=B), jnp.float32),
  }
  return pcfg, theta, batch


def _unpipelined_per_microbatch(pcfg, theta, batch, M):
  """The unpipelined model on each microbatch (the same arithmetic shapes), merged back."""
  f = jax.jit(lambda t, p, s: pol.forward(theta, pcfg, t, p, s))
  split = lambda x: pipe.split_microbatches(x, M)
  outs = [
    f(*(split(batch[k])[m] for k in ("tokens", "positions", "segment_ids"))) for m in range(M)
  ]
  logits = pipe.merge_microbatches(jnp.stack([o[0] for o in outs]))
  taps = jax.vmap(pipe.merge_microbatches, in_axes=1)(jnp.stack([o[1].layers for o in outs]))
  return logits, taps


def _sft_grad(pcfg, batch, **kw):
  spec = StepSpec.of(pcfg, **kw)
  return jax.jit(jax.value_and_grad(lambda th: step_lib.sft_loss(th, batch, spec)[0]))


# ----------------------------------------------------------------------------- plan and schedule


def test_tap_plan_by_hand():
  plan = TapPlan((1, 3, 4, 6), num_layers=8, num_stages=2)
  assert plan.entries == ((0, 1), (0, 3), (1, 0), (1, 2))
  assert plan.slots(0) == (0, 1) and plan.slots(1) == (2, 3)
  assert plan.sources == (0,) and plan.max_per_stage == 2
  plan4 = TapPlan((6, 1, 4), num_layers=8, num_stages=4)  # draft order is kept
  assert plan4.entries == ((3, 0), (0, 1), (2, 0))
  assert plan4.sources == (0, 2) and plan4.count(1) == 0
  assert plan4.local_union == (0, 1)
  np.testing.assert_array_equal(plan4.gather_table(), [[1], [-1], [0], [0]])
  with pytest.raises(ValueError, match=r"tap layer\(s\) \[9\] do not exist.*layers 0\.\.7"):
    TapPlan((1, 9), num_layers=8, num_stages=2)
  with pytest.raises(ValueError, match=r"n_layers=6 cannot be split into 4 equal pipeline stages"):
    TapPlan((1,), num_layers=6, num_stages=4)
  with pytest.raises(ValueError, match="tap_mode='sideways' is unknown"):
    TapChannel(plan, mode="sideways")
  with pytest.raises(ValueError, match="tap_delay=True only applies"):
    TapChannel(plan, mode="bulk", delay=True)


def test_schedule_runs_every_microbatch_on_every_stage_once():
  M, P = 5, 4
  sched = pipe.schedule(M, P)
  assert max(it for it, _, _ in sched) + 1 == M + P - 1
  work = [(s, m) for _, s, m in sched if m is not None]
  assert sorted(work) == sorted((s, m) for s in range(P) for m in range(M))
  for it, s, m in sched:  # stage s works on microbatch m at iteration m + s
    assert m is None or it == m + s
  x = jnp.arange(24).reshape(12, 2)
  np.testing.assert_array_equal(pipe.merge_microbatches(pipe.split_microbatches(x, 4)), x)
  assert pipe.split_microbatches(x, 4)[1, 0, 0] == x[1, 0]  # row r in microbatch r % M
  with pytest.raises(ValueError, match="cannot be split into parallel.pipeline.microbatches=5"):
    pipe.split_microbatches(x, 5)


def test_config_errors_name_the_field(smoke_config):
  def bad(layout, match, **over):
    c = default_config.get_config(f"smoke,layout={layout}")
    for k, v in over.items():
      section, _, field = k.rpartition(".")
      node = c
      for part in section.split("."):
        node = node[part]
      node[field] = v
    with pytest.raises(ValueError, match=match):
      config_lib.validate(c, num_devices=8)

  bad(
    "pp4_dp2",
    r"n_layers=6 cannot be split into 4 equal pipeline stages",
    **{"model.n_layers": 6, "model.tap_layers": (1, 2)},
  )
  bad("pp2", r"tap_layers=\(1, 9\).*\[0, 4\)", **{"model.tap_layers": (1, 9)})
  bad(
    "pp4_dp2",
    r"parallel.pipeline.microbatches=3.*must divide data.batch_size=8",
    **{"parallel.pipeline.microbatches": 3},
  )
  bad(
    "pp4_dp2",
    r"parallel.pipeline.tap_mode='off'.*stages \(0, 1\)",
    **{"parallel.pipeline.tap_mode": "off"},
  )
  bad("pp4_dp2", r"tap_mode='carrier' is unknown", **{"parallel.pipeline.tap_mode": "carrier"})
  c = default_config.get_config("smoke,layout=pp4_dp2")
  config_lib.validate(c, num_devices=8)  # the smoke variant itself is valid


# ----------------------------------------------------------------------------- against the oracle


@pytest.mark.parametrize(
  "P,M",
  [
    (2, 2),
    pytest.param(2, 4, marks=pytest.mark.slow),
    pytest.param(4, 4, marks=pytest.mark.slow),
    (4, 8),
  ],
)
def test_logits_taps_and_policy_grads_equal_unpipelined(setup, P, M):
  pcfg, theta, batch = setup
  mesh = mesh_for(f"pp{P}")
  spec = pipelined.PipelineSpec(microbatches=M, tap_mode="direct")
  logits, taps, sent = jax.jit(
    lambda th: pipelined.forward(
      th, pcfg, batch["tokens"], batch["positions"], batch["segment_ids"], mesh=mesh, spec=spec
    )
  )(theta)
  ref_logits, ref_taps = pol.forward(
    theta, pcfg, batch["tokens"], batch["positions"], batch["segment_ids"]
  )
  np.testing.assert_allclose(logits, ref_logits, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(taps.final, ref_taps.final, atol=1e-5, rtol=1e-5)
  # Taps: the receiver buffer is bit-exactly what each stage sent (pure data movement), and equals
  # the unpipelined layer outputs up to float32 reordering (other programs, other batch shapes).
  _, mb_taps = _unpipelined_per_microbatch(pcfg, theta, batch, M)
  np.testing.assert_allclose(taps.layers, mb_taps, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(taps.layers, ref_taps.layers, atol=1e-5, rtol=1e-5)
  plan = TapPlan(TAPS, pcfg.n_layers, P)
  for s in range(P):
    for j, i in enumerate(plan.slots(s)):
      np.testing.assert_array_equal(pipe.merge_microbatches(sent[s, :, j]), taps.layers[i])
  # Policy gradients (loss on the last stage) equal the unpipelined model's.
  (l_pp, g_pp) = _sft_grad(pcfg, batch, mesh=mesh, pipeline=spec)(theta)
  (l_ref, g_ref) = _sft_grad(pcfg, batch)(theta)
  np.testing.assert_allclose(l_pp, l_ref, rtol=1e-5)
  tol.assert_grads_close(g_pp, g_ref, rtol=1e-4)


def test_every_tap_mode_delivers_the_same_buffer(setup):
  pcfg, theta, batch = setup
  mesh = mesh_for("pp4")
  plan = TapPlan(TAPS, pcfg.n_layers, 4)
  got = {}
  for mode, delay in (
    ("direct", False),
    ("direct", True),
    ("bulk", False),
    ("hop", False),
    ("off", False),
  ):
    spec = pipelined.PipelineSpec(microbatches=4, tap_mode=mode, tap_delay=delay)
    logits, taps, _ = jax.jit(
      lambda th, spec=spec: pipelined.forward(
        th, pcfg, batch["tokens"], batch["positions"], batch["segment_ids"], mesh=mesh, spec=spec
      )
    )(theta)
    got[(mode, delay)] = (logits, taps.layers)
  ref_logits, ref_taps = got[("direct", False)]
  for (mode, delay), (logits, taps) in got.items():
    np.testing.assert_array_equal(logits, ref_logits)  # the pipeline itself is untouched
    if mode == "off":
      for i, (s, _) in enumerate(plan.entries):
        if s == plan.last:
          np.testing.assert_array_equal(taps[i], ref_taps[i])  # the last stage's own tap
        else:
          assert not np.any(taps[i]), f"tap {i} travelled with the channel off"
    else:
      np.testing.assert_array_equal(taps, ref_taps, err_msg=f"{mode} delay={delay}")


# ----------------------------------------------------------------------------- the co-training step


@pytest.fixture(scope="module")
def cotrain_setup(setup):
  pcfg, theta, batch = setup
  c = default_config.get_config("smoke")
  dcfg = eagle3.DraftConfig(
    d_model=32,
    n_heads=4,
    n_kv_heads=2,
    head_dim=8,
    d_ff=64,
    n_taps=len(pcfg.taps),
    vocab_size=99,
    ttt_steps=2,
  )
  dparams = eagle3.init_params(dcfg, 1, theta, pcfg)
  return c, pcfg, dcfg, {"policy": theta, "draft": dparams}, batch


def _cotrain_grad(c, pcfg, dcfg, batch, **kw):
  spec = StepSpec.of(pcfg, dcfg, c.rl, lam=1.0, **kw)
  f = lambda tr: step_lib.cotrain_loss(tr, batch, spec)
  return jax.jit(jax.value_and_grad(f, has_aux=True))


def test_channel_on_or_off_leaves_outputs_and_policy_grads_bit_identical(cotrain_setup):
  c, pcfg, dcfg, tr, batch = cotrain_setup
  mesh = mesh_for("pp2")
  res = {}
  for mode in ("direct", "off"):
    spec = pipelined.PipelineSpec(microbatches=4, tap_mode=mode)
    res[mode] = _cotrain_grad(c, pcfg, dcfg, batch, mesh=mesh, pipeline=spec)(tr)
  (_, m_on), g_on = res["direct"]
  (_, m_off), g_off = res["off"]
  jax.tree.map(np.testing.assert_array_equal, g_on["policy"], g_off["policy"])
  assert {"rl_loss", "entropy"} <= set(m_on) and set(m_on) == set(m_off)
  for k in ("rl_loss", "entropy"):
    np.testing.assert_array_equal(m_on[k], m_off[k])
  # ... and the draft did see different features (the channel is not a no-op)
  assert float(m_on["draft_loss"]) != float(m_off["draft_loss"])


def test_cotrain_step_under_pp4_dp2_equals_single_device(cotrain_setup):
  c, pcfg, dcfg, tr, batch = cotrain_setup
  mesh = mesh_for("pp4_dp2")
  rl_cfg = c.rl.copy_and_resolve_references()
  rl_cfg.beta = 0.05  # with a KL to a reference policy, which runs through the pipeline too
  ref = jax.tree.map(lambda x: x * 1.01, tr["policy"])
  tx = step_lib.make_cotrain_optimizer(rl_cfg, c.draft)
  state = {"step": 0, "params": tr, "opt_state": tx.init(tr)}
  spec = pipelined.PipelineSpec(microbatches=4, tap_mode="direct", tap_delay=True, remat=True)
  outs = {}
  for name, kw in (("single", {}), ("pp4_dp2", dict(mesh=mesh, pipeline=spec))):
    # The step and its gradients in one program, the forward/backward traced once.
    step_spec = StepSpec.of(pcfg, dcfg, rl_cfg, lam=1.0, **kw)
    loss = lambda t, b, sp=step_spec: step_lib.cotrain_loss(t, b, sp, ref)

    def f(s, b, loss=loss):
      (_, metrics), grads = jax.value_and_grad(loss, has_aux=True)(s["params"], b)
      return step_lib.apply_update(s, grads, metrics, tx, norms=None), grads

    f = jax.jit(f)
    sh_batch = (
      batch
      if name == "single"
      else mesh_lib.shard_batch(batch, mesh, [tuple(r) for r in layouts.DEFAULT_RULES])
    )
    outs[name] = jax.device_get(f(state, sh_batch))
  ((s1, m1), g1), ((s2, m2), g2) = outs["single"], outs["pp4_dp2"]
  assert set(m1) == set(m2)
  for k in m1:
    # argmax agreement and clip fractions count tokens: a near-tie may move one token (~1/70)
    discrete = k.startswith("ttt_acc") or k == "clip_frac"
    np.testing.assert_allclose(m2[k], m1[k], rtol=1e-4, atol=0.02 if discrete else 1e-6, err_msg=k)
  assert float(m1["draft_loss"]) > 0 and float(m1["draft_grad_norm"]) > 0
  assert float(m1["kl"]) > 0  # the reference term is live
  # Gradients per leaf relative to its norm; the AdamW update with Adam's own tolerance (raw
  # post-Adam parameters are decided by the last bits wherever a gradient is near zero).
  tol.assert_grads_close(g2, g1, rtol=1e-4)
  for part, lr in (("policy", rl_cfg.lr), ("draft", c.draft.cotrain_lr)):
    tol.assert_adam_update_close(
      tr[part], s2["params"][part], s1["params"][part], g2[part], g1[part], lr=lr, err=part
    )


# ----------------------------------------------------------------------------- compiled program


def _grad_permutes(pcfg, theta, batch, *, mode="direct", stop=True):
  mesh = mesh_for("pp4")
  spec = pipelined.PipelineSpec(microbatches=4, tap_mode=mode)

  def objective(sh, th, extra, h, taps, b, ref):  # a draft-like consumer of the taps
    return jnp.mean(jnp.sin(taps)) + jnp.mean(h), {}

  f = lambda th: pipelined.loss(
    th,
    None,
    batch,
    objective,
    pcfg=pcfg,
    mesh=mesh,
    spec=spec,
    ops=sequence.ShardOps(),
    stop_tap_gradient=stop,
  )[0]
  # value_and_grad: the loss (which reads the taps) is an output, so the taps must travel
  prog = jax.jit(jax.value_and_grad(f)).lower(theta).compile().as_text()
  return hlo_lib.collective_permutes(prog)


def test_no_reverse_tap_transfer_in_the_gradient_program(setup):
  pcfg, theta, batch = setup
  main_fwd = ((0, 1), (1, 2), (2, 3))
  main_bwd = ((1, 0), (2, 1), (3, 2))
  with_stop = _grad_permutes(pcfg, theta, batch)
  fwd = [p for p in with_stop if "transpose(" not in p.op_name]
  bwd = [p for p in with_stop if "transpose(" in p.op_name]
  # forward: the main shift plus one single-pair send per source stage, straight to stage 3
  assert sorted(p.pairs for p in fwd) == sorted([main_fwd, ((0, 3),), ((1, 3),), ((2, 3),)])
  # gradient program: only the main shift's transpose; no tap travels back
  assert [p.pairs for p in bwd] == [main_bwd]
  # negative control: without stop_gradient the reverse tap transfers appear
  without = _grad_permutes(pcfg, theta, batch, stop=False)
  back = sorted(p.pairs for p in without if "transpose(" in p.op_name)
  assert back == sorted([main_bwd, ((3, 0),), ((3, 1),), ((3, 2),)])


def test_bulk_moves_exactly_the_tapped_bytes_and_main_shift_is_unchanged(setup):
  pcfg, theta, batch = setup
  plan = TapPlan(TAPS, pcfg.n_layers, 4)
  B, S = batch["tokens"].shape
  main = lambda ps: [
    (p.pairs, p.operand_bytes, p.runs) for p in ps if p.pairs == ((0, 1), (1, 2), (2, 3))
  ]
  res = {m: _grad_permutes(pcfg, theta, batch, mode=m) for m in ("off", "bulk")}
  assert main(res["off"]) == main(res["bulk"])
  assert [p for p in res["off"] if len(p.pairs) == 1] == []  # off: nothing but the pipeline
  tap_ops = [p for p in res["bulk"] if len(p.pairs) == 1]
  assert all(p.runs == 1 for p in tap_ops)  # sent once, after the loop
  tapped = TapChannel(plan, "bulk").tapped_bytes((B // 4, S, pcfg.d_model), jnp.float32, 4)
  assert sum(p.wire_bytes for p in tap_ops) == tapped


# ----------------------------------------------------------------------------- the whole run


@pytest.mark.slow
def test_train_and_evaluate_under_pp4_dp2(tmp_path):
  """SFT, draft distillation and co-trained RL with every training step pipelined."""
  import json

  from specdraft.train import loop

  c = default_config.get_config("smoke,layout=pp4_dp2")
  c.data.data_dir = str(tmp_path / "tfds")
  c.rl.steps = 2
  loop.train_and_evaluate(c, str(tmp_path / "run"))
  rows = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl")]
  assert len(rows) == 2
  for r in rows:
    assert np.isfinite(r["draft_loss"]) and np.isfinite(r["rl_loss"]) and r["accept_len"] >= 1
  sft = [json.loads(x) for x in open(tmp_path / "run" / "sft_metrics.jsonl")]
  assert sft[-1]["loss"] < sft[0]["loss"]


def test_dot_flops_count_every_loop_iteration():
  """Matmul FLOPs from the compiled HLO equal the count by hand for a scanned stack and its
  gradient, as for the same stack unrolled; XLA's cost_analysis counts the scan body once (the
  reason dot_flops exists)."""
  x, ws = jnp.ones((64, 128)), jnp.ones((12, 128, 96))
  scanned = lambda x, ws: jax.lax.scan(lambda c, w: (jnp.tanh(c @ w) @ w.T, None), x, ws)[0]

  def unrolled(x, ws):
    for i in range(12):
      x = jnp.tanh(x @ ws[i]) @ ws[i].T
    return x

  by_hand = 12 * 2 * (2 * 64 * 128 * 96)  # two matmuls per layer
  for f in (scanned, unrolled):
    fwd = jax.jit(f).lower(x, ws).compile()
    assert hlo_lib.dot_flops(fwd.as_text()) == by_hand
    loss = lambda x, ws: jnp.sin(f(x, ws)).sum()  # a non-constant cotangent (no dot folds away)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, ws)
    assert hlo_lib.dot_flops(grad.compile().as_text()) == 3 * by_hand
  assert jax.jit(scanned).lower(x, ws).compile().cost_analysis()["flops"] < by_hand / 6
