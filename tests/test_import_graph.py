"""The house rule on imports: no module of transformer/ imports one that imports
it back, directly or through others, not even inside a function."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "transformer"


def module_names() -> list[str]:
  return sorted(path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__")


def imported_modules(source: str, modules: set[str]) -> set[str]:
  """The modules of the package that `source` imports, anywhere in it:
  `from transformer import x`, `from transformer.x import ...`, `import transformer.x`."""
  found = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
      if node.module == "transformer":
        found.update(alias.name for alias in node.names if alias.name in modules)
      elif node.module.startswith("transformer."):
        found.add(node.module.split(".")[1])
    elif isinstance(node, ast.Import):
      found.update(alias.name.split(".")[1] for alias in node.names
                   if alias.name.startswith("transformer."))
  return found & modules


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


def test_find_cycle_finds_direct_and_indirect_cycles():
  assert find_cycle({"a": {"b"}, "b": set()}) is None
  assert find_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
  assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
  source = "def f():\n  from transformer.b import x\n  from transformer import c, numpy\n"
  assert imported_modules(source, {"b", "c"}) == {"b", "c"}


def test_every_module_imports_and_the_import_graph_has_no_cycle():
  modules = module_names()
  assert {"training", "translation", "workdir"} <= set(modules)
  for name in modules:
    importlib.import_module(f"transformer.{name}")
  graph = {name: imported_modules((PACKAGE / f"{name}.py").read_text(), set(modules))
           for name in modules}
  assert "translation" in graph["workdir"] and "workdir" in graph["training"]  # (it sees them)
  cycle = find_cycle(graph)
  assert cycle is None, f"import cycle: {' -> '.join(cycle)}"
