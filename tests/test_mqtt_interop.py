"""MQTT that interoperates by default (issue 44): keep-alive 0 accepted and bounded by a
server-side idle deadline, and what a standard 5.0 client expects of a broker. Against real
server processes with default settings (anonymous devices allowed), driven by the Debian
mosquitto tools, paho-mqtt and bare sockets (packets from aaabus.mqtt.codec)."""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.libmosquitto import LibMosquitto, needs_libmosquitto
from tests.support.mqtt import Device, Device5, RawDevice, RawDevice5
from tests.support.topics import wait_until

# Real server processes and client processes: not in the fast lane.
pytestmark = pytest.mark.slow


class Server:
    """One server process with an MQTT listener: its port and its output."""

    def __init__(self, port: int, bus: Bus) -> None:
        self.port, self.bus = port, bus

    def logged(self, text: str) -> bool:
        return any(text in line for line in self.bus[0].lines)


@pytest.fixture
def server(tmp_path: Path, make_config: Callable[..., Path]) -> Iterator[Callable[..., Server]]:
    """``start(properties) -> Server``: one server whose listener has the default settings but
    ``aaabus.mqtt.anonymous`` (without credentials nobody gets in) and ``properties``."""
    buses: list[Bus] = []

    def start(properties: dict[str, str] | None = None) -> Server:
        (port,) = free_ports(1)
        props = {"aaabus.mqtt.port": str(port), "aaabus.mqtt.anonymous": "true"}
        n = len(buses)
        config = make_config(name=f"a3-{n}.xml", properties={**props, **(properties or {})})
        bus = Bus(config, [0], tmp_path / f"store{n}", cwd=REPO_ROOT).start()
        buses.append(bus)
        return Server(port, bus)

    try:
        yield start
    finally:
        for bus in buses:
            bus.stop()


# -- keep-alive 0 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [3, 5])
def test_paho_with_keep_alive_0_publishes_and_receives_against_a_default_server(
    server: Callable[..., Server], version: int
) -> None:
    port = server().port
    kind = Device5 if version == 5 else Device
    sub, pub = kind(port, f"k0-sub-{version}"), kind(port, f"k0-pub-{version}")
    for each in (sub, pub):
        assert each.connect(keepalive=0)[0] == 0
    sub.subscribe("k0/#", 1)
    pub.publish("k0/a", b"hello", 1)
    assert sub.receive(1) == [("k0/a", b"hello", 1, False)]
    sub.close()
    pub.close()


@needs_libmosquitto
@pytest.mark.parametrize("version", [3, 5])
def test_libmosquitto_with_keep_alive_0_publishes_and_receives_against_a_default_server(
    server: Callable[..., Server], version: int
) -> None:
    # The library of the mosquitto tools, which refuse -k 0 before asking it (2.0.11).
    port = server().port
    client = LibMosquitto(f"k0-lib-{version}", version)
    assert client.connect(port, keep_alive=0) == 0
    assert client.subscribe("k0lib/#", 1) == [1]
    client.publish("k0lib/a", b"hello", 1)  # to itself, through the bus
    client.run_until(lambda: client.messages)
    assert client.messages == [("k0lib/a", b"hello")]
    client.close()


def test_keep_alive_0_is_bounded_by_the_idle_deadline_and_5_0_is_told_a_keep_alive(
    server: Callable[..., Server],
) -> None:
    # Defaults: 3.1.1 gets in; 5.0 gets in and is told max_keepalive (3,600 s) to ping by.
    srv = server()
    old = RawDevice(srv.port)
    assert old.connect("k0-311", keep_alive=0) == 0
    old.close()
    new = RawDevice5(srv.port)
    ack = new.connect("k0-5", keep_alive=0)
    assert (ack.code, ack.properties[mq.SERVER_KEEP_ALIVE]) == (0, 3600)
    new.close()
    # A device that says nothing for max_idle_s is closed, whatever its keep-alive (5.0: 0x8D).
    idle = server({"aaabus.mqtt.max_idle_s": "1"})
    silent = RawDevice(idle.port)
    assert silent.connect("silent", keep_alive=0) == 0
    silent.sock.settimeout(10)
    assert silent.sock.recv(1) == b""  # closed by the server, within the test's deadline
    silent.close()
    wait_until("the silence is logged", lambda: idle.logged("silent for 1 s"))
    told = RawDevice5(idle.port)
    assert told.connect("told", keep_alive=0).code == 0
    assert told.until(mc.Disconnect, timeout=10).code == mq.KEEP_ALIVE_TIMEOUT
    told.close()
    # The operator may still refuse 3.1.1's keep-alive 0 (an old a3.xml's keepalive_0=false).
    strict = server({"aaabus.mqtt.keepalive_0": "false"})
    refused = RawDevice(strict.port)
    assert refused.connect("strict", keep_alive=0) == 0x02
    refused.close()


def test_connected_devices_per_address_are_capped(server: Callable[..., Server]) -> None:
    srv = server({"aaabus.mqtt.connections_per_address": "2"})
    first, second = RawDevice(srv.port), RawDevice(srv.port)
    assert (first.connect("a", keep_alive=0), second.connect("b", keep_alive=0)) == (0, 0)
    third = RawDevice(srv.port)
    assert third.connect("c", keep_alive=0) == 0x03  # 5.0: 0x97 quota exceeded
    wait_until("the refusal is logged", lambda: srv.logged("(connections_per_address)"))
    # A takeover of an id connected from the address is not one more; a device that leaves
    # makes room.
    again = RawDevice(srv.port)
    assert again.connect("b", keep_alive=0) == 0
    first.close()
    wait_until("the address has room again", lambda: _connects(srv.port, "c"))
    for each in (second, third, again):
        each.close()


def _connects(port: int, client_id: str) -> bool:
    """Whether a 3.1.1 CONNECT of ``client_id`` is accepted (the device then leaves)."""
    device = RawDevice(port)
    try:
        return device.connect(client_id, keep_alive=0) == 0
    finally:
        device.close()


# -- the server's DISCONNECT is read before the socket closes ------------------------------------


def test_a_device_over_our_receive_maximum_that_keeps_sending_reads_disconnect_0x93(
    server: Callable[..., Server],
) -> None:
    srv = server({"aaabus.mqtt.inflight": "4"})
    raw = RawDevice5(srv.port)
    raw.connect("greedy")
    # Five QoS 2 flows never finished (no PUBREL), then more the device pipelines behind them:
    # the server stops at the fifth, with bytes it never handles still arriving. Closing on
    # them would reset the connection (the device's sending fails before it reads why); the
    # server shuts its side down after DISCONNECT and drains instead.
    flood = b"".join(
        mc.encode(mc.Publish("rm/t", bytes(4096), 2, False, False, pid % 65535 + 1), mq.V5)
        for pid in range(4096)
    )
    failed: list[OSError] = []
    sender = threading.Thread(target=_send, args=(raw.sock, flood, failed), daemon=True)
    sender.start()
    sender.join(10)
    assert not sender.is_alive() and failed == []
    assert raw.until(mc.Disconnect).code == mq.RECEIVE_MAXIMUM_EXCEEDED
    assert raw.sock.recv(1) == b""  # then the server's end of the stream, not a reset
    raw.close()


def _send(sock: socket.socket, data: bytes, failed: list[OSError]) -> None:
    try:
        sock.sendall(data)
    except OSError as exc:  # a reset: what the test shows does not happen
        failed.append(exc)


# -- 5.0 what a standard client expects -----------------------------------------------------------


class Watcher(Device5):
    """A paho 5.0 device that keeps every message it receives, properties included."""

    def __init__(self, port: int, client_id: str) -> None:
        super().__init__(port, client_id)
        self.messages: queue.Queue[Any] = queue.Queue()
        self.client.on_message = lambda _c, _u, msg: self.messages.put(msg)

    def next(self, timeout: float = 20.0) -> tuple[str, bytes, dict[str, Any]]:
        """The next message: its topic, payload and 5.0 properties by paho's names."""
        msg = self.messages.get(timeout=timeout)
        props = msg.properties.json() if msg.properties is not None else {}
        return msg.topic, bytes(msg.payload), props


def test_a_will_reaches_subscribers_with_its_message_properties(
    server: Callable[..., Server],
) -> None:
    srv = server()
    watcher = Watcher(srv.port, "will-watcher")
    watcher.connect()
    watcher.subscribe("will/#", 1)
    properties = {
        mq.PAYLOAD_FORMAT: 1,
        mq.CONTENT_TYPE: "text/plain",
        mq.RESPONSE_TOPIC: "will/answers",
        mq.CORRELATION_DATA: b"c-7",
        mq.USER_PROPERTY: [("k", "1"), ("other", "x"), ("k", "2")],
        mq.MESSAGE_EXPIRY: 600,
    }
    dying = RawDevice5(srv.port)
    will = mc.Will("will/dying", b"gone", 1, False, properties)
    dying.send(mc.Connect(mq.V5, "dying", True, 30, None, None, will))
    assert dying.packet().code == 0
    dying.close()  # no DISCONNECT: the will is published
    topic, payload, got = watcher.next()
    assert (topic, payload) == ("will/dying", b"gone")
    assert got["PayloadFormatIndicator"] == 1
    assert got["ContentType"] == "text/plain"
    assert got["ResponseTopic"] == "will/answers"
    assert bytes.fromhex(got["CorrelationData"]) == b"c-7"
    assert got["UserProperty"] == [("k", "1"), ("other", "x"), ("k", "2")]
    assert 598 <= got["MessageExpiryInterval"] <= 600  # counted from the will's publication
    watcher.close()


def test_puback_and_pubrec_say_0x10_when_no_subscriber_matched(
    server: Callable[..., Server],
) -> None:
    srv = server()
    watcher = Device5(srv.port, "match-watcher")
    watcher.connect()
    watcher.subscribe("matched/#", 1)
    raw = RawDevice5(srv.port)
    raw.connect("publisher")
    for qos, kind in ((1, mq.PUBACK), (2, mq.PUBREC)):
        raw.send(mc.Publish("unmatched/t", b"x", qos, False, False, qos))
        ack = raw.until(mc.Ack)
        assert (ack.kind, ack.code) == (kind, mq.NO_MATCHING_SUBSCRIBERS)
        raw.send(mc.Publish("matched/t", b"y", qos, False, False, 10 + qos))
        ack = raw.until(mc.Ack)
        assert (ack.kind, ack.code) == (kind, mq.SUCCESS)
    # 0x10 is a success: the QoS 2 flow goes on to PUBCOMP.
    raw.send(mc.Ack(mq.PUBREL, 2))
    assert raw.until(mc.Ack).kind == mq.PUBCOMP
    assert watcher.receive(2) == [("matched/t", b"y", 1, False)] * 2
    raw.close()
    watcher.close()


def test_topic_aliases_towards_a_device_that_allows_them(server: Callable[..., Server]) -> None:
    srv = server()
    publisher = Device(srv.port, "alias-publisher")
    publisher.connect()
    raw = RawDevice5(srv.port)
    raw.connect("alias-raw", properties={mq.TOPIC_ALIAS_MAXIMUM: 2})
    raw.send(mc.Subscribe(1, [("al/#", 1)], {}))
    raw.until(mc.SubAck)
    plain = RawDevice5(srv.port)  # allows none: never sent one
    plain.connect("alias-plain")
    plain.send(mc.Subscribe(1, [("al/#", 0)], {}))
    plain.until(mc.SubAck)
    sent = ["al/a", "al/a", "al/b", "al/c", "al/a", "al/c"]
    for n, topic in enumerate(sent):
        publisher.publish(topic, str(n).encode(), 1)
    got = [raw.until(mc.Publish) for _ in sent]
    # The two topics sent most recently hold the aliases; a third takes the older one's.
    seen = [(p.topic, p.properties.get(mq.TOPIC_ALIAS), p.payload) for p in got]
    assert seen == [
        ("al/a", 1, b"0"),
        ("", 1, b"1"),
        ("al/b", 2, b"2"),
        ("al/c", 1, b"3"),  # al/a was sent before al/b: its alias goes
        ("al/a", 2, b"4"),
        ("", 1, b"5"),
    ]
    for packet in got:
        raw.send(mc.Ack(mq.PUBACK, packet.packet_id))
    for n, topic in enumerate(sent):
        packet = plain.until(mc.Publish)
        assert (packet.topic, packet.payload, packet.properties) == (topic, str(n).encode(), {})
    # gmqtt resolves them as a standard 5.0 client does.
    assert asyncio.run(_gmqtt_receives(srv.port, publisher, sent)) == sent
    for each in (raw, plain):
        each.close()
    publisher.close()


async def _gmqtt_receives(port: int, publisher: Device, topics: list[str]) -> list[str]:
    """The topics a gmqtt device that allows 2 topic aliases receives on al/#, in order."""
    from gmqtt import Client as GmqttClient
    from gmqtt.mqtt.constants import MQTTv50

    got: asyncio.Queue[str] = asyncio.Queue()
    client = GmqttClient("alias-gmqtt", topic_alias_maximum=2)

    def on_message(_c: Any, topic: str, _payload: bytes, _q: int, _p: Any) -> int:
        got.put_nowait(topic)
        return 0

    subscribed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    client.on_message = on_message
    client.on_subscribe = lambda *_args: subscribed.set_result(None)
    await client.connect("127.0.0.1", port, version=MQTTv50, keepalive=30)
    client.subscribe("al/#", qos=1)
    await asyncio.wait_for(subscribed, 10)
    loop = asyncio.get_running_loop()
    for topic in topics:  # paho's blocking publish, off this loop
        await loop.run_in_executor(None, publisher.publish, topic, b"g", 1)
    received = [await asyncio.wait_for(got.get(), 10) for _ in topics]
    await client.disconnect()
    return received
