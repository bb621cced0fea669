"""A voter of a failover (issue 42), as a real server process on 127.0.0.1 with a real store.

Server 0 has a replica (so it can fail over and sends keepalives); server 1 shares its domain,
so it votes on server 0's epochs. The test plays the candidate, as a member of server 0 would:
an admin session of role ROLE_CANDIDATE proving the key of the link between 0 and 1
(:func:`aaabus.node.vote.request_vote`). While server 0 is alive, however idle, the vote is
refused; once it has been stopped (SIGSTOP) for longer than the failover delay, it is granted,
once; the voter then cuts its link with server 0, and when server 0 wakes up (SIGCONT) its links
of the old epoch are refused, in one line each, and nothing it sends is delivered.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aaabus.config.reader import BusConfig, load_config
from aaabus.config.secret import ServerKeys, load_secret
from aaabus.errors import AdminError, ServerUnreachable
from aaabus.io.adminlink import AdminLink
from aaabus.node.admin import CANDIDATE_SESSIONS
from aaabus.node.epochs import FILE_NAME, EpochBook
from aaabus.node.vote import request_vote, whois
from aaabus.tools.client import Client
from aaabus.tools.launch import ServerProcess
from aaabus.wire.frames import ROLE_CANDIDATE
from tests.support.harness import REPO_ROOT, free_ports

pytestmark = pytest.mark.slow

# Long enough that a loaded 2-core machine still hears each keepalive (every DELAY_MS / 4)
# well within it, and that the test's own checks fit inside it: at 400 ms the test failed once
# on a loaded machine (load 5-8), on timing alone.
DELAY_MS = 1000
READY_S = 30.0
WAIT_S = 20.0
POSITION = "00000000000000ff"


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        pause.wait(0.02)


class Bus2:
    """Server 0 (with replica 1, which never runs: ``sync`` 0) and server 1, its voter."""

    def __init__(self, tmp_path: Path, make_config: Callable[..., Path]) -> None:
        (replica_port,) = free_ports(1)
        self.path = make_config(
            servers=2,
            extra={0: f'<replica index="1" port="{replica_port}"/>'},
            properties={
                "aaabus.replication.sync": "0",
                "aaabus.failover.delay_ms": str(DELAY_MS),
            },
        )
        self.config: BusConfig = load_config(self.path)
        self.keys0 = ServerKeys.from_bus_key(load_secret(tmp_path / "bus.key"), 0)
        self.s0 = ServerProcess(self.path, 0, tmp_path / "s0", cwd=REPO_ROOT)
        self.s1 = ServerProcess(self.path, 1, tmp_path / "s1", cwd=REPO_ROOT, log_level="INFO")
        self.store1 = tmp_path / "s1"

    def vote(self, epoch: int = 2, member: int = 1) -> tuple[bool, int, int, str]:
        answer = request_vote(
            self.config, self.keys0, 1, 0, epoch, member, POSITION, time.monotonic() + 10
        )
        return answer.granted, answer.epoch, answer.member, answer.why

    def log1(self) -> str:
        return "\n".join(self.s1.lines)


@pytest.fixture
def bus(tmp_path: Path, make_config: Callable[..., Path]) -> Iterator[Bus2]:
    bus = Bus2(tmp_path, make_config)
    try:
        for proc in (bus.s1, bus.s0):
            proc.start()
            proc.wait_ready(READY_S)
        yield bus
    finally:
        for proc in (bus.s0, bus.s1):
            if proc.proc is not None and proc.proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot take its SIGTERM
            proc.stop()


def test_a_voter_refuses_while_the_server_lives_and_grants_once_it_is_silent(bus: Bus2) -> None:
    with Client(bus.path, 1, timeout=30) as client1, Client(bus.path, 0, timeout=30) as client0:
        keep = client1.subscribe("ha/#", name="keep")
        wait_until(lambda: client0.status()["topics"]["remote_filters"] >= 1, "0 hears of it")
        client0.publish("ha/before", {"n": 1})
        first = keep.get(timeout=WAIT_S)
        assert first is not None and first.topic == "ha/before"
        keep.ack()

        # Idle and alive: server 0's keepalives reach server 1 (no traffic flows now), so the
        # vote is refused for having heard it, over several delays in a row.
        wait_until(lambda: "was heard from" in bus.vote()[3], "a refusal for hearing server 0")
        ends = time.monotonic() + 3 * DELAY_MS / 1000
        while time.monotonic() < ends:
            granted, epoch, member, why = bus.vote()
            assert not granted and (epoch, member) == (1, 0), why
            assert "was heard from" in why, why
        assert whois(bus.config, bus.keys0, 1, 0, time.monotonic() + 10) == (0, 0)
        status = client1.status()
        assert status["epoch"] == [1, 0] and status["epochs"] == {}

        os.kill(bus.s0.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        wait_until(lambda: bus.vote()[0], "the vote granted")
        assert time.monotonic() - stopped >= DELAY_MS / 1000 / 2
        # Once: the same candidate asking again gets the same grant, any other is refused.
        assert bus.vote() == (True, 2, 1, "already granted to this member")
        granted, epoch, member, why = bus.vote(member=0)
        assert not granted and (epoch, member) == (2, 1) and "not newer" in why
        assert whois(bus.config, bus.keys0, 1, 0, time.monotonic() + 10) == (2, 1)
        assert EpochBook(bus.store1).granted(0) == (2, 1)  # on the voter's disk
        assert (bus.store1 / FILE_NAME).stat().st_mode & 0o777 == 0o600
        assert "granted epoch 2 of server 0 to its member 1" in bus.log1()
        assert client1.status()["epochs"] == {"0": [2, 1]}
        shown = subprocess.run(
            [sys.executable, "-m", "aaabus", "status", str(bus.path), "--id", "1"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert "server 1 knows server 0 at epoch 2 (member 1)" in shown.stdout, shown

        os.kill(bus.s0.pid, signal.SIGCONT)
        refusal = "server 0 speaks for its epoch 1 (member 0), which epoch 2 (member 1) took over"
        wait_until(lambda: refusal in bus.log1(), "server 1 refusing server 0's old epoch")
        line = next(x for x in bus.s1.lines if refusal in x)
        assert "WARNING" in line and "refused connection from" in line
        client0.publish("ha/after", {"n": 2})  # committed by the old primary, never accepted
        assert keep.get(timeout=1.5) is None  # an observation over a fixed span
        assert isinstance(client1.status(), dict)  # the voter still answers


def test_a_candidate_session_may_ask_nothing_else(bus: Bus2, tmp_path: Path) -> None:
    address = ("127.0.0.1", bus.config.servers[1].networks[0].port + 1000)
    key = bus.keys0.link_key(1)
    link = AdminLink.candidate(address, key, 0, 1)
    try:
        for request, error in (
            ({"op": "status"}, "may ask only vote or whois, not 'status'"),
            ({"op": "stop"}, "may ask only vote or whois, not 'stop'"),
            ({"op": "whois", "server": 1}, "may ask about server 0 only, not 1"),
            ({"op": "vote", "server": 0, "epoch": 1, "member": 1, "position": ""}, "'epoch'"),
            ({"op": "vote", "server": 0, "epoch": 2, "member": 7, "position": ""}, "no member 7"),
        ):
            answer = link.request(request)
            assert answer == {"ok": False, "error": answer["error"]}
            assert error in answer["error"] and "\n" not in answer["error"], answer
    finally:
        link.close()
    # The candidates of one server hold a few sessions at most (a stolen key file of that
    # server cannot take the slots the operator's tools need).
    links = [AdminLink.candidate(address, key, 0, 1) for _ in range(CANDIDATE_SESSIONS + 1)]
    try:
        answers = [link.request({"op": "whois", "server": 0}) for link in links]
    finally:
        for link in links:
            link.close()
    assert answers[:-1] == [{"ok": True, "epoch": 0, "member": 0}] * CANDIDATE_SESSIONS
    busy = answers[-1]
    assert busy["ok"] is False and "candidates for server 0 already hold" in busy["error"]
    # The role needs the pair's key: a tool key or another pair's does not open it.
    with pytest.raises(AdminError):
        AdminLink.candidate(address, bus.keys0.link_key(2), 0, 1)
    assert ROLE_CANDIDATE == 254


def test_a_voter_is_reached_at_each_of_its_members_hosts_in_turn(bus: Bus2, tmp_path: Path) -> None:
    """As a candidate sees the bus when server 1's primary is its replica 1: the <server>'s
    host (127.0.0.2, where nothing listens) first, then the replica's (where server 1 is)."""
    text = bus.path.read_text()
    moved = text.replace(
        '<server id="1" name="s1" hostname="127.0.0.1">',
        '<server id="1" name="s1" hostname="127.0.0.2">\n    '
        '<replica index="1" hostname="127.0.0.1" port="1"/>',
    )
    assert moved != text
    (tmp_path / "moved.xml").write_text(moved)
    config = load_config(tmp_path / "moved.xml")
    assert whois(config, bus.keys0, 1, 0, time.monotonic() + 10) == (0, 0)
    # Nothing at any of them: one line naming every address tried.
    bus.s1.stop()
    with pytest.raises(ServerUnreachable) as info:
        whois(config, bus.keys0, 1, 0, time.monotonic() + 10)
    port = config.servers[1].networks[0].port + 1000
    assert f"voter 1 does not answer at 127.0.0.2:{port}, 127.0.0.1:{port}" in str(info.value)
