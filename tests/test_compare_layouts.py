"""Sharding layouts compared (experiments/bench/compare_layouts.py): collective bytes read from the
HLO against a count by hand, every named layout's co-training step against the single-device
step, the comparison at smoke size, the plan, and the committed sharding snapshots."""

import difflib
import json
import os

import _tolerance as tol
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec

from configs import compare_layouts as compare_config
from experiments.bench import compare_layouts as cl
from experiments.bench import hlo as hlo_lib
from specdraft.parallel import layouts
from specdraft.train import state as state_lib

SNAPSHOTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "snapshots", "shardings")
UPDATE = (
  "python experiments/compare_layouts.py --config=configs/compare_layouts.py:smoke "
  "--update_snapshots"
)


# ----------------------------------------------------------------------------- collectives


def test_collective_bytes_by_hand():
  """One collective of each kind over the 4-device axis of a 4x2 mesh, inside a loop of 3 trips:
  bytes sent per device as the ring algorithm counts them (hlo.Collective.sent_bytes)."""
  mesh = jax.make_mesh((4, 2), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)

  def body(x_16, y_8):
    s = jax.lax.psum(x_16, "a")  # all-reduce f32[16]: 2 * 64 * 3/4 = 96 bytes
    g = jax.lax.all_gather(y_8, "a", tiled=True)  # all-gather -> f32[32]: 128 * 3/4 = 96
    r = jax.lax.psum_scatter(x_16 * 2, "a", tiled=True)  # reduce-scatter -> f32[4]: 16 * 3 = 48
    p = jax.lax.ppermute(y_8, "a", [(i, (i + 1) % 4) for i in range(4)])  # permute f32[8]: 32
    t = jax.lax.all_to_all(y_8 * 3, "a", 0, 0, tiled=True)  # all-to-all f32[8]: 32 * 3/4 = 24
    return jnp.sum(s) + jnp.sum(g) + jnp.sum(r) + jnp.sum(p) + jnp.sum(t)

  f = jax.shard_map(
    body,
    mesh=mesh,
    in_specs=(PartitionSpec("a"), PartitionSpec("a")),  # x: [64] -> 16 each; y: [32] -> 8 each
    out_specs=PartitionSpec(),
    axis_names={"a"},
    check_vma=False,
  )

  def looped(x, y):
    return jax.lax.fori_loop(0, 3, lambda i, c: c + f(x + c, y * c), 0.0)

  text = jax.jit(looped).lower(jnp.ones(64), jnp.ones(32)).compile().as_text()
  got = hlo_lib.collective_bytes(text)
  want = {
    "all-reduce": 96,
    "all-gather": 96,
    "reduce-scatter": 48,
    "collective-permute": 32,
    "all-to-all": 24,
  }
  for kind, per_run in want.items():
    assert got[kind]["ops"] >= 1, f"{kind}: not found in the program"
    assert got[kind]["sent_bytes"] == 3 * per_run, f"{kind}: {got[kind]}"


# ----------------------------------------------------------------------------- parity


@pytest.fixture(scope="module")
def smoke():
  """The comparison's smoke config and setup (2 KV heads, so tensor layouts split them) and the
  single-device reference: (config, setup, initial parameters, (metrics, gradients))."""
  c = compare_config.get_config("smoke")
  s = cl.make_setup(c)
  trainable = cl.initial_trainable(s)
  single = cl.make_layout("single", cl.named_parallel("single"))
  return c, s, trainable, cl.cotrain_grads(s, single, trainable)


def test_smoke_model_has_two_kv_heads(smoke):
  c, s, *_ = smoke
  assert s.pcfg.n_kv_heads == 2 and s.pcfg.n_heads % 2 == 0


# `make test` keeps the two tensor combinations added with this file (~12 s each); the rest run
# in `make test-slow` (CI runs both): the cp layouts' steps are also compared in
# tests/test_sequence.py, pp4_dp2's in tests/test_pipeline.py, and the pp layouts compile the
# pipeline's schedule (the slowest cases).
_FAST = {"fsdp4_tp2", "pp2_tp2_dp2"}


@pytest.mark.parametrize(
  "name",
  [
    n if n in _FAST else pytest.param(n, marks=pytest.mark.slow)
    for n in sorted(layouts.LAYOUTS)
    if n != "single"
  ],
)
def test_every_layout_cotrain_step_equals_single_device(name, smoke):
  """Every named layout (a new one is tested by being named in LAYOUTS): the co-training loss,
  gradient norms and every gradient leaf, relative to its norm, equal the single-device step's."""
  _assert_layout_equals_single(name, *smoke[1:])


def _assert_layout_equals_single(name, s, trainable, reference):
  m1, g1 = reference
  lay = cl.make_layout(name, cl.named_parallel(name))
  m2, g2 = cl.cotrain_grads(s, lay, trainable)
  assert float(m1["draft_loss"]) > 0 and float(m1["draft_grad_norm"]) > 0
  for k in ("loss", "rl_loss", "draft_loss", "policy_grad_norm", "draft_grad_norm"):
    np.testing.assert_allclose(m2[k], m1[k], rtol=1e-4, atol=1e-6, err_msg=f"{name}: {k}")
  tol.assert_grads_close(g2, g1, rtol=1e-4, err=name)
  p = cl.parity_figures((m2, g2), (m1, g1), rtol=1e-4)
  assert p["passed"] and p["max_grad_rel_diff"] <= 1e-4


_BLOCK_REFERENCES = {}


@pytest.mark.parametrize(
  "kind,name",
  [
    ("dflash", "pp2_tp2_dp2"),  # the block draft on the last stage, its heads split
    pytest.param("dflash", "tp2_cp2_dp2", marks=pytest.mark.slow),  # block queries on the ring
    pytest.param("dspark", "pp2_cp2_dp2", marks=pytest.mark.slow),
    pytest.param("dspark", "fsdp4_tp2", marks=pytest.mark.slow),
  ],
)
def test_block_draft_cotrain_step_equals_single_device_across_layouts(kind, name):
  """The comparison runs block drafts too (config.draft.kind): their co-training step under a
  layout equals the single-device step, as EAGLE-3's does."""
  if kind not in _BLOCK_REFERENCES:
    c = compare_config.get_config("smoke")
    c.draft.kind = kind
    s = cl.make_setup(c)
    assert type(s.dcfg).__name__ == "BlockDraftConfig" and s.dcfg.kind == kind
    trainable = cl.initial_trainable(s)
    single = cl.make_layout("single", cl.named_parallel("single"))
    _BLOCK_REFERENCES[kind] = (s, trainable, cl.cotrain_grads(s, single, trainable))
  _assert_layout_equals_single(name, *_BLOCK_REFERENCES[kind])


def test_parity_figures_catch_a_wrong_gradient(smoke):
  """The comparison's parity verdict fails when one leaf is off by 1e-3 of its norm."""
  *_, (m, g) = smoke
  bad = jax.tree.map(np.array, g)
  w = bad["policy"]["layers"]["wq"]
  w += 1e-3 * np.linalg.norm(w) / np.sqrt(w.size)
  p = cl.parity_figures((m, bad), (m, g), rtol=1e-4)
  assert not p["passed"] and p["worst_leaf"] == "['policy']['layers']['wq']"
  assert p["max_grad_rel_diff"] == pytest.approx(1e-3, rel=1e-3)


def test_first_step_moments_are_the_clipped_gradients(smoke):
  """The comparison's parity reads a layout's compiled step once: Adam's first moments after one
  step from zero are (1 - b1) times the gradient clipped per partition (policy, draft), so they
  compare as the gradients do. Checked on one device against `cotrain_grads`."""
  c, s, trainable, (m, g) = smoke
  lay = cl.make_layout("single", cl.named_parallel("single"))
  compiled = {"single": cl.compile_layout(s, lay, sft=False)["compiled"]}
  first, _ = cl.run_steps(s, {"single": lay}, compiled, repeats=0)
  metrics, mu = first["single"]
  for part, clip in (("policy", c.rl.grad_clip), ("draft", c.draft.grad_clip)):
    norm = float(metrics[f"{part}_grad_norm"])
    np.testing.assert_allclose(norm, float(m[f"{part}_grad_norm"]), rtol=1e-5)
    scale = 0.1 * min(1.0, clip / norm)  # optax.adamw's b1 = 0.9
    for path, x in jax.tree_util.tree_leaves_with_path(g[part]):
      key = f"['{part}']" + jax.tree_util.keystr(path)
      want = scale * np.asarray(x)
      err = np.linalg.norm(mu[key] - want) / max(np.linalg.norm(want), 1e-30)
      assert err < 1e-5, (key, err)
  p = cl.parity_figures(first["single"], first["single"], rtol=1e-4)
  assert p["passed"] and p["max_grad_rel_diff"] == 0.0


# ----------------------------------------------------------------------------- the comparison


@pytest.mark.slow  # ~1 min
def test_comparison_at_smoke_size(tmp_path):
  """single beside a mesh from the command line (data=2, fsdp=2, tensor=2): figures that must
  hold, a results file with provenance and goals, the table and the plots."""
  c = compare_config.get_config("smoke")
  c.compare.layouts = "single"
  c.compare.repeats = 1
  c.parallel.mesh.data, c.parallel.mesh.fsdp, c.parallel.mesh.tensor = 2, 2, 2
  res = cl.run(c, str(tmp_path))
  rows = res["layouts"]
  assert list(rows) == ["single", "custom:data=2,fsdp=2,tensor=2"]
  single, custom = rows.values()
  for r in rows.values():
    for step in ("cotrain", "sft"):
      assert all(r[step][k] > 0 for k in cl.QUANTITIES), r[step]
      assert r[step]["flops"] > 0 and r[step]["dot_flops"] > 0
    assert r["parity"]["passed"], r["parity"]
    assert r["step_seconds"] > 0
  for step in ("cotrain", "sft"):
    assert single[step]["collective_bytes"] == 0
    assert custom[step]["collectives"]["all-reduce"]["sent_bytes"] > 0  # gradients over data
    # fsdp x tensor shard the policy and its Adam moments: fewer argument bytes per device
    assert custom[step]["argument_bytes"] < single[step]["argument_bytes"]
    # a quarter of the batch per device and half the heads: fewer matmul FLOPs
    assert custom[step]["dot_flops"] < single[step]["dot_flops"] / 4
  assert single["time_over_single"] == 1.0
  written = json.load(open(tmp_path / "results.json"))
  assert written["goals"]["parity"]["met"] and written["goals"]["single_moves_nothing"]["met"]
  assert "commit" in written and "command" in written
  for f in ("table.md", "peak_memory.png", "collectives.png", "time.png", "parity.png"):
    assert (tmp_path / f).stat().st_size > 0, f
  assert "custom:data=2,fsdp=2,tensor=2" in (tmp_path / "table.md").read_text()


def test_selected_layouts_and_a_command_line_mesh():
  c = compare_config.get_config("smoke")
  c.compare.layouts = "dp8,fsdp4_tp2"
  assert [n for n, _ in cl.selected(c)] == ["single", "dp8", "fsdp4_tp2"]
  assert [int(p.devices) for _, p in cl.selected(c)] == [1, 8, 8]
  c.compare.layouts = "all"
  c.parallel.mesh.pp, c.parallel.mesh.tensor = 2, 2
  entries = dict(cl.selected(c))
  assert set(entries) == set(layouts.LAYOUTS) | {"custom:tensor=2,pp=2"}
  p = entries["custom:tensor=2,pp=2"]
  assert int(p.devices) == 4 and int(p.pipeline.microbatches) == 4


def test_unknown_layout_names_the_field():
  c = compare_config.get_config("smoke")
  c.compare.layouts = "single,dp3"
  with pytest.raises(ValueError, match=r"config.compare.layouts='single,dp3' is invalid.*dp3"):
    cl.selected(c)


def _fsdp8_figures(vocab_chunk: int) -> tuple[dict, int]:
  """(compiled figures of the smoke co-training step under fsdp8 at 64 tokens per row and
  `vocab_chunk`, bytes of the policy's and the draft's parameters)."""
  c = compare_config.get_config("smoke")
  c.compare.seq_len = 64
  c.compute.vocab_chunk = vocab_chunk
  s = cl.make_setup(c, host_batch=False)
  lay = cl.make_layout("fsdp8", cl.named_parallel("fsdp8"))
  figures = cl.compile_layout(s, lay, sft=False)["cotrain"]
  abstract, _ = cl.cotrain_state_shardings(s, lay)
  n = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(abstract["params"]))
  return figures, n


def test_fsdp_moves_weights_once_not_activations(monkeypatch):
  """Under fsdp8 a co-training step's collectives stay within a few times the parameters' bytes
  (gather the weights, reduce their gradients) and do not grow with the number of vocabulary
  chunks: the trunk's residual stream is pinned to rows (`mesh.activation_constraint`) and the
  chunk loops run on each device's rows with the heads gathered once (`mesh.rows_local`).
  Without them (the control, measured 44-52x here) the compiler reshards activations and
  reduces a head-sized gradient on every chunk."""
  whole, n = _fsdp8_figures(0)
  chunked, _ = _fsdp8_figures(16)  # 4 chunks a row
  assert whole["collective_bytes"] <= 8 * n, (whole["collectives"], n)
  assert chunked["collective_bytes"] <= 1.05 * whole["collective_bytes"], (
    chunked["collectives"],
    whole["collectives"],
  )
  from specdraft.parallel import mesh as mesh_lib

  monkeypatch.setattr(mesh_lib, "activation_constraint", lambda mesh, rules=None: None)
  monkeypatch.setattr(mesh_lib, "rows_local", lambda mesh, rules=None: None)
  control, _ = _fsdp8_figures(16)
  assert control["collective_bytes"] > 8 * n, (control["collectives"], n)


def _skip_test_collectives(name: str) -> list:
  """The collectives of the smoke co-training step under layout `name` that come from the
  attention's per-tile skip test (an `any` over the batch: reduce_or), with how often they run."""
  s = cl.make_setup(compare_config.get_config("smoke"), host_batch=False)
  lay = cl.make_layout(name, cl.named_parallel(name))
  text = cl.compile_layout(s, lay, sft=False)["compiled"].as_text()
  return [
    (c.kind, c.runs, c.op_name)
    for c in hlo_lib.collectives(text, lay.devices)
    if c.op_name.endswith("reduce_or")
  ]


@pytest.mark.parametrize("name", ["dp8", "tp2_cp2_dp2", "pp4_dp2"])
def test_attention_tile_loops_do_not_communicate(name, monkeypatch):
  """The attention's tile loops skip a tile pair that no row of the batch sees: a test over the
  whole batch, which, with the batch split over data, XLA made an all-reduce per tile pair inside
  the loops (beside the ring's permutes; the CPU runtime's rendezvous aborts under tp2_cp2_dp2 and
  pp2_cp2_dp2). With the mask metadata whole on every device (`mesh.metadata_constraint`) the
  test is local: no collective comes from it. The control under every layout, without it, has
  them."""
  assert _skip_test_collectives(name) == []
  from specdraft.parallel import mesh as mesh_lib

  monkeypatch.setattr(mesh_lib, "metadata_constraint", lambda mesh: None)
  control = _skip_test_collectives(name)
  assert control and all(k == "all-reduce" for k, _, _ in control), control


@pytest.mark.slow
def test_plan_compiles_abstract_inputs_on_eight_devices(capsys):
  """The plan at smoke size on the 8 test devices: fsdp shards the arguments (the policy's and
  the draft's) and gathers its weights."""
  c = compare_config.get_config("smoke")
  c.compare.plan.devices = 8
  c.compare.plan.batch_size = 16
  c.compare.plan.meshes = {"dp8": {"data": 8}, "fsdp8": {"fsdp": 8}}
  rows = cl.plan(c)
  assert all("error" not in r for r in rows.values()), rows
  assert rows["fsdp8"]["argument_bytes"] < rows["dp8"]["argument_bytes"] / 2
  assert rows["dp8"]["collectives"]["all-reduce"]["sent_bytes"] > 0
  assert rows["fsdp8"]["collectives"]["all-gather"]["sent_bytes"] > 0
  # dp8 gathers only the attention's mask metadata (int32 positions and segment ids, for the
  # tile loops' skip test: `mesh.metadata_constraint`; measured 6.6x below fsdp8's gathers at
  # this size), fsdp8 the weights besides
  gathered = {k: rows[k]["collectives"]["all-gather"]["sent_bytes"] for k in ("dp8", "fsdp8")}
  assert gathered["dp8"] < gathered["fsdp8"] / 3, gathered
  assert "fsdp8" in capsys.readouterr().out


# ----------------------------------------------------------------------------- snapshots


@pytest.fixture(scope="module")
def snapshot_setup():
  return cl.make_setup(compare_config.get_config("smoke"), host_batch=False)


@pytest.mark.parametrize("name", sorted(layouts.LAYOUTS))
def test_sharding_snapshot(name, snapshot_setup):
  """The PartitionSpec of every parameter and optimizer-state leaf equals the committed one."""
  path = os.path.join(SNAPSHOTS, f"{name}.txt")
  got = cl.snapshot_text(snapshot_setup, cl.make_layout(name, cl.named_parallel(name)))
  assert os.path.exists(path), f"no snapshot for layout {name!r}: run `{UPDATE}`"
  want = open(path).read()
  if got != want:
    diff = "".join(
      difflib.unified_diff(
        want.splitlines(True), got.splitlines(True), f"committed {name}.txt", "now"
      )
    )
    pytest.fail(
      f"the shardings of layout {name!r} changed:\n{diff}\nIf this is intended, run `{UPDATE}` "
      "and commit the snapshots."
    )


@pytest.mark.parametrize("name", ["fsdp4_tp2", "cp4_dp2", "pp2_cp2_dp2"])
def test_the_trainers_own_state_matches_its_snapshot(name, snapshot_setup):
  """The state the trainer places (`state.init_state` for SFT, `state.init_draft`, then the RL
  phase's `state.keyed_state`: what `train/phases.py` calls), rendered from the shardings its
  arrays carry, equals the committed snapshot: the snapshots show what training runs."""
  s = snapshot_setup
  lay = cl.make_layout(name, cl.named_parallel(name))
  policy = state_lib.init_state(s.pcfg, s.sft_tx, lay, 0)["params"]
  draft = state_lib.init_draft(s.dcfg, s.pcfg, policy, lay, 1)
  state, sh = state_lib.keyed_state(s.cotrain_tx, {"policy": policy, "draft": draft}, lay, 3)
  placed = jax.tree.map(lambda x: x.sharding, state)
  got = cl.render_snapshot(lay, state, placed)
  assert got == open(os.path.join(SNAPSHOTS, f"{name}.txt")).read()
  # the shardings the step compiles with are the ones the arrays carry
  assert cl.render_snapshot(lay, state, sh) == got


def test_weights_are_sharded_over_cp_and_a_cp8_checkpoint_restores_under_dp8(tmp_path):
  """With parallel.shard_weights_over_cp (default on) the cp ranks hold different slices of every
  parameter and moment (the 'embed' rule is (fsdp, cp)); a checkpoint written under cp8 restores
  under dp8 (orbax reshards to the target shardings) bit for bit, and dp8's compiled step runs on
  the restored state exactly as on the same values placed directly."""
  from specdraft.train.checkpoint import Checkpointer

  s = cl.make_setup(compare_config.get_config("smoke"))
  cp8, dp8 = (cl.make_layout(n, cl.named_parallel(n)) for n in ("cp8", "dp8"))
  policy = state_lib.init_state(s.pcfg, s.sft_tx, cp8, 0)["params"]
  draft = state_lib.init_draft(s.dcfg, s.pcfg, policy, cp8, 1)
  state, _ = state_lib.keyed_state(s.cotrain_tx, {"policy": policy, "draft": draft}, cp8, 3)
  wq = state["params"]["policy"]["layers"]["wq"]
  assert wq.sharding.spec[1] == "cp" and wq.addressable_shards[0].data.shape[1] == 32 // 8
  # the moments follow: no device holds a whole Adam moment of a width-sharded weight
  mus = [
    x
    for p, x in jax.tree_util.tree_leaves_with_path(state["opt_state"])
    if jax.tree_util.keystr(p).endswith("['policy']['layers']['wq']")
  ]
  assert mus and all(m.sharding.spec[1] == "cp" for m in mus)
  # without the rule the same layout replicates them over cp
  flat = cl.named_parallel("cp8")
  flat.shard_weights_over_cp = False
  _, sh = state_lib.cotrain_state_shardings(
    s.pcfg, s.dcfg, s.cotrain_tx, cl.make_layout("cp8", flat)
  )
  assert sh["params"]["policy"]["layers"]["wq"].spec == PartitionSpec(None, None, None, None)

  saved = {k: state[k] for k in ("step", "params", "opt_state")}
  ck = Checkpointer(str(tmp_path / "ckpt"))
  ck.save(0, saved, {"data_iter": None})
  abstract, dp8_sh = cl.cotrain_state_shardings(s, dp8)
  target = jax.tree.map(
    lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), abstract, dp8_sh
  )
  step, restored, _ = ck.restore_latest(target)
  ck.close()
  assert step == 0
  host = jax.device_get(saved)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), host)
  for x, sh in zip(jax.tree.leaves(restored), jax.tree.leaves(dp8_sh), strict=True):
    assert x.sharding.is_equivalent_to(sh, x.ndim), (x.sharding, sh)

  batch, batch_sh = cl.laid_out_batch(s, dp8)
  fn = cl.cotrain_program(s, dp8, dp8_sh, batch_sh)
  batch = jax.device_put(batch, batch_sh)
  after, m1 = jax.device_get(fn(restored, batch))
  again, m2 = jax.device_get(fn(jax.device_put(host, dp8_sh), batch))
  jax.tree.map(np.testing.assert_array_equal, (after, m1), (again, m2))
  assert np.isfinite(m1["loss"])


def test_snapshot_names_every_leaf_with_its_spec(snapshot_setup):
  text = cl.snapshot_text(
    snapshot_setup, cl.make_layout("fsdp4_tp2", cl.named_parallel("fsdp4_tp2"))
  )
  lines = dict(line.split("  ", 1) for line in text.splitlines()[1:])
  assert lines["params/policy/layers/wq"].endswith("(None, 'fsdp', 'tensor', None)")
  mu = [k for k in lines if k.endswith("mu/policy/layers/wq")]
  assert len(mu) == 1 and lines[mu[0]] == lines["params/policy/layers/wq"]
  # the draft is sharded like the policy's layers (its width over fsdp, heads over tensor)
  assert lines["params/draft/fc"].endswith("(None, 'fsdp')")
  assert lines["params/draft/wq"].endswith("('fsdp', 'tensor', None)")
  mu = [k for k in lines if k.endswith("mu/draft/wq")]
  assert len(mu) == 1 and lines[mu[0]] == lines["params/draft/wq"]


# ----------------------------------------------------------------------------- long rows


@pytest.mark.parametrize("name", ["cp4_dp2", pytest.param("pp2_cp2_dp2", marks=pytest.mark.slow)])
def test_long_rows_leave_no_quadratic_or_vocabulary_sized_buffer(name):
  """The compiled co-training step (forward and backward) under a cp layout at S = 2048 has no
  array of (S/cp)^2 elements (the ring attends in tiles) nor of (S/cp) x V (the vocabulary is
  chunked), on any device; the same layout with whole-row logits (vocab_chunk = 0) has an
  (S/cp) x V one (the negative control: the check sees such buffers)."""
  from _hlo import largest_array

  c = compare_config.get_config("smoke")
  S, V = 2048, 1024
  c.model.vocab_size = V
  c.compute.update(attn_tile=128, vocab_chunk=128)
  lay = cl.make_layout(name, cl.named_parallel(name))
  local = S // lay.cp

  def largest(vocab_chunk):
    c.compute.vocab_chunk = vocab_chunk
    s = cl.make_setup(c, batch_size=lay.devices // lay.cp, seq_len=S, host_batch=False)
    return largest_array(cl.compile_layout(s, lay, sft=False)["compiled"].as_text())

  chunked = largest(128)
  assert chunked < local * local and chunked < local * V, (chunked, local)
  assert largest(0) >= local * V


def _reductions(name, vocab_chunk):
  """All-reduce and reduce-scatter executions per compiled co-training step under `name`."""
  c = compare_config.get_config("smoke")
  c.model.vocab_size = 512
  c.compute.vocab_chunk = vocab_chunk
  s = cl.make_setup(c, batch_size=16, seq_len=64, host_batch=False)
  lay = cl.make_layout(name, cl.named_parallel(name))
  text = cl.compile_layout(s, lay, sft=False)["compiled"].as_text()
  return sum(
    x.runs for x in hlo_lib.collectives(text) if x.kind in ("all-reduce", "reduce-scatter")
  )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp4_dp2", "pp2_cp2_dp2"])
def test_pipelined_vocabulary_loops_reduce_once(name, monkeypatch):
  """The pipelined step's vocabulary loops (64 tokens in 8 chunks) run as many reductions per
  step as with whole-row logits: the head's gradient is summed once per loop, not per chunk.
  Negative control: without the rows-local loops (`parallel.mesh.rows_local` off) the chunked
  step reduces more often (the check sees per-chunk reductions)."""
  from specdraft.parallel import mesh as mesh_lib

  whole = _reductions(name, 0)
  assert _reductions(name, 8) == whole
  monkeypatch.setattr(mesh_lib, "rows_local", lambda mesh, rules=None: None)
  assert _reductions(name, 8) > whole


@pytest.mark.parametrize("name", ["cp4_dp2", "fsdp2_dp4"])
def test_rollout_rows_are_sharded_over_every_batch_axis(name):
  """The compiled rollout (the engine's first stage: prefill and SD rounds) under the layout's
  rows rule: every row array of its carry (both KV caches, tokens, lengths, keys) is split over
  every mesh axis a row can go to (data, fsdp and cp: all but tensor and pp), one slice of rows
  per device, never replicated over one of them."""
  from specdraft.decode import engine, speculative
  from specdraft.decode.sampling import Sampling
  from specdraft.parallel import mesh as mesh_lib

  c = compare_config.get_config("smoke")
  s = cl.make_setup(c, batch_size=8, seq_len=16, host_batch=False)
  lay = cl.make_layout(name, cl.named_parallel(name))
  ways = int(np.prod([n for a, n in lay.mesh.shape.items() if a not in ("tensor", "pp")]))
  assert ways == 8
  B, S, N, G = 16, 8, 6, 2
  rows1 = mesh_lib.rows_sharding(lay.mesh, lay.rules, ndim=1)
  rows2 = mesh_lib.rows_sharding(lay.mesh, lay.rules, ndim=2)
  tr = cl.initial_trainable(s)
  prompts = jax.device_put(jnp.ones((B, S), jnp.int32), rows2)
  lengths = jax.device_put(jnp.full((B,), S, jnp.int32), rows1)
  spec = speculative.Spec(s.pcfg, s.dcfg, N, G, False, Sampling(1.0, 0, 1.0))
  choice = speculative.Choice.of(spec, None, None)
  rows = engine.Rows(lay.mesh, rows1.spec[0])
  assert rows.min_rows == ways
  compiled = engine._start.lower(
    tr["policy"], tr["draft"], prompts, lengths, jax.random.key(0), choice, jnp.int32(0),
    spec=spec, sampler=speculative.rejection_sample,
  ).compile()  # fmt: skip
  carry_sh, _ = compiled.output_shardings
  carry_shapes, _ = jax.eval_shape(
    lambda *a: engine._start(*a, spec=spec, sampler=speculative.rejection_sample),
    tr["policy"], tr["draft"], prompts, lengths, jax.random.key(0), choice, jnp.int32(0),
  )  # fmt: skip
  checked = []

  def check(path, sh, shape):
    ax = engine._row_axis(path, shape)
    if ax is None or shape.ndim == 0 or shape.shape[ax] != B:
      return
    checked.append(jax.tree_util.keystr(path))
    assert sh.shard_shape(shape.shape)[ax] == B // ways, (jax.tree_util.keystr(path), sh)

  jax.tree_util.tree_map_with_path(check, carry_sh, carry_shapes)
  assert {"['pcache'].k", "['dcache'].k", "['out']", "['key']"} <= set(checked), checked
