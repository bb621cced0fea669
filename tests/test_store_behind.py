"""A server restarted on a store older than its peers remember (its disk lost, replaced, or
restored from an old backup) is named by them and by itself, in one line saying what is
missing, and `aaabus status` says it too: never a silent hold-back (issue 42)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from aaabus import Client
from aaabus.tools.launch import Bus, ServerProcess
from tests.support.harness import REPO_ROOT
from tests.support.topics import wait_until

# Real server processes: not in the fast lane (make check).
pytestmark = pytest.mark.slow


def said(proc: ServerProcess, *words: str) -> list[str]:
    """The server's output lines that contain every one of ``words``."""
    return [line for line in list(proc.lines) if all(word in line for word in words)]


def knows_filter(config: Path, server: int) -> bool:
    """Whether ``server``'s representative knows a filter of another server."""
    with Client(config, server) as client:
        return int(client.status()["topics"]["remote_filters"]) >= 1


def held_back(config: Path, server: int) -> int:
    with Client(config, server) as client:
        return int(client.status()["queues"]["held_back"])


def test_a_server_restarted_on_an_empty_store_is_named_by_itself_and_its_peer(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """The issue's scenario on two servers: a durable subscription held by s1, one publication
    delivered, s1 killed, five more published through s0 (queued there), s1's store deleted,
    s1 restarted: both servers log what is lost, `aaabus status` names it and exits 1."""
    config = make_config("flat", 2)
    store = tmp_path / "store"
    with Bus(config, [0, 1], store, cwd=REPO_ROOT, log_level="INFO") as bus:
        with Client(config, 1) as consumer:
            subscription = consumer.subscribe("ha/#", name="keep")
            wait_until("s0 knows the filter", lambda: knows_filter(config, 0))
            with Client(config, 0) as producer:
                producer.publish("ha/0", "first")
            first = wait_until("the first publication", lambda: subscription.get(timeout=1))
            assert first.payload == "first"
            subscription.ack()
        bus[1].kill()
        with Client(config, 0) as producer:
            for i in range(1, 6):
                producer.publish(f"ha/{i}", f"item {i}")
        shutil.rmtree(store / "s1")
        bus[1].start().wait_ready(30)
        # Held back at s1: what was lost with its store cannot be made up.
        wait_until("s1 holds the five back", lambda: held_back(config, 1) == 5)
        behind = "server 1's store is older than server 0 remembers"
        wait_until("s1 says what it lost", lambda: said(bus[1], behind, "lost"))
        wait_until("s0 says what s1 lost", lambda: said(bus[0], "server 1's store is older"))
        # Each fact in one line, once, however often the link comes up again.
        assert len(said(bus[1], behind, "lost and everything")) == 1
        status = subprocess.run(
            [sys.executable, "-m", "aaabus", "status", str(config)],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 1, status.stdout + status.stderr
        assert behind in status.stderr
        assert "Traceback" not in status.stderr


def test_servers_restarted_on_their_own_stores_report_nothing(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """The control: the same traffic and kill with s1's store kept is no disagreement."""
    config = make_config("flat", 2)
    with Bus(config, [0, 1], tmp_path / "store", cwd=REPO_ROOT, log_level="INFO") as bus:
        with Client(config, 1) as consumer:
            subscription = consumer.subscribe("ha/#", name="keep")
            wait_until("s0 knows the filter", lambda: knows_filter(config, 0))
            bus[1].kill()
            with Client(config, 0) as producer:
                for i in range(5):
                    producer.publish(f"ha/{i}", f"item {i}")
            bus[1].start().wait_ready(30)
            got: list[object] = []
            while len(got) < 5:
                publication = wait_until("a publication", lambda: subscription.get(timeout=1))
                got.append(publication.payload)
            subscription.ack()
        assert got == [f"item {i}" for i in range(5)]
        with Client(config, 0) as client:
            assert client.status()["diverged"] == []
        with Client(config, 1) as client:
            assert client.status()["diverged"] == []
        assert not said(bus[0], "store is older") and not said(bus[1], "store is older")
