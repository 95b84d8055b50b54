import copy
import json
import os
import re
import shutil

import _tolerance as tol
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import default as default_config
from specdraft.decode import autoregressive
from specdraft.model import policy as pol
from specdraft.parallel.layout import Layout
from specdraft.tasks.tokenizer import EOS, PAD
from specdraft.train import loop
from specdraft.train import step as step_lib
from specdraft.train.spec import StepSpec


def _batch(seed, B=8, S=24, V=99):
  rng = np.random.default_rng(seed)
  seg = np.ones((B, S), np.int32)
  seg[:, S // 2 :] = 2
  seg[:, -3:] = 0
  pos = np.concatenate([np.arange(S // 2), np.arange(S - S // 2)])[None].repeat(B, 0)
  return {
    "tokens": rng.integers(3, V, (B, S)).astype(np.int32),
    "positions": pos.astype(np.int32),
    "segment_ids": seg,
    "loss_mask": (rng.random((B, S)) < 0.7).astype(np.float32),
  }


def test_next_token_targets_respect_documents():
  b = _batch(0)
  targets, w = step_lib.next_token_targets({k: jnp.asarray(v) for k, v in b.items()})
  S = 24
  np.testing.assert_array_equal(targets[:, :-1], b["tokens"][:, 1:])
  assert np.all(np.asarray(w)[:, S // 2 - 1] == 0)  # last token of doc 1 does not predict doc 2
  assert np.all(np.asarray(w)[:, -4:] == 0)  # nothing predicts padding


def test_the_optimizer_builds_for_phases_of_zero_or_one_step():
  """sft.steps = 0 is a valid config (no SFT: the phase still evaluates at step 0); its
  optimizer, and a one-step phase's, must build and step with a finite learning rate."""
  c = default_config.get_config("smoke")
  p = {"w": jnp.ones(3)}
  for steps in (0, 1, 2):
    tx = step_lib.make_optimizer(c.sft, steps)
    updates, _ = tx.update({"w": jnp.ones(3)}, tx.init(p), p)
    assert np.all(np.isfinite(updates["w"])), steps


def _sft_config(layout):
  c = default_config.get_config(f"layout={layout},smoke")
  c.model.n_kv_heads = 2  # so that kv heads split over tensor=2
  return c


def _two_sft_steps(c, parallel):
  """Initial parameters and, for two SFT steps, (state, metrics, gradients) under `parallel`."""
  cfg = pol.PolicyConfig.from_config(c.model, 99)
  tx = step_lib.make_optimizer(c.sft, 10)
  layout = Layout.from_config(parallel)
  state = loop.init_state(cfg, tx, layout, 0)
  sh = loop.state_shardings(state)
  bsh = layout.batch_sharding()

  def step_and_grads(s, b):  # sft_step's two halves, the forward/backward traced once
    spec = StepSpec.of(cfg)
    (_, metrics), grads = jax.value_and_grad(step_lib.sft_loss, has_aux=True)(s["params"], b, spec)
    return (*step_lib.apply_update(s, grads, metrics, tx), grads)

  f = jax.jit(step_and_grads, in_shardings=(sh, bsh), out_shardings=(sh, None, None))
  p0, b = jax.device_get(state["params"]), jax.device_put(_batch(1), bsh)
  out = [jax.device_get(f(state, b))]
  out.append(jax.device_get(f(out[0][0], b)))
  return p0, out


@pytest.fixture(scope="module")
def single_device_sft():
  """The single-device reference, computed once for every sharded layout."""
  c = _sft_config("single")
  c.parallel.devices = 1
  return _two_sft_steps(c, c.parallel)


@pytest.mark.parametrize("layout", ["dp8", "fsdp2_dp4", "tp2_dp4"])
def test_sharded_sft_step_equals_single_device(layout, single_device_sft):
  c = _sft_config(layout)
  p0, ((s1, m1, g1), (t1, n1, _)) = single_device_sft
  p0_8, ((s8, m8, g8), (t8, n8, _)) = _two_sft_steps(c, c.parallel)
  jax.tree.map(np.testing.assert_array_equal, p0_8, p0)  # the same initial parameters
  for a, b in ((m1, m8), (n1, n8)):
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-5)
    np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-4)
  tol.assert_grads_close(g8, g1, rtol=1e-4)
  # The warm-up schedule starts at lr 0: step 1 moves nothing (exactly), step 2 is then Adam's
  # first bias-corrected update from the same parameters and gradients, at most lr = c.sft.lr.
  jax.tree.map(np.testing.assert_array_equal, s1["params"], p0)
  jax.tree.map(np.testing.assert_array_equal, s8["params"], p0)
  tol.assert_adam_update_close(p0, t8["params"], t1["params"], g8, g1, lr=c.sft.lr)


def test_sft_learns_a_fixed_batch():
  c = default_config.get_config("smoke")
  cfg = pol.PolicyConfig.from_config(c.model, 99)
  c.sft.lr, c.sft.warmup_steps = 1e-2, 1
  tx = step_lib.make_optimizer(c.sft, 40)
  params = pol.init_params(cfg, 0)
  state = {"step": jnp.int32(0), "params": params, "opt_state": tx.init(params)}
  batch = {k: jnp.asarray(v) for k, v in _batch(2).items()}
  f = jax.jit(lambda s: step_lib.sft_step(s, batch, StepSpec.of(cfg, tx=tx)))
  losses = []
  for _ in range(40):
    state, m = f(state)
    losses.append(float(m["loss"]))
  assert losses[-1] < 0.5 * losses[0]


def test_greedy_generate_matches_naive_argmax_loop():
  cfg = pol.PolicyConfig(
    vocab_size=99, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64
  )
  params = pol.init_params(cfg, 3)
  params["embed"] = params["embed"] * 20.0  # spread-out logits: greedy choices by clear margins
  prompts = np.array([[1, 10, 11, 12, 13], [1, 20, 0, 0, 0], [1, 30, 31, 0, 0]], np.int32)
  lengths = np.array([5, 2, 3], np.int32)
  gen = autoregressive.generate(
    params, cfg, prompts, lengths, jax.random.key(0), max_new_tokens=6, temperature=0.0
  )
  for b in range(3):
    seq = list(prompts[b, : lengths[b]])
    for i in range(6):
      logits, _ = pol.forward(params, cfg, jnp.asarray([seq]))
      lp = jax.nn.log_softmax(logits[0, -1])
      nxt = int(jnp.argmax(logits[0, -1]))
      top2 = jax.lax.top_k(logits[0, -1], 2)[0]
      assert float(top2[0] - top2[1]) > 1e-3  # a margin no float32 reordering can close ...
      assert int(gen.tokens[b, i]) == nxt  # ... so the token is asserted exactly
      np.testing.assert_allclose(gen.logprobs[b, i], lp[nxt], rtol=1e-4, atol=1e-4)
      seq.append(nxt)
      if nxt == EOS:  # the naive loop's stop (EOS stopping itself: test_generate_stops_rows_at_eos)
        break
    n = len(seq) - int(lengths[b])
    assert int(gen.lengths[b]) == n
    np.testing.assert_array_equal(np.asarray(gen.tokens[b, n:]), PAD)


# A bigram policy: every layer adds nothing to the residual stream (wo = w_down = 0), so the
# logits at a position depend only on its token, through an untied head that sends token i to
# NEXT[i] with a margin of 8 nats (log-prob log(e^8 / (e^8 + 7)), far from 0 in float32). Rows
# then follow fixed chains, and when each reaches EOS is known beforehand: 3 -> 4 -> 5 -> EOS,
# while 6 <-> 7 never ends. After EOS the chain would go on (EOS -> 3), so a row that is not
# stopped shows it.
NEXT = {PAD: 3, 1: 3, EOS: 3, 3: 4, 4: 5, 5: EOS, 6: 7, 7: 6}


def bigram_policy():
  V, E = 8, 16
  cfg = pol.PolicyConfig(
    vocab_size=V,
    d_model=E,
    n_layers=2,
    n_heads=2,
    n_kv_heads=1,
    head_dim=8,
    d_ff=32,
    tie_embeddings=False,
  )
  params = pol.init_params(cfg, 0)
  params["layers"]["wo"] = jnp.zeros_like(params["layers"]["wo"])
  params["layers"]["w_down"] = jnp.zeros_like(params["layers"]["w_down"])
  params["embed"] = jnp.eye(V, E)
  head = np.zeros((E, V), np.float32)
  for i, j in NEXT.items():
    head[i, j] = 2.0  # rms_norm(one-hot) = 4 * one-hot: logit 8
  params["head"] = jnp.asarray(head)
  params["final_norm"] = jnp.ones((E,))
  return cfg, params


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generate_stops_rows_at_eos(temperature):
  cfg, params = bigram_policy()
  N = 10
  prompts = np.array([[1, 3, 0], [1, 6, 5], [1, 6, 0], [1, 4, 0]], np.int32)
  lengths = np.array([2, 3, 2, 2], np.int32)
  # row 0: 4 5 EOS; row 1: EOS at once; row 2: 7 6 7 ... never stops; row 3: 5 EOS
  want = [[4, 5, EOS], [EOS], [7, 6] * (N // 2), [5, EOS]]
  gen = autoregressive.generate(
    params, cfg, prompts, lengths, jax.random.key(1), max_new_tokens=N, temperature=temperature
  )
  tokens, logprobs = np.asarray(gen.tokens), np.asarray(gen.logprobs)
  np.testing.assert_array_equal(gen.lengths, [len(w) for w in want])
  for b, w in enumerate(want):
    n = len(w)
    np.testing.assert_array_equal(tokens[b, :n], w)
    np.testing.assert_array_equal(tokens[b, n:], PAD)  # nothing after EOS ...
    np.testing.assert_array_equal(logprobs[b, n:], 0.0)  # ... and no log-prob either
    np.testing.assert_allclose(logprobs[b, :n], np.log(np.e**8 / (np.e**8 + 7)), rtol=1e-3)
  assert int(gen.stats["policy_passes"]) == N + 1  # row 2 keeps the loop running to the end


def _read(path):
  with open(path) as f:
    return [json.loads(ln) for ln in f]


@pytest.mark.slow  # ~2 min; `make test-slow` (and CI) run it
def test_train_and_evaluate_smoke_and_exact_resume(smoke_config, tmp_path):
  c = smoke_config
  full = str(tmp_path / "full")
  summary = loop.train_and_evaluate(c, full)
  assert summary["sft_steps"] == c.sft.steps
  ph = summary["phase_seconds"]  # each phase's wall time; together within the run's
  assert list(ph) == ["sft", "draft", "rl", "report", "plots"]
  assert all(v > 0 for v in ph.values()) and sum(ph.values()) <= summary["wall_seconds"]
  assert "wall time (s): sft / draft / rl / report / plots" in loop.summary_table(summary)
  for f in (
    "sft_metrics.jsonl",
    "eval.jsonl",
    "draft_metrics.jsonl",
    "summary.json",
    "plots/sft_loss.png",
    "plots/eval_accuracy.png",
    "plots/draft_ttt_acc.png",
  ):
    assert os.path.exists(os.path.join(full, f)), f
  # Interrupted after the first checkpoint (step 6), then resumed: same SFT metrics afterwards.
  # (Later phases do not touch the SFT metrics; they are skipped to keep the test short.)
  c.draft.pretrain_steps, c.rl.steps = 0, 0
  part = str(tmp_path / "part")
  loop.train_and_evaluate(c, part, stop_after=("sft", 8))
  assert [r["step"] for r in _read(os.path.join(part, "sft_metrics.jsonl"))] == [4, 8]
  loop.train_and_evaluate(c, part)
  a, b = (
    _read(os.path.join(full, "sft_metrics.jsonl")),
    _read(os.path.join(part, "sft_metrics.jsonl")),
  )
  assert [r["step"] for r in a] == [r["step"] for r in b] == [4, 8, 12]
  for ra, rb in zip(a, b):
    assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6)
    assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-5)


def test_corrupt_latest_checkpoint_falls_back(smoke_config, tmp_path, capsys):
  c = smoke_config
  c.draft.pretrain_steps, c.rl.steps = 0, 0  # the fallback is per phase; SFT shows it
  wd = str(tmp_path / "run")
  loop.train_and_evaluate(c, wd)  # checkpoints at 6 and 12
  ckdir = os.path.join(wd, "checkpoints", "sft")
  assert sorted(os.listdir(ckdir)) == ["12", "6"]
  # Corrupt the newest: remove its state payload.
  shutil.rmtree(os.path.join(ckdir, "12", "state"))
  c.sft.steps = 12
  loop.train_and_evaluate(c, wd)
  out = capsys.readouterr().out
  assert "checkpoint at step 12" in out and "falling back" in out
  assert "Resumed sft from step 6" in out
  assert [r["step"] for r in _read(os.path.join(wd, "sft_metrics.jsonl"))] == [4, 8, 12]


@pytest.mark.slow  # two draft-iteration compiles and a resume, ~15 s
def test_draft_rollout_temperatures_cycle_over_steps_from_the_step_count(
  smoke_config, tmp_path, monkeypatch
):
  from specdraft.train import draft as draft_lib
  from specdraft.train import phases

  c = smoke_config
  c.draft.pretrain_steps, c.draft.rollout_temperatures = 3, (0.0, 1.0)
  c.checkpoint.every = 2
  used, original = [], draft_lib.draft_iteration

  def recording(*args, temperature, **kw):  # one entry per executed step
    jax.debug.callback(lambda: used.append(temperature))
    return original(*args, temperature=temperature, **kw)

  monkeypatch.setattr(draft_lib, "draft_iteration", recording)
  ctx = loop.Context(c, str(tmp_path / "run"))
  params = pol.init_params(ctx.models.pcfg, 0)
  phases.draft_phase(ctx, params, stop_after=2)
  jax.effects_barrier()
  assert used == [0.0, 1.0]
  _, finished = phases.draft_phase(ctx, params)  # resumes at step 2: temperature 0 again
  jax.effects_barrier()
  assert finished and used == [0.0, 1.0, 0.0]


def test_a_resumed_workdir_refuses_a_change_to_what_the_run_is(smoke_config, tmp_path):
  """workdir/run_config.json records the run's config; resuming the workdir under another policy,
  task, data or draft identity is refused before any work, naming the field; steps, evaluation,
  export and the like may change."""
  c = smoke_config
  wd = str(tmp_path / "run")
  loop.check_and_record_config(c, wd)
  with open(os.path.join(wd, loop.RUN_CONFIG)) as f:
    rec = json.load(f)
  assert rec["identity"]["model.n_layers"] == c.model.n_layers
  assert rec["config"]["sft.steps"] == c.sft.steps
  c.sft.steps, c.eval.report_repeats, c.checkpoint.keep = c.sft.steps + 5, 0, 3
  loop.check_and_record_config(c, wd)  # a longer run, no report, more checkpoints: the same run
  with open(os.path.join(wd, loop.RUN_CONFIG)) as f:
    assert json.load(f)["config"]["sft.steps"] == c.sft.steps  # the latest invocation's config
  for field, value in (
    ("model.init_from", "/elsewhere/checkpoint"),
    ("draft.vocab_file", "/elsewhere/vocab.json"),
    ("draft.kind", "dflash"),
    ("task.arithmetic.max_digits", 4),
    ("seed", 7),
  ):
    d = copy.deepcopy(c)
    *path, last = field.split(".")
    node = d
    for p in path:
      node = node[p]
    node[last] = value
    with pytest.raises(ValueError, match=rf"config\.{re.escape(field)}=.*started with"):
      loop.check_and_record_config(d, wd)
  # a run recorded before draft.block.anchor_residual existed resumes under the value it had:
  # '' (the default) for its EAGLE-3 draft; a DSpark run had its anchor slot at the token
  with open(os.path.join(wd, loop.RUN_CONFIG)) as f:
    rec = json.load(f)
  del rec["identity"]["draft.block.anchor_residual"]
  with open(os.path.join(wd, loop.RUN_CONFIG), "w") as f:
    json.dump(rec, f)
  loop.check_and_record_config(c, wd)
  d = copy.deepcopy(c)
  d.draft.block.anchor_residual = "mask"
  with pytest.raises(ValueError, match=r"anchor_residual='mask' .*started with ''"):
    loop.check_and_record_config(d, wd)
  # train_and_evaluate checks before building anything
  d = copy.deepcopy(c)
  d.seed = 7
  with pytest.raises(ValueError, match=r"config\.seed=7 .*started with 0"):
    loop.train_and_evaluate(d, wd)
  assert sorted(os.listdir(wd)) == [loop.RUN_CONFIG]


def test_the_rl_state_shards_each_moment_like_its_parameter(tmp_path):
  """Under fsdp the RL phase's initial state holds the policy's and the draft's Adam moments
  sharded like their parameters, as the co-training step returns them: not replicated on every
  device, and the step compiles once instead of again at step 2."""
  import optax

  from specdraft.train import phases
  from specdraft.train import state as state_lib

  c = default_config.get_config("smoke,layout=fsdp2_dp4")
  c.data.data_dir = str(tmp_path / "tfds")
  ctx = loop.Context(c, str(tmp_path / "run"))
  params = state_lib.init_state(ctx.models.pcfg, optax.sgd(0.1), ctx.layout, 0)["params"]
  dparams = phases.init_draft(ctx, params)
  tx = step_lib.make_cotrain_optimizer(c.rl, c.draft, train_draft=True)
  state, _ = phases.rl_state(ctx, tx, params, dparams)
  moments = []

  def same(moment, param):
    moments.append("fsdp" in str(param.sharding.spec))
    assert moment.sharding.is_equivalent_to(param.sharding, param.ndim), (
      f"a moment sharded {moment.sharding.spec} of a {param.shape} parameter sharded "
      f"{param.sharding.spec}"
    )

  is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
  for part in ("policy", "draft"):  # multi_transform: one masked AdamW per part
    (adam,) = [
      x
      for x in jax.tree.leaves(state["opt_state"].inner_states[part], is_leaf=is_adam)
      if is_adam(x)
    ]
    jax.tree.map(same, adam.mu[part], state["params"][part])
    jax.tree.map(same, adam.nu[part], state["params"][part])
    assert adam.count.sharding.is_fully_replicated
  assert sum(moments) >= 8, "too few fsdp-sharded parameters for the test to mean anything"


def test_a_context_shares_run_data_only_with_a_config_that_agrees_on_it(smoke_config, tmp_path):
  """Context is built from parts (data, models, layout, rollouts); a benchmark's arms share one
  RunData when they agree on what it is built from (RunData.KEYS and the tokenizer as the run
  finds it), and one built for another task, data or tokenizer is refused before any work."""
  import copy

  from specdraft.train import phases

  base = loop.Context(smoke_config, str(tmp_path / "base"))
  assert base.models.pcfg.vocab_size >= base.data.tok.vocab_size
  assert base.layout.mesh.size >= 1 and base.rollouts.cost_model is None
  arm = copy.deepcopy(smoke_config)
  arm.seed, arm.data.shuffle_seed, arm.rl.steps = 7, 7, 1  # not what the data is built from
  shared = base.data.shared_with(arm)
  assert shared is base.data
  ctx = loop.Context(arm, str(tmp_path / "arm"), data=shared)
  assert ctx.data is base.data and ctx.rollouts is not base.rollouts
  assert ctx.data.prompt_len == base.data.prompt_len
  n = smoke_config.eval.num_examples
  changes = {
    "eval.num_examples": n + 1,
    "data.data_dir": str(tmp_path / "elsewhere"),
    "data.tokenizer": str(tmp_path / "tokenizer.json"),  # another tokenizer ...
    "model.init_from": str(tmp_path / "hf"),  # ... or the one of a checkpoint
    "data.chat_template": True,
    "data.seq_len": smoke_config.data.seq_len + 8,
  }
  for path, value in changes.items():
    other = copy.deepcopy(smoke_config)
    section, field = path.split(".")
    other[section][field] = value
    assert base.data.shared_with(other) is None, path
  for field in ("name", "seed", "num_train", "num_test", "arithmetic.max_digits"):  # the task's
    other = copy.deepcopy(smoke_config)
    *up, last = field.split(".")
    where = other.task[up[0]] if up else other.task
    v = where[last]
    where[last] = "countdown" if field == "name" else v + 1
    assert base.data.shared_with(other) is None, field
  other = copy.deepcopy(smoke_config)
  other.eval.num_examples = n + 1
  with pytest.raises(ValueError, match=f"eval.num_examples={n + 1}"):
    loop.Context(other, str(tmp_path / "other"), data=base.data)
  del other.sft["steps"]
  with pytest.raises(ValueError, match="config.sft.steps is missing"):
    phases.RunData.key_of(other)
