"""Files that say what a server trusts are refused when others can change them (issue 44, 9).

``a3.xml`` (it can switch on ``aaabus.trust.by_value``: code), the MQTT ACL file and the MQTT
credentials file. The real command line, as subprocesses: ``aaabus check`` and ``aaabus
server`` exit 2 with one line naming the file, its mode or owner, and the command that fixes
it. Before, each of them was read whatever its mode and owner.

The tests change owners, so they run as root (as the suite does in CI); the mode cases that do
not need a foreign owner run as any user.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from aaabus.mqtt.auth import hash_password
from tests.support.harness import REPO_ROOT

pytestmark = pytest.mark.slow  # tool subprocesses

#: A uid and a gid that no account of the test machine uses (the foreign writer).
STRANGER = 54_321
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="changing a file's owner takes root")


def aaabus(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aaabus", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip


def refused(run: subprocess.CompletedProcess[str]) -> str:
    """The one stderr line of a command that refused a file: exit status 2, no traceback."""
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, (run.returncode, run.stdout, run.stderr)
    return lines[0]


@pytest.fixture
def mqtt_config(tmp_path: Path, make_config: Callable[..., Path]) -> Path:
    """A one-server config with an MQTT port, an ACL file and a credentials file, all 0644."""
    (tmp_path / "acl").write_text("user alice\ntopic readwrite plant/#\n")
    (tmp_path / "users").write_text(f"alice:{hash_password('secret')}\n")
    properties = {
        "aaabus.mqtt.port": "0",
        "aaabus.mqtt.acl": "acl",
        "aaabus.mqtt.credentials": "users",
    }
    config = make_config(properties=properties)
    for path in (config, tmp_path / "acl", tmp_path / "users"):
        path.chmod(0o644)  # what an editor makes under the usual umask 022: accepted
    return config


def server(config: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """``aaabus server`` that must refuse to start (a server that starts is a failure here)."""
    return aaabus("server", "--id", "0", "--config", str(config), "--storage", str(tmp_path / "s"))


@pytest.mark.parametrize("name", ["a3.xml", "acl", "users"])
@pytest.mark.parametrize("mode", [0o666, 0o602])
def test_a_file_others_may_write_is_refused(
    tmp_path: Path, mqtt_config: Path, name: str, mode: int
) -> None:
    assert aaabus("check", str(mqtt_config)).returncode == 0
    target = tmp_path / name
    target.chmod(mode)
    line = refused(aaabus("check", str(mqtt_config)))
    assert str(target) in line and f"(mode {mode:o})" in line, line
    assert f"run `chmod go-w {target}`" in line, line
    assert refused(server(mqtt_config, tmp_path)).endswith(line.split(": error: ", 1)[1])
    if name == "a3.xml":
        assert not (tmp_path / "s").exists()  # refused before anything was made


@as_root
def test_a_group_writable_file_is_refused_unless_the_group_is_the_owners_own(
    tmp_path: Path, mqtt_config: Path
) -> None:
    # root's own group (its primary group, no other member): what a umask of 002 makes.
    mqtt_config.chmod(0o664)
    assert aaabus("check", str(mqtt_config)).returncode == 0, "the owner's own group is refused"
    os.chown(mqtt_config, -1, STRANGER)
    line = refused(aaabus("check", str(mqtt_config)))
    assert f"configuration file is writable by group {STRANGER} (mode 664)" in line, line


@as_root
@pytest.mark.parametrize("name", ["a3.xml", "acl", "users"])
def test_a_file_of_another_user_is_refused(tmp_path: Path, mqtt_config: Path, name: str) -> None:
    target = tmp_path / name
    os.chown(target, STRANGER, -1)
    line = refused(aaabus("check", str(mqtt_config)))
    assert str(target) in line and f"belongs to user {STRANGER}, not to root" in line, line
    assert f"run `chown root {target}`" in line, line
    os.chown(target, 0, -1)
    assert aaabus("check", str(mqtt_config)).returncode == 0


def test_a_directory_others_may_write_is_refused_unless_sticky(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    text = (REPO_ROOT / "domains" / "flat-1.xml").read_text()
    (shared / "a3.xml").write_text(text)
    (shared / "a3.xml").chmod(0o644)
    shared.chmod(0o777)  # anyone may replace the file, whatever its own mode
    line = refused(aaabus("check", str(shared / "a3.xml")))
    assert f"{shared}: directory of configuration file" in line and "(mode 777)" in line, line
    shared.chmod(0o1777)  # as /tmp: only the file's owner may rename or remove it
    assert aaabus("check", str(shared / "a3.xml")).returncode == 0


def test_the_configs_of_the_repository_stay_accepted() -> None:
    configs = sorted((REPO_ROOT / "domains").glob("*.xml"))
    assert configs
    for config in configs:
        run = aaabus("check", str(config))
        assert run.returncode == 0, (config, oct(config.stat().st_mode), run.stderr)
