"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os
import sys

# The tests run tiny programs, so compiling dominates: LLVM's optimisation level 0 roughly halves
# the suite's CPU time. (Numerics are compared with float32-safe tolerances, so another backend
# optimisation level cannot change a verdict; subprocesses get the same flags, see test_resume.)
os.environ["XLA_FLAGS"] = (
  os.environ.get("XLA_FLAGS", "")
  + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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
