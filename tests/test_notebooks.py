"""Every notebook under notebooks/ runs top to bottom, and is committed without outputs."""

import glob
import json
import os

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
IDS = [os.path.basename(p) for p in NOTEBOOKS]


def test_there_are_notebooks():
  assert len(NOTEBOOKS) >= 2, NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_committed_notebook_carries_no_outputs(path):
  with open(path) as f:
    nb = json.load(f)
  code = [c for c in nb["cells"] if c["cell_type"] == "code"]
  assert code, f"{path} has no code cells"
  for i, cell in enumerate(code):
    assert cell.get("outputs", []) == [], f"{path}: code cell {i} carries outputs"
    assert cell.get("execution_count") is None, f"{path}: code cell {i} has an execution count"
  # Notebooks show the package, they do not re-implement it.
  source = "\n".join("".join(c["source"]) for c in code)
  assert "from specdraft" in source or "import specdraft" in source, path


# Notebooks that compile many programs (~1 min here) execute in `make test-slow` (CI runs both).
_SLOW = {"04_compare_layouts.ipynb"}


@pytest.mark.parametrize(
  "path",
  [
    pytest.param(p, marks=pytest.mark.slow) if os.path.basename(p) in _SLOW else p
    for p in NOTEBOOKS
  ],
  ids=IDS,
)
def test_notebook_executes(path):
  """Runs in a fresh kernel from notebooks/ on 8 simulated CPU devices, at the smoke sizes."""
  nb = nbformat.read(path, as_version=4)
  env = dict(os.environ)  # conftest's XLA_FLAGS: 8 devices, the suite's compile flags
  assert "--xla_force_host_platform_device_count=8" in env["XLA_FLAGS"]
  env["JAX_PLATFORMS"] = "cpu"
  env["SPECDRAFT_SMOKE"] = "1"  # notebooks shrink their workloads
  env["MPLBACKEND"] = "Agg"
  client = NotebookClient(
    nb,
    kernel_name="python3",
    timeout=300,
    resources={"metadata": {"path": os.path.dirname(path)}},
  )
  client.execute(env=env, cwd=os.path.dirname(path))  # raises CellExecutionError on any error
  ran = [c for c in nb.cells if c.cell_type == "code"]
  assert all(c.execution_count is not None for c in ran)
