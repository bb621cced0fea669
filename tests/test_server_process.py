"""The ``aaabus-server`` command as a real process: durability across SIGKILL, clean stop, and a
one-line error with exit status 2 for every bad input."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from aaabus.config.secret import ensure_secret
from aaabus.tools.launch import ServerProcess
from tests.support.harness import REPO_ROOT

# Real server processes, subprocesses or Spark: not in the fast lane (make check).
pytestmark = pytest.mark.slow

READY_TIMEOUT = 30.0


def server_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "aaabus", "server", *args]


def run_server_expecting_error(*args: str, cwd: Path | None = None) -> str:
    """Run a server that must refuse to start; return its single stderr line."""
    proc = subprocess.run(
        server_cmd(*args),
        cwd=cwd or REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    event = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        event.wait(0.01)  # polling a file another process writes: there is nothing to wait on


def read_counter(storage: Path) -> tuple[int, int]:
    from aaabus.core.store import DEFAULT_STORE_KIND, open_store
    from tests.support.agents import Counter

    store = open_store(DEFAULT_STORE_KIND, storage, 0)
    try:
        counters = [a for a in store.agents.values() if isinstance(a, Counter)]
        assert len(counters) == 1
        return counters[0].count, counters[0].errors
    finally:
        store.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_counter_is_exact_after_sigkills_at_random_moments(
    tmp_path: Path, make_config: Callable[..., Path], seed: int
) -> None:
    """1,000 local increments, the server SIGKILLed at random moments and restarted: the counter
    ends at exactly 1,000, every increment counted once and in order."""
    rng = random.Random(seed)
    done = tmp_path / "done.json"
    args = json.dumps({"n": 1000, "done": str(done)})
    service = f"<service class=\"tests.support.agents:durability_setup\" args='{args}'/>"
    config = make_config(extra={0: service}, properties={"aaabus.engine.max_batch": "4"})
    storage = tmp_path / "s0"
    kills_mid_run = 0
    for _ in range(4):
        proc = ServerProcess(config, 0, storage, cwd=REPO_ROOT).start()
        try:
            proc.wait_ready(READY_TIMEOUT)
            # A random moment within the run (the whole run takes a few hundred ms).
            threading.Event().wait(rng.uniform(0.0, 0.15))
            finished_before_kill = done.exists()
            proc.kill()
        finally:
            proc.stop()
        if not finished_before_kill:
            kills_mid_run += 1
    proc = ServerProcess(config, 0, storage, cwd=REPO_ROOT).start()
    try:
        proc.wait_ready(READY_TIMEOUT)
        wait_for(done.exists, 60, "the counter to reach 1000")
        assert proc.stop() == 0
    finally:
        proc.stop()
    assert kills_mid_run >= 1, "no kill landed in the middle of the run"
    assert json.loads(done.read_text()) == {"count": 1000, "errors": 0}
    assert read_counter(storage) == (1000, 0)


def test_sigterm_stops_cleanly_and_restart_resumes(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    done = tmp_path / "done.json"
    args = json.dumps({"n": 300, "done": str(done)})
    service = f"<service class=\"tests.support.agents:durability_setup\" args='{args}'/>"
    config = make_config(extra={0: service})
    storage = tmp_path / "s0"
    proc = ServerProcess(config, 0, storage, cwd=REPO_ROOT).start()
    try:
        proc.wait_ready(READY_TIMEOUT)
        assert proc.stop() == 0
    finally:
        proc.stop()
    proc = ServerProcess(config, 0, storage, cwd=REPO_ROOT).start()
    try:
        proc.wait_ready(READY_TIMEOUT)
        wait_for(done.exists, 60, "the counter to reach 300")
        assert proc.stop() == 0
    finally:
        proc.stop()
    assert read_counter(storage) == (300, 0)


# -- bad input: one line, exit 2 ------------------------------------------------------------------

GOOD = """<config>
  <domain name="D0"/>
  <server id="0" name="s0" hostname="127.0.0.1">
    <network domain="D0" port="{port}"/>{extra}
  </server>
</config>
"""


def write(tmp_path: Path, text: str, name: str = "a3.xml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    ensure_secret(tmp_path / "bus.key")
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<config><domain name='D0'/>", "a3.xml:1"),
        (GOOD.replace("<network", "<netwrok"), "a3.xml:4"),
        (GOOD.replace('name="s0"', 'name="s0" colour="red"'), "colour"),
        (GOOD.replace('id="0" ', ""), "id"),
        (
            GOOD.replace(
                "</config>",
                '<server id="0"><network domain="D0" port="{port2}"/></server></config>',
            ),
            "server id 0 is used twice",
        ),
        (
            GOOD.replace(
                "</config>", '<server id="1"><network domain="D0" port="{port}"/></server></config>'
            ),
            "port",
        ),
    ],
    ids=["malformed", "unknown-element", "unknown-attribute", "missing-id", "dup-id", "dup-port"],
)
def test_bad_config_is_one_line_exit_2(tmp_path: Path, text: str, expected: str) -> None:
    path = write(tmp_path, text.format(port=40001, port2=40002, extra=""))
    line = run_server_expecting_error(
        "--id", "0", "--config", str(path), "--storage", str(tmp_path)
    )
    assert expected in line and "a3.xml" in line, line


def test_id_not_in_config(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.format(port=40001, extra=""))
    line = run_server_expecting_error("--id", "7", "--config", str(path))
    assert "server id 7" in line and "--id" in line, line


def test_service_class_that_cannot_be_imported(tmp_path: Path) -> None:
    extra = '\n    <service class="no_such_module.sub:Thing" args=""/>'
    path = write(tmp_path, GOOD.format(port=40001, extra=extra))
    line = run_server_expecting_error(
        "--id", "0", "--config", str(path), "--storage", str(tmp_path / "s0")
    )
    assert "no_such_module.sub:Thing" in line and "a3.xml:5" in line, line


def test_service_that_fails_at_boot(tmp_path: Path) -> None:
    extra = '\n    <service class="tests.support.agents:failing_service" args=""/>'
    path = write(tmp_path, GOOD.format(port=40001, extra=extra))
    line = run_server_expecting_error(
        "--id", "0", "--config", str(path), "--storage", str(tmp_path / "s0")
    )
    assert "this service always fails" in line, line


def test_unwritable_storage(tmp_path: Path) -> None:
    path = write(tmp_path, GOOD.format(port=40001, extra=""))
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    line = run_server_expecting_error(
        "--id", "0", "--config", str(path), "--storage", str(blocker / "s0")
    )
    assert "not writable" in line and "--storage" in line, line


def test_storage_already_open_by_another_process(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = make_config()
    storage = tmp_path / "s0"
    proc = ServerProcess(config, 0, storage, cwd=REPO_ROOT).start()
    try:
        proc.wait_ready(READY_TIMEOUT)
        line = run_server_expecting_error(
            "--id", "0", "--config", str(config), "--storage", str(storage)
        )
        assert "in use by another process" in line, line
    finally:
        assert proc.stop() == 0


def test_storage_of_another_server(tmp_path: Path, make_config: Callable[..., Path]) -> None:
    config = make_config(servers=2)
    storage = tmp_path / "shared"
    proc = ServerProcess(config, 0, storage, cwd=REPO_ROOT).start()
    try:
        proc.wait_ready(READY_TIMEOUT)
    finally:
        proc.stop()
    line = run_server_expecting_error(
        "--id", "1", "--config", str(config), "--storage", str(storage)
    )
    assert "belongs to server 0" in line, line


def test_missing_config_file(tmp_path: Path) -> None:
    line = run_server_expecting_error("--id", "0", "--config", str(tmp_path / "nope.xml"))
    assert "nope.xml" in line, line


def test_bad_flag_is_one_line() -> None:
    line = run_server_expecting_error("--id", "zero", "--config", "x.xml")
    assert "--id" in line, line
    assert os.path.exists(REPO_ROOT / "aaabus")


def test_missing_secret_names_the_command(tmp_path: Path) -> None:
    path = tmp_path / "a3.xml"
    path.write_text(GOOD.format(port=40001, extra=""))
    line = run_server_expecting_error(
        "--id", "0", "--config", str(path), "--storage", str(tmp_path / "s0")
    )
    assert "aaabus secret --out bus.key" in line, line
