"""Starts N processes of one command on this machine as a multi-process JAX run, for testing.

  python scripts/launch_local.py N_PROCESSES DEVICES_PER_PROCESS [--port P] [--timeout S] -- \
      python experiments/train.py --config=configs/default.py:smoke,layout=dp8 --workdir=runs/mp

Each process gets the launcher variables a cluster would set (JAX_COORDINATOR_ADDRESS=
127.0.0.1:PORT, JAX_NUM_PROCESSES, JAX_PROCESS_ID), JAX_PLATFORMS=cpu and DEVICES_PER_PROCESS
simulated CPU devices; the processes' collectives run over gloo. Every output line is prefixed
with its process (`[p1] ...`). When one process fails or is killed, the others are stopped
(SIGTERM, then SIGKILL after a grace period) and the launcher exits with that process's status
(128 + signal for a signal); it exits 0 when every process does. `--timeout` stops them all after
S seconds (status 124).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def process_env(base: dict, *, port: int, n: int, i: int, devices: int) -> dict:
  env = dict(base)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
  env.update(
    JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
    JAX_NUM_PROCESSES=str(n),
    JAX_PROCESS_ID=str(i),
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=" ".join(flags + [f"--xla_force_host_platform_device_count={devices}"]),
    PYTHONUNBUFFERED="1",
  )
  return env


def _pump(stream, prefix: str, out) -> None:
  for line in iter(stream.readline, b""):
    out.write(f"{prefix}{line.decode(errors='replace')}")
    out.flush()


def _exit_code(rc: int) -> int:
  return 128 - rc if rc < 0 else rc


def launch(
  n: int,
  devices: int,
  command: list[str],
  *,
  port: int | None = None,
  timeout: float | None = None,
  grace_s: float = 10.0,
  out=None,
) -> int:
  """Runs `command` as processes 0..n-1; returns the exit status described above."""
  if n < 1 or devices < 1:
    raise ValueError(f"need N_PROCESSES >= 1 and DEVICES_PER_PROCESS >= 1, got {n} and {devices}")
  if not command:
    raise ValueError("no command given after --")
  out = sys.stdout if out is None else out
  port = port or free_port()
  procs, pumps = [], []
  for i in range(n):
    p = subprocess.Popen(
      command,
      env=process_env(os.environ, port=port, n=n, i=i, devices=devices),
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      start_new_session=True,  # the launcher stops a process's whole group
    )
    t = threading.Thread(target=_pump, args=(p.stdout, f"[p{i}] ", out), daemon=True)
    t.start()
    procs.append(p)
    pumps.append(t)
  start, status = time.monotonic(), None
  previous = _stop_on_sigterm()
  try:
    while status is None:
      codes = [p.poll() for p in procs]
      # several found failed in one poll: a killed process (a signal) is the likelier cause
      failed = sorted(
        ((i, c) for i, c in enumerate(codes) if c not in (None, 0)), key=lambda f: f[1] >= 0
      )
      if failed:
        i, c = failed[0]
        out.write(f"[launch] process {i} exited with status {_exit_code(c)}; stopping the others\n")
        status = _exit_code(c)
      elif all(c == 0 for c in codes):
        status = 0
      elif timeout is not None and time.monotonic() - start > timeout:
        out.write(f"[launch] timed out after {timeout:g} s; stopping every process\n")
        status = 124
      else:
        time.sleep(0.05)
  except KeyboardInterrupt:
    status = 130
  finally:
    if previous is not None:
      signal.signal(signal.SIGTERM, previous)
    _stop(procs, grace_s)
    for t in pumps:
      t.join(timeout=5)
    out.flush()
  return status


def _stop_on_sigterm():
  """SIGTERM to the launcher stops its processes too (as Ctrl-C does); returns the previous
  handler (None off the main thread, where no handler can be set)."""

  def handler(signum, frame):
    raise KeyboardInterrupt

  try:
    return signal.signal(signal.SIGTERM, handler)
  except ValueError:
    return None


def _stop(procs, grace_s: float) -> None:
  alive = [p for p in procs if p.poll() is None]
  for p in alive:
    _signal(p, signal.SIGTERM)
  deadline = time.monotonic() + grace_s
  for p in alive:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      _signal(p, signal.SIGKILL)
      p.wait()


def _signal(p, sig) -> None:
  try:
    os.killpg(p.pid, sig)
  except ProcessLookupError:
    pass


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "--" not in argv:
    print(__doc__, file=sys.stderr)
    return 2
  cut = argv.index("--")
  ap = argparse.ArgumentParser(description="Local multi-process JAX launcher (CPU, gloo).")
  ap.add_argument("num_processes", type=int)
  ap.add_argument("devices_per_process", type=int)
  ap.add_argument("--port", type=int, default=None, help="coordinator port (default: a free one)")
  ap.add_argument("--timeout", type=float, default=None, help="stop every process after S s")
  args = ap.parse_args(argv[:cut])
  return launch(
    args.num_processes,
    args.devices_per_process,
    argv[cut + 1 :],
    port=args.port,
    timeout=args.timeout,
  )


if __name__ == "__main__":
  sys.exit(main())
