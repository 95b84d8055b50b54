"""The layout-comparison helpers accept float32 reordering and reject real differences."""

import _tolerance as tol
import numpy as np
import optax
import pytest


def _adam_step(params, grads, lr):
  tx = optax.adamw(lr, weight_decay=0.01)
  updates, _ = tx.update(grads, tx.init(params), params)
  return optax.apply_updates(params, updates)


@pytest.fixture
def case():
  rng = np.random.default_rng(0)
  params = {"w": rng.normal(size=(64, 32)).astype(np.float32), "b": np.ones(32, np.float32)}
  grads = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in params.items()}
  grads["w"][0, 0] = 3e-9  # a gradient below Adam's eps, decided by rounding
  return params, grads


def test_reordering_noise_and_a_flipped_tiny_gradient_pass(case):
  params, grads = case
  lr = 1e-3
  noisy = {k: v * (1 + 1e-7 * np.sign(v)) for k, v in grads.items()}
  noisy["w"][0, 0] = -3e-9  # its sign flips: Adam moves that parameter the other way
  tol.assert_grads_close(noisy, grads)
  p_want, p_got = _adam_step(params, grads, lr), _adam_step(params, noisy, lr)
  assert abs(float(p_got["w"][0, 0] - p_want["w"][0, 0])) > 0.2 * lr  # raw params differ
  tol.assert_adam_update_close(params, p_got, p_want, noisy, grads, lr=lr)


def test_real_differences_fail(case):
  params, grads = case
  lr = 1e-3
  with pytest.raises(AssertionError, match=r"\['w'\]"):  # a gradient off by a factor
    tol.assert_grads_close({**grads, "w": grads["w"] * 2}, grads)
  with pytest.raises(AssertionError, match="zero everywhere"):
    tol.assert_grads_close(grads, {k: 0 * v for k, v in grads.items()})
  wrong = {**grads, "b": -grads["b"]}  # a resolved gradient with the wrong sign
  p_want, p_got = _adam_step(params, grads, lr), _adam_step(params, wrong, lr)
  with pytest.raises(AssertionError, match="resolved update differs"):
    tol.assert_adam_update_close(params, p_got, p_want, grads, grads, lr=lr)
  p_off = {**p_want, "w": p_want["w"] + 0.05 * lr}  # every update off by 5% of lr
  with pytest.raises(AssertionError, match="resolved update differs"):
    tol.assert_adam_update_close(params, p_off, p_want, grads, grads, lr=lr)
  with pytest.raises(AssertionError, match="did not move"):
    tol.assert_adam_update_close(params, params, params, grads, grads, lr=lr)
