"""A run killed with SIGKILL mid-way through RL resumes to the same metrics as an uninterrupted
run (smoke size)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from specdraft.train import loop

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = {"rollout_seconds", "train_seconds", "seconds_per_step"}


def _read(path):
  with open(path) as f:
    return [json.loads(ln) for ln in f if ln.strip()]


def _strip(rows):
  return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.mark.slow
def test_sigkill_mid_rl_then_resume_matches_uninterrupted(smoke_config, tmp_path):
  c = smoke_config
  c.checkpoint.every = 2
  full = str(tmp_path / "full")
  loop.train_and_evaluate(c, full)

  wd = str(tmp_path / "killed")
  cmd = [
    sys.executable,
    os.path.join(ROOT, "experiments", "train.py"),
    "--config=" + os.path.join(ROOT, "configs", "default.py") + ":smoke",
    f"--workdir={wd}",
    f"--config.data.data_dir={c.data.data_dir}",
    "--config.parallel.devices=1",
    "--config.checkpoint.every=2",
  ]
  # the same XLA flags as this process (conftest), so both runs compile the same programs
  env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"])
  proc = subprocess.Popen(
    cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
  )
  metrics = os.path.join(wd, "metrics.jsonl")
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    if os.path.exists(metrics) and len(_read(metrics)) >= 3:  # RL checkpoint at step 2 exists
      break
    time.sleep(0.2)
  assert proc.poll() is None, "the run ended before it could be killed"
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert len(_read(metrics)) < c.rl.steps

  res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert res.returncode == 0, res.stderr[-3000:]
  assert "Resumed rl from step" in res.stdout
  a, b = _strip(_read(os.path.join(full, "metrics.jsonl"))), _strip(_read(metrics))
  assert [r["step"] for r in b] == list(range(1, c.rl.steps + 1))
  assert a == b
