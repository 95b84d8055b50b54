"""The package's import structure, read from the source (AST, function-level imports included):
subpackages import only downwards (no cycle between them), no module uses another module's
private names, and the library never imports the lab notebook (experiments/, configs/)."""

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "specdraft")

# What each subpackage (or top-level module) may import; anything else is an upward import.
ALLOWED = {
  "parallel": set(),
  "attention": {"parallel"},
  "model": {"attention", "parallel"},
  "tasks": set(),
  "rl": set(),
  "interop": {"model", "parallel"},
  "decode": {"model", "parallel", "tasks"},
  "devices": {"parallel"},
  "config": {"attention", "interop", "model", "parallel", "rl", "tasks"},
  "train": {"attention", "config", "decode", "interop", "model", "parallel", "rl", "tasks"},
  # the natural-order losses the tests hold the steps equal to (no training run calls them)
  "oracles": {"attention", "decode", "model", "parallel", "rl", "train"},
}


def _modules():
  for dirpath, _, files in os.walk(ROOT):
    for f in sorted(files):
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
        yield path, rel.removesuffix(".__init__")


def _is_module(dotted: str) -> bool:
  base = os.path.join(os.path.dirname(ROOT), *dotted.split("."))
  return os.path.exists(base + ".py") or os.path.isdir(base)


def _imports(tree):
  """(module imported, {local name: module} of imported specdraft modules, private names
  imported with `from m import _x`)."""
  targets, names, private = set(), {}, []
  for n in ast.walk(tree):
    if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("specdraft"):
      for a in n.names:
        full = f"{n.module}.{a.name}"
        if _is_module(full):
          targets.add(full)
          names[a.asname or a.name] = full
        else:
          targets.add(n.module)
          if a.name.startswith("_"):
            private.append(full)
    elif isinstance(n, ast.Import):
      for a in n.names:
        if a.name.startswith("specdraft"):
          targets.add(a.name)
          if a.asname:
            names[a.asname] = a.name
  return targets, names, private


def _package(dotted: str) -> str:
  parts = dotted.split(".")
  return parts[1] if len(parts) > 1 else ""


def test_subpackages_import_only_downwards():
  found = {}
  for path, mod in _modules():
    with open(path) as f:
      targets, _, _ = _imports(ast.parse(f.read()))
    src = _package(mod)
    for t in targets:
      dst = _package(t)
      if dst and dst != src:
        found.setdefault(src, set()).add((dst, mod))
  assert set(found) <= set(ALLOWED), f"packages without a rule: {set(found) - set(ALLOWED)}"
  upward = [f"{mod} imports specdraft.{dst}" for src, d in found.items() for dst, mod in d
            if dst not in ALLOWED[src]]  # fmt: skip
  assert not upward, "\n".join(sorted(upward))


def test_the_allowed_imports_have_no_cycle():
  done = set()

  def visit(p, stack):
    assert p not in stack, f"import cycle: {' -> '.join(stack + [p])}"
    if p in done:
      return
    for q in ALLOWED.get(p, ()):
      visit(q, stack + [p])
    done.add(p)

  for p in ALLOWED:
    visit(p, [])
  assert not ({"devices"} & set().union(*(ALLOWED[p] for p in ("parallel",))))


def test_no_module_uses_another_modules_private_names():
  bad = []
  for path, mod in _modules():
    with open(path) as f:
      tree = ast.parse(f.read())
    _, names, private = _imports(tree)
    bad += [f"{mod}: from-imports {p}" for p in private]
    for n in ast.walk(tree):
      if (
        isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id in names
        and names[n.value.id] != mod
        and n.attr.startswith("_")
        and not n.attr.startswith("__")
      ):
        bad.append(f"{mod}: {names[n.value.id]}.{n.attr}")
  assert not bad, "\n".join(sorted(set(bad)))


@pytest.mark.parametrize("pkg", ["model", "attention", "parallel"])
def test_the_model_layers_never_import_training_or_decoding(pkg):
  assert not ALLOWED[pkg] & {"train", "decode", "config", "devices"}


def test_the_library_never_imports_the_lab_notebook():
  """The benchmark bodies, entry points and renderers live in experiments/ and the configs in
  configs/; the installed package `specdraft` imports neither (they are not installed with it)."""
  bad = []
  for path, mod in _modules():
    with open(path) as f:
      tree = ast.parse(f.read())
    for n in ast.walk(tree):
      names = []
      if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
        names = [n.module]
      elif isinstance(n, ast.Import):
        names = [a.name for a in n.names]
      bad += [f"{mod} imports {m}" for m in names if m.split(".")[0] in ("experiments", "configs")]
  assert not bad, "\n".join(sorted(bad))
