"""Failover of a server to one of its replicas (issue 42): real server and member processes,
each member of server 1 on its own loopback address (127.0.0.1, 127.0.0.2, 127.0.0.3), real
log stores.

* Server 1's primary SIGKILLed and its store deleted: its replica takes over within 5 s, a
  durable subscription of server 1 gets every publication made through server 0, before and
  after, exactly once and in order; the old member 0, restarted on an empty store, follows the
  new primary and catches up.
* Server 1's primary SIGSTOPped past the failover delay: a replica takes over; woken, the old
  primary acknowledges nothing (a publication sent to it is not answered, and not delivered)
  and steps down, then follows the new primary.
* A follower answers MQTT devices with the primary's address.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aaabus.errors import AaabusError
from aaabus.tools.client import Client
from aaabus.tools.launch import ServerProcess
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.mqtt import connect_packet
from tests.test_replication import processes, records_of, wait_until

pytestmark = pytest.mark.slow

#: The failover delay of these buses (ms): small, so that a takeover is quick.
DELAY_MS = 500
TAKEOVER_S = 5.0


def failover_bus(make_config: Callable[..., Path], replicas: int) -> Path:
    """flat-2, server 1 with ``replicas`` replicas on 127.0.0.2, 127.0.0.3..., sync 1."""
    ports = free_ports(replicas + 1)
    members = "".join(
        f'<replica index="{k}" hostname="127.0.0.{k + 1}" port="{ports[k]}"/>'
        for k in range(1, replicas + 1)
    )
    return make_config(
        servers=2,
        extra={
            1: members + f'<property name="aaabus.replication.port" value="{ports[0]}"/>',
        },
        properties={
            "aaabus.replication.sync": "1",
            "aaabus.failover.delay_ms": str(DELAY_MS),
        },
    )


def as_member(config: Path, index: int) -> Path:
    """A copy of ``config`` in which server 1 is at member ``index``'s address and has no other
    member: what a tool given that member's address alone reaches (its admin port, when that
    member serves). With the replicas listed, a tool would walk to whichever member serves."""
    text = config.read_text()
    old = '<server id="1" name="s1" hostname="127.0.0.1">'
    assert old in text
    text = text.replace(old, old.replace("127.0.0.1", f"127.0.0.{index + 1}"))
    text = re.sub(r"<replica [^>]*/>", "", text)
    sync = '<property name="aaabus.replication.sync" value="1"/>'
    assert sync in text
    text = text.replace(sync, sync.replace('"1"', '"0"'))  # no replica left to wait for
    path = config.with_name(f"a3-m{index}.xml")
    path.write_text(text)
    return path


@contextlib.contextmanager
def telling(*procs: ServerProcess) -> Iterator[None]:
    """A failed assertion inside also shows the last lines of each process."""
    try:
        yield
    except AssertionError as exc:
        tails = "\n".join(f"--- {p.name}\n" + "\n".join(list(p.lines)[-40:]) for p in procs)
        raise AssertionError(f"{exc}\n{tails}") from None


def member(config: Path, index: int, storage: Path) -> ServerProcess:
    return ServerProcess(config, 1, storage, cwd=REPO_ROOT, replica=index or None)


def serving(config: Path) -> bool:
    """Whether server 1 answers on the admin port of ``config`` (a member's address)."""
    try:
        with Client(config, 1, timeout=2) as client:
            client.status()
        return True
    except (AaabusError, OSError):
        return False


def replication(config: Path) -> dict[str, Any]:
    with Client(config, 1, timeout=10) as client:
        figures: dict[str, Any] = client.status()["replication"]
        return figures


def follows(config: Path, index: int) -> bool:
    """Whether member ``index`` follows the primary that ``config`` reaches, caught up."""
    try:
        rep = replication(config)["replicas"][str(index)]
    except (AaabusError, OSError, KeyError):
        return False
    return bool(rep["connected"]) and rep["behind_commits"] == 0


def warm_subscription(config: Path, through: int, topic: str) -> None:
    """Publish through server ``through`` until the durable subscription ``keep`` of server 1
    has one (the subscription reaches the other server after a few link delays); drain."""
    with Client(config, 1, timeout=30) as reader, Client(config, through, timeout=30) as writer:
        sub = reader.subscribe(f"{topic}/#", name="keep")
        deadline = time.monotonic() + 30
        got = None
        while got is None and time.monotonic() < deadline:
            writer.publish(f"{topic}/warmup", "warmup")
            got = sub.get(timeout=0.5)
        assert got is not None, "the subscription never reached server 0"
        while sub.get(timeout=0.5) is not None:
            pass


def read_all(config: Path, topic: str, count: int) -> list[Any]:
    """The payloads of the durable subscription ``keep`` until ``count`` came and nothing more
    comes for a second."""
    payloads: list[Any] = []
    with Client(config, 1, timeout=30) as reader:
        sub = reader.subscribe(f"{topic}/#", name="keep")
        deadline = time.monotonic() + 30
        while len(payloads) < count and time.monotonic() < deadline:
            got = sub.get(timeout=0.5)
            if got is not None and got.payload != "warmup":
                payloads.append(got.payload)
        while (got := sub.get(timeout=1.0)) is not None:
            if got.payload != "warmup":
                payloads.append(got.payload)
    return payloads


def test_replica_takes_over_a_killed_and_wiped_primary_and_the_old_one_rejoins(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = failover_bus(make_config, replicas=1)
    at1 = as_member(config, 1)
    m0 = member(config, 0, tmp_path / "s1")
    m1 = member(config, 1, tmp_path / "s1r1")
    s0 = ServerProcess(config, 0, tmp_path / "s0", cwd=REPO_ROOT)
    with processes(m1, m0, s0), telling(m0, m1, s0):
        wait_until(lambda: follows(config, 1), 30, "replica 1 to follow member 0")
        warm_subscription(config, 0, "ha")
        with Client(config, 0, timeout=30) as writer:
            for i in range(3):
                writer.publish(f"ha/{i}", i)
            wait_until(lambda: follows(config, 1), 30, "replica 1 to have them")
            os.kill(m0.pid, signal.SIGKILL)
            killed = time.monotonic()
            assert m0.proc is not None
            m0.proc.wait(10)
            shutil.rmtree(tmp_path / "s1")
            for i in range(3, 7):
                writer.publish(f"ha/{i}", i)  # durable at server 0, held for server 1
        # Member 0 comes back at once on an empty store (as a launcher restarts it): it must
        # follow member 1, which with sync 1 needs a follower to make anything durable.
        with processes(member(config, 0, tmp_path / "s1")) as (again,), telling(again):
            wait_until(lambda: serving(at1), 30, "replica 1 to serve server 1")
            took = time.monotonic() - killed
            assert took <= TAKEOVER_S, f"the takeover took {took:.1f} s"
            # Its log is read by another thread of the harness: waited for, never assumed read.
            wait_until(lambda: any("voted in" in line for line in m1.lines), 10, "the vote's line")
            # Every publication, exactly once, in order (held ones included).
            assert read_all(at1, "ha", 7) == list(range(7))
            wait_until(lambda: follows(at1, 0), 30, "member 0 to follow member 1")
    objects, side = records_of(tmp_path / "s1r1")
    copied, copied_side = records_of(tmp_path / "s1")
    assert all(copied.get(oid) == data for oid, data in objects.items())
    assert copied_side == side


def test_a_paused_primary_that_wakes_after_a_takeover_acknowledges_nothing(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = failover_bus(make_config, replicas=2)
    m0 = member(config, 0, tmp_path / "s1")
    m1 = member(config, 1, tmp_path / "s1r1")
    m2 = member(config, 2, tmp_path / "s1r2")
    s0 = ServerProcess(config, 0, tmp_path / "s0", cwd=REPO_ROOT)
    with processes(m1, m2, m0, s0), telling(m0, m1, m2, s0):
        wait_until(lambda: follows(config, 1) and follows(config, 2), 30, "both replicas")
        warm_subscription(config, 1, "ha")
        os.kill(m0.pid, signal.SIGSTOP)
        try:
            at = [as_member(config, k) for k in (1, 2)]
            wait_until(lambda: any(serving(c) for c in at), 30, "a replica to take over")
            new = next(c for c in at if serving(c))
        finally:
            os.kill(m0.pid, signal.SIGCONT)
        answered = threading.Event()

        def publish_to_old() -> None:
            # Whatever happens to it, it must not be answered (acknowledged).
            only = as_member(config, 0)
            with contextlib.suppress(AaabusError, OSError), Client(only, 1, timeout=10) as old:
                old.publish("ha/stale", "stale")
                answered.set()

        thread = threading.Thread(target=publish_to_old, name="test-old-primary", daemon=True)
        thread.start()
        with Client(new, 1, timeout=30) as writer:
            writer.publish("ha/fresh", "fresh")
        wait_until(
            lambda: any("stops serving" in line for line in m0.lines),
            30,
            "the old primary's line saying it steps down",
        )
        thread.join(30)
        assert not answered.is_set(), "the deposed primary acknowledged a publication"
        assert read_all(new, "ha", 1) == ["fresh"]
        # It follows the new primary now, caught up.
        wait_until(lambda: follows(new, 0), 30, "the old primary to follow the new one")


def test_a_follower_sends_mqtt_devices_to_the_primary(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """A follower does not serve MQTT: on the server's MQTT port, on its own address, it answers
    a 5.0 CONNECT "use another server" with the primary's listener as Server Reference."""
    mqtt_port, replica_port, member0_port = free_ports(3)
    config = make_config(
        servers=2,
        extra={
            1: f'<replica index="1" hostname="127.0.0.2" port="{replica_port}"/>'
            f'<property name="aaabus.replication.port" value="{member0_port}"/>'
            f'<property name="aaabus.mqtt.port" value="{mqtt_port}"/>',
        },
        properties={"aaabus.failover.delay_ms": str(DELAY_MS)},
    )
    m0 = member(config, 0, tmp_path / "s1")
    m1 = member(config, 1, tmp_path / "s1r1")
    with processes(m1, m0), telling(m0, m1):
        wait_until(lambda: follows(config, 1), 30, "replica 1 to follow member 0")
        with socket.create_connection(("127.0.0.2", mqtt_port), timeout=10) as sock:
            sock.sendall(connect_packet(level=5, props=b"\x00"))
            connack = sock.recv(1024)
        assert connack[0] == 0x20 and connack[3] == 0x9C, connack.hex()  # use another server
        assert f"127.0.0.1:{mqtt_port}".encode() in connack
