"""The MQTT listener against real server processes, with unmodified standard clients: paho-mqtt
and the Debian mosquitto-clients tools (issue 16)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aaabus import Client
from aaabus.mqtt.auth import hash_password
from aaabus.testing.topicload import Do, Received, TopicProbe
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.mqtt import Device, needs_tools, tool
from tests.support.tls import make_certificate
from tests.support.topics import wait_until

# Real server processes and client processes: not in the fast lane.
pytestmark = pytest.mark.slow


@pytest.fixture
def mqtt_bus(
    tmp_path: Path, make_config: Callable[..., Path]
) -> Iterator[Callable[..., tuple[int, Bus, Path]]]:
    """Start a one-server bus with an MQTT listener: ``start(properties) -> (port, bus, a3)``."""
    buses: list[Bus] = []

    def start(properties: dict[str, str] | None = None) -> tuple[int, Bus, Path]:
        (port,) = free_ports(1)
        props = {"aaabus.mqtt.port": str(port), "aaabus.mqtt.anonymous": "true"}
        config = make_config(properties={**props, **(properties or {})})
        bus = Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT).start()
        buses.append(bus)
        return port, bus, config

    try:
        yield start
    finally:
        for bus in buses:
            bus.stop()


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_each_qos_delivers_every_publication_once_and_in_order(
    mqtt_bus: Callable[..., tuple[int, Bus, Path]], qos: int
) -> None:
    port, _bus, _config = mqtt_bus()
    sub = Device(port, "sub", clean=False)
    pub = Device(port, "pub")
    try:
        assert sub.connect() == (0, False)
        sub.subscribe("meters/#", qos)
        assert pub.connect()[0] == 0
        for i in range(60):
            pub.publish(f"meters/{i % 3}", str(i).encode(), qos)
        got = sub.receive(60)
        assert [payload for _t, payload, _q, _r in got] == [str(i).encode() for i in range(60)]
        assert {q for _t, _p, q, _r in got} == {qos}
        assert sub.nothing_before("meters/end", via=pub)
    finally:
        sub.close()
        pub.close()


def test_a_device_receives_at_the_lower_of_the_published_and_the_granted_qos(
    mqtt_bus: Callable[..., tuple[int, Bus, Path]],
) -> None:
    port, _bus, config = mqtt_bus()
    high = Device(port, "high")
    low = Device(port, "low")
    pub = Device(port, "pub")
    try:
        for device, qos in ((high, 2), (low, 1)):
            device.connect()
            device.subscribe("q/#", qos)
        pub.connect()
        for qos in (0, 1, 2):
            pub.publish(f"q/{qos}", b"x", qos)
        with Client(config, 0) as client:
            client.publish("q/bus", b"y")  # the bus delivers exactly once: QoS 2 for MQTT
        assert [(t, q) for t, _p, q, _r in high.receive(4)] == [
            ("q/0", 0),
            ("q/1", 1),
            ("q/2", 2),
            ("q/bus", 2),
        ]
        assert [q for _t, _p, q, _r in low.receive(4)] == [0, 1, 1, 1]
    finally:
        for device in (high, low, pub):
            device.close()


def test_retained_value_reaches_a_later_subscriber_and_an_empty_one_clears_it(
    mqtt_bus: Callable[..., tuple[int, Bus, Path]],
) -> None:
    port, _bus, _config = mqtt_bus()
    pub = Device(port, "pub")
    pub.connect()
    pub.publish("site/1/state", b"open", 1, retain=True)
    late = Device(port, "late")
    try:
        late.connect()
        late.subscribe("site/+/state", 1)
        assert late.receive(1) == [("site/1/state", b"open", 1, True)]
        pub.publish("site/1/state", b"", 1, retain=True)  # MQTT's way to clear it
        assert late.receive(1)[0][1] == b""  # live subscribers see the clearing publication
        later = Device(port, "later")
        later.connect()
        later.subscribe("site/#", 1)
        assert later.nothing_before("site/marker")  # no retained copy came first
        later.close()
    finally:
        late.close()
        pub.close()


@needs_tools
def test_will_is_published_when_a_device_dies_without_disconnect(
    mqtt_bus: Callable[..., tuple[int, Bus, Path]],
) -> None:
    port, _bus, config = mqtt_bus()
    watcher = Device(port, "watcher")
    watcher.connect()
    watcher.subscribe("status/#", 1)
    dying = subprocess.Popen(
        [
            *("mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-t", "x", "-i", "dying"),
            *("--will-topic", "status/dying", "--will-payload", "gone", "--will-qos", "1"),
        ],
        stdout=subprocess.DEVNULL,
    )
    try:
        with Client(config, 0) as client:
            wait_until("dying is connected", lambda: client.status()["mqtt"]["connected"] == 2)
        assert watcher.nothing_before("status/marker")  # alive: no will yet
        dying.send_signal(signal.SIGKILL)  # the TCP connection ends without DISCONNECT
        dying.wait(10)
        assert watcher.receive(1) == [("status/dying", b"gone", 1, False)]
        polite = Device(port, "polite", will=("status/polite", b"gone", 1))
        polite.connect()
        polite.close()  # DISCONNECT: no will
        # Once the server has let go of it, any will would be published before the marker.
        with Client(config, 0) as client:
            wait_until("polite is gone", lambda: client.status()["mqtt"]["connected"] == 1)
        assert watcher.nothing_before("status/marker")
    finally:
        if dying.poll() is None:
            dying.kill()
            dying.wait(10)
        watcher.close()


def test_persistent_session_keeps_subscriptions_and_backlog_across_a_sigkill(
    mqtt_bus: Callable[..., tuple[int, Bus, Path]],
) -> None:
    port, bus, _config = mqtt_bus()
    device = Device(port, "meter-7", clean=False)
    assert device.connect() == (0, False)
    device.subscribe("cmd/meter-7/#", 2)
    device.close()
    pub = Device(port, "ops")
    pub.connect()
    for i in range(5):
        pub.publish(f"cmd/meter-7/{i}", f"do {i}".encode(), 2)
    pub.close()
    bus[0].kill()  # the committed backlog is all there is
    bus[0].start().wait_ready(30)
    again = Device(port, "meter-7", clean=False)
    try:
        assert again.connect() == (0, True)  # session present
        got = again.receive(5)
        assert [p for _t, p, _q, _r in got] == [f"do {i}".encode() for i in range(5)]
        assert again.nothing_before("cmd/meter-7/end")
    finally:
        again.close()
    fresh = Device(port, "meter-7", clean=True)  # a clean start drops the session
    assert fresh.connect() == (0, False)
    fresh.close()


def test_qos2_stays_exactly_once_when_the_server_is_killed_mid_stream(
    mqtt_bus: Callable[..., tuple[int, Bus, Path]],
) -> None:
    """QoS 2 flows open in both directions at the kill: after the restart the publisher resends
    PUBLISH (DUP) for what it has no PUBREC for, PUBREL for what it has; the server resends
    PUBREL or PUBLISH to the subscriber as its committed state says. Each publication once.

    The devices reconnect by hand, once, after the restart: paho 2.2.0's automatic reconnection
    demotes a message awaiting PUBCOMP to a fresh PUBLISH (DUP unset) when a reconnection
    attempt fails before one succeeds, re-sending after its PUBREL what MQTT forbids it to
    (3.1.1, 4.3.3): no broker can tell that from a new message.
    """
    port, bus, config = mqtt_bus()
    with Client(config, 0) as client:
        client.subscribe("exact/#", name="watch").close()  # counts what the bus published
    sub = Device(port, "exact-sub", clean=False)
    pub = Device(port, "exact-pub", clean=False)
    total = 300
    try:
        sub.connect()
        sub.subscribe("exact/#", 2)
        pub.connect()
        infos = [pub.client.publish(f"exact/{i % 5}", str(i).encode(), 2) for i in range(total)]
        got = [p for _t, p, _q, _r in sub.receive(total // 3, timeout=60)]
        for device in (sub, pub):
            device.pause()
        bus[0].kill()  # with QoS 2 flows open in both directions
        bus[0].start().wait_ready(30)
        for device in (sub, pub):
            assert device.resume() == (0, True)
        got += [p for _t, p, _q, _r in sub.receive(total - len(got), timeout=90)]
        for info in infos:
            info.wait_for_publish(60)
        assert sub.nothing_before("exact/end", via=pub)
    finally:
        sub.close()
        pub.close()
    # One publisher: its publications arrive in order, each exactly once; the bus made each once.
    assert got == [str(i).encode() for i in range(total)]
    with Client(config, 0) as client, client.subscribe("exact/#", name="watch") as watch:
        published = []
        while (item := watch.get(timeout=3)) is not None:
            published.append(item.payload)
    assert published == [*got, published[-1]]  # and the closing marker


def test_qos2_stays_exactly_once_across_twenty_sigkills_of_the_server(
    mqtt_bus: Callable[..., tuple[int, Bus, Path]],
) -> None:
    """The same as above, twenty times over: each round publishes, receives part of it, and
    kills the server with QoS 2 flows open both ways; at the end every publication arrived
    once, in order, and nothing else arrived before the closing marker."""
    port, bus, _config = mqtt_bus()
    sub = Device(port, "kills-sub", clean=False)
    pub = Device(port, "kills-pub", clean=False)
    rounds, per_round = 20, 15
    got: list[bytes] = []
    infos = []
    try:
        sub.connect()
        sub.subscribe("kills/#", 2)
        pub.connect()
        for r in range(rounds):
            for i in range(per_round):
                n = r * per_round + i
                infos.append(pub.client.publish(f"kills/{n % 3}", str(n).encode(), 2))
            got += [p for _t, p, _q, _r in sub.receive(per_round // 3, timeout=60)]
            for device in (sub, pub):
                device.pause()
            bus[0].kill()
            bus[0].start().wait_ready(30)
            for device in (sub, pub):
                assert device.resume(30) == (0, True)
        total = rounds * per_round
        got += [p for _t, p, _q, _r in sub.receive(total - len(got), timeout=120)]
        for info in infos:
            info.wait_for_publish(60)
        pub.publish("kills/end", b"marker", 2)
        assert [p for _t, p, _q, _r in sub.receive(1, timeout=30)] == [b"marker"]
    finally:
        sub.close()
        pub.close()
    assert got == [str(n).encode() for n in range(total)]


def test_a_newer_connection_takes_the_client_id_and_its_session_over(
    mqtt_bus: Callable[..., tuple[int, Bus, Path]],
) -> None:
    port, _bus, _config = mqtt_bus()
    first = Device(port, "same", clean=False, will=("gone/same", b"first", 1))
    first.client.reconnect_delay_set(60, 60)  # paho would otherwise take the id back at once
    watcher = Device(port, "watcher")
    second = Device(port, "same", clean=False)
    pub = Device(port, "pub")
    try:
        assert first.connect() == (0, False)
        first.subscribe("t/#", 1)
        watcher.connect()
        watcher.subscribe("gone/#", 1)
        assert second.connect() == (0, True)  # the session, subscriptions included
        assert watcher.receive(1)[0][:2] == ("gone/same", b"first")  # the old one's will
        pub.connect()
        pub.publish("t/1", b"to the newer", 1)
        assert second.receive(1)[0][:2] == ("t/1", b"to the newer")
        assert first.inbox.empty()  # the session's one delivery went to the newer connection
    finally:
        for device in (first, watcher, second, pub):
            device.close()


@needs_tools
def test_credentials_file_admits_its_users_and_refuses_others_with_connack_5(
    mqtt_bus: Callable[..., tuple[int, Bus, Path]], tmp_path: Path
) -> None:
    (tmp_path / "mqtt.passwd").write_text(f"sensor:{hash_password('pw-1')}\n")
    port, _bus, _config = mqtt_bus(
        {"aaabus.mqtt.credentials": "mqtt.passwd", "aaabus.mqtt.anonymous": "false"}
    )
    # paho reports 3.1.1's return code 5 as its 5.0 equivalent, 0x87 "not authorized".
    assert Device(port, "a", user="sensor", password="wrong").connect() == (0x87, False)
    assert Device(port, "b").connect() == (0x87, False)
    refused = tool("mosquitto_pub", "-p", str(port), "-t", "t", "-m", "x", "-u", "x", "-P", "y")
    assert refused.returncode != 0 and "not authori" in refused.stderr.lower()
    good = Device(port, "c", user="sensor", password="pw-1")
    assert good.connect() == (0, False)
    good.subscribe("t", 1)
    sent = tool(
        *("mosquitto_pub", "-p", str(port), "-t", "t", "-m", "hi", "-q", "1"),
        *("-u", "sensor", "-P", "pw-1"),
    )
    assert sent.returncode == 0, sent.stderr
    assert good.receive(1)[0][:2] == ("t", b"hi")
    good.close()


@needs_tools
def test_tls_listener_serves_paho_and_mosquitto_tools(
    mqtt_bus: Callable[..., tuple[int, Bus, Path]], tmp_path: Path
) -> None:
    cert, key = make_certificate(tmp_path, "mqtt")
    port, _bus, _config = mqtt_bus(
        {"aaabus.mqtt.tls.cert": cert.name, "aaabus.mqtt.tls.key": key.name}
    )
    device = Device(port, "tls-sub", tls_ca=str(cert))
    try:
        assert device.connect() == (0, False)
        device.subscribe("secure/#", 1)
        sent = tool(
            *("mosquitto_pub", "-p", str(port), "-t", "secure/x", "-m", "s", "-q", "1"),
            *("--cafile", str(cert), "--insecure"),
        )
        assert sent.returncode == 0, sent.stderr
        assert device.receive(1)[0][:2] == ("secure/x", b"s")
        plain = tool("mosquitto_pub", "-p", str(port), "-t", "secure/x", "-m", "p")
        assert plain.returncode != 0  # no cleartext on a TLS port
        assert device.nothing_before("secure/marker")
    finally:
        device.close()


@needs_tools
def test_devices_agents_and_outside_clients_share_the_topics(
    mqtt_bus: Callable[..., tuple[int, Bus, Path]],
) -> None:
    port, _bus, config = mqtt_bus()
    device = Device(port, "dev")
    device.connect()
    device.subscribe("to-device/#", 1)
    with Client(config, 0) as client:
        probe = client.deploy(TopicProbe("probe", ["from-device/#"]), server=0)
        watch = client.subscribe("from-device/#")
        try:
            # device -> agent and outside client (published with the Debian tool)
            sent = tool(
                "mosquitto_pub", "-p", str(port), "-t", "from-device/t", "-m", "21.5", "-q", "2"
            )
            assert sent.returncode == 0, sent.stderr
            seen = watch.get(timeout=20)
            assert seen is not None and (seen.topic, seen.payload) == ("from-device/t", b"21.5")

            def probe_got() -> bool:
                reply = client.request(probe, Do("report", ""), timeout=20)
                assert isinstance(reply, Received)
                return [r[:2] for r in reply.items] == [("from-device/t", b"21.5")]

            wait_until("the agent received the device's publication", probe_got)
            # agent -> device, and outside client -> device (text is sent as UTF-8)
            client.send(probe, Do("publish", "to-device/a", "from agent"))
            client.publish("to-device/c", b"from client")
            got = sorted(device.receive(2))
            assert [(t, p) for t, p, _q, _r in got] == [
                ("to-device/a", b"from agent"),
                ("to-device/c", b"from client"),
            ]
            # The Debian subscriber: a retained value published by a client reaches it.
            client.publish("to-device/r", "kept", retain=True)
            wait_until("the device saw the retained value", lambda: bool(device.receive(1)))
            received = tool(
                *("mosquitto_sub", "-p", str(port), "-t", "to-device/r", "-C", "1"),
                *("-W", "15", "-q", "1"),
                timeout=30,
            )
            assert (received.returncode, received.stdout) == (0, "kept\n"), received.stderr
        finally:
            watch.close()
    device.close()
