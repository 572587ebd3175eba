"""The package's import graph: no cycles; `autotuning/` and the modules shared by
the ops (directly under `ops/`) only point down.

Read from the source with `ast` (nothing imported, so it runs in milliseconds).
Every import counts, also the ones inside functions: a cycle through a lazy
import is still a cycle in the design, only hidden at import time.
"""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "tokamax_gdn"


def _modules() -> dict[str, pathlib.Path]:
  """Dotted module name -> file, for every module of the package."""
  found = {}
  for path in sorted((ROOT / PACKAGE).rglob("*.py")):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
      parts = parts[:-1]
    found[".".join(parts)] = path
  return found


def _imports(path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
  """The package modules `path` imports (`from a import b` counts as a.b when
  b is a module, else as a)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
               else node.module for alias in node.names]
    else:
      continue
    out.update(n for n in names if n in modules)
  return out


def _graph() -> dict[str, set[str]]:
  modules = _modules()
  return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
  """One import cycle of `graph` (a package's __init__ importing its own
  submodules is not one: Python loads the submodule first), or None."""
  is_parent = lambda a, b: b.startswith(a + ".")
  edges = {a: {b for b in bs if not is_parent(a, b)} for a, bs in graph.items()}
  state, stack = {}, []

  def visit(node):
    state[node] = "open"
    stack.append(node)
    for nxt in sorted(edges[node]):
      if state.get(nxt) == "open":
        return stack[stack.index(nxt):] + [nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    state[node] = "done"
    stack.pop()
    return None

  for node in sorted(edges):
    if node not in state and (found := visit(node)):
      return found
  return None


def test_the_graph_is_read():
  graph = _graph()
  assert "tokamax_gdn.ops.segments" in graph[
      "tokamax_gdn.ops.gated_delta_rule.reference"]


def test_no_import_cycle():
  cycle = _cycle(_graph())
  assert cycle is None, " -> ".join(cycle)


def test_cycle_finder_finds_one():
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"p": {"p.x"}, "p.x": {"q"}, "q": set()}) is None


@pytest.mark.parametrize("module", sorted(
    m for m in _modules() if m.startswith(f"{PACKAGE}.autotuning")))
def test_autotuning_imports_no_op_or_registry(module):
  """autotuning/ is a foundation every op imports: it must not import the ops
  (statically or by name through importlib) nor the registry."""
  path = _modules()[module]
  upward = {m for m in _graph()[module]
            if m.startswith(f"{PACKAGE}.ops") or m == f"{PACKAGE}.registry"}
  assert not upward, upward
  assert f"{PACKAGE}.ops." not in path.read_text(), "imports an op module by name"


def _is_op_folder(module: str) -> bool:
  """An op's own module (`tokamax_gdn.ops.<op>.<name>`), not a shared one."""
  parts = module.split(".")
  return len(parts) > 3 and parts[:2] == [PACKAGE, "ops"]


@pytest.mark.parametrize("module", sorted(
    m for m, path in _modules().items()
    if m.startswith(f"{PACKAGE}.ops.") and m.count(".") == 2 and path.name != "__init__.py"))
def test_shared_op_modules_import_no_op(module):
  """Modules shared by the ops (directly under `ops/`) sit below every op."""
  upward = {m for m in _graph()[module] if _is_op_folder(m)}
  assert not upward, upward
