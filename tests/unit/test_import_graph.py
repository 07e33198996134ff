"""The house's shape, read off the source with `ast` (no import runs): every import of nemo_grpo (at module level,
inside functions, under TYPE_CHECKING) points to a room on its floor or below (ARCHITECTURE.md's floors), no two
modules or rooms import each other, and files and functions stay short (STYLE.md)."""

from __future__ import annotations

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(__file__), "..", "..", "nemo_grpo")
# ARCHITECTURE.md's floors: a room (top-level module or package of nemo_grpo) imports rooms on its floor or below
FLOORS = {
    "errors": 0,
    "config": 1, "config_policy": 1, "layout": 1, "precision": 1,
    "utils": 2, "data": 2, "distributed": 2, "weights": 2, "batch": 2,
    "models": 3,
    "backends": 4, "generation": 4,
    "policy": 5,
    "envs": 6, "planning": 6,
    "algorithms": 7, "validation": 7,
    "build": 8,
    "train": 9, "eval": 9, "train_rm": 9, "eval_rm": 9, "plan": 9, "config_reference": 9,
}
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, str]:
    """Dotted module name -> path, for every .py file of the package."""
    out = {}
    root = os.path.dirname(os.path.abspath(PACKAGE))
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.abspath(os.path.join(folder, name))
                dotted = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[dotted.removesuffix(".__init__")] = path
    return out


MODULES = _modules()


def _target(name: str) -> str | None:
    """The module an imported dotted name lands in (the longest prefix that is a module); None outside nemo_grpo."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in MODULES:
            return ".".join(parts[:end])
    return None


def _imports(module: str, path: str) -> set[str]:
    """Every nemo_grpo module `module` imports, wherever the import statement sits."""
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        out.update(t for t in map(_target, names) if t and t != module)
    return out


def room(module: str) -> str:
    return module.split(".")[1] if "." in module else module


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan's algorithm), each sorted."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def module_cycles() -> list[list[str]]:
    return _cycles(GRAPH)


def room_cycles() -> list[list[str]]:
    rooms: dict[str, set[str]] = {}
    for m, targets in GRAPH.items():
        if "." in m:
            rooms.setdefault(room(m), set()).update(room(t) for t in targets if "." in t and room(t) != room(m))
    return _cycles(rooms)


def arrows_up() -> list[str]:
    """'a -> b' for every import of a room on a higher floor."""
    return sorted(f"{m} -> {t}" for m, targets in GRAPH.items() for t in targets
                  if "." in m and "." in t and FLOORS[room(t)] > FLOORS[room(m)])


def long_files() -> list[str]:
    return sorted(f"{os.path.relpath(p, os.path.dirname(PACKAGE))}: {n}" for p in MODULES.values()
                  if (n := len(open(p).read().splitlines())) > MAX_FILE_LINES)


def long_functions() -> list[str]:
    out = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1  # from `def`: decorators excluded
                if n > MAX_FUNCTION_LINES:
                    out.append(f"{os.path.relpath(path, os.path.dirname(PACKAGE))}:{node.lineno} {node.name}: {n}")
    return sorted(out)


def test_every_room_has_a_floor():
    assert sorted({room(m) for m in MODULES if "." in m} - set(FLOORS)) == []


def test_the_graph_sees_function_level_and_type_checking_imports():
    """The parser finds the imports this test exists for (so an empty answer below means something)."""
    assert "nemo_grpo.validation" in GRAPH["nemo_grpo.plan"]  # at module level
    assert "nemo_grpo.planning.memory" in GRAPH["nemo_grpo.plan"]  # inside plan_recipe
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_itself_back():
    assert module_cycles() == []


def test_no_two_rooms_import_each_other():
    assert room_cycles() == []


def test_no_arrow_points_up():
    assert arrows_up() == []


@pytest.mark.parametrize("check,limit", [(long_files, MAX_FILE_LINES), (long_functions, MAX_FUNCTION_LINES)],
                         ids=["files", "functions"])
def test_files_and_functions_are_short(check, limit):
    assert check() == [], f"over {limit} lines"
