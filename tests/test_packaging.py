"""What the wheel installs, and which code may import which: no generic top-level packages,
nothing outside ``tests/`` imports the tests, and the core loads none of the optional libraries
(each feature behind an extra imports its own at first use, and says which extra is missing)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable
from pathlib import Path

import pytest
from setuptools import find_packages

from aaabus.config.reader import load_config
from aaabus.errors import ConfigError, ExtraMissing
from aaabus.node.server import AgentServer
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
    for top in ("aaabus", "perf", "examples"):
        for path in sorted((REPO_ROOT / top).rglob("*.py")):
            roots = _imported_roots(path)
            forbidden = {"tests"} | ({"perf"} if top == "aaabus" else set())
            if roots & forbidden:
                offenders.append(f"{path.relative_to(REPO_ROOT)}: {sorted(roots & forbidden)}")
    assert not offenders, offenders


# -- a slim core: the optional libraries are imported by their features only ------------------


def _distribution(requirement: str) -> str:
    """The normalised distribution name of a requirement (``prometheus-client>=0.20``...)."""
    name = re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def optional_modules() -> set[str]:
    """The top-level modules that only distributions an extra names (and the core does not)
    provide: a namespace shared with a core dependency (``zope``) is not one."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    core = {_distribution(r) for r in project["dependencies"]}
    extras = {_distribution(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    optional = extras - core - {"aaabus"}
    return {
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if all(_distribution(d) in optional for d in dists)
    }


def loaded_after(code: str, optional: set[str], *args: str) -> list[str]:
    """The ``optional`` top-level modules loaded in a fresh interpreter once ``code`` has run."""
    probe = f"import sys\n{code}\nprint(sorted({{m.split('.')[0] for m in sys.modules}}))"
    proc = subprocess.run(
        [sys.executable, "-c", probe, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    loaded: list[str] = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    return sorted(set(loaded) & optional)


def test_the_optional_libraries_are_known_and_installed_here() -> None:
    # What the tests below look for: the suite runs with every extra installed, so an empty or
    # wrong list would let them pass whatever `import aaabus` loads.
    found = optional_modules()
    assert {"pyarrow", "pyspark", "numpy", "networkx", "matplotlib", "prometheus_client"} <= found


def test_import_aaabus_and_its_command_line_load_no_optional_library() -> None:
    optional = optional_modules()
    assert loaded_after("import aaabus", optional) == []
    # The `aaabus` command's parser (plan and analyze included) and the server's entry point.
    code = "import aaabus.tools.cli as cli\ncli._main_parser()\ncli._server_parser('aaabus-server')"
    assert loaded_after(code, optional) == []


@pytest.mark.slow  # a server process
def test_a_server_starts_and_stops_without_optional_library(
    make_config: Callable[..., Path], tmp_path: Path
) -> None:
    config = make_config(properties={"aaabus.store": "log"})
    code = (
        "from aaabus.config.reader import load_config\n"
        "from aaabus.node.server import AgentServer\n"
        "server = AgentServer(load_config(sys.argv[1]), 0, storage=sys.argv[2], endpoints=True)\n"
        "server.start()\n"
        "server.stop()"
    )
    assert loaded_after(code, optional_modules(), str(config), str(tmp_path / "s0")) == []


#: Run by ``python -c``: the modules named in argv[1] (comma-separated) cannot be imported, as
#: if not installed, then the ``aaabus`` command runs with the rest of argv.
WITHOUT = """
import sys
from importlib.abc import MetaPathFinder

blocked = set(sys.argv[1].split(","))

class NotInstalled(MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, NotInstalled())
from aaabus.tools.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize(
    ("command", "blocked", "needs"),
    [
        ("plan", "pyspark", "planning from traces needs pyspark"),
        ("plan", "networkx,numpy", "planning from traces needs numpy, networkx"),
        ("analyze", "pyspark", "the analysis of traces needs pyspark"),
        ("analyze", "matplotlib", "the analysis of traces needs matplotlib"),
    ],
)
def test_analysis_commands_without_their_extra_say_which_to_install(
    tmp_path: Path, command: str, blocked: str, needs: str
) -> None:
    args = [str(tmp_path), "--out", str(tmp_path / "out")]
    args += ["--max-domain-size", "4"] if command == "plan" else []
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT, blocked, command, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr == (
        f"aaabus {command}: error: {needs}, not installed here: pip install 'aaabus[spark]'\n"
    )
    assert list(tmp_path.iterdir()) == []  # refused before anything was read or written


@pytest.mark.parametrize(
    ("prop", "value", "module", "extra"),
    [
        ("aaabus.traffic", "traces", "pyarrow", "traffic"),
        ("aaabus.metrics.port", "0", "prometheus_client", "metrics"),
    ],
)
def test_a_property_whose_extra_is_missing_is_refused_at_start(
    make_config: Callable[..., Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    prop: str,
    value: str,
    module: str,
    extra: str,
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what an install without it looks like
    config = load_config(make_config(properties={prop: value, "aaabus.store": "log"}))
    with pytest.raises(ExtraMissing) as refused:
        AgentServer(config, 0, storage=tmp_path / "s0", endpoints=True)
    assert isinstance(refused.value, ConfigError)
    assert str(refused.value) == (
        f"property {prop} needs {module}, not installed here: pip install 'aaabus[{extra}]'"
    )
    assert not (tmp_path / "s0").exists()  # before the store was opened
