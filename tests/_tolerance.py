"""Comparisons that float32 reordering cannot break, shared by the layout-equivalence tests.

A sharded, pipelined or context-parallel step computes the same sums as the single-device step in
another order, so their float32 results differ in the last bits, by different amounts on different
CPUs. Raw post-Adam parameters are the wrong thing to compare: Adam divides each gradient element by
its own magnitude, so a near-zero gradient whose sign or size is decided by those last bits moves
its parameter by anything in [-lr, lr]. These helpers compare instead

- gradients, per leaf, relative to the leaf's norm (`assert_grads_close`), and
- one Adam(W) update, per element, with the tolerance Adam's update rule gives
  (`assert_adam_update_close`): tight where the gradient's sign is resolved, Adam's own bound
  elsewhere.
"""

import jax
import numpy as np


def _leaves(tree):
  return [
    (jax.tree_util.keystr(path), np.asarray(x, np.float64))
    for path, x in jax.tree_util.tree_leaves_with_path(tree)
  ]


def _paired(got, want):
  a, b = _leaves(got), _leaves(want)
  assert [p for p, _ in a] == [p for p, _ in b], "the two trees have different structures"
  for (path, x), (_, y) in zip(a, b):
    assert x.shape == y.shape, f"{path}: shape {x.shape} != {y.shape}"
  return [(p, x, y) for (p, x), (_, y) in zip(a, b)]


def assert_grads_close(got, want, *, rtol=1e-4, err=""):
  """Per leaf: ||got - want|| <= rtol * ||want||.

  A leaf whose reference norm is below 1e-6 of the largest leaf's is held to that scale instead
  (a zero-gradient leaf must stay near zero; 0/0 is no tolerance). The reference must not be all
  zero, so the comparison cannot pass vacuously."""
  pairs = _paired(got, want)
  scale = max(np.linalg.norm(y) for _, _, y in pairs)
  assert scale > 0, f"{err}: the reference gradient is zero everywhere"
  for path, x, y in pairs:
    assert np.all(np.isfinite(x)), f"{err}{path}: non-finite gradient"
    diff, ref = np.linalg.norm(x - y), max(np.linalg.norm(y), 1e-6 * scale)
    assert diff <= rtol * ref, f"{err}{path}: ||got - want|| = {diff:.3g} > {rtol} * {ref:.3g}"


def assert_adam_update_close(
  params0, params_got, params_want, grads_got, grads_want, *, lr, min_resolved=0.9, err=""
):
  """One Adam(W) update from the same parameters and optimizer state, compared per element.

  Adam's first (bias-corrected) step moves an element by -lr * (g / (|g| + eps) + wd * p), with g
  the (clipped) gradient: |u| <= lr apart from the decay term, which is the same on both sides.
  Where g keeps its sign, a relative change d of g moves g / (|g| + eps) by at most d. So:

  - where the gradient is resolved (|g_want| > 1000 |g_got - g_want|: its sign cannot flip and
    d <= 1e-3), the updates agree to 1e-2 * lr (10x margin, also over the clip factor's change);
  - elsewhere (a gradient near zero, decided by rounding) only Adam's bound holds: they differ by
    at most 2 * lr.

  `lr` is the learning rate of this step (an upper bound works); at least `min_resolved` of all
  elements must be resolved and the reference update must be non-zero, so this cannot pass
  vacuously."""
  delta = lambda p: jax.tree.map(
    lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64), p, params0
  )
  updates = _paired(delta(params_got), delta(params_want))
  grads = _paired(grads_got, grads_want)
  assert [p for p, *_ in updates] == [p for p, *_ in grads], f"{err}: params and grads differ"
  resolved_n = total_n = 0
  moved = 0.0
  for (path, u_got, u_want), (_, g_got, g_want) in zip(updates, grads):
    d_u = np.abs(u_got - u_want)
    resolved = np.abs(g_want) > 1000 * np.abs(g_got - g_want)
    resolved_n, total_n = resolved_n + resolved.sum(), total_n + resolved.size
    moved = max(moved, float(np.abs(u_want).max(initial=0.0)))
    worst = float(d_u[resolved].max(initial=0.0))
    assert worst <= 1e-2 * lr, f"{err}{path}: resolved update differs by {worst:.3g} > 1e-2 * lr"
    worst = float(d_u.max(initial=0.0))
    assert worst <= 2.01 * lr, f"{err}{path}: update differs by {worst:.3g} > Adam's bound 2 * lr"
  assert moved > 0, f"{err}: the reference step did not move any parameter"
  frac = resolved_n / total_n
  assert frac >= min_resolved, f"{err}: only {frac:.3f} of the gradient elements are resolved"
