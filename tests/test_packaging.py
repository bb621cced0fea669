"""What the wheel installs, and which code may import which: no generic top-level packages, and
nothing outside ``tests/`` imports the tests."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

from setuptools import find_packages

from tests.support.harness import REPO_ROOT


def _imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_the_wheel_installs_only_the_aaabus_package() -> None:
    config = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = find_packages(str(REPO_ROOT), include=include)
    assert "aaabus" in packages and "aaabus.testing" in packages
    assert all(p == "aaabus" or p.startswith("aaabus.") for p in packages), packages


def test_nothing_outside_tests_imports_tests_and_the_runtime_imports_no_checkout_code() -> None:
    offenders = []
    for top in ("aaabus", "perf", "agents", "examples"):
        for path in sorted((REPO_ROOT / top).rglob("*.py")):
            roots = _imported_roots(path)
            forbidden = {"tests"} | ({"perf", "agents"} if top == "aaabus" else set())
            if roots & forbidden:
                offenders.append(f"{path.relative_to(REPO_ROOT)}: {sorted(roots & forbidden)}")
    assert not offenders, offenders
