"""Failover of a server that shares no domain with another (issue 42): a one-server bus whose
members vote (docs/architecture.md, "Replicas and failover", the lone server). Real member
processes, each on its own loopback address (127.0.0.1, 127.0.0.2, 127.0.0.3), real log stores.

* Two replicas: member 0 SIGKILLed and its store deleted, a replica takes over by 2 votes of
  the 3 members; a durable subscription and a retained publication survive; member 0,
  restarted on an empty store, follows the new primary.
* One replica: the members say at startup, in one line, that the server cannot fail over, and
  the replica does not take over when member 0 dies.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aaabus.errors import AaabusError
from aaabus.tools.client import Client
from aaabus.tools.launch import ServerProcess
from tests.support.harness import REPO_ROOT, aaabus_cli, free_ports
from tests.test_failover import telling
from tests.test_replication import processes, wait_until

pytestmark = pytest.mark.slow

DELAY_MS = 500
TAKEOVER_S = 5.0


def lone_bus(make_config: Callable[..., Path], replicas: int) -> Path:
    """flat-1: server 0 alone, ``replicas`` replicas on 127.0.0.2, 127.0.0.3..., sync 1."""
    ports = free_ports(replicas + 1)
    members = "".join(
        f'<replica index="{k}" hostname="127.0.0.{k + 1}" port="{ports[k]}"/>'
        for k in range(1, replicas + 1)
    )
    return make_config(
        servers=1,
        extra={0: members + f'<property name="aaabus.replication.port" value="{ports[0]}"/>'},
        properties={
            "aaabus.replication.sync": "1",
            "aaabus.failover.delay_ms": str(DELAY_MS),
        },
    )


def member(config: Path, index: int, storage: Path) -> ServerProcess:
    return ServerProcess(config, 0, storage, cwd=REPO_ROOT, replica=index or None)


def primary(config: Path) -> tuple[int, int] | None:
    """(epoch, member) of the member serving server 0 (the tools try each member), or None."""
    try:
        with Client(config, 0, timeout=2) as client:
            epoch, index = client.status()["epoch"]
        return epoch, index
    except (AaabusError, OSError):
        return None


def follows(config: Path, index: int) -> bool:
    """Whether member ``index`` follows the primary, caught up."""
    try:
        with Client(config, 0, timeout=10) as client:
            rep: dict[str, Any] = client.status()["replication"]["replicas"][str(index)]
    except (AaabusError, OSError, KeyError):
        return False
    return bool(rep["connected"]) and rep["behind_commits"] == 0


def test_a_lone_server_fails_over_by_a_majority_of_its_members(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = lone_bus(make_config, replicas=2)
    m0 = member(config, 0, tmp_path / "s0")
    m1 = member(config, 1, tmp_path / "s0r1")
    m2 = member(config, 2, tmp_path / "s0r2")
    with processes(m1, m2, m0), telling(m0, m1, m2):
        wait_until(lambda: follows(config, 1) and follows(config, 2), 30, "both replicas")
        assert primary(config) == (1, 0)
        with Client(config, 0, timeout=30) as client:
            client.subscribe("ha/#", name="keep").close()  # durable: kept, unread
            client.publish("kept/news", "retained", retain=True)
            for i in range(3):
                client.publish(f"ha/{i}", i)
        wait_until(lambda: follows(config, 1) and follows(config, 2), 30, "them replicated")
        os.kill(m0.pid, signal.SIGKILL)
        killed = time.monotonic()
        assert m0.proc is not None
        m0.proc.wait(10)
        shutil.rmtree(tmp_path / "s0")
        wait_until(lambda: (primary(config) or (0, 0))[0] == 2, 30, "a replica to serve")
        took = time.monotonic() - killed
        assert took <= TAKEOVER_S, f"the takeover took {took:.1f} s"
        winner = (primary(config) or (0, 0))[1]
        assert winner in (1, 2)
        wait_until(  # their logs are read by other threads of the harness
            lambda: any("voted in by 2 of 3 members" in line for p in (m1, m2) for line in p.lines),
            10,
            "the vote's line",
        )
        with Client(config, 0, timeout=30) as client:
            for i in range(3, 6):
                client.publish(f"ha/{i}", i)
            keep = client.subscribe("ha/#", name="keep")
            got = [keep.get(timeout=10) for _ in range(6)]
            assert [p.payload if p else None for p in got] == list(range(6))
            news = client.subscribe("kept/#").get(timeout=10)
            assert news is not None and news.payload == "retained" and news.retained
            # Its members' votes on it are not shown as another server's epoch.
            assert client.status()["epochs"] == {}
        # Member 0 comes back on an empty store: it follows the new primary, copied whole.
        with processes(member(config, 0, tmp_path / "s0")) as (again,), telling(again):
            wait_until(lambda: follows(config, 0), 30, "member 0 to follow the new primary")
            assert primary(config) == (2, winner)


def test_a_lone_server_with_one_replica_says_it_cannot_fail_over_and_does_not(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = lone_bus(make_config, replicas=1)
    check = aaabus_cli("check", str(config))
    assert check.returncode == 0, check.stderr
    assert check.stderr.count("cannot fail over") == 1, check.stderr
    m0 = member(config, 0, tmp_path / "s0")
    m1 = member(config, 1, tmp_path / "s0r1")
    with processes(m1, m0), telling(m0, m1):
        wait_until(lambda: follows(config, 1), 30, "replica 1 to follow member 0")
        wait_until(  # its log is read by another thread of the harness (counted once below)
            lambda: any("cannot fail over" in line for line in m1.lines), 10, "its warning"
        )
        os.kill(m0.pid, signal.SIGKILL)
        assert m0.proc is not None
        m0.proc.wait(10)
        # An observation window, not a synchronisation: eight failover delays in which a
        # member that could stand would have stood and been voted in several times over.
        end = time.monotonic() + 8 * DELAY_MS / 1000
        pause = threading.Event()
        while time.monotonic() < end:
            assert primary(config) is None, "replica 1 took over alone"
            pause.wait(0.1)
        assert not any("standing" in line for line in m1.lines)
        assert sum("cannot fail over" in line for line in m1.lines) == 1
