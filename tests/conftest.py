"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os
import sys

# The tests run tiny programs, so compiling dominates (about 60% of the suite's CPU time): LLVM's
# optimisation level 0 roughly halves it, and XLA's older elemental emitters instead of its
# fusion emitters take a third off what is left (a single-device co-training fwd/bwd: 9.9 -> 6.7 s
# to compile). Numerics are compared with float32-safe tolerances and bit-identity tests compare
# two programs compiled alike, so neither changes a verdict; subprocesses inherit the flags.
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
  + " --xla_cpu_use_fusion_emitters=false"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Many tests compile the same programs (the smoke run's steps in-process, in subprocesses, in
# notebooks, under each launcher process), so the suites share JAX's persistent compilation cache:
# an executable is compiled once per CI run and loaded after that. The key hashes the program, the
# XLA flags, the devices and the JAX version, so a hit is the executable a compile would give.
# Entries under 0.5 s of compile time are not worth the disk; the size bound turns on JAX's file
# lock (xdist workers and subprocesses read and write concurrently). SPECDRAFT_TEST_JAX_CACHE=""
# turns it off; the directory lives under .pytest_cache (git-ignored; `make clean` removes it).
_CACHE = os.environ.get("SPECDRAFT_TEST_JAX_CACHE", os.path.join(ROOT, ".pytest_cache", "jax"))
if _CACHE:
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import pytest  # noqa: E402

from configs import default as default_config  # noqa: E402


@pytest.fixture
def smoke_config(tmp_path):
  """The default config's smoke variant, with its data and runs under tmp_path."""
  c = default_config.get_config("smoke")
  c.data.data_dir = str(tmp_path / "tfds")
  c.parallel.devices = 1  # the single-device layout on the 8 simulated devices
  return c


def pytest_configure(config):
  assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"
