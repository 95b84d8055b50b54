"""The suite's guards against a run that never ends (tests/conftest.py): a hung test is stopped by
the per-test watchdog with its tracebacks, and a dead xdist worker ends the run naming its test
instead of being replaced (pytest-xdist's loadfile scheduler can wait forever after a
replacement); the slow suite alone runs without JAX's persistent compile cache."""

import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_hung_test_is_stopped_and_named_and_the_run_ends(tmp_path):
  (tmp_path / "test_hangs.py").write_text("import time\n\ndef test_sleeps():\n  time.sleep(120)\n")
  (tmp_path / "test_fine.py").write_text("def test_passes():\n  pass\n")
  env = dict(os.environ, SPECDRAFT_TEST_TIMEOUT="5", PYTHONPATH=os.path.join(ROOT, "tests"))
  cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-n", "2", "--dist", "loadfile",
         "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)]  # fmt: skip
  t0 = time.perf_counter()
  out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100)
  elapsed = time.perf_counter() - t0
  text = out.stdout + out.stderr
  assert out.returncode != 0, text
  assert "crashed while running 'test_hangs.py::test_sleeps'" in text, text
  assert "1 passed" in text and "1 failed" in text, text
  assert elapsed < 60, (elapsed, text)  # the sleeping test alone would take 120 s


_SEES = """
import os

import jax
import jax.numpy as jnp
import pytest


def _compile():
  jax.jit(lambda x: jnp.tanh(x) * 2 + 1)(jnp.ones(3)).block_until_ready()


@pytest.mark.slow
def test_slow_sees_no_cache():
  assert not jax.config.jax_enable_compilation_cache
  assert "JAX_COMPILATION_CACHE_DIR" not in os.environ  # nor do the processes it launches
  assert os.environ["JAX_ENABLE_COMPILATION_CACHE"] == "false"
  _compile()


def test_everyday_sees_the_cache():
  assert jax.config.jax_enable_compilation_cache
  assert os.environ["JAX_COMPILATION_CACHE_DIR"] == os.environ["SPECDRAFT_TEST_JAX_CACHE"]
  _compile()
"""


def test_the_slow_suite_alone_runs_without_the_persistent_cache(tmp_path):
  """Under an xdist worker as in CI: a program compiled in a slow-only session leaves the cache
  directory empty; the same program in an everyday session is written to it (every compile is,
  with the minimum compile time at 0)."""
  (tmp_path / "test_sees.py").write_text(_SEES)
  cache = tmp_path / "cache"
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
  env.update(
    SPECDRAFT_TEST_JAX_CACHE=str(cache),
    JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
    PYTHONPATH=os.path.join(ROOT, "tests"),
  )
  for marks, ran, written in (
    ("slow", "test_slow_sees_no_cache", False),
    ("not slow", "test_everyday_sees_the_cache", True),
  ):
    cmd = [sys.executable, "-m", "pytest", "-p", "conftest", "-m", marks, "-n", "1", "-v", "-W",
           "ignore::pytest.PytestUnknownMarkWarning", "-c", os.devnull, "--rootdir",
           str(tmp_path), str(tmp_path / "test_sees.py")]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    text = out.stdout + out.stderr
    other = ({"test_slow_sees_no_cache", "test_everyday_sees_the_cache"} - {ran}).pop()
    assert out.returncode == 0 and "1 passed" in text and ran in text, text
    assert other not in text and "failed" not in text, text
    entries = [f for _, _, files in os.walk(cache) for f in files] if cache.exists() else []
    assert bool(entries) == written, (marks, entries)
