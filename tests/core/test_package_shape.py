"""The package's shape, checked: no import circles among its modules, no module over 800 lines (all of
``vllm_hs_compat``: the export, the capture store and the record types were split where their jobs split, and the
check keeps every room that way).

The import graph is read from the source (``ast``, nothing imported): every import at a module's top level, those
under ``if TYPE_CHECKING:`` included (a circle there still means two modules that know each other both ways);
imports inside functions are deliberate lazy loads and are not counted.  ``from package import name`` counts as an
import of ``package.name`` when that is a module of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vllm_hs_compat

ROOT = Path(vllm_hs_compat.__file__).parent
PACKAGE = "vllm_hs_compat"
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


def long_modules(max_lines: int = MAX_LINES) -> dict[str, int]:
    """Modules of the package over ``max_lines`` lines, with their line counts."""
    return {
        str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py") if (n := len(p.read_text().splitlines())) > max_lines
    }


def test_the_package_has_no_import_circles() -> None:
    graph = import_graph()
    for mod, needs in (  # the graph was read, in every room (a few edges each, relative imports included)
        ("export.consumer.core", "export.consumer.claims"),
        ("capture.store", "capture.recovery"),
        ("core.records", "core.record_checks"),
        ("trainer.formats", "trainer.specs"),
        ("connector.worker", "core.records"),
    ):
        assert f"{PACKAGE}.{needs}" in graph[f"{PACKAGE}.{mod}"], (mod, needs)
    assert cycles(graph) == []


def test_the_circle_check_sees_a_circle() -> None:
    """Negative control: two modules that import each other, the way two of the consumer's layers did (one of them
    under ``if TYPE_CHECKING:``), make a circle."""
    graph = import_graph()
    a, b = f"{PACKAGE}.export.consumer.claims", f"{PACKAGE}.export.consumer.releases"
    assert b in graph[a]
    graph[b] = {*graph[b], a}
    assert [a, b] in [[m for m in c if m in (a, b)] for c in cycles(graph)]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from x import y\n")
    assert len(_top_level_imports(tree)) == 2


def test_no_module_is_over_800_lines() -> None:
    assert long_modules() == {}, f"split these where their jobs split: {long_modules()}"


def test_the_line_check_sees_a_long_module() -> None:
    """Negative control: at a lower limit the largest modules are found (and every module is counted)."""
    assert "capture/samples.py" in long_modules(600)
    assert len(long_modules(0)) == len(list(ROOT.rglob("*.py")))
