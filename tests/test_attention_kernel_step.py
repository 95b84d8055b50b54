"""`attention.kernel = pallas`: the training step with the fused Pallas block (interpret mode on
CPU) in every attention it runs (the policy's trunk, the cp ring, the draft's branch rows) equals
the step with the XLA tiles, in loss, every metric and gradient, at cp = 1 and over a cp = 2 ring,
for an EAGLE-3 (TTT branch) and a DFlash (block branch) draft; the config selects it and refuses
what it cannot run before compiling."""

import _tolerance as tol
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from configs import default as default_config
from specdraft import config as config_lib
from specdraft.attention.kernels import KernelSettings
from specdraft.model import drafts
from specdraft.model import policy as pol
from specdraft.parallel import mesh as mesh_lib
from specdraft.train import sequence
from specdraft.train import step as step_lib
from specdraft.train.spec import StepSpec

KERNEL = KernelSettings(block_q=8, block_k=8, backend="interpret")


def _batch(B=2, S=16, V=99, seed=0):
  """Two rows: one document with tail padding, and two packed documents."""
  rng = np.random.default_rng(seed)
  seg = np.array([[1] * 13 + [0] * 3, [1] * 6 + [2] * 10], np.int32)[:B, :S]
  positions = np.zeros((B, S), np.int32)
  for b in range(B):
    for s in np.unique(seg[b][seg[b] > 0]):
      idx = np.where(seg[b] == s)[0]
      positions[b, idx] = np.arange(len(idx))
  mask = ((seg > 0) & (positions >= 3)).astype(np.float32)
  return {
    "tokens": rng.integers(3, V, (B, S)).astype(np.int32),
    "positions": positions,
    "segment_ids": seg,
    "loss_mask": mask,
    "logprobs": (np.log(rng.uniform(0.01, 0.2, (B, S))) * mask).astype(np.float32),
    "advantages": np.asarray([1.0, -0.5], np.float32)[:B],
  }


def _setup(kind):
  c = default_config.get_config("smoke")
  c.rl.beta = 0.1  # the KL term on: the reference policy's forward runs the kernel too
  c.model.update(n_layers=2, n_kv_heads=2)
  c.draft.kind = kind
  if kind != "eagle3":
    c.draft.block.update(block_size=3, n_layers=1)
  c.draft.ttt_steps = 2
  pcfg = pol.PolicyConfig.from_config(c.model, 99)
  dcfg = drafts.draft_config(c.draft, pcfg, num_draft=2)
  params = pol.init_params(pcfg, 0)
  return c, pcfg, dcfg, {"policy": params, "draft": drafts.init_params(dcfg, 1, params, pcfg)}


def _loss(c, pcfg, dcfg, tr, *, kernel, mesh=None):
  spec = StepSpec.of(
    pcfg, dcfg, c.rl, lam=1.0, max_tokens=16, mesh=mesh, vocab_chunk=8, attn_tile=8,
    attn_kernel=kernel,
  )  # fmt: skip
  ref = jax.tree.map(lambda x: x * 1.01, tr["policy"])
  return lambda t, b: step_lib.cotrain_loss(t, b, spec, ref)  # noqa: E731


def _value_and_grad(c, pcfg, dcfg, tr, batch, *, kernel, mesh=None):
  loss = _loss(c, pcfg, dcfg, tr, kernel=kernel, mesh=mesh)
  return jax.device_get(jax.jit(jax.value_and_grad(loss, has_aux=True))(tr, batch))


def _assert_same(got, want, err):
  (l1, m1), g1 = got
  (l0, m0), g0 = want
  np.testing.assert_allclose(l1, l0, rtol=1e-5, err_msg=err)
  assert set(m1) == set(m0), err
  for k in m0:  # argmax agreement counts tokens: identical unless a near-tie flips
    np.testing.assert_allclose(m1[k], m0[k], rtol=1e-5, atol=1e-6, err_msg=f"{err} {k}")
  tol.assert_grads_close(g1, g0, rtol=1e-5, err=err)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_step_with_the_pallas_kernel_equals_the_xla_tiles(kind):
  """cp = 1 (no collective) and cp = 2 (the kernel ring under shard_map): loss, metrics and
  gradients (relative to their norms) equal the XLA tiles' at cp = 1."""
  c, pcfg, dcfg, tr = _setup(kind)
  batch = _batch()
  laid = sequence.zigzag_order(batch, 1)
  # the kernel runs in every attention: the policy's layers (one scanned body), the reference
  # policy's and the draft's; the XLA step has none
  calls = lambda kernel: str(jax.make_jaxpr(_loss(c, pcfg, dcfg, tr, kernel=kernel))(tr, laid))  # noqa: E731
  assert calls(KERNEL).count("pallas_call") >= 3
  assert "pallas_call" not in calls(None)
  want = _value_and_grad(c, pcfg, dcfg, tr, sequence.zigzag_order(batch, 1), kernel=None)
  got = _value_and_grad(c, pcfg, dcfg, tr, sequence.zigzag_order(batch, 1), kernel=KERNEL)
  _assert_same(got, want, f"{kind} cp=1")
  mc = default_config.get_config("smoke,layout=cp2")
  mc.parallel.devices = 2
  mesh, rules = mesh_lib.make_mesh(mc.parallel), [tuple(r) for r in mc.parallel.rules]
  laid = sequence.shard(sequence.zigzag_order(batch, 2), mesh, rules)
  got = _value_and_grad(c, pcfg, dcfg, tr, laid, kernel=KERNEL, mesh=mesh)
  _assert_same(got, want, f"{kind} cp=2")


def _smoke():
  c = default_config.get_config("smoke")
  c.parallel.devices = 1
  return c


def test_the_config_selects_the_kernel_and_refuses_what_it_cannot_run():
  c = _smoke()
  assert c.attention.kernel == "xla"
  assert StepSpec.from_config(c, "sft", pcfg=None).compute.attn_kernel is None
  c.attention.update(kernel="pallas", backend="interpret", block_q=16)
  config_lib.validate(c)
  k = StepSpec.from_config(c, "sft", pcfg=None).compute.attn_kernel
  assert k == KernelSettings(block_q=16, block_k=0, backend="interpret")
  bad = [
    ("kernel", "cuda", r"config\.attention\.kernel='cuda' is invalid: expected one of"),
    ("backend", "gpu", r"config\.attention\.backend='gpu' is invalid"),
    ("block_k", -1, r"config\.attention\.block_k=-1 is invalid: must be >= 0"),
    ("num_warps", 0, r"config\.attention\.num_warps=0 is invalid"),
  ]
  for field, value, message in bad:
    c2 = _smoke()
    c2.attention[field] = value
    with pytest.raises(ValueError, match=message):
      config_lib.validate(c2)
  c3 = _smoke()
  c3.attention.update(kernel="pallas", backend="triton", block_q=24)
  with pytest.raises(ValueError, match=r"attention\.block_q=24 is invalid: Triton tiles"):
    config_lib.validate(c3)
  # a layout with row axes: the compiler cannot split a GPU/TPU custom call by rows
  c4 = default_config.get_config("smoke,layout=dp8")
  c4.attention.update(kernel="pallas", backend="triton")
  with pytest.raises(ValueError, match=r"attention\.kernel='pallas' is invalid: on triton .*data"):
    config_lib.validate(c4)
  c4.attention.backend = "interpret"  # interpret mode is plain XLA ops: any layout
  config_lib.validate(c4)
  # rows padded so that the backend's tiles divide them
  assert KERNEL.row_multiple() == 1
  assert KernelSettings(backend="triton").row_multiple() == 64
  assert sequence.row_multiple(KernelSettings(block_q=32, block_k=128, backend="mosaic")) == 128
  laid = sequence.zigzag_order({"tokens": np.zeros((1, 72), np.int32)}, 1, multiple=64)
  assert laid["tokens"].shape[1] == 128


def test_context_parallel_takes_the_kernel():
  """`api.context_parallel(kernel=)`: the kernel ring (impl ring, block branch) and the all-gather
  path's block (impl allgather, TTT branch) equal the XLA tiles over a cp = 2 mesh; options of
  the XLA ring are refused."""
  from specdraft.attention.api import context_parallel

  mesh = jax.make_mesh((2,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])
  B, S, W, H, K, D = 1, 8, 2, 2, 1, 8
  ks = jax.random.split(jax.random.key(0), 6)
  shapes = [(B, S, H, D), (B, S, K, D), (B, S, K, D), (B, S, W, H, D), (B, S, W, K, D)]
  xs = [jax.random.normal(k, sh) for k, sh in zip(ks, shapes + [(B, S, W, K, D)])]
  seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0]], jnp.int32)
  for impl, branch in (("ring", "block"), ("allgather", "ttt")):
    run = lambda kernel: context_parallel(  # noqa: E731
      *xs, seg, branch=branch, impl=impl, mesh=mesh, tile=4, kernel=kernel
    )
    want, got = run(None), run(KERNEL)
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{impl} {branch}")
  with pytest.raises(ValueError, match=r"apply to the XLA tiles' ring only"):
    context_parallel(
      *xs, seg, branch="ttt", impl="ring", mesh=mesh, kernel=KERNEL, skip_empty=False
    )
