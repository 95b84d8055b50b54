"""Helpers of the multi-process tests: the local launcher as a subprocess, entry-point commands,
and comparing metrics files written by different process counts."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = {"rollout_seconds", "train_seconds", "seconds_per_step"}


def entry_command(script, config, spec, data_dir, workdir, overrides=None) -> list[str]:
  """`python experiments/<script> --config=configs/<config>:<spec>` on `data_dir`, into `workdir`,
  with `--config.<key>=<value>` for each of `overrides`."""
  return [
    sys.executable,
    os.path.join(ROOT, "experiments", script),
    f"--config={os.path.join(ROOT, 'configs', config)}:{spec}",
    f"--workdir={workdir}",
    f"--config.data.data_dir={data_dir}",
  ] + [f"--config.{k}={v}" for k, v in (overrides or {}).items()]


def launch(n: int, devices: int, cmd: list[str], *, timeout: int = 900, stdout=subprocess.PIPE):
  """The local launcher as a subprocess (it passes this process's XLA flags on, less the device
  count, so every process compiles as the in-process reference does)."""
  launcher = [
    sys.executable,
    os.path.join(ROOT, "scripts", "launch_local.py"),
    str(n),
    str(devices),
  ]
  # the launched processes compile for themselves (no persistent compilation cache: see
  # tests/test_multihost.py's no_persistent_cache)
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
  env["JAX_ENABLE_COMPILATION_CACHE"] = "false"
  return subprocess.Popen(
    launcher + ["--timeout", str(timeout), "--"] + cmd,
    cwd=ROOT,
    env=env,
    stdout=stdout,
    stderr=subprocess.STDOUT,
    text=True,
  )


def read_jsonl(path):
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(ln) for ln in f if ln.strip()]


def assert_same(a, b, path="", rtol=1e-5):
  """Discrete fields identical, floats within rtol, timing fields left out."""
  if isinstance(a, dict):
    assert set(a) == set(b), f"{path}: keys differ {set(a) ^ set(b)}"
    for k in a:
      if k not in TIMING:
        assert_same(a[k], b[k], f"{path}.{k}", rtol)
  elif isinstance(a, list):
    assert len(a) == len(b), f"{path}: {len(a)} vs {len(b)} entries"
    for i, (x, y) in enumerate(zip(a, b)):
      assert_same(x, y, f"{path}[{i}]", rtol)
  elif isinstance(a, float) and isinstance(b, float):
    assert math.isclose(a, b, rel_tol=rtol, abs_tol=1e-12), f"{path}: {a} vs {b}"
  else:
    assert a == b, f"{path}: {a!r} vs {b!r}"


def run_on_two_processes(script, config, spec, data_dir, workdir, overrides) -> str:
  """`experiments/<script>` with `--config.<key>=<value>` overrides on 2 processes x 4 devices:
  its output, once it succeeded and process 1 joined."""
  proc = launch(2, 4, entry_command(script, config, spec, data_dir, workdir, overrides))
  out, _ = proc.communicate(timeout=960)
  assert proc.returncode == 0, out[-4000:]
  assert "process 1 of 2 joining" in out
  return out
