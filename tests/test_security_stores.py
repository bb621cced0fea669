"""Secrets and stores created safe: private modes, refused shared directories, bus identity.

Each scenario boots a real server process on 127.0.0.1 and checks the one-line refusal (exit 2)
or the modes it created.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aaabus.config.secret import write_secret
from aaabus.tools.launch import ServerProcess
from tests.support.harness import REPO_ROOT

pytestmark = pytest.mark.slow  # every test boots a server process

READY = 30.0


def boot_refused(config: Path, storage: Path) -> str:
    """Start server 0 on ``storage``, which it must refuse; its one stderr line."""
    run = subprocess.run(
        [sys.executable, "-m", "aaabus", "server", "--id", "0", "--config", str(config),
         "--storage", str(storage)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, (run.returncode, run.stderr)
    return lines[0]


@pytest.mark.parametrize("kind", ["log", "file"])
def test_a_store_is_private_and_refuses_another_bus_key(
    tmp_path: Path, make_config: Any, kind: str
) -> None:
    config = make_config(properties={"aaabus.store": kind})
    storage = tmp_path / "s0"
    old = os.umask(0o022)
    try:
        proc = ServerProcess(config, 0, storage, cwd=REPO_ROOT).start()
        try:
            proc.wait_ready(READY)
        finally:
            assert proc.stop() == 0
    finally:
        os.umask(old)
    key = (tmp_path / "bus.key").read_bytes().strip()
    assert stat.S_IMODE(storage.stat().st_mode) == 0o700
    files = [path for path in storage.rglob("*") if path.is_file()]
    assert files, "the store wrote nothing"
    for path in storage.rglob("*"):
        assert stat.S_IMODE(path.stat().st_mode) == (0o700 if path.is_dir() else 0o600), path
    for path in files:
        data = path.read_bytes()
        assert key not in data and b"aaabus-secret" not in data, path  # an HMAC, not the key

    # Another bus's key: the store is refused, and its data left as it was (lock files hold the
    # pid of their last holder, FileStorage empties its scratch file when it opens).
    files = [path for path in files if not path.name.endswith(("lock", ".tmp"))]
    before = {path: path.read_bytes() for path in files}
    (tmp_path / "bus.key").unlink()
    write_secret(tmp_path / "bus.key")
    line = boot_refused(config, storage)
    assert "belongs to another bus" in line, line
    assert {path: path.read_bytes() for path in files} == before


def test_storage_directories_others_control_are_refused(tmp_path: Path, make_config: Any) -> None:
    config = make_config()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    line = boot_refused(config, shared)
    assert f"run `chmod 700 {shared}`" in line, line
    assert not (shared / "data.fs").exists()


def test_the_write_probe_never_follows_a_planted_link(tmp_path: Path, make_config: Any) -> None:
    config = make_config()
    storage = tmp_path / "s0"
    storage.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (storage / ".aaabus-write-probe").symlink_to(victim)
    proc = ServerProcess(config, 0, storage, cwd=REPO_ROOT).start()
    try:
        proc.wait_ready(READY)
    finally:
        assert proc.stop() == 0
    assert victim.read_text() == "precious"


def test_a_storage_directory_owned_by_another_user_is_refused(
    tmp_path: Path, make_config: Any
) -> None:
    config = make_config()
    if os.geteuid() == 0:
        foreign = tmp_path / "foreign"
        foreign.mkdir(mode=0o700)
        os.chown(foreign, 54321, 54321)
    else:
        # Only root can give a directory away; a system directory, owned by root and private
        # to it for writing, is one that belongs to another user.
        foreign = Path("/usr")
        assert foreign.stat().st_uid != os.geteuid()
    line = boot_refused(config, foreign)
    assert f"belongs to user {foreign.stat().st_uid}" in line, line


def test_a_server_refuses_a_key_others_may_read(tmp_path: Path, make_config: Any) -> None:
    config = make_config()
    key = tmp_path / "bus.key"
    key.chmod(0o644)  # what `aaabus secret > bus.key` made under the usual umask
    line = boot_refused(config, tmp_path / "s0")
    assert f"run `chmod 600 {key}`" in line, line
    assert not (tmp_path / "s0" / "data.fs").exists()
