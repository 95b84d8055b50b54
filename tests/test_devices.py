"""Simulated CPU devices for the entry points, and the error when a layout lacks devices."""

import os
import subprocess
import sys

import pytest

from configs import default as default_config
from specdraft import config as config_lib
from specdraft import devices
from specdraft.parallel import mesh as mesh_lib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAG = "--xla_force_host_platform_device_count"


@pytest.mark.parametrize(
  "argv,n",
  [
    (["--config=configs/default.py"], 1),
    (["--config=configs/default.py:smoke,layout=pp4_dp2", "--workdir=/tmp/x"], 8),
    (["--config", "configs/default.py:layout=cp4"], 4),
    (["--config=configs/default.py:layout=dp2,smoke"], 2),
    (["--config=configs/default.py:layout=pp4", "--config.parallel.mesh.data=2"], 8),
    (["--config=configs/default.py:layout=pp4", "--config.parallel.mesh.pp", "2"], 2),
    (["--config=configs/drift.py:smoke", "--config.parallel.mesh.cp=2"], 2),
    (["--config=configs/default.py", "--config.parallel.devices=4"], 4),
    (["--config=configs/long.py:smoke"], 8),  # the config file's DEFAULT_LAYOUT (cp8)
    (["--config=configs/long.py:layout=cp2"], 2),
    (["--config=configs/default.py:layout=nope"], 1),  # the config names the unknown layout
    (["--config=configs/default.py", "--config.parallel.mesh.data=two"], 1),
  ],
)
def test_device_count_from_the_command_line(argv, n):
  assert devices.layout_devices(["experiments/train.py", *argv])[0] == n


def test_simulation_sets_xla_flags_only_where_allowed():
  argv = ["train.py", "--config=configs/default.py:layout=pp4_dp2"]
  env = {"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"}
  assert devices.simulate_cpu_devices(argv, env, quiet=True) == 8
  assert env["XLA_FLAGS"] == f"--xla_cpu_enable_fast_math=false {FLAG}=8"
  env = {"JAX_PLATFORMS": "cpu"}
  assert (
    devices.simulate_cpu_devices(argv, env, quiet=True) == 8 and env["XLA_FLAGS"] == f"{FLAG}=8"
  )
  assert devices.simulate_cpu_devices(["b.py"], env := {}, count=8, quiet=True) == 8
  assert env == {"XLA_FLAGS": f"{FLAG}=8"}

  # One device needs nothing.
  env = {}
  assert devices.simulate_cpu_devices(["train.py", "--config=c.py"], env, quiet=True) is None
  assert env == {}

  # Multi-process launches, accelerator backends and a count the user chose are left alone.
  for extra in (
    {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234"},
    {"SLURM_JOB_ID": "77"},
    {"TPU_WORKER_ID": "0"},
    {"JAX_PLATFORMS": "cuda"},
    {"JAX_PLATFORMS": "tpu,cpu"},
    {"XLA_FLAGS": f"{FLAG}=2"},
    {"JAX_NUM_CPU_DEVICES": "4"},
  ):
    env = dict(extra)
    assert devices.blocked(env) is not None, extra
    assert devices.simulate_cpu_devices(argv, env, quiet=True) is None, extra
    assert env == extra, extra


def test_entry_point_setup_reaches_jax():
  """In a fresh process, before JAX is imported: the module imports no JAX and its flag holds."""
  code = (
    "import sys\n"
    "from specdraft import devices\n"
    "assert 'jax' not in sys.modules\n"
    "devices.simulate_cpu_devices(['t.py', '--config=configs/default.py:layout=cp2_x'])\n"
    "devices.simulate_cpu_devices(['t.py', '--config=configs/default.py:layout=pp2_cp2_dp2'])\n"
    "import jax\n"
    "print(jax.device_count())\n"
  )
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
  env["JAX_PLATFORMS"] = "cpu"
  out = subprocess.run(
    [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "8"
  assert "simulating 8 CPU devices for layout 'pp2_cp2_dp2'" in out.stderr


def test_missing_devices_error_says_what_to_do():
  c = default_config.get_config("smoke,layout=pp4_dp2")
  with pytest.raises(ValueError) as e:
    config_lib.validate(c, num_devices=1)
  msg = str(e.value)
  for part in (
    "parallel.layout='pp4_dp2' (data=2, pp=4)",
    "needs 8 devices but this process has 1",
    "experiments/*.py simulate",
    f"XLA_FLAGS={FLAG}=N before JAX is imported",
    "On GPU/TPU, choose a layout whose axis sizes multiply to your device count",
    "parallel.devices",
  ):
    assert part in msg, (part, msg)

  # A count above what exists says the same; a layout smaller than the devices names the fix.
  c.parallel.devices = 16
  with pytest.raises(ValueError, match=r"asks for 16 devices but this process has 8 .*XLA_FLAGS"):
    mesh_lib.check_mesh(c.parallel, 8)
  c = default_config.get_config("layout=dp2")
  with pytest.raises(ValueError, match=r"mesh size 2 but it must cover 8 .*parallel.devices=2"):
    mesh_lib.check_mesh(c.parallel, 8)
  c.parallel.devices = 2
  mesh_lib.check_mesh(c.parallel, 8)
