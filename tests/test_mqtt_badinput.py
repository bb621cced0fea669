"""Bad input on the MQTT port of a real server process (issue 16): each bad connection is closed
(after CONNACK with its return code where 3.1.1 has one), the log gets rate-limited lines, and
the server and every other device keep working, losing nothing committed. Ends with a fuzz of the
live listener: mutated packet streams, bounded in time, seeded."""

from __future__ import annotations

import contextlib
import random
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.mqtt import Device, connect_packet, publish_packet
from tests.support.topics import wait_until

pytestmark = pytest.mark.slow

MAX_PACKET = 4096


@pytest.fixture
def server(tmp_path: Path, make_config: Callable[..., Path]) -> Iterator[tuple[int, Bus]]:
    (port,) = free_ports(1)
    config = make_config(
        properties={
            "aaabus.mqtt.port": str(port),
            "aaabus.mqtt.anonymous": "true",
            "aaabus.mqtt.max_packet": str(MAX_PACKET),
            "aaabus.mqtt.connect_ms": "400",
            "aaabus.mqtt.per_address": "20",
        }
    )
    bus = Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT).start()
    try:
        yield port, bus
    finally:
        bus.stop()


def closed_after(sock: socket.socket, timeout: float = 5.0) -> bytes:
    """Everything the server sends until it closes ``sock`` (fails if it stays open)."""
    sock.settimeout(timeout)
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk


def raw(port: int, *packets: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    for packet in packets:
        sock.sendall(packet)
    return sock


CONNACK_OK = bytes([0x20, 0x02, 0x00, 0x00])


@pytest.mark.parametrize(
    ("what", "packet"),
    [
        ("wildcard in a PUBLISH topic", publish_packet(b"a/+")),
        ("invalid UTF-8 topic", publish_packet(b"\xc3\x28")),
        ("oversized packet", publish_packet(b"big", b"x" * 100)[:1] + bytes([0xFF, 0x7F])),
        ("malformed SUBSCRIBE", bytes([0x82, 0x03, 0x00, 0x01, 0x00])),
        ("a second CONNECT", connect_packet("again")),
    ],
    ids=["wildcard", "utf8", "oversized", "malformed", "second-connect"],
)
def test_bad_packet_closes_only_its_connection(
    server: tuple[int, Bus], what: str, packet: bytes
) -> None:
    port, bus = server
    good = Device(port, "good", clean=False)
    good.connect()
    good.subscribe("ok/#", 1)
    bad = raw(port, connect_packet("bad"), packet)
    assert closed_after(bad) == CONNACK_OK, what
    bad.close()
    good.publish("ok/1", b"still here", 1)
    assert good.receive(1)[0][1] == b"still here"
    # The server's log is read by another thread of the harness: waited for, never assumed read.
    wait_until(
        "the refusal in the server's log",
        lambda: any("MQTT port: refused connection" in line for line in bus[0].lines),
    )
    good.close()


def test_other_protocols_get_their_refusal_and_a_silent_client_is_closed_at_the_deadline(
    server: tuple[int, Bus],
) -> None:
    port, bus = server
    # Level 5 under another protocol name than "MQTT": CONNACK in 5.0's format, reason 0x84
    # "unsupported protocol version" (5.0 itself is served: tests/test_mqtt5.py).
    v5 = raw(port, connect_packet(level=5, props=b"\x00").replace(b"MQTT", b"MQTX", 1))
    assert closed_after(v5) == bytes([0x20, 0x03, 0x00, 0x84, 0x00])
    v5.close()
    other = raw(port, connect_packet(level=3))
    assert closed_after(other) == bytes([0x20, 0x02, 0x00, 0x01])
    other.close()
    silent = raw(port)
    start = time.monotonic()
    assert closed_after(silent) == b""
    assert time.monotonic() - start < 3.0  # aaabus.mqtt.connect_ms=400
    silent.close()
    trickle = raw(port, connect_packet()[:5])  # half a CONNECT, then nothing
    assert closed_after(trickle) == b""
    trickle.close()
    wait_until(
        "the deadline is logged",
        lambda: any("no CONNECT before the deadline" in line for line in bus[0].lines),
    )


def test_connect_flood_from_one_address_does_not_keep_a_device_out_or_fill_the_log(
    server: tuple[int, Bus],
) -> None:
    port, bus = server
    flood = [raw(port) for _ in range(150)]  # 150 connections that never send CONNECT
    try:
        device = Device(port, "real")
        assert device.connect()[0] == 0  # the flood does not keep it out
        device.close()
        # Every silent connection is closed by the server (its CONNECT deadline, 400 ms here).
        for sock in flood:
            assert closed_after(sock) == b""
    finally:
        for sock in flood:
            sock.close()
    # The server's log reaches us through its output's relay thread: wait for the lines.
    refusals = wait_until(
        "the server logged the refusals",
        lambda: [line for line in bus[0].lines if "MQTT port" in line],
    )
    assert len(refusals) <= 12  # RefusalLog: 10 lines per window, then a count


def test_fuzzed_packet_streams_leave_the_server_and_a_persistent_subscriber_whole(
    server: tuple[int, Bus],
) -> None:
    port, bus = server
    rng = random.Random(1616)
    sub = Device(port, "witness", clean=False)
    sub.connect()
    sub.subscribe("fz/#", 2)
    pub = Device(port, "steady")
    pub.connect()
    templates = [
        publish_packet(b"fz/a", b"p", qos=1),
        publish_packet(b"fz/b", b"q", qos=2, pid=3),
        bytes([0x82, 0x08, 0x00, 0x01, 0x00, 0x03]) + b"fz/" + b"\x02",
        bytes([0x62, 0x02, 0x00, 0x03]),
        bytes([0xC0, 0x00]),
    ]
    deadline = time.monotonic() + 20.0
    sent = 0
    for round_ in range(200):
        if time.monotonic() > deadline:
            break
        stream = bytearray(connect_packet(f"fuzz{round_}"))
        for _ in range(rng.randint(1, 6)):
            packet = bytearray(rng.choice(templates))
            for _ in range(rng.randint(0, 3)):
                packet[rng.randrange(len(packet))] = rng.randrange(256)
            stream += packet
        sock = raw(port, bytes(stream))
        sock.settimeout(0.2)
        with contextlib.suppress(OSError):
            sock.recv(4096)  # CONNACK, or the close: the server has read the stream
        sock.close()
        pub.publish(f"fz/steady/{round_}", str(round_).encode(), 2)
        sent += 1
    # Fuzzed publications that were valid may reach the witness too: keep only the steady ones.
    steady: list[bytes] = []
    while len(steady) < sent:
        topic, payload, _q, _r = sub.receive(1)[0]
        if topic.startswith("fz/steady/"):
            steady.append(payload)
    assert steady == [str(i).encode() for i in range(sent)]
    assert bus[0].running()
    sub.close()
    pub.close()
