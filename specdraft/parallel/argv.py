"""Command-line flags read before absl parses them (imports no JAX): the entry points size the
simulated CPU devices (`specdraft.devices`) and the multi-process launch (`parallel.multihost`)
from argv before JAX is imported."""

from __future__ import annotations

from collections.abc import Sequence


def flag_values(argv: Sequence[str], name: str) -> list[str]:
  """Values of `--name=v` and `--name v` in argv, in order."""
  out = []
  for i, a in enumerate(argv):
    if a.startswith(f"--{name}="):
      out.append(a.split("=", 1)[1])
    elif a == f"--{name}" and i + 1 < len(argv):
      out.append(argv[i + 1])
  return out
