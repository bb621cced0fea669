"""Tools and clients find a server's primary among its members (issue 42, "Finding the primary"),
and `aaabus status` says who is who.

Members listen on loopback addresses of their own (127.0.0.1 is member 0, 127.0.0.2 replica 1).
Until a follower takes over by itself, a primary on replica 1's address is made the way an
operator would after a failover by hand: the server process started on the same store with a
config that puts it on 127.0.0.2 (``primary.xml``), while the tools read the bus's config
(``bus.xml``: member 0 on 127.0.0.1, where nothing listens then, and replica 1 on 127.0.0.2).
Real server processes, real TCP, the real CLI."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from aaabus import Client
from aaabus.config.reader import load_config
from aaabus.errors import ServerUnreachable
from aaabus.io.adminlink import QUICK_S
from aaabus.tools.buswide import membership
from aaabus.tools.launch import ServerProcess
from tests.support.harness import REPO_ROOT, free_ports

pytestmark = pytest.mark.slow

READY_S = 30.0


def configs(make_config: Callable[..., Path]) -> tuple[Path, Path, Path]:
    """``(bus.xml, primary-0.xml, primary-1.xml)``: the bus's config (member 0 on 127.0.0.1,
    replica 1 on 127.0.0.2) and the server's own, on member 0's and on member 1's address."""
    (replication,) = free_ports(1)
    on_0 = make_config(name="primary-0.xml")
    text = on_0.read_text()
    on_1 = on_0.with_name("primary-1.xml")
    on_1.write_text(text.replace('hostname="127.0.0.1"', 'hostname="127.0.0.2"'))
    bus = on_0.with_name("bus.xml")
    bus.write_text(
        text.replace(
            "</server>",
            f'  <replica index="1" hostname="127.0.0.2" port="{replication}"/>\n  </server>',
        )
    )
    return bus, on_0, on_1


@contextmanager
def running(config: Path, storage: Path) -> Iterator[ServerProcess]:
    proc = ServerProcess(config, 0, storage, cwd=REPO_ROOT).start()
    try:
        proc.wait_ready(READY_S)
        yield proc
    finally:
        proc.stop()


class Dropper:
    """A listener that accepts every connection and closes it at once, on its own thread."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_server(address)
        self.count = 0
        self.thread = threading.Thread(target=self._run, name="test-dropper", daemon=True)

    def _run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            self.count += 1
            conn.close()


@contextmanager
def dropping(address: tuple[str, int]) -> Iterator[Dropper]:
    dropper = Dropper(address)
    dropper.thread.start()
    try:
        yield dropper
    finally:
        dropper.sock.shutdown(socket.SHUT_RDWR)
        dropper.sock.close()
        dropper.thread.join(5)


def aaabus(*args: str | Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aaabus", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


def test_the_tools_reach_a_primary_on_a_replica_address(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    bus, _on_0, on_1 = configs(make_config)
    port = load_config(bus).servers[0].networks[0].port + 1000
    # On member 0's address something takes connections and drops them (busy): the tools go
    # on to the next member all the same.
    with running(on_1, tmp_path / "s0") as server, dropping(("127.0.0.1", port)) as dropped:
        shown = aaabus("status", bus, "--json")
        assert shown.returncode == 0, shown.stderr
        (status,) = json.loads(shown.stdout)["servers"]
        assert status["up"] is True and status["pid"] == server.pid
        assert status["membership"]["primary"] == 1
        roles = [(m["member"], m["hostname"], m["role"]) for m in status["membership"]["members"]]
        assert roles == [(0, "127.0.0.1", "unreachable"), (1, "127.0.0.2", "primary")]
        table = aaabus("status", bus)
        line = "server 0: primary member 1, epoch 1; members: 0 unreachable; 1 primary"
        assert line in table.stdout

        published = aaabus("publish", bus, "ha/1", "one", "--timeout", "20")
        assert published.returncode == 0, published.stderr
        with Client(bus, 0, timeout=20) as client:
            assert client.status()["pid"] == server.pid
            assert client.member == 1 and client.address == ("127.0.0.2", client.address[1])

        assert dropped.count >= 4  # status twice, publish, the client: member 0 tried first
        stopped = aaabus("stop", bus)
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout.strip() == "server 0: stopped"
        assert server.proc is not None and server.proc.wait(30) == 0


def test_a_member_that_accepts_and_stays_silent_costs_the_tools_a_second_not_their_timeout(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    bus, _on_0, on_1 = configs(make_config)
    port = load_config(bus).servers[0].networks[0].port + 1000
    # What a stopped (SIGSTOP) old primary looks like from outside: its kernel completes the
    # TCP handshakes on its admin port, and nothing ever answers.
    with running(on_1, tmp_path / "s0") as server, socket.create_server(("127.0.0.1", port)):
        began = time.monotonic()
        with Client(bus, 0, timeout=20) as client:
            assert client.status()["pid"] == server.pid
        assert time.monotonic() - began < QUICK_S + 2.0  # not the 5 s of a whole attempt
        shown = aaabus("status", bus, "--json", "--timeout", "5")
        (status,) = json.loads(shown.stdout)["servers"]
        assert status["up"] is True and status["membership"]["primary"] == 1


def test_a_primary_slower_than_the_first_round_is_waited_for_in_the_second(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    bus, _on_0, on_1 = configs(make_config)
    with running(on_1, tmp_path / "s0") as server:
        # Paused for longer than a first round's QUICK_S, then resumed: what a primary busy
        # for a moment (a long commit, a collection) looks like. Nothing listens on member 0.
        os.kill(server.pid, signal.SIGSTOP)
        resume = threading.Timer(QUICK_S + 0.5, os.kill, (server.pid, signal.SIGCONT))
        resume.start()
        try:
            shown = aaabus("status", bus, "--json", "--timeout", "8")
        finally:
            resume.join()
        (status,) = json.loads(shown.stdout)["servers"]
        assert status["up"] is True, status  # not "busy": one status call, no retries


def test_when_no_member_answers_one_line_names_every_address_tried(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    bus, _on_0, _on_1 = configs(make_config)
    port = load_config(bus).servers[0].networks[0].port + 1000
    published = aaabus("publish", bus, "ha/1", "one", "--timeout", "0.5")
    assert published.returncode == 1
    lines = published.stderr.strip().splitlines()
    assert len(lines) == 1, published.stderr
    assert f"127.0.0.1:{port} (Connection refused)" in lines[0]
    assert f"127.0.0.2:{port} (Connection refused)" in lines[0]
    assert "Traceback" not in published.stderr

    shown = aaabus("status", bus, "--json")
    (status,) = json.loads(shown.stdout)["servers"]
    assert status["up"] is False and f"127.0.0.2:{port}" in status["error"]
    assert status["membership"]["primary"] is None
    assert [m["role"] for m in status["membership"]["members"]] == ["unreachable"] * 2
    assert "server 0: no primary answers; members: 0 unreachable; 1 unreachable" in (
        aaabus("status", bus).stdout
    )


def test_a_client_follows_its_server_to_the_new_primary_by_itself(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    bus, on_0, on_1 = configs(make_config)
    store = tmp_path / "s0"
    with Client(bus, 0, timeout=60) as client:
        with running(on_0, store):
            keep = client.subscribe("ha/#", name="keep")
            client.publish("ha/1", "one")
            first = keep.get(20)
            assert first is not None and first.payload == "one"
            assert client.member == 0
        # The primary is gone; the same server comes back on replica 1's address, on its
        # store (what a takeover does). The client's next requests find it there.
        with running(on_1, store):
            client.publish("ha/2", "two")
            assert client.member == 1
            second = keep.get(20)
            assert second is not None and second.payload == "two"
            keep.close()


def test_the_client_error_names_every_member_address(tmp_path: Path) -> None:
    # The same line from the library, without a process: nothing listens on any address.
    net, rep1, rep2 = free_ports(3)
    config = tmp_path / "a3.xml"
    config.write_text(
        f"""<config><domain name="D"/>
      <server id="0" name="s0" hostname="127.0.0.1"><network domain="D" port="{net}"/>
        <replica index="1" hostname="127.0.0.3" port="{rep1}"/>
        <replica index="2" hostname="127.0.0.2" port="{rep2}"/>
      </server></config>"""
    )
    with (
        pytest.raises(ServerUnreachable) as caught,
        Client(config, 0, secret=b"k" * 32, timeout=0.3) as client,
    ):
        client.status()
    message = str(caught.value)
    assert "\n" not in message
    # Member 0 first, then the replicas in document order.
    assert re.findall(r"(127\.0\.0\.\d):(\d+) \(", message) == [
        (host, str(net + 1000)) for host in ("127.0.0.1", "127.0.0.3", "127.0.0.2")
    ], message


# -- membership: who is who, from a primary's status ---------------------------------------------


@pytest.fixture
def three_members(tmp_path: Path) -> Path:
    path = tmp_path / "a3.xml"
    path.write_text(
        """<config><domain name="D"/>
      <server id="0" name="s0" hostname="127.0.0.1"><network domain="D" port="21000"/>
        <replica index="1" hostname="127.0.0.2" port="21001"/>
        <replica index="2" hostname="127.0.0.3" port="21002"/>
      </server></config>"""
    )
    return path


def shipping(**replicas: Any) -> dict[str, Any]:
    return {"sync": 1, "waiting_s": None, "waits": 0, "replicas": replicas}


def test_membership_from_todays_status_the_answering_member_is_primary(
    three_members: Path,
) -> None:
    status = {
        "replication": shipping(**{
            "1": {"connected": True, "behind_commits": 1, "behind_bytes": 300},
            "2": {"connected": False, "behind_commits": None, "behind_bytes": None},
        })
    }  # fmt: skip
    view = membership(load_config(three_members), 0, status, 0)
    assert view["primary"] == 0 and view["epoch"] is None
    figures = [
        (m["member"], m["role"], m["behind_commits"], m["behind_bytes"]) for m in view["members"]
    ]
    assert figures == [
        (0, "primary", None, None),
        (1, "follower", 1, 300),
        (2, "unreachable", None, None),
    ]


def test_membership_names_the_member_that_answered_and_the_epoch_it_speaks_for(
    three_members: Path,
) -> None:
    # After a takeover by member 2 (which answered at its address) the primary's figures name
    # member 0 among its followers; the server speaks for [epoch, member] (aaabus.node.status).
    status = {
        "epoch": [4, 2],
        "replication": shipping(**{
            "0": {"connected": True, "behind_commits": 0, "behind_bytes": 0},
            "1": {"connected": True, "behind_commits": 3, "behind_bytes": 4096},
        }),
    }  # fmt: skip
    view = membership(load_config(three_members), 0, status, 2)
    assert view["primary"] == 2 and view["epoch"] == 4
    assert [m["role"] for m in view["members"]] == ["follower", "follower", "primary"]
    assert view["members"][1]["behind_bytes"] == 4096


def test_status_shows_a_real_followers_lag_in_json_and_table(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    (port,) = free_ports(1)
    config = make_config(extra={0: f'<replica index="1" port="{port}"/>'})
    replica = ServerProcess(config, 0, tmp_path / "s0r1", cwd=REPO_ROOT, replica=1).start()
    try:
        replica.wait_ready(READY_S)
        with running(config, tmp_path / "s0"):
            with Client(config, 0) as client:
                client.publish("lag/1", "x")  # sync 1: acknowledged by the replica first
            shown = aaabus("status", config, "--json")
            (status,) = json.loads(shown.stdout)["servers"]
            members = status["membership"]["members"]
            assert [(m["member"], m["role"]) for m in members] == [(0, "primary"), (1, "follower")]
            assert members[1]["behind_commits"] in (0, 1)  # the last commit may be in flight
            assert isinstance(members[1]["behind_bytes"], int)
            assert "; 1 follower behind " in aaabus("status", config).stdout
    finally:
        replica.stop()
