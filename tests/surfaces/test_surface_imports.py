"""A surface is its module and a row of the table: no surface module imports another's, and
each row names a surface class that answers with the skeleton's flow."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import homelab_gateway.surfaces as package
from homelab_gateway.core.surfaces import SURFACES
from homelab_gateway.surfaces.skeleton import Surface

SURFACE_MODULES = {row.surface.partition(":")[0] for row in SURFACES}


def imported(module: str) -> set[str]:
    source = Path(package.__path__[0], f"{module}.py").read_text()
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_surface_imports_another_surfaces_module() -> None:
    for module in SURFACE_MODULES:
        others = {f"homelab_gateway.surfaces.{m}" for m in SURFACE_MODULES - {module}}
        assert not imported(module) & others, module


def test_every_row_names_a_surface_of_the_skeleton() -> None:
    for row in SURFACES:
        module, _, name = row.surface.partition(":")
        kind = getattr(importlib.import_module(f"homelab_gateway.surfaces.{module}"), name)
        assert issubclass(kind, Surface), row.name
    names = [row.name for row in SURFACES]
    paths = [path for row in SURFACES for path in row.paths]
    assert len(set(names)) == len(names) and len(set(paths)) == len(paths)
