"""The house rules on imports: no module of transformer/ imports one that imports
it back, directly or through others, not even inside a function; and imports go
one way between the sub-packages: the CLIs -> training / decoding -> model, data,
runtime, plotting (DESIGN.md), never back up."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "transformer"

# The sub-packages a sub-package may import (besides itself). Everything not
# listed is forbidden: the model imports nothing of the project, and the lower
# layers never import training or decoding.
ALLOWED = {
    "model": set(),
    "data": set(),
    "runtime": {"model", "data"},
    "plotting": {"model", "data"},
    "decoding": {"model", "data", "runtime", "plotting"},
    "training": {"model", "data", "runtime", "plotting", "decoding"},
    "interop": {"model", "data", "runtime", "decoding"},
}


def module_names() -> list[str]:
  """Every module of the package as a dotted name below `transformer`, e.g.
  "model.transformer" (packages' `__init__` modules as "model")."""
  names = []
  for path in sorted(PACKAGE.rglob("*.py")):
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    if parts:
      names.append(".".join(parts))
  return names


def imported_modules(source: str, modules: set[str]) -> set[str]:
  """The modules of the package that `source` imports, anywhere in it:
  `from transformer.x import y` (y a module, or a name in module x),
  `from transformer import x`, `import transformer.x.y`."""
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      if node.module == "transformer" or node.module.startswith("transformer."):
        base = node.module[len("transformer."):] if "." in node.module else ""
        for alias in node.names:
          child = f"{base}.{alias.name}" if base else alias.name
          if child in modules:
            found.add(child)
          elif base in modules:
            found.add(base)
    elif isinstance(node, ast.Import):
      found.update(alias.name[len("transformer."):] for alias in node.names
                   if alias.name.startswith("transformer."))
  return found & set(modules)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """A cycle of `graph` as [a, b, ..., a], or None (depth-first search)."""
  state: dict[str, str] = {}  # "open" on the current path, "done" once explored

  def visit(node, path):
    state[node] = "open"
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        return path[path.index(nxt):] + [nxt]
      if nxt not in state and (cycle := visit(nxt, path + [nxt])):
        return cycle
    state[node] = "done"
    return None

  for node in sorted(graph):
    if node not in state and (cycle := visit(node, [node])):
      return cycle
  return None


def _source(name: str) -> str:
  path = PACKAGE.joinpath(*name.split("."))
  return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


def import_graph() -> dict[str, set[str]]:
  modules = module_names()
  return {name: imported_modules(_source(name), set(modules)) - {name} for name in modules}


def test_find_cycle_finds_direct_and_indirect_cycles():
  assert find_cycle({"a": {"b"}, "b": set()}) is None
  assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
  source = ("def f():\n  from transformer.b import x\n  from transformer import c, numpy\n"
            "  from transformer.d import e\n  import transformer.f.g\n")
  assert imported_modules(source, {"b", "c", "d", "d.e", "f.g"}) == {"b", "c", "d.e", "f.g"}


def test_every_module_imports_and_the_import_graph_has_no_cycle():
  modules = module_names()
  assert {"training.loop", "decoding.translator", "runtime.workdir"} <= set(modules)
  for name in modules:
    importlib.import_module(f"transformer.{name}")
  graph = import_graph()
  assert "runtime.workdir" in graph["training.loop"]  # (it sees them)
  cycle = find_cycle(graph)
  assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_sub_packages_import_only_the_layers_below_them():
  graph = import_graph()
  wrong = []
  for name, imported in graph.items():
    package = name.split(".")[0]
    if package not in ALLOWED:
      continue  # transformer/__init__.py: the public API, free to import anything
    for other in imported:
      other_package = other.split(".")[0]
      if other_package != package and other_package not in ALLOWED[package]:
        wrong.append(f"{name} imports {other}")
  assert not wrong, "imports against the layers: " + "; ".join(sorted(wrong))
  assert set(ALLOWED) >= {n.split(".")[0] for n in graph if "." in n}, "a new sub-package"
