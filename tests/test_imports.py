"""The import directions, read from the source with `ast`: the core imports none of the layers
around it, the upstream client no surface, no surface another surface; tests/ and bench/ share
testsupport/ and never import each other; and no modules of src/, bench/ or testsupport/ import
each other in a circle. Every import counts, in a function or under TYPE_CHECKING too: a type's
home is a dependency all the same."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {
    "homelab_gateway": ROOT / "src" / "homelab_gateway",
    "bench": ROOT / "bench",
    "testsupport": ROOT / "testsupport",
    "tests": ROOT / "tests",
}
CIRCLE_FREE = ("homelab_gateway", "bench", "testsupport")

CORE = "homelab_gateway.core"
LAYERS = tuple(f"homelab_gateway.{name}" for name in ("line", "upstream", "surfaces", "web"))
FORBIDDEN = {
    CORE: LAYERS,
    "homelab_gateway.upstream": ("homelab_gateway.surfaces",),
    "tests": ("bench",),
    "bench": ("tests",),
    "testsupport": ("tests", "bench"),
}
"""Importer package: the packages none of its modules may import."""

SURFACES = frozenset({"messages", "openai", "responses", "proxy"})
"""The front surfaces in homelab_gateway.surfaces: none imports another."""
SHARED = frozenset({"attempts", "skeleton", "stream", "translated"})
"""The modules of homelab_gateway.surfaces every surface may use. Each module there is one or
the other, so a new one is placed by whoever adds it."""

Graph = Mapping[str, frozenset[str]]


def module_files() -> dict[str, Path]:
    """Every module of the checkout's packages by its dotted name (a package by its own)."""
    found = {}
    for package, directory in PACKAGES.items():
        for path in directory.rglob("*.py"):
            parts = (package, *path.relative_to(directory).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imported(name: str, path: Path, modules: Mapping[str, Path]) -> Iterator[str]:
    """The modules one module imports: each import named by the longest module of `modules`
    it names (`from a import b` names a.b when b is a module), else as written."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            yield known_prefix(target, modules)


def known_prefix(target: str, modules: Mapping[str, Path]) -> str:
    parts = target.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return target


def import_graph() -> dict[str, frozenset[str]]:
    """Importer: what it imports, leaving out itself."""
    modules = module_files()
    return {
        name: frozenset(target for target in imported(name, path, modules) if target != name)
        for name, path in modules.items()
    }


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(graph: Graph) -> list[tuple[str, str]]:
    """Each import of a package its importer's package may not import (FORBIDDEN), and each
    surface's import of another surface."""
    found = []
    for importer, targets in graph.items():
        for target in targets:
            if any(
                within(importer, package) and any(within(target, f) for f in forbidden)
                for package, forbidden in FORBIDDEN.items()
            ) or (surface(importer) and surface(target)):
                found.append((importer, target))
    return sorted(found)


def surface(module: str) -> bool:
    package, _, name = module.rpartition(".")
    return package == "homelab_gateway.surfaces" and name in SURFACES


def circles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): each
    a set of modules that import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in graph.get(module, ()):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def circle_free(graph: Graph) -> dict[str, frozenset[str]]:
    """The graph among the modules of CIRCLE_FREE's packages alone."""

    def kept(module: str) -> bool:
        return any(within(module, package) for package in CIRCLE_FREE)

    return {name: frozenset(filter(kept, targets)) for name, targets in graph.items() if kept(name)}


GRAPH = import_graph()


def test_the_graph_has_every_package_and_its_imports() -> None:
    for package in PACKAGES:
        assert sum(within(name, package) for name in GRAPH) >= 5, package
    assert "homelab_gateway.core.sse" in GRAPH["testsupport.client"]
    assert "testsupport.processes" in GRAPH["bench.__main__"]


def test_the_core_imports_no_layer_and_the_upstream_client_no_surface() -> None:
    assert [v for v in violations(GRAPH) if within(v[0], "homelab_gateway")] == []


def test_tests_and_bench_never_import_each_other() -> None:
    assert [v for v in violations(GRAPH) if not within(v[0], "homelab_gateway")] == []


def test_every_module_of_the_surfaces_is_a_surface_or_shared() -> None:
    names = {
        name.rpartition(".")[2]
        for name in GRAPH
        if name.rpartition(".")[0] == "homelab_gateway.surfaces"
    }
    assert names - SURFACES - SHARED == set(), "add each to SURFACES or SHARED"
    assert names >= SURFACES and names >= SHARED, "a listed module is gone"


def test_no_modules_import_each_other_in_a_circle() -> None:
    assert circles(circle_free(GRAPH)) == []


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a"})}, [["a", "b", "c"]]),
        ({"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset()}, []),
        ({"a": frozenset({"b"}), "b": frozenset({"a"}), "c": frozenset({"a"})}, [["a", "b"]]),
    ],
)
def test_circles_finds_each_circle(graph: Graph, expected: list[list[str]]) -> None:
    assert circles(graph) == expected


def test_violations_names_each_forbidden_import() -> None:
    graph = {
        "homelab_gateway.core.line": frozenset({"homelab_gateway.web.respond"}),
        "homelab_gateway.surfaces.openai": frozenset(
            {"homelab_gateway.surfaces.messages", "homelab_gateway.surfaces.attempts"}
        ),
        "bench.pair": frozenset({"tests.helpers", "testsupport.processes"}),
        "homelab_gateway.web.app": frozenset({"homelab_gateway.core.line"}),
    }
    assert violations(graph) == [
        ("bench.pair", "tests.helpers"),
        ("homelab_gateway.core.line", "homelab_gateway.web.respond"),
        ("homelab_gateway.surfaces.openai", "homelab_gateway.surfaces.messages"),
    ]
