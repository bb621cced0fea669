"""QoS 2 retransmissions from a device are published once (issue 48.2).

A device that has no PUBREC, or is unsure its PUBREC was its last word, sends its PUBLISH again
with the same packet identifier and DUP set until it has sent PUBREL (3.1.1 §4.3.3, 5.0
§4.3.3). The server must publish the message on the first copy and only acknowledge the others.
The copies come from a raw-socket client (tests/support/rawmqtt.py), because a library decides
for itself when to resend, and at an exact point of the flow: twice in one connection, again on
a new connection, again after the server was killed and restarted. What the bus published is
counted by a durable bus subscription, independent of MQTT's delivery, up to a marker the same
device publishes after its flow ended: the bus keeps one publisher's order, so a second copy
would be seen before the marker.

A clean session's state ends with its connection (3.1.1 §3.1.2.4, 5.0 §3.1.2.4): a device that
resends on a new connection of a clean session is sending a new message, and the server must
publish it. Clean sessions are therefore tested for the duplicate within one connection, and
for the other side of that rule, that a packet identifier of an ended clean connection does not
swallow the next connection's message (docs/testing.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aaabus import Client
from aaabus.mqtt import codes as mq
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, free_ports, published_before
from tests.support.rawmqtt import RawClient

# Real server processes: not in the fast lane.
pytestmark = pytest.mark.slow

VERSIONS = {"3.1.1": mq.V311, "5.0": mq.V5}
TOPIC = "retx/meter"
PID = 7


class Server:
    """One server process with an MQTT listener, and the bus subscription ``watch`` on
    ``retx/#`` that counts what the bus published (durable: it outlives a restart)."""

    def __init__(self, tmp_path: Path, make_config: Callable[..., Path]) -> None:
        (self.port,) = free_ports(1)
        props = {"aaabus.mqtt.port": str(self.port), "aaabus.mqtt.anonymous": "true"}
        self.config = make_config(properties=props)
        self.bus = Bus(self.config, [0], tmp_path / "store", cwd=REPO_ROOT).start()
        with Client(self.config, 0) as client:
            client.subscribe("retx/#", name="watch").close()

    def restart(self) -> None:
        """SIGKILL, as a crash would, and start again on the same store."""
        self.bus[0].kill()
        self.bus[0].start().wait_ready(30)


@pytest.fixture
def server(tmp_path: Path, make_config: Callable[..., Path]) -> Iterator[Server]:
    started = Server(tmp_path, make_config)
    try:
        yield started
    finally:
        started.bus.stop()


def device(server: Server, version: int, client_id: str, persistent: bool) -> RawClient:
    """A connected raw device; ``persistent``: its session outlives the connection (3.1.1: Clean
    Session 0; 5.0: Clean Start 0 and a Session Expiry Interval)."""
    raw = RawClient(server.port, version)
    if persistent:
        raw.connect(client_id, clean=False, expiry=3600 if version == mq.V5 else None)
    else:
        raw.connect(client_id, clean=True)
    return raw


def finish(raw: RawClient, server: Server) -> list[bytes]:
    """End the open flow (PUBREL, PUBCOMP), publish the marker, and return what the bus
    published before it."""
    raw.ack(mq.PUBREL, PID)
    raw.expect_ack(mq.PUBCOMP, PID)
    marker = f"marker {time.monotonic_ns()}".encode()
    raw.publish(TOPIC, marker, 1, PID + 1, dup=False)
    raw.expect_ack(mq.PUBACK, PID + 1)
    raw.close()
    return published_before(server.config, lambda payload: payload == marker)


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "clean"])
@pytest.mark.parametrize("version", VERSIONS.values(), ids=VERSIONS.keys())
def test_a_qos2_publish_sent_twice_before_pubrel_is_published_once(
    server: Server, version: int, persistent: bool
) -> None:
    """Both copies go out before the first PUBREC comes back: each is answered with PUBREC,
    the message is published once."""
    raw = device(server, version, "twice", persistent)
    raw.publish(TOPIC, b"reading 1", 2, PID, dup=False)
    raw.publish(TOPIC, b"reading 1", 2, PID, dup=True)
    raw.expect_ack(mq.PUBREC, PID)
    raw.expect_ack(mq.PUBREC, PID)
    assert finish(raw, server) == [b"reading 1"]


@pytest.mark.parametrize("version", VERSIONS.values(), ids=VERSIONS.keys())
def test_a_qos2_publish_resent_on_a_new_connection_is_published_once(
    server: Server, version: int
) -> None:
    """The connection drops after PUBREC; the device resumes its session and resends."""
    raw = device(server, version, "reconnects", persistent=True)
    raw.publish(TOPIC, b"reading 2", 2, PID, dup=False)
    raw.expect_ack(mq.PUBREC, PID)
    raw.close()
    raw = device(server, version, "reconnects", persistent=True)
    raw.publish(TOPIC, b"reading 2", 2, PID, dup=True)
    raw.expect_ack(mq.PUBREC, PID)
    assert finish(raw, server) == [b"reading 2"]


@pytest.mark.parametrize("version", VERSIONS.values(), ids=VERSIONS.keys())
def test_a_qos2_publish_resent_after_a_server_restart_is_published_once(
    server: Server, version: int
) -> None:
    """PUBREC came back, then the server was killed: the restarted server still knows the
    packet identifier from its store and does not publish the copy."""
    raw = device(server, version, "restarts", persistent=True)
    raw.publish(TOPIC, b"reading 3", 2, PID, dup=False)
    raw.expect_ack(mq.PUBREC, PID)
    raw.close()
    server.restart()
    raw = device(server, version, "restarts", persistent=True)
    raw.publish(TOPIC, b"reading 3", 2, PID, dup=True)
    raw.expect_ack(mq.PUBREC, PID)
    assert finish(raw, server) == [b"reading 3"]


@pytest.mark.parametrize("version", VERSIONS.values(), ids=VERSIONS.keys())
def test_a_clean_sessions_packet_identifier_ends_with_its_connection(
    server: Server, version: int
) -> None:
    """A clean session's open QoS 2 flow ends with the connection: the same packet identifier
    on the next clean connection is a new message, published again."""
    raw = device(server, version, "forgets", persistent=False)
    raw.publish(TOPIC, b"reading 4", 2, PID, dup=False)
    raw.expect_ack(mq.PUBREC, PID)
    raw.close()
    raw = device(server, version, "forgets", persistent=False)
    raw.publish(TOPIC, b"reading 4", 2, PID, dup=False)
    raw.expect_ack(mq.PUBREC, PID)
    assert finish(raw, server) == [b"reading 4", b"reading 4"]
