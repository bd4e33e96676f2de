"""The export package's shape, checked: no import circles among its modules, no module over 800 lines.

The import graph is read from the source (``ast``, nothing imported): every import at a module's top level, those
under ``if TYPE_CHECKING:`` included (a circle there still means two modules that know each other both ways);
imports inside functions are deliberate lazy loads and are not counted.  ``from package import name`` counts as an
import of ``package.name`` when that is a module of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_hs_compat.export as export_pkg

ROOT = Path(export_pkg.__file__).parent
PACKAGE = "vllm_hs_compat.export"
MAX_LINES = 800


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([PACKAGE, *parts])] = path
    return out


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports at the top level, and in its ``if``/``try`` blocks (``if TYPE_CHECKING:``), never in functions."""
    found: list[ast.Import | ast.ImportFrom] = []
    todo: list[ast.stmt] = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        elif isinstance(node, ast.If | ast.Try):
            todo.extend(node.body)
            todo.extend(node.orelse)
            for handler in getattr(node, "handlers", []):
                todo.extend(handler.body)
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (top level)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the module's package
                    anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for t in targets:
                while t and t not in mods and t.startswith(PACKAGE):
                    t = t.rsplit(".", 1)[0]
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_export_package_has_no_import_circles() -> None:
    graph = import_graph()
    assert f"{PACKAGE}.consumer.core" in graph and graph[f"{PACKAGE}.consumer.core"], "the graph was not read"
    assert cycles(graph) == []


def test_the_circle_check_sees_a_circle() -> None:
    """Negative control: two modules that import each other, the way two of the consumer's layers did (one of them
    under ``if TYPE_CHECKING:``), make a circle."""
    graph = import_graph()
    a, b = f"{PACKAGE}.consumer.claims", f"{PACKAGE}.consumer.releases"
    assert b in graph[a]
    graph[b] = {*graph[b], a}
    assert [a, b] in [[m for m in c if m in (a, b)] for c in cycles(graph)]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from x import y\n")
    assert len(_top_level_imports(tree)) == 2


def test_no_export_module_is_over_800_lines() -> None:
    long = {
        str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these where their jobs split: {long}"
