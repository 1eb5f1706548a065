"""The sans-IO core imports no I/O framework: each module of `homelab_gateway.core` imports in
a fresh interpreter where Twisted, treq, klein, txredisapi and prometheus_client cannot be
imported, and a module outside the core that needs them cannot."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import homelab_gateway.core

BLOCKED = ("twisted", "treq", "klein", "txredisapi", "prometheus_client")
PROBE = f"""
import importlib, sys

class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {BLOCKED!r}:
            raise ImportError("imports " + name)

sys.meta_path.insert(0, Blocked())
importlib.import_module(sys.argv[1])
"""
CORE = sorted(
    f"homelab_gateway.core.{module.name}"
    for module in pkgutil.iter_modules(homelab_gateway.core.__path__)
)


def imports_alone(module: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PROBE, module], capture_output=True, text=True, timeout=60
    )


def test_the_core_has_its_modules() -> None:
    assert len(CORE) >= 6, CORE


@pytest.mark.parametrize("module", CORE)
def test_a_core_module_imports_without_any_io_framework(module: str) -> None:
    result = imports_alone(module)
    assert result.returncode == 0, result.stderr


def test_the_probe_catches_a_module_that_needs_twisted() -> None:
    result = imports_alone("homelab_gateway.line.limiter")
    assert result.returncode != 0 and "imports twisted" in result.stderr, result.stderr
