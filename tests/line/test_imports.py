"""The line's modules import one another in one direction: no circle among them, counting
imports made for type checking only (a circle there still ties the two modules together)."""

from __future__ import annotations

import ast
from pathlib import Path

import homelab_gateway.line

PACKAGE = "homelab_gateway.line"


def imported(path: Path) -> set[str]:
    """The modules of the line that `path` imports, wherever the import stands."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module is not None:
            if node.module == PACKAGE:
                found.update(alias.name for alias in node.names)
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module.removeprefix(PACKAGE + ".").partition(".")[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name.removeprefix(PACKAGE + ".").partition(".")[0])
    return found


def graph() -> dict[str, set[str]]:
    folder = Path(homelab_gateway.line.__file__).parent
    return {path.stem: imported(path) for path in folder.glob("*.py")}


def circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `edges`, as the modules along it, or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for other in sorted(edges.get(module, ())):
            found = visit(other, [*path, module])
            if found:
                return found
        done.add(module)
        return None

    for module in sorted(edges):
        found = visit(module, [])
        if found:
            return found
    return None


def test_the_line_has_no_import_circle() -> None:
    edges = graph()
    assert {"cluster", "shared", "limiter", "wire", "tokens"} <= set(edges), edges
    assert circle(edges) is None, circle(edges)


def test_a_circle_is_found() -> None:
    assert circle({"cluster": {"shared"}, "shared": {"cluster"}}) == [
        "cluster",
        "shared",
        "cluster",
    ]
    assert circle({"shared": {"cluster", "wire"}, "wire": {"limiter"}, "cluster": set()}) is None
