"""The product's modules import one way: no circle among the imports that run at import time.

A circle passes unnoticed while every process imports its modules in one order, and breaks
the first import in another (``import extproc.prefix`` alone failed: it imported the
admission package, whose controller reached back into the half-run ``extproc.prefix``).
Read from the source, so it costs no import: a module's top-level imports (not those under
``if TYPE_CHECKING`` nor inside functions), and importing ``a.b.c`` runs ``a/__init__`` and
``a/b/__init__`` first, so those count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules(package: str = "extproc") -> dict[str, Path]:
    """modules is every module of ``package`` by dotted name (a package by its own name)."""
    out = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def top_imports(tree: ast.Module) -> set[str]:
    """top_imports is every dotted name a module's top level imports (``from a import b`` gives
    ``a`` and ``a.b``), with every package above each."""
    names: set[str] = set()
    for stmt in tree.body:
        if isinstance(stmt, ast.If) and "TYPE_CHECKING" in ast.dump(stmt.test):
            continue
        for node in ast.walk(stmt) if isinstance(stmt, (ast.If, ast.Try)) else [stmt]:
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.update(f"{node.module}.{a.name}" for a in node.names)
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
    return {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 2)}


def graph() -> dict[str, set[str]]:
    """graph is module -> the product's modules its import runs first (its own packages left out:
    they are running already)."""
    mods = modules()
    return {name: {d for d in top_imports(ast.parse(path.read_text())) if d in mods and d != name
                   and not name.startswith(d + ".")}
            for name, path in mods.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """circles is every set of modules that import one another, round (strongly connected)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            part = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(part) > 1:
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in order:
            visit(v)
    return found


def test_the_checker_finds_a_circle_through_a_package():
    """The check itself: ``m`` imports ``p.b``, which runs ``p/__init__`` first, which imports
    ``p.a``, which imports ``m``: a circle; the TYPE_CHECKING import is not one."""
    tree = ast.parse("from p.b import x\nif TYPE_CHECKING:\n    import q\n")
    assert top_imports(tree) == {"p", "p.b", "p.b.x"}
    edges = {"p": {"p.a"}, "p.a": {"m"}, "m": {"p", "p.b"}, "p.b": set()}
    assert circles(edges) == [["m", "p", "p.a"]]
    assert circles({"p": {"p.a"}, "p.a": set(), "m": {"p", "p.b"}, "p.b": set()}) == []


def test_no_module_of_the_product_imports_in_a_circle():
    assert circles(graph()) == []
