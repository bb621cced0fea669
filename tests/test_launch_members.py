"""`aaabus launch` starts every member of every server that lives on this host, each on its own
store, and stops them by PID (issue 42). The real command, as a process of its own: member 0 of
server 0 on 127.0.0.1 with its replica 1 on 127.0.0.2; server 1 on another machine
(192.0.2.10, a documentation address) with its replica 1 here, on 127.0.0.3."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from aaabus.config.reader import load_config
from aaabus.tools.launch import local_members
from tests.support.harness import REPO_ROOT, free_ports

pytestmark = pytest.mark.slow

READY_S = 60.0


def two_server_config(make_config: Callable[..., Path]) -> Path:
    rep0, rep1 = free_ports(2)
    config = make_config(
        servers=2,
        extra={
            0: f'<replica index="1" hostname="127.0.0.2" port="{rep0}"/>'
            f'<replica index="2" hostname="192.0.2.11" port="{rep0}"/>',
            1: f'<replica index="1" hostname="127.0.0.3" port="{rep1}"/>',
        },
    )
    text = config.read_text()
    config.write_text(
        text.replace(
            '<server id="1" name="s1" hostname="127.0.0.1"',
            '<server id="1" name="s1" hostname="192.0.2.10"',
        )
    )
    return config


class Launcher:
    """``aaabus launch`` running, its output lines in a queue (read by a thread of the test)."""

    def __init__(self, config: Path, root: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aaabus", "launch", str(config), "--storage-root", str(root)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        self._reader = threading.Thread(target=self._read, name="test-launch-out", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def expect(self, prefix: str, timeout: float = READY_S) -> str:
        """The first line (from here on) starting with ``prefix``; fails past ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"no line {prefix!r} in {timeout}s: {self.seen[-8:]}"
                ) from None
            self.seen.append(line)
            if line.startswith(prefix):
                return line

    def rest(self) -> list[str]:
        """Every line not read yet, once the launcher has exited (its output ended)."""
        self._reader.join(30)
        assert not self._reader.is_alive(), "the launcher's output did not end"
        lines = []
        while not self.lines.empty():
            lines.append(self.lines.get_nowait())
        return lines

    def children(self) -> set[int]:
        """The PIDs of the processes it started (its direct children)."""
        pids: set[int] = set()
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            pids |= {int(p) for p in (task / "children").read_text().split()}
        return pids


@contextmanager
def launched(config: Path, root: Path) -> Iterator[Launcher]:
    launcher = Launcher(config, root)
    try:
        yield launcher
    finally:
        if launcher.proc.poll() is None:
            launcher.proc.send_signal(signal.SIGTERM)
            try:
                launcher.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(launcher.proc.pid, signal.SIGKILL)
                launcher.proc.wait(10)


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A child of the launcher that has exited but was not reaped yet shows as a zombie.
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z"


def aaabus_status(config: Path) -> dict[str, object]:
    shown = subprocess.run(
        [sys.executable, "-m", "aaabus", "status", str(config), "--id", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO_ROOT,
    )
    (status,) = json.loads(shown.stdout)["servers"]
    assert isinstance(status, dict)
    return status


def test_the_local_members_are_the_servers_and_replicas_on_this_host(
    make_config: Callable[..., Path],
) -> None:
    config = load_config(two_server_config(make_config))
    assert local_members(config) == ([0], [(0, 1), (1, 1)])


def test_launch_starts_every_local_member_on_its_own_store_and_stops_them_by_pid(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = two_server_config(make_config)
    root = tmp_path / "stores"
    with launched(config, root) as launcher:
        ready = launcher.expect("aaabus launch: 1 server(s) ready")
        assert ready == "aaabus launch: 1 server(s) ready: 0; 2 replica(s): s0r1, s1r1"
        assert sorted(p.name for p in root.iterdir()) == ["s0", "s0r1", "s1r1"]
        members = aaabus_status(config)["membership"]
        assert isinstance(members, dict)
        assert [(m["member"], m["role"]) for m in members["members"]] == [
            (0, "primary"),
            (1, "follower"),
            (2, "unreachable"),
        ]
        pids = launcher.children()
        assert len(pids) == 3

        # A replica's crash is its server's business (its other members go on), not the bus's.
        s1r1 = next(
            pid
            for pid in pids
            if str(root / "s1r1") in Path(f"/proc/{pid}/cmdline").read_text().split("\0")
        )
        os.kill(s1r1, signal.SIGKILL)
        failed = launcher.expect("aaabus launch: s1r1 failed")
        assert failed == "aaabus launch: s1r1 failed (exit -9); the other members of server 1 go on"
        assert aaabus_status(config)["up"] is True
        assert launcher.proc.poll() is None

        launcher.proc.send_signal(signal.SIGTERM)
        stopped = launcher.expect("aaabus launch: stopped")
        assert "'s0': 0" in stopped and "'s0r1': 0" in stopped, stopped
        assert launcher.proc.wait(30) == 1  # one member failed on the way
    deadline = time.monotonic() + 30
    while not all(gone(pid) for pid in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if not gone(p)]}"
        threading.Event().wait(0.05)  # processes of another program: poll the kernel's table


def test_a_host_with_only_a_replica_of_a_remote_server_launches_it(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    (port,) = free_ports(1)
    config = make_config(extra={0: f'<replica index="1" hostname="127.0.0.2" port="{port}"/>'})
    config.write_text(config.read_text().replace('hostname="127.0.0.1"', 'hostname="192.0.2.10"'))
    with launched(config, tmp_path / "stores") as launcher:
        ready = launcher.expect("aaabus launch: 0 server(s) ready")
        assert ready == "aaabus launch: 0 server(s) ready; 1 replica(s): s0r1"
        assert [p.name for p in (tmp_path / "stores").iterdir()] == ["s0r1"]
        launcher.proc.send_signal(signal.SIGTERM)
        assert launcher.expect("aaabus launch: stopped") == "aaabus launch: stopped ({'s0r1': 0})"
        assert launcher.proc.wait(30) == 0


def test_a_member_that_cannot_start_is_named_in_one_line(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    with socket.create_server(("127.0.0.2", 0)) as taken:
        port = taken.getsockname()[1]
        config = make_config(
            extra={0: f'<replica index="1" hostname="127.0.0.2" port="{port}"/>'},
            properties={"aaabus.replication.sync": "0"},
        )
        launcher = Launcher(config, tmp_path / "stores")
        assert launcher.proc.wait(60) == 2
    lines = launcher.rest()
    errors = [line for line in lines if line.startswith("aaabus launch: error:")]
    assert len(errors) == 1, lines
    assert errors[0].startswith(
        "aaabus launch: error: replica 1 of server 0 exited (2) before ready"
    )
