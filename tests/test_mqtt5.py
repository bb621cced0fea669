"""MQTT 5.0 beside 3.1.1 on one port, the connection's side (issue 32.1): sessions with an expiry
interval and clean start, CONNACK's limits, flow control both ways, maximum packet size, topic
aliases, and the server's DISCONNECT reasons. Against real server processes, with three 5.0
clients: paho-mqtt in 5.0 mode, gmqtt (asyncio) and the Debian mosquitto tools (-V mqttv5); raw
sockets (packets from aaabus.mqtt.codec) for what a library would not send."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from aaabus import Client
from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq
from aaabus.mqtt.auth import hash_password
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.mqtt import (
    Device,
    Device5,
    RawDevice,
    RawDevice5,
    connect_packet,
    needs_tools,
    tool,
)
from tests.support.topics import wait_until

# Real server processes and client processes: not in the fast lane.
pytestmark = pytest.mark.slow

INFLIGHT = 8  # our Receive Maximum on the test servers


class Server:
    """One server process with an MQTT listener: its port, bus, and status (admin port)."""

    def __init__(self, port: int, bus: Bus, config: Path) -> None:
        self.port, self.bus, self.config = port, bus, config

    def mqtt(self) -> dict[str, Any]:
        with Client(self.config, 0) as client:
            figures: dict[str, Any] = client.status()["mqtt"]
        return figures

    def logged(self, text: str) -> int:
        return sum(text in line for line in self.bus[0].lines)


@pytest.fixture
def server(tmp_path: Path, make_config: Callable[..., Path]) -> Iterator[Callable[..., Server]]:
    """``start(properties, users) -> Server``: one server, anonymous devices unless ``users``
    (name -> password) are given."""
    buses: list[Bus] = []

    def start(
        properties: dict[str, str] | None = None, users: dict[str, str] | None = None
    ) -> Server:
        (port,) = free_ports(1)
        props = {
            "aaabus.mqtt.port": str(port),
            "aaabus.mqtt.anonymous": "true",
            "aaabus.mqtt.inflight": str(INFLIGHT),
        }
        if users:
            lines = "".join(f"{user}:{hash_password(pw)}\n" for user, pw in users.items())
            (tmp_path / "mqtt.passwd").write_text(lines)
            props["aaabus.mqtt.credentials"] = "mqtt.passwd"
            props["aaabus.mqtt.anonymous"] = "false"
        n = len(buses)
        config = make_config(name=f"a3-{n}.xml", properties={**props, **(properties or {})})
        bus = Bus(config, [0], tmp_path / f"store{n}", cwd=REPO_ROOT).start()
        buses.append(bus)
        return Server(port, bus, config)

    try:
        yield start
    finally:
        for bus in buses:
            bus.stop()


def payloads(got: list[tuple[str, bytes, int, bool]]) -> list[bytes]:
    return [payload for _t, payload, _q, _r in got]


# -- 5.0 and 3.1.1 devices together ---------------------------------------------------------------


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_5_0_and_3_1_1_devices_mixed_on_one_server_each_receive_everything_in_order(
    server: Callable[..., Server], qos: int
) -> None:
    port = server().port
    sub5, sub3 = Device5(port, "sub5", expiry=60), Device(port, "sub3", clean=False)
    pub5, pub3 = Device5(port, "pub5"), Device(port, "pub3")
    devices = [sub5, sub3, pub5, pub3]
    try:
        assert sub5.connect() == (0, False)
        assert sub3.connect() == (0, False)
        assert pub5.connect()[0] == 0 and pub3.connect()[0] == 0
        for sub in (sub5, sub3):
            sub.subscribe("mix/#", qos)
        for i in range(30):
            pub5.publish(f"mix/5/{i % 3}", f"5-{i}".encode(), qos)
            pub3.publish(f"mix/3/{i % 3}", f"3-{i}".encode(), qos)
        for sub in (sub5, sub3):
            got = payloads(sub.receive(60))
            for origin in (b"5-", b"3-"):  # each publisher's order, everything once
                mine = [p for p in got if p.startswith(origin)]
                assert mine == [origin + str(i).encode() for i in range(30)]
        pub5.publish("mix/end", b"marker", 1)  # nothing more before it: no duplicates
        for sub in (sub5, sub3):
            assert sub.receive(1)[0][:2] == ("mix/end", b"marker")
    finally:
        for device in devices:
            device.close()


def test_gmqtt_a_second_5_0_library_keeps_a_session_and_exchanges_with_paho(
    server: Callable[..., Server],
) -> None:
    from gmqtt import Client as GmqttClient
    from gmqtt.mqtt.constants import MQTTv50

    port = server({"aaabus.mqtt.session_expiry_s": "60"}).port
    paho5 = Device5(port, "paho5")
    assert paho5.connect()[0] == 0
    paho5.subscribe("from-g/#", 2)

    async def session(clean: bool, publish: bool) -> tuple[dict[str, Any], list[bytes]]:
        got: asyncio.Queue[bytes] = asyncio.Queue()
        connack: dict[str, Any] = {}
        client = GmqttClient("gm", clean_session=clean, session_expiry_interval=3600)

        def on_message(_c: Any, _t: str, payload: bytes, _q: int, _p: Any) -> int:
            got.put_nowait(payload)
            return 0  # gmqtt: the PUBACK/PUBREC reason code

        client.on_message = on_message
        client.on_connect = lambda _c, flags, rc, _props: connack.update(
            {"present": flags, "rc": rc}
        )
        await client.connect("127.0.0.1", port, version=MQTTv50, keepalive=30)
        connack["expiry"] = client.session_expiry_interval  # CONNACK's, if it sent one
        received = []
        if publish:
            client.subscribe("to-g/#", qos=1)
            for i in range(3):
                client.publish(f"from-g/{i}", f"g{i}".encode(), qos=2)
        else:
            received = [await asyncio.wait_for(got.get(), 10) for _ in range(2)]
        await client.disconnect()
        return connack, received

    first, _ = asyncio.run(session(True, True))
    assert first["rc"] == 0 and first["present"] == 0
    # The expiry asked for (3600 s) is over aaabus.mqtt.session_expiry_s: CONNACK caps it.
    assert first["expiry"] == 60
    assert payloads(paho5.receive(3)) == [b"g0", b"g1", b"g2"]
    # While gmqtt is away, its session collects what it subscribed to.
    paho5.publish("to-g/a", b"one", 1)
    paho5.publish("to-g/b", b"two", 2)
    second, received = asyncio.run(session(False, False))
    assert second["present"] == 1
    assert received == [b"one", b"two"]
    paho5.close()


@needs_tools
def test_mosquitto_tools_in_5_0_keep_a_session_and_exchange_with_paho_3_1_1(
    server: Callable[..., Server],
) -> None:
    port = str(server().port)
    sub = ("mosquitto_sub", "-V", "mqttv5", "-p", port, "-i", "toolsub", "-c", "-x", "60")
    # -E: exit once subscribed; the session (expiry 60 s) keeps the subscription.
    made = tool(*sub, "-t", "tools/#", "-q", "2", "-E")
    assert made.returncode == 0, made.stderr
    # QoS 1 both: libmosquitto hands a QoS 2 message to its application only at PUBREL, after
    # a QoS 1 one sent later, so the printed order would not be the order of delivery.
    sent = tool(
        *("mosquitto_pub", "-V", "mqttv5", "-p", port, "-t", "tools/a", "-m", "m5", "-q", "1")
    )
    assert sent.returncode == 0, sent.stderr
    pub3 = Device(port=int(port), client_id="pub3")
    pub3.connect()
    pub3.publish("tools/b", b"m3", 1)
    pub3.close()
    got = tool(*sub, "-t", "tools/#", "-q", "2", "-C", "2", "-W", "15", "-v")
    assert (got.returncode, got.stdout) == (0, "tools/a m5\ntools/b m3\n"), got.stderr


# -- sessions: expiry interval and clean start ----------------------------------------------------


def test_a_session_with_expiry_2_s_survives_a_reconnection_then_expires(
    server: Callable[..., Server],
) -> None:
    srv = server()
    pub = Device(srv.port, "pub")
    pub.connect()
    device = Device5(srv.port, "short", expiry=2)
    assert device.connect() == (0, False)
    device.subscribe("short/#", 1)
    device.close()
    pub.publish("short/1", b"kept", 1)
    again = Device5(srv.port, "short", clean_start=False, expiry=2)
    assert again.connect() == (0, True)
    assert payloads(again.receive(1)) == [b"kept"]
    again.close()
    assert srv.mqtt()["sessions_stored"] == 1
    # 2 s after it left, the listener's sweep deletes it (not at the hourly expiry's pace).
    wait_until("the session expired", lambda: srv.mqtt()["sessions_stored"] == 0, timeout=10)
    late = Device5(srv.port, "short", clean_start=False, expiry=2)
    assert late.connect() == (0, False)
    late.subscribe("late/#", 1)
    pub.publish("short/2", b"lost", 1)  # its old subscription went with the session
    assert late.nothing_before("late/marker", via=pub)
    late.close()
    pub.close()


def test_expiry_0_ends_the_session_with_its_connection_even_a_resumed_one(
    server: Callable[..., Server],
) -> None:
    srv = server()
    device = Device5(srv.port, "d", expiry=300)
    assert device.connect() == (0, False)
    device.subscribe("d/#", 1)
    device.close()
    # Resumed without an expiry: the session is there, and ends with this connection.
    resumed = Device5(srv.port, "d", clean_start=False)
    assert resumed.connect() == (0, True)
    resumed.close()
    wait_until("the session is deleted", lambda: srv.mqtt()["sessions_stored"] == 0)
    fresh = Device5(srv.port, "d", clean_start=False, expiry=300)
    assert fresh.connect() == (0, False)
    # DISCONNECT may shorten the expiry to 0: the session ends there too.
    fresh.close(expiry=0)
    wait_until("the session is deleted again", lambda: srv.mqtt()["sessions_stored"] == 0)
    # ...or to 1 s: the session is kept that long after DISCONNECT.
    brief = Device5(srv.port, "d", clean_start=False, expiry=300)
    assert brief.connect() == (0, False)
    brief.close(expiry=1)
    assert srv.mqtt()["sessions_stored"] == 1
    wait_until("the session expired", lambda: srv.mqtt()["sessions_stored"] == 0, timeout=10)
    # A connection without expiry writes nothing at CONNECT.
    plain = Device5(srv.port, "plain")
    assert plain.connect() == (0, False)
    assert srv.mqtt()["sessions_stored"] == 0
    plain.close()


def test_clean_start_drops_the_stored_session_and_its_backlog(
    server: Callable[..., Server],
) -> None:
    srv = server()
    pub = Device(srv.port, "pub")
    pub.connect()
    device = Device5(srv.port, "c", expiry=300)
    device.connect()
    device.subscribe("old/#", 1)
    device.close()
    pub.publish("old/1", b"queued", 1)
    restart = Device5(srv.port, "c", clean_start=True, expiry=300)
    assert restart.connect() == (0, False)
    restart.subscribe("new/#", 1)
    pub.publish("old/2", b"old filter", 1)
    # Neither the backlog nor the old subscription survived: only the marker arrives.
    assert restart.nothing_before("new/marker", via=pub)
    restart.close()
    pub.close()


# -- CONNACK and the connection's limits ----------------------------------------------------------


def test_connack_tells_the_server_limits_and_assigns_a_client_id(
    server: Callable[..., Server],
) -> None:
    srv = server({"aaabus.mqtt.session_expiry_s": "100", "aaabus.mqtt.max_packet": "50000"})
    raw = RawDevice5(srv.port)
    ack = raw.connect("", properties={mq.SESSION_EXPIRY: 0xFFFFFFFF})
    assert (ack.code, ack.session_present) == (0, False)
    props = ack.properties
    assert props[mq.RECEIVE_MAXIMUM] == INFLIGHT
    assert props[mq.MAXIMUM_PACKET_SIZE] == 50000
    assert props[mq.TOPIC_ALIAS_MAXIMUM] == 16
    assert props[mq.SESSION_EXPIRY] == 100  # "never" capped by session_expiry_s
    for flag in (
        mq.RETAIN_AVAILABLE,
        mq.WILDCARD_SUB_AVAILABLE,
        mq.SUBSCRIPTION_ID_AVAILABLE,
        mq.SHARED_SUB_AVAILABLE,
    ):
        assert props[flag] == 1
    assert props[mq.ASSIGNED_CLIENT_ID].startswith("auto-")
    assert mq.SERVER_KEEP_ALIVE not in props  # 30 s is within max_keepalive
    raw.close()
    # A client id given: none assigned, no expiry to cap, no aliases when disabled.
    named = RawDevice5(server({"aaabus.mqtt.topic_aliases": "0"}).port)
    props = named.connect("named").properties
    assert mq.ASSIGNED_CLIENT_ID not in props and mq.SESSION_EXPIRY not in props
    assert mq.TOPIC_ALIAS_MAXIMUM not in props
    named.close()


def test_server_keep_alive_instead_of_a_refusal_then_timeout_0x8d(
    server: Callable[..., Server],
) -> None:
    srv = server({"aaabus.mqtt.max_keepalive": "1"})
    raw = RawDevice5(srv.port)
    ack = raw.connect("silent", keep_alive=0)  # 0: told the server's keep-alive
    assert (ack.code, ack.properties[mq.SERVER_KEEP_ALIVE]) == (0, 1)
    # Silent for 1.5 × 1 s: told why.
    assert raw.until(mc.Disconnect, timeout=5).code == mq.KEEP_ALIVE_TIMEOUT
    assert raw.closed()
    raw.close()
    over = RawDevice5(srv.port)
    assert over.connect("over", keep_alive=600).properties[mq.SERVER_KEEP_ALIVE] == 1
    over.close()
    # 3.1.1 cannot be told another keep-alive: still refused (0x02).
    old = RawDevice(srv.port)
    assert old.connect("old", keep_alive=600) == 0x02
    old.close()


def test_a_device_over_our_receive_maximum_is_disconnected_0x93(
    server: Callable[..., Server],
) -> None:
    srv = server()
    watcher = Device(srv.port, "watcher")
    watcher.connect()
    watcher.subscribe("rm/#", 2)
    raw = RawDevice5(srv.port)
    raw.connect("greedy")
    # QoS 2 publications stay unacknowledged until PUBCOMP, which needs our PUBREL: never sent.
    for pid in range(1, INFLIGHT + 1):
        raw.send(mc.Publish("rm/t", str(pid).encode(), 2, False, False, pid))
        assert raw.until(mc.Ack).kind == mq.PUBREC
    raw.send(mc.Publish("rm/t", b"one too many", 2, False, False, INFLIGHT + 1))
    assert raw.until(mc.Disconnect).code == mq.RECEIVE_MAXIMUM_EXCEEDED
    assert raw.closed()
    raw.close()
    got = payloads(watcher.receive(INFLIGHT))
    assert got == [str(pid).encode() for pid in range(1, INFLIGHT + 1)]
    assert watcher.nothing_before("rm/marker")
    # A device that finishes its flows may go on for ever within the bound.
    polite = RawDevice5(srv.port)
    polite.connect("polite")
    for pid in range(1, 3 * INFLIGHT):
        polite.send(mc.Publish("rm/p", b"p", 2, False, False, pid))
        assert polite.until(mc.Ack).kind == mq.PUBREC
        polite.send(mc.Ack(mq.PUBREL, pid))
        assert polite.until(mc.Ack).kind == mq.PUBCOMP
    polite.close()
    watcher.close()


def test_paho_with_receive_maximum_2_never_has_more_than_2_unacknowledged(
    server: Callable[..., Server],
) -> None:
    srv = server()
    device = Device5(srv.port, "slow", expiry=60, receive_max=2, manual_ack=True)
    assert device.connect() == (0, False)
    device.subscribe("slow/#", 1)
    pub = Device5(srv.port, "pub")
    pub.connect()
    for i in range(10):
        pub.publish(f"slow/{i}", str(i).encode(), 1 + i % 2)
    got: list[bytes] = []
    held: list[tuple[int, int]] = []
    while len(got) < 10:
        got.extend(payloads(device.receive(1)))
        held.append(device.mids.get(timeout=5))
        if len(held) == 2 or len(got) == 10:
            # The window is full: nothing more comes until an acknowledgement.
            with pytest.raises(queue.Empty):
                device.inbox.get(timeout=0.3)
            mid, qos = held.pop(0)
            device.ack(mid, qos)
    assert got == [str(i).encode() for i in range(10)]
    for mid, qos in held:
        device.ack(mid, qos)
    device.close()
    pub.close()


def test_receive_maximum_1_one_delivery_at_a_time_and_a_refusing_pubrec_ends_the_flow(
    server: Callable[..., Server],
) -> None:
    srv = server()
    raw = RawDevice5(srv.port)
    raw.connect("one", properties={mq.RECEIVE_MAXIMUM: 1, mq.SESSION_EXPIRY: 60})
    raw.send(mc.Subscribe(1, [("one/#", 2)]))
    assert isinstance(raw.packet(), mc.SubAck)
    pub = Device(srv.port, "pub")
    pub.connect()
    for i in range(3):
        pub.publish("one/t", str(i).encode(), 2)
    first = raw.packet()
    assert (first.payload, first.qos) == (b"0", 2)
    # Its window is full: "1" and "2" are in its session (each PUBCOMP came once stored), yet
    # nothing of them comes before the answer to a PINGREQ.
    assert raw.nothing_queued()
    # The device refuses it (PUBREC 0x80): that flow is over, the next message comes.
    raw.send(mc.Ack(mq.PUBREC, first.packet_id or 0, mq.UNSPECIFIED))
    second = raw.packet()
    assert isinstance(second, mc.Publish) and second.payload == b"1"
    raw.send(mc.Ack(mq.PUBREC, second.packet_id or 0))
    assert raw.packet() == mc.Ack(mq.PUBREL, second.packet_id or 0)
    assert raw.nothing_queued()  # no third PUBLISH before PUBCOMP
    raw.send(mc.Ack(mq.PUBCOMP, second.packet_id or 0))
    third = raw.packet()
    assert isinstance(third, mc.Publish) and third.payload == b"2"
    raw.close()
    pub.close()


def test_a_message_over_the_device_maximum_packet_size_is_skipped_and_logged_once(
    server: Callable[..., Server],
) -> None:
    srv = server()
    device = Device5(srv.port, "small", expiry=60, max_packet=200)
    device.connect()
    device.subscribe("size/#", 1)
    pub = Device(srv.port, "pub")
    pub.connect()
    for payload in (b"a", b"x" * 500, b"b", b"y" * 500, b"c"):
        pub.publish("size/t", payload, 1)
    assert payloads(device.receive(3)) == [b"a", b"b", b"c"]
    assert device.nothing_before("size/marker", via=pub)
    assert srv.logged("over the device's maximum packet size") == 1
    device.close()
    # Skipped counts as delivered: the session's backlog holds nothing of it. (The first
    # marker may come again: the device may have closed before its PUBACK left, and QoS 1
    # then redelivers it.)
    again = Device5(srv.port, "small", clean_start=False, expiry=60, max_packet=200)
    assert again.connect() == (0, True)
    marker = b"after the resume"
    pub.publish("size/marker", marker, 1)
    backlog: list[bytes] = []
    while not backlog or backlog[-1] != marker:
        backlog.append(again.receive(1)[0][1])
    assert all(got.startswith(b"marker ") for got in backlog[:-1]), backlog
    again.close()
    pub.close()


# -- topic aliases --------------------------------------------------------------------------------


def test_paho_sets_and_uses_a_topic_alias(server: Callable[..., Server]) -> None:
    srv = server()
    sub = Device(srv.port, "sub")
    sub.connect()
    sub.subscribe("alias/#", 1)
    pub = Device5(srv.port, "aliaser")
    pub.connect()
    props = Properties(PacketTypes.PUBLISH)
    props.TopicAlias = 3
    pub.publish_props("alias/long/topic/name", b"set", 1, props)
    pub.publish_props("", b"used", 1, props)
    pub.publish_props("", b"again", 0, props)
    got = sub.receive(3)
    assert [(t, p) for t, p, _q, _r in got] == [
        ("alias/long/topic/name", b"set"),
        ("alias/long/topic/name", b"used"),
        ("alias/long/topic/name", b"again"),
    ]
    pub.close()
    sub.close()


@pytest.mark.parametrize(
    ("packets", "code"),
    [
        ([mc.Publish("t", b"x", 1, False, False, 1, {mq.TOPIC_ALIAS: 17})], 0x94),
        ([mc.Publish("", b"x", 1, False, False, 1, {mq.TOPIC_ALIAS: 2})], 0x94),
    ],
    ids=["over-the-maximum", "never-set"],
)
def test_an_invalid_topic_alias_is_disconnect_0x94(
    server: Callable[..., Server], packets: list[Any], code: int
) -> None:
    srv = server()
    raw = RawDevice5(srv.port)
    raw.connect("bad-alias")
    raw.send(*packets)
    assert raw.until(mc.Disconnect).code == code
    assert raw.closed()
    raw.close()


# -- the server's DISCONNECT reasons, AUTH, refusals ----------------------------------------------


def test_a_newer_connection_takes_the_session_over_0x8e(server: Callable[..., Server]) -> None:
    srv = server()
    old = RawDevice5(srv.port)
    old.connect("same", properties={mq.SESSION_EXPIRY: 60})
    new = Device5(srv.port, "same", clean_start=False, expiry=60)
    assert new.connect() == (0, True)
    assert old.until(mc.Disconnect).code == mq.SESSION_TAKEN_OVER
    assert old.closed()
    old.close()
    # paho sees it too, with the reason.
    newest = Device5(srv.port, "same", clean_start=False, expiry=60)
    assert newest.connect() == (0, True)
    assert new.disconnects.get(timeout=10) == mq.SESSION_TAKEN_OVER
    new.client.loop_stop()
    newest.close()


def test_a_server_that_stops_says_so_0x8b(server: Callable[..., Server]) -> None:
    srv = server()
    raw = RawDevice5(srv.port)
    raw.connect("leaving")
    srv.bus.stop()
    assert raw.until(mc.Disconnect).code == mq.SERVER_SHUTTING_DOWN
    raw.close()


def test_enhanced_authentication_is_refused_cleanly(server: Callable[..., Server]) -> None:
    srv = server()
    raw = RawDevice5(srv.port)
    ack = raw.connect("auth", properties={mq.AUTH_METHOD: "SCRAM-SHA-1"})
    assert ack.code == mq.BAD_AUTH_METHOD
    assert raw.closed()
    raw.close()
    # AUTH after CONNECT (re-authentication) is a protocol error.
    again = RawDevice5(srv.port)
    again.connect("reauth")
    again.send(mc.Auth(mq.REAUTHENTICATE, {mq.AUTH_METHOD: "SCRAM-SHA-1"}))
    assert again.until(mc.Disconnect).code == mq.PROTOCOL_ERROR
    again.close()


def test_a_disconnect_that_sets_an_expiry_after_none_is_a_protocol_error_and_the_will_goes(
    server: Callable[..., Server],
) -> None:
    srv = server()
    watcher = Device(srv.port, "watcher")
    watcher.connect()
    watcher.subscribe("wills/#", 1)
    raw = RawDevice5(srv.port)
    will = mc.Will("wills/w", b"gone", 1, False)
    raw.send(mc.Connect(mq.V5, "w", True, 30, None, None, will, {}))
    assert raw.packet().code == 0
    raw.send(mc.Disconnect(0, {mq.SESSION_EXPIRY: 60}))
    assert raw.until(mc.Disconnect).code == mq.PROTOCOL_ERROR
    assert payloads(watcher.receive(1)) == [b"gone"]
    raw.close()
    watcher.close()


def test_a_will_delay_holds_the_will_and_a_resumed_session_cancels_it(
    server: Callable[..., Server],
) -> None:
    srv = server()
    watcher = Device(srv.port, "watcher")
    watcher.connect()
    watcher.subscribe("wills/#", 1)

    def vanish(client_id: str) -> None:
        """Connect with a will delayed 1 s and a session of 60 s, then drop the socket."""
        raw = RawDevice5(srv.port)
        will = mc.Will(f"wills/{client_id}", b"gone", 1, False, {mq.WILL_DELAY: 1})
        raw.send(mc.Connect(mq.V5, client_id, True, 30, None, None, will, {mq.SESSION_EXPIRY: 60}))
        assert raw.packet().code == 0
        raw.close()  # no DISCONNECT
        wait_until("the server let it go", lambda: srv.mqtt()["connected"] == 1)

    vanish("late")
    assert watcher.nothing_before("wills/marker")  # not when the connection ended...
    assert watcher.receive(1)[0][:2] == ("wills/late", b"gone")  # ...but after the delay
    vanish("back")
    again = Device5(srv.port, "back", clean_start=False, expiry=60)
    assert again.connect() == (0, True)  # back within the delay: no will, ever
    again.close()  # a DISCONNECT: no will either
    # "Never", shown by a marker instead of a window: a will falls due later than the one
    # cancelled would have, and the server publishes wills as they fall due, in order.
    vanish("later")
    assert watcher.receive(1)[0][:2] == ("wills/later", b"gone")
    watcher.close()


def test_refusals_are_said_in_5_0_codes(server: Callable[..., Server]) -> None:
    srv = server({"aaabus.mqtt.connections_per_user": "1"}, users={"ann": "pw"})

    def connect(client_id: str, user: str | None, password: bytes | None) -> int:
        raw = RawDevice5(srv.port)
        try:
            packet = mc.Connect(mq.V5, client_id, True, 30, user, password, None, {})
            raw.send(packet)
            code: int = raw.packet().code
            return code
        finally:
            raw.close()

    assert connect("a", "ann", b"wrong") == mq.BAD_CREDENTIALS
    assert connect("a", None, None) == mq.NOT_AUTHORIZED
    holder = RawDevice5(srv.port)
    holder.send(mc.Connect(mq.V5, "held", True, 30, "ann", b"pw", None, {}))
    assert holder.packet().code == 0
    assert connect("other", "ann", b"pw") == mq.QUOTA_EXCEEDED  # connections_per_user = 1
    holder.close()
    # 3.1.1 keeps its own codes for the same refusals.
    old = Device(srv.port, "old", user="ann", password="wrong")
    assert old.connect()[0] == 0x87  # paho reports 3.1.1's 0x05 as 5.0's 0x87
    old.client.loop_stop()


def test_5_0_bad_input_closes_its_connection_only(server: Callable[..., Server]) -> None:
    srv = server({"aaabus.mqtt.max_packet": "4096"})
    good = Device5(srv.port, "good", expiry=60)
    good.connect()
    good.subscribe("ok/#", 1)
    # A Receive Maximum or Maximum Packet Size of 0 (which the codec will not encode) is a
    # protocol error at CONNECT: CONNACK 0x82. Properties: 0x21 0x0000, then 0x27 0x00000000.
    for props in (bytes.fromhex("03 21 0000"), bytes.fromhex("05 27 00000000")):
        raw = RawDevice(srv.port)
        raw.send(connect_packet("bad", level=5, props=props))
        first, body = raw.packet()
        assert (first, body[1]) == (0x20, mq.PROTOCOL_ERROR)
        raw.close()
    # A packet over our Maximum Packet Size: DISCONNECT 0x95.
    big = RawDevice5(srv.port)
    big.connect("big")
    # Its head only: refused once its length is known (and nothing unread makes a reset).
    big.sock.sendall(mc.encode(mc.Publish("ok/big", b"x" * 5000, 1, False, False, 1), mq.V5)[:8])
    assert big.until(mc.Disconnect).code == mq.PACKET_TOO_LARGE
    assert big.closed()
    big.close()
    good.publish("ok/1", b"still here", 1)
    assert payloads(good.receive(1)) == [b"still here"]
    good.close()
