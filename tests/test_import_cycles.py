"""No import cycles among mha's modules, counting imports inside functions too.

The graph is read from the source with ``ast`` (nothing is imported): one node per module
under src/mha, one edge per ``import`` / ``from ... import`` statement anywhere in the file
(module level, inside functions, under ``if TYPE_CHECKING``) that names another mha module.
A function-level import that closes a loop is still a loop: it only moves the failure from
import time to call time, and it hides which module depends on which.

A package's ``__init__`` is a node like any other; the implicit import of a parent package
that Python performs before a submodule is not an edge (every submodule would otherwise sit
in a loop with ``mha/__init__.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def module_name(path: Path, root: Path) -> str:
    """``src/mha/backends/base.py`` -> ``mha.backends.base``; ``.../__init__.py`` -> the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(tree: ast.Module, name: str, is_package: bool,
                     modules: set[str]) -> set[str]:
    """The modules of ``modules`` the file imports, relative imports resolved.
    ``import X.Y`` imports ``X.Y``; ``from X import Y`` imports ``X.Y`` when that is a module
    (``from mha import trace``), else ``X`` (``from mha.trace import record``)."""
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for alias in node.names:
                sub = f"{prefix}.{alias.name}"
                out.add(sub if sub in modules else prefix)
    return out & modules


def import_graph(root: Path = SRC, top: str = "mha") -> dict[str, set[str]]:
    """``{module: {mha modules it imports}}`` for every .py file under ``root/top``."""
    files = {module_name(p, root): p for p in sorted((root / top).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = imported_modules(tree, name, path.name == "__init__.py", set(files)) - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or None when the graph is acyclic (iterative DFS)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = finished
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n    return x\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.a"}
    assert find_cycle(graph) in (["pkg.a", "pkg.sub.b", "pkg.a"], ["pkg.sub.b", "pkg.a", "pkg.sub.b"])
    (pkg / "sub" / "b.py").write_text("import pkg.sub\n")
    assert find_cycle(import_graph(tmp_path, "pkg")) is None


def test_mha_has_no_import_cycles():
    graph = import_graph()
    assert "mha.module" in graph and "mha.functional" in graph["mha.module"]  # the walk saw the tree
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_models_and_sampling_do_not_import_the_llm_or_cli_layers():
    graph = import_graph()
    for start in ("mha.models", "mha.models.llama", "mha.sampling"):
        above = sorted(m for m in reachable(graph, start) if m.split(".")[1] in ("llm", "cli"))
        assert above == [], f"{start} imports {above}"
