"""The ring with the fused block (attention/kernels/ring.py) under context parallelism, on
simulated CPU devices in Pallas interpret mode: equal to the ring with the XLA tiles and to the
dense oracle, in value and gradient, at cp = 1, 2, 4, for both branch kinds."""

import _tolerance as tol
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from specdraft.attention import branch_attention
from specdraft.attention.api import context_parallel
from specdraft.attention.kernels import KernelSettings
from specdraft.attention.kernels import ring as kring
from specdraft.parallel import zigzag

# Row 0: a length-1 document, documents across chunks and ranks, tail padding. Row 1: short
# documents.
SEGS = np.array(
  [
    [1, 2, 2, 2, 2, 2, 3, 4, 4, 4, 4, 4, 4, 0, 0, 0],
    [1, 1, 2, 3, 3, 3, 4, 5, 5, 6, 6, 6, 6, 6, 7, 7],
  ]
)
SETTINGS = KernelSettings(block_q=4, block_k=4, backend="interpret")


def cp_mesh(cp):
  return jax.make_mesh((cp,), ("cp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:cp])


def inputs(seed, W=2, H=4, K=2, D=8):
  B, S = SEGS.shape
  ks = jax.random.split(jax.random.key(seed), 6)
  n = lambda k, s: jax.random.normal(k, s, jnp.float32)
  shapes = [(B, S, H, D), (B, S, K, D), (B, S, K, D), (B, S, W, H, D), (B, S, W, K, D)]
  shapes.append((B, S, W, K, D))
  return [n(k, s) for k, s in zip(ks, shapes)] + [jnp.asarray(SEGS, jnp.int32)]


def kernel_ring(cp):
  """Natural order in and out: the zigzag order, the kernel ring under shard_map, undone."""
  mesh = cp_mesh(cp)

  def fn(q, k, v, q_br, k_br, v_br, seg, *, branch):
    B, S = seg.shape
    perm = zigzag.permutation(S, cp)
    lay = lambda x: jnp.take(x, jnp.asarray(perm), axis=1)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
    body = lambda *a: kring.ring_attention_shard(
      *a, branch=branch, axis_name="cp", cp=cp, settings=SETTINGS
    )
    spec = P(None, "cp")
    out, out_br = jax.shard_map(
      body, mesh=mesh, in_specs=(spec,) * 8, out_specs=(spec, spec), check_vma=False
    )(*(lay(x) for x in (q, k, v, q_br, k_br, v_br, seg, pos)))
    inverse = jnp.asarray(np.argsort(perm))
    return jnp.take(out, inverse, axis=1), jnp.take(out_br, inverse, axis=1)

  return fn


def value_and_grads(fn, xs, branch):
  seg = xs[-1]

  def loss(*a):
    out, out_br = fn(*a, seg, branch=branch)
    value = jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(out_br) * out_br)
    return value, (out, out_br)

  (_, outs), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(
    *xs[:6]
  )
  return outs, grads


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("branch", ["ttt", "block"])
def test_kernel_ring_equals_the_xla_ring_and_the_oracle(cp, branch):
  xs = inputs(cp)
  got, g_got = value_and_grads(kernel_ring(cp), xs, branch)
  mesh = cp_mesh(cp)
  xla_ring = lambda *a, branch: context_parallel(
    *a, branch=branch, impl="ring", mesh=mesh, tile=4
  )  # fmt: skip
  want, g_want = value_and_grads(xla_ring, xs, branch)
  dense, g_dense = value_and_grads(
    lambda *a, branch: branch_attention(*a, branch=branch), xs, branch
  )
  for ref, g_ref, name in ((want, g_want, "xla ring"), (dense, g_dense, "oracle")):
    for a, b in zip(got, ref):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, rtol=0, err_msg=name)
    tol.assert_grads_close(g_got, g_ref, rtol=1e-5, err=f"{name} cp={cp} {branch}")


def test_ring_block_attention_without_branches_is_the_blocks_over_gathered_keys():
  """The trunk ring alone (no branch rows) returns lse as well: equal to the XLA tiles over
  every rank's keys, gathered."""
  from specdraft.attention import blockwise as bw

  cp = 4
  mesh = cp_mesh(cp)
  q, k, v, *_, seg = inputs(7)
  B, S = seg.shape
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  spec, lse_spec = P(None, "cp"), P(None, None, "cp")

  def body(q, k, v, pos, seg):
    rows = bw.Rows(pos, seg, jnp.zeros_like(pos))
    return kring.ring_block_attention(
      q, k, v, rows, bw.Rows(pos, seg), axis_name="cp", cp=cp, settings=SETTINGS
    )

  out, lse = jax.jit(
    jax.shard_map(
      body, mesh=mesh, in_specs=(spec,) * 5, out_specs=(spec, lse_spec), check_vma=False
    )
  )(q, k, v, pos, seg)
  want_out, want_lse = bw.blk(q, k, v, bw.Rows(pos, seg, jnp.zeros_like(pos)), bw.Rows(pos, seg))
  np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), atol=2e-6)
  finite = np.isfinite(np.asarray(want_lse))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  np.testing.assert_allclose(np.asarray(lse)[finite], np.asarray(want_lse)[finite], atol=2e-6)
