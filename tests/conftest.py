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
# A session of slow tests only (`make test-slow`, `-m slow`) runs without it: see pytest_configure.
_CACHE = os.environ.get("SPECDRAFT_TEST_JAX_CACHE", os.path.join(ROOT, ".pytest_cache", "jax"))
if _CACHE:
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _CACHE)
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
sys.path.insert(0, ROOT)

import faulthandler  # noqa: E402

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


# A test that runs longer than this (seconds) is stopped with every thread's traceback on stderr and
# its process exits (under xdist: the worker, which fails the run at once, below), so a hang costs
# minutes and names itself instead of eating CI's time limit. The slowest test takes ~260 s here.
# SPECDRAFT_TEST_TIMEOUT=0 turns the watchdog off (e.g. under a debugger).
TEST_TIMEOUT_S = float(os.environ.get("SPECDRAFT_TEST_TIMEOUT", "1200"))
# Writes to the persistent cache that slow tests (and the processes they launch) would make are
# skipped: they read what the everyday suite wrote but add nothing. A CI run's slow suite once died
# with a segfault inside XLA's executable serialisation (`executable.serialize()` in JAX's cache
# write), after which pytest-xdist's loadfile scheduler waited forever on the replaced worker; the
# slow programs are mostly compiled once each, so their entries bought little.
_NO_WRITE = "1e9"  # a minimum compile time no program reaches: JAX then skips the write


def _persistent_cache_off():
  """No persistent compile cache in this process or the processes its tests launch (called before
  anything compiles: JAX decides once, at the first compile, whether a process uses the cache)."""
  global _CACHE
  _CACHE = ""
  os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)
  os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  jax.config.update("jax_enable_compilation_cache", False)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
  assert jax.device_count() == 8, "tests expect 8 simulated CPU devices"
  # A crashed xdist worker ends the run (naming the test it died in) rather than being replaced:
  # pytest-xdist 3.8's loadfile/loadscope schedulers can hang for good after a replacement. An
  # explicit --max-worker-restart on the command line wins.
  if hasattr(config.option, "maxworkerrestart") and config.option.maxworkerrestart is None:
    config.option.maxworkerrestart = "0"
  # The slow suite alone (CI's second step) runs without the persistent cache, even read-only: two
  # CI runs' slow suites lost a worker to a segfault, once inside the cache's write and once in a
  # test whose in-process run read it, and its programs are mostly compiled once each anyway
  # (71 slow tests: 24:35 reading the cache, 27:42 without it, on this machine's 2 cores).
  if _CACHE and (config.option.markexpr or "").strip() == "slow":
    _persistent_cache_off()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  if TEST_TIMEOUT_S > 0:
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True)
  slow = item.get_closest_marker("slow") is not None and _CACHE
  if slow:
    old_env = os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS")
    old_cfg = jax.config.jax_persistent_cache_min_compile_time_secs
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = _NO_WRITE
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(_NO_WRITE))
  try:
    yield
  finally:
    if TEST_TIMEOUT_S > 0:
      faulthandler.cancel_dump_traceback_later()
    if slow:
      jax.config.update("jax_persistent_cache_min_compile_time_secs", old_cfg)
      if old_env is None:
        os.environ.pop("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", None)
      else:
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = old_env
