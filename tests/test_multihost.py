"""Multi-process runs on JAX's own distributed runtime, for real: N local processes (gloo
collectives between them) against one process with the same 8 devices.

The co-training loop at a reduced smoke size gives the same metrics files on 2 processes x 4
devices as on 1 process x 8 (discrete fields identical, floats within rtol 1e-5, timings left
out); a run killed in one process (SIGKILL) resumes exactly; a process that cannot reach the
coordinator fails with a clear message in bounded time; the launcher stops every process when
one fails. Data shards and row bookkeeping are checked in this process. The other entry points'
multi-process runs are in test_multihost_entry_points.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from _multiprocess import (
  ROOT,
  assert_same,
  entry_command,
  launch,
  read_jsonl,
  run_on_two_processes,
)

from configs import default as default_config
from specdraft.parallel import mesh as mesh_lib
from specdraft.parallel import multihost
from specdraft.tasks import CharTokenizer, loader
from specdraft.tasks import datasets as task_data
from specdraft.train import loop, shards

LOGS = ("sft_metrics", "eval", "draft_metrics", "metrics", "rl_eval")
# The smoke run, shortened: every phase logs, evaluates and checkpoints at least twice.
OVERRIDES = {
  "sft.steps": 4,
  "sft.log_every": 2,
  "eval.every": 4,
  "checkpoint.every": 2,
  "draft.pretrain_steps": 2,
  "draft.log_every": 1,
  "rl.steps": 4,
  "rl.eval_every": 4,
  "eval.report_repeats": 0,
  "eval.num_examples": 8,  # one batch
  # 8 new tokens a rollout: every decode round of SD and every greedy step of the evaluation
  # synchronises the processes (gloo over TCP here), which at 24 tokens was most of a run
  "decode.max_new_tokens": 8,
}


def _config(layout: str, data_dir: str, **extra):
  c = default_config.get_config(f"smoke,layout={layout}")
  for key, value in {**OVERRIDES, **extra}.items():
    section, field = key.split(".")
    c[section][field] = value
  c.data.data_dir = data_dir
  return c


# The variables of a SLURM job step of two tasks (an srun), as each task sees them.
SRUN = {
  "SLURM_JOB_ID": "7",
  "SLURM_STEP_NODELIST": "n[1-2]",
  "SLURM_PROCID": "1",
  "SLURM_LOCALID": "0",
  "SLURM_STEP_NUM_TASKS": "2",
}


def _command(layout: str, data_dir: str, workdir: str, **extra) -> list[str]:
  spec = f"smoke,layout={layout}"
  return entry_command("train.py", "default.py", spec, data_dir, workdir, {**OVERRIDES, **extra})


def _logs(workdir):
  return {name: read_jsonl(os.path.join(workdir, f"{name}.jsonl")) for name in LOGS}


def _assert_same_logs(ref, got, names=LOGS):
  for name in names:
    assert len(ref[name]) > 0, f"the reference run wrote no {name}.jsonl"
    assert_same(ref[name], got[name], name)


@pytest.fixture(autouse=True, scope="module")
def no_persistent_cache():
  """This module's programs compile without JAX's persistent cache: with the cache warm from
  earlier runs of the suite, the cp4_dp2 two-process run aborted in gloo ("Received data size
  doesn't match expected size") on every rerun in one checkout, and passed with it off or cold."""
  old = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  yield
  jax.config.update("jax_enable_compilation_cache", old)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("tfds"))
  task_data.prepare(default_config.get_config("smoke").task, d)  # once, before any process
  return d


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir):
  """One process, 8 devices: the logs of each layout's run (and overrides), computed once."""
  cache = {}

  def run(layout: str, **extra):
    key = (layout, tuple(sorted(extra.items())))
    if key not in cache:
      wd = str(tmp_path_factory.mktemp(f"one_{layout}"))
      loop.train_and_evaluate(_config(layout, data_dir, **extra), wd)
      cache[key] = _logs(wd)
    return cache[key]

  return run


def _two_processes(layout, data_dir, workdir, **extra):
  spec = f"smoke,layout={layout}"
  overrides = {**OVERRIDES, **extra}
  return run_on_two_processes("train.py", "default.py", spec, data_dir, workdir, overrides)


# One prompt a step in groups of 8 rows: every group spans both processes, whose rewards must
# be gathered before its advantages are taken.
GROUPS_SPAN = {"rl.prompts_per_step": 1, "rl.group_size": 8}

# ----------------------------------------------------------------------------- runs
# The runs are `make test-slow` (CI runs both suites).


def _child_with_process_id(parent: int, process_id: int, deadline: float) -> int:
  """The pid of the launcher's child whose JAX_PROCESS_ID is `process_id` (read from /proc)."""
  want = f"JAX_PROCESS_ID={process_id}".encode()
  while time.time() < deadline:
    for entry in os.listdir("/proc"):
      if not entry.isdigit():
        continue
      try:
        with open(f"/proc/{entry}/stat") as f:
          ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        if ppid != parent:
          continue
        with open(f"/proc/{entry}/environ", "rb") as f:
          if want in f.read().split(b"\0"):
            return int(entry)
      except (OSError, IndexError, ValueError):
        continue
    time.sleep(0.2)
  raise AssertionError(f"no child of {parent} with {want.decode()}")


@pytest.mark.slow
def test_two_processes_give_the_one_process_metrics_dp8_across_a_kill(
  reference, data_dir, tmp_path
):
  """Every phase (SFT, distillation, RL) on 2 processes; process 1 is SIGKILLed mid-RL, the
  launcher stops process 0, and the run started again on 2 processes resumes from the last
  checkpoint. The metrics files, written before and after the kill, are the 1-process run's."""
  wd = str(tmp_path / "two")
  log = tmp_path / "killed.log"  # a file, not a pipe: nothing reads the output until the kill
  with open(log, "w") as f:
    proc = launch(2, 4, _command("dp8", data_dir, wd, **GROUPS_SPAN), stdout=f)
  victim = _child_with_process_id(proc.pid, 1, time.time() + 60)
  metrics = os.path.join(wd, "metrics.jsonl")
  saved = os.path.join(wd, "checkpoints", "rl", "2")  # orbax renames it there once complete
  deadline = time.time() + 900
  while time.time() < deadline and proc.poll() is None:
    if os.path.isdir(saved):  # the RL checkpoint at step 2 exists: kill during steps 3-4
      break
    time.sleep(0.05)
  assert proc.poll() is None, "the run ended before it could be killed: " + log.read_text()[-3000:]
  os.kill(victim, signal.SIGKILL)
  proc.wait(timeout=120)
  out = log.read_text()
  assert proc.returncode == 128 + signal.SIGKILL, out[-3000:]
  assert "process 1 exited with status 137; stopping the others" in out
  assert "process 1 of 2 joining" in out
  # each process builds the data shards of its devices' rows only: 8 SFT shards (one per
  # data-parallel slice), 4 each; the one prompt a step is one shard that both need
  assert "[p0] sft: process 0 builds data shards [0, 1, 2, 3] of 8" in out
  assert "[p1] sft: process 1 builds data shards [4, 5, 6, 7] of 8" in out
  assert "[p1] rl (cotrained): process 1 builds data shards [0] of 1" in out
  assert len(read_jsonl(metrics)) < OVERRIDES["rl.steps"]

  out = _two_processes("dp8", data_dir, wd, **GROUPS_SPAN)
  assert "[p0] Resumed rl from step" in out and "[p1] Resumed rl from step" in out
  _assert_same_logs(reference("dp8", **GROUPS_SPAN), _logs(wd))
  # one process wrote them: no line twice
  assert len(read_jsonl(metrics)) == OVERRIDES["rl.steps"]


# The other layouts run the co-training loop itself from the initial policy and an untrained
# draft (the SFT and distillation phases, their sharded streams and their checkpoints, are the
# dp8 test's): the SFT phase's step-0 evaluation, 3 RL steps of SD rollouts and co-training
# steps, their checkpoints and the RL evaluation. That halves what each run compiles.
RL_ONLY = {"sft.steps": 0, "draft.pretrain_steps": 0, "rl.steps": 3, "rl.eval_every": 3}
RL_LOGS = ("eval", "metrics", "rl_eval")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2_dp4", "cp4_dp2", "pp4_dp2"])
def test_two_processes_give_the_one_process_metrics(reference, data_dir, tmp_path, layout):
  _two_processes(layout, data_dir, str(tmp_path / "two"), **RL_ONLY)
  two = _logs(str(tmp_path / "two"))
  _assert_same_logs(reference(layout, **RL_ONLY), two, RL_LOGS)
  assert not two["sft_metrics"] and not two["draft_metrics"]


def test_single_process_entry_points_refuse_a_multi_process_launch():
  """The benchmarks and the layout comparison time or report from one host: each refuses a
  multi-process launch before any work, naming the setting; train.py, long_run.py and drift.py
  join one. Every JAX entry point is one or the other."""
  for name in sorted(os.listdir(os.path.join(ROOT, "experiments"))):
    if not name.endswith(".py"):
      continue
    text = open(os.path.join(ROOT, "experiments", name)).read()
    if "simulate_cpu_devices" not in text:
      continue  # no JAX run (plots, README tables)
    entry = f"experiments/{name}"
    joins = "multihost.initialize(sys.argv)" in text
    assert joins == (entry in multihost.MULTI_PROCESS_ENTRY_POINTS), entry
    assert joins or f'multihost.single_process_only("{entry}")' in text, entry
  flags = ["--num_processes=2", "--coordinator_address=127.0.0.1:1", "--process_id=0"]
  with pytest.raises(SystemExit, match=r"bench_step.py runs on one process, but --num_processes=2"):
    multihost.single_process_only("experiments/bench_step.py", ["x", *flags], {})
  with pytest.raises(SystemExit, match="--distributed=auto"):
    multihost.single_process_only("x.py", ["x", "--distributed=auto"], {})
  srun = dict(SRUN)
  with pytest.raises(SystemExit, match="a SLURM launch of several processes"):
    multihost.single_process_only("x.py", ["x"], srun)
  multihost.single_process_only("x.py", ["x"], {})  # one process: nothing to refuse
  multihost.single_process_only("x.py", ["x", "--num_processes=1"], {})
  # wired before absl parses the flags (else: an unknown flag)
  res = subprocess.run(
    [sys.executable, os.path.join(ROOT, "experiments", "bench_step.py"), *flags],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert res.returncode != 0
  assert "bench_step.py runs on one process, but --num_processes=2 asks for several" in res.stderr


# ----------------------------------------------------------------------------- launch


def test_a_process_that_cannot_reach_the_coordinator_fails_clearly_in_bounded_time():
  port = multihost_free_port()
  code = (
    "import sys; from specdraft.parallel import multihost; "
    f"multihost.initialize(['x', '--coordinator_address=127.0.0.1:{port}', "
    "'--num_processes=2', '--process_id=1', '--init_timeout=3'])"
  )
  t0 = time.time()
  res = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
  )
  assert res.returncode != 0
  assert f"could not reach the coordinator at 127.0.0.1:{port} within 3 s" in res.stderr
  assert time.time() - t0 < 60


def multihost_free_port() -> int:
  sys.path.insert(0, os.path.join(ROOT, "scripts"))
  import launch_local

  return launch_local.free_port()


def test_the_launcher_sets_each_process_up_and_stops_all_when_one_fails():
  code = (
    "import os, sys, time; i = int(os.environ['JAX_PROCESS_ID']); "
    "print('id', i, os.environ['JAX_NUM_PROCESSES'], os.environ['JAX_COORDINATOR_ADDRESS'], "
    "'device_count=2' in os.environ['XLA_FLAGS'], flush=True); "
    "sys.exit(3) if i == 1 else time.sleep(300)"
  )
  t0 = time.time()
  proc = launch(2, 2, [sys.executable, "-c", code], timeout=200)
  out, _ = proc.communicate(timeout=120)
  assert proc.returncode == 3, out
  assert time.time() - t0 < 60  # process 0 (sleeping 300 s) was stopped
  assert "[p0] id 0 2 127.0.0.1:" in out and "[p1] id 1 2 127.0.0.1:" in out
  assert "True" in out and "process 1 exited with status 3; stopping the others" in out


def test_settings_come_from_flags_or_the_environment_and_bad_ones_are_named():
  env = {
    "JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234",
    "JAX_NUM_PROCESSES": "4",
    "JAX_PROCESS_ID": "2",
  }
  s = multihost.settings(["x"], env)
  assert (s["coordinator_address"], s["num_processes"], s["process_id"]) == ("10.0.0.1:1234", 4, 2)
  s = multihost.settings(["x", "--process_id=3", "--init_timeout", "30"], env)
  assert s["process_id"] == 3 and s["init_timeout"] == 30  # flags win over the environment
  assert multihost.settings(["x"], {})["num_processes"] is None
  assert multihost.settings(["x", "--distributed=auto"], {})["distributed"] == "auto"
  # a SLURM job step of several tasks (srun) is a launch; a plain python in an allocation is not
  srun = dict(SRUN)
  assert multihost._cluster_launch(srun) == "SLURM"
  assert multihost._cluster_launch({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}) is None
  assert multihost._cluster_launch(dict(srun, SLURM_STEP_NUM_TASKS="1")) is None
  assert multihost.initialize(["x"], {}) == 1  # a single process: nothing to join
  for argv, environ, message in [
    (["x", "--num_processes=2"], {}, "--num_processes=2 also needs --coordinator_address"),
    (["x", "--coordinator_address=nohost"], {}, "expected host:port"),
    (["x", "--num_processes=two"], {}, "--num_processes='two' is invalid"),
    (["x"], dict(env, JAX_PROCESS_ID="4"), "expected 0 <= process_id < 4"),
    (["x", "--init_timeout=0"], {}, "--init_timeout=0 is invalid"),
    (["x", "--distributed=yes"], {}, "expected 'auto'"),
  ]:
    with pytest.raises(ValueError, match=message):
      multihost.settings(argv, environ)


# ----------------------------------------------------------------------------- data shards


def test_data_shards_follow_the_data_parallel_slices_not_the_processes():
  rules = [tuple(r) for r in default_config.get_config("smoke").parallel.rules]
  for layout, units, want in [
    ("single", 8, 1),
    ("dp8", 8, 8),
    ("dp8", 2, 2),  # 2 prompts a step: groups of rows span data-parallel slices
    ("fsdp2_dp4", 8, 8),
    ("cp4_dp2", 8, 2),
    ("pp4_dp2", 8, 2),
  ]:
    c = default_config.get_config(f"smoke,layout={layout}")
    if layout == "single":
      c.parallel.devices = 1
    mesh = mesh_lib.make_mesh(c.parallel)
    assert shards.num_shards(mesh, rules, units) == want, layout
    # one process holds every row, so it builds every shard
    sh = mesh_lib.rows_sharding(mesh, rules, ndim=2)
    assert multihost.local_rows(sh, 16) == [(0, 16)]
    assert multihost.local_shards(sh, 16, want) == list(range(want))


def test_a_sharded_stream_is_the_plain_stream_for_one_shard_and_resumes_per_shard(tmp_path):
  c = default_config.get_config("smoke,layout=dp8")
  src = task_data.data_source(c.task, str(tmp_path), "train")
  tok, rules = CharTokenizer(), [tuple(r) for r in c.parallel.rules]
  mesh = mesh_lib.make_mesh(c.parallel)

  def make(j, n, batch=8):
    return loader.sft_dataset(
      src, tok, batch_size=batch // n, seq_len=64, packing=True, seed=0, shard=(j, n)
    )

  sh = mesh_lib.batch_sharding(mesh, rules, ndim=2)
  one_mesh = mesh_lib.make_mesh(default_config.get_config("smoke").parallel, jax.devices()[:1])
  one = shards.ShardedStream(
    make, units=8, mesh=one_mesh, rules=rules, sharding=mesh_lib.batch_sharding(one_mesh, rules)
  )
  plain = iter(make(0, 1))
  for _ in range(3):
    a, b = next(one)[0], next(plain)
    assert all(np.array_equal(a[k], b[k]) for k in b)

  s = shards.ShardedStream(make, units=8, mesh=mesh, rules=rules, sharding=sh)
  assert s.num_shards == 8 and s.rows_per_shard == 1 and s.shards == list(range(8))
  first = next(s)
  # shard j packs records j, j + 8, ...: the shards hold different documents
  assert len({first[j]["tokens"].tobytes() for j in range(8)}) == 8
  state = s.global_state()
  assert sorted(state, key=int) == [str(j) for j in range(8)]
  after = [next(s) for _ in range(2)]
  s2 = shards.ShardedStream(make, units=8, mesh=mesh, rules=rules, sharding=sh)
  s2.set_state(state)
  again = [next(s2) for _ in range(2)]
  for x, y in zip(after, again):
    assert all(np.array_equal(x[j][k], y[j][k]) for j in x for k in x[j])
  # the global batch is the shards' rows in order
  arr = multihost.assemble({j: first[j]["tokens"] for j in first}, 1, 8, sh)
  assert np.array_equal(np.asarray(arr), np.concatenate([first[j]["tokens"] for j in range(8)]))
  # a state of one plain stream (a checkpoint from before data shards) restores one shard...
  mark = plain.get_state()
  want = [next(plain) for _ in range(2)]
  one.set_state(mark)
  for w in want:
    got = next(one)[0]
    assert all(np.array_equal(got[k], w[k]) for k in w)
  # ...but cannot be continued by a run of several shards, and a missing shard is named
  with pytest.raises(ValueError, match="written before data shards"):
    s2.set_state(mark)
  with pytest.raises(ValueError, match="this process needs"):
    s2.set_state({"0": state["0"]})
  # shards shuffle with seeds of their own; one shard keeps the stream's seed
  assert loader.shard_seed(5, (0, 1)) == 5
  assert len({loader.shard_seed(5, (j, 8)) for j in range(8)}) == 8


def test_a_workdir_that_is_not_a_local_path_is_refused_before_any_work(smoke_config):
  with pytest.raises(ValueError, match="workdir='gs://bucket/run' is invalid"):
    loop.Context(smoke_config, "gs://bucket/run")


def test_to_host_and_gather_on_one_process():
  mesh = mesh_lib.make_mesh(default_config.get_config("smoke,layout=dp8").parallel)
  sh = mesh_lib.rows_sharding(mesh, [("rows", ("data",))], ndim=2)
  x = np.arange(32).reshape(16, 2)
  g = multihost.put(x, sh)
  assert np.array_equal(multihost.to_host(g), x)
  rows = multihost.host_rows(g)
  assert sorted(rows) == list(range(16)) and np.array_equal(rows[5], x[5])
  assert multihost.gather_rows({1: 0.5, 3: "a"}) == {1: 0.5, 3: "a"}
