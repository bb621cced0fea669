"""The MQTT bridge (issue 32, point 4) between a real aaabus server process and a real Mosquitto
broker process: bus -> broker, broker -> bus, no echo, either side SIGKILLed mid-stream."""

from __future__ import annotations

import getpass
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from aaabus import Client
from aaabus.config.reader import load_config
from aaabus.errors import AaabusError
from aaabus.model.ids import TOPICS_STAMP
from aaabus.mqtt.bridgesettings import filters_meet
from aaabus.node.server import AgentServer
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.mqtt import Device
from tests.support.tls import make_certificate
from tests.support.topics import wait_until

# Real server and broker processes: not in the fast lane.
pytestmark = pytest.mark.slow

MOSQUITTO = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/sbin")
needs_broker = pytest.mark.skipif(MOSQUITTO is None, reason="apt-get install mosquitto")


class Broker:
    """A Mosquitto process on ``port`` with a persistent store in ``where`` (saved every
    second), so that a session made before a SIGKILL survives it as of the last save."""

    def __init__(self, where: Path, port: int, extra: str = "allow_anonymous true\n") -> None:
        assert MOSQUITTO is not None
        self.port = port
        self.where = where
        where.mkdir(exist_ok=True)
        self.conf = where / "mosquitto.conf"
        self.conf.write_text(
            f"listener {port} 127.0.0.1\n"
            f"{extra}"
            # Run as root, Mosquitto would switch to its own user, who cannot write here.
            f"user {getpass.getuser()}\n"
            "persistence true\n"
            f"persistence_location {where}/\n"
            "autosave_interval 1\n"
            "max_queued_messages 100000\n"
            f"log_dest file {where}/mosquitto.log\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def db(self) -> Path:
        return self.where / "mosquitto.db"

    def _runs(self) -> int:
        log = self.where / "mosquitto.log"
        return log.read_text(errors="replace").count(" running") if log.exists() else 0

    def start(self) -> Broker:
        runs = self._runs()
        self.proc = proc = subprocess.Popen(
            [str(MOSQUITTO), "-c", str(self.conf)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

        def accepts() -> bool:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.2).close()
            except OSError:
                return False
            return True

        # Its own log says it runs: a port taken by another process makes it exit instead, and
        # a connection that another listener accepts would prove nothing.
        wait_until("mosquitto running", lambda: self._runs() > runs or proc.poll() is not None, 10)
        assert proc.poll() is None, f"mosquitto exited: {self.where / 'mosquitto.log'}"
        wait_until("mosquitto accepting", accepts, 10)
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)  # its own PID, nothing else

    def kill(self) -> None:
        assert self.proc is not None
        self.signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


Start = Callable[..., tuple[Broker, Bus, Path]]


@pytest.fixture
def bridged(tmp_path: Path, make_config: Callable[..., Path]) -> Iterator[Start]:
    """``start(properties, before=fn) -> (broker, bus, a3)``: a Mosquitto broker, then
    ``before(broker)`` (subscribers the broker needs first), then a one-server bus whose
    server bridges to it."""
    started: list[Any] = []

    def start(
        properties: dict[str, str],
        before: Callable[[Broker], None] | None = None,
        broker_conf: str = "allow_anonymous true\n",
    ) -> tuple[Broker, Bus, Path]:
        (port,) = free_ports(1)
        broker = Broker(tmp_path / "broker", port, broker_conf).start()
        started.append(broker)
        if before is not None:
            before(broker)
        props = {"aaabus.mqtt.bridge.address": f"127.0.0.1:{port}", **properties}
        config = make_config(properties=props)
        bus = Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT).start()
        started.append(bus)
        return broker, bus, config

    try:
        yield start
    finally:
        for thing in reversed(started):
            thing.stop()


def bridge_figures(config: Path) -> dict[str, Any]:
    with Client(config, 0) as client:
        figures: dict[str, Any] = client.status()["bridge"]
        return figures


def subscribed(config: Path) -> bool:
    """Whether the bridge holds its in filters at the broker (SUBACK in)."""
    try:
        return bool(bridge_figures(config)["subscribed"])
    except AaabusError:
        return False  # the server is restarting


def first_seen(payloads: list[bytes]) -> tuple[list[bytes], int]:
    """The payloads in the order of their first arrival, and how many arrived again."""
    seen: dict[bytes, None] = {}
    for payload in payloads:
        seen.setdefault(payload, None)
    return list(seen), len(payloads) - len(seen)


def numbered(count: int, start: int = 0) -> list[bytes]:
    return [b"%d" % i for i in range(start, start + count)]


def drain(device: Device, want: set[bytes], timeout: float = 30.0) -> list[bytes]:
    """Payloads ``device`` receives until it has every one of ``want`` (duplicates kept)."""
    got: list[bytes] = []
    deadline = time.monotonic() + timeout
    while not want <= set(got):
        _topic, payload, _qos, _retain = device.inbox.get(
            timeout=max(0.01, deadline - time.monotonic())
        )
        got.append(payload)
    return got


@needs_broker
def test_bus_publications_reach_the_broker_at_qos1_in_order_with_the_prefix(
    bridged: Start,
) -> None:
    watcher: list[Device] = []

    def subscribe(broker: Broker) -> None:
        device = Device(broker.port, "cloud-watch")
        device.connect()
        device.subscribe("site-7/#", 1)
        watcher.append(device)

    broker, _bus, config = bridged(
        {"aaabus.mqtt.bridge.out": "meters/#", "aaabus.mqtt.bridge.prefix_out": "site-7/"},
        before=subscribe,
    )
    (sub,) = watcher
    try:
        with Client(config, 0) as client:
            for i in range(60):
                client.publish(f"meters/{i % 3}", b"%d" % i)
            client.publish("other/topic", b"not bridged")
            client.publish("meters/state", b"open", retain=True)
        got = sub.receive(61)
        assert [p for _t, p, _q, _r in got[:60]] == numbered(60)
        assert [t for t, _p, _q, _r in got[:3]] == [f"site-7/meters/{i}" for i in range(3)]
        assert {q for _t, _p, q, _r in got} == {1}
        assert got[60][:2] == ("site-7/meters/state", b"open")
        # The RETAIN flag went with it: a later subscriber at the broker gets the value.
        late = Device(broker.port, "late")
        late.connect()
        late.subscribe("site-7/meters/state", 1)
        assert late.receive(1) == [("site-7/meters/state", b"open", 1, True)]
        late.close()
        wait_until("the mailbox emptied", lambda: bridge_figures(config)["waiting"] == 0, 10)
        figures = bridge_figures(config)
        assert figures["connected"] and figures["sent"] == 61 and figures["in_flight"] == 0
    finally:
        sub.close()


@needs_broker
def test_broker_messages_reach_bus_subscribers_and_are_not_echoed_back(bridged: Start) -> None:
    watcher: list[Device] = []

    def subscribe(broker: Broker) -> None:
        device = Device(broker.port, "cloud-watch")
        device.connect()
        device.subscribe("#", 1)
        watcher.append(device)

    broker, _bus, config = bridged(
        {
            "aaabus.mqtt.bridge.in": "cmd/#",
            "aaabus.mqtt.bridge.prefix_in": "cloud/",
            # Bus topics under cloud/ go out: what came in from the broker must not.
            "aaabus.mqtt.bridge.out": "cloud/#",
        },
        before=subscribe,
    )
    (watch,) = watcher
    cloud = Device(broker.port, "cloud-app")
    try:
        wait_until("the bridge subscribed at the broker", lambda: subscribed(config), 10)
        with Client(config, 0) as client, client.subscribe("cloud/cmd/#") as on_bus:
            cloud.connect()
            for i in range(40):
                cloud.publish(f"cmd/valve/{i % 4}", b"%d" % i, 1)
            got = [on_bus.get(20) for _ in range(40)]
            assert [p.payload for p in got if p is not None] == numbered(40)
            assert got[0] is not None and got[0].topic == "cloud/cmd/valve/0"
            # After those 40 on the bus, a marker of the bus's own goes out: the broker's
            # watcher sees the 40 (the cloud's) and the marker, nothing brought back.
            client.publish("cloud/marker", b"end")
        seen = [(t, p) for t, p, _q, _r in watch.receive(41)]
        assert seen[:40] == [(f"cmd/valve/{i % 4}", b"%d" % i) for i in range(40)]
        assert seen[40] == ("cloud/marker", b"end")
        # "sent" counts the broker's PUBACKs, which may reach the bridge after the watcher
        # read the marker.
        figures = wait_until(
            "the broker acknowledged the marker",
            lambda: (f := bridge_figures(config))["sent"] >= 1 and f,
            10,
        )
        assert figures["received"] == 40 and figures["skipped"] == 40 and figures["sent"] == 1
    finally:
        watch.close()
        cloud.close()


@needs_broker
def test_mqtt5_bridges_one_filter_both_ways_without_a_loop(bridged: Start) -> None:
    """Protocol 5: the same filter out and in; no-local at the broker, the origin on the bus."""
    watcher: list[Device] = []

    def subscribe(broker: Broker) -> None:
        device = Device(broker.port, "cloud-watch")
        device.connect()
        device.subscribe("shared/#", 1)
        watcher.append(device)

    _broker, _bus, config = bridged(
        {
            "aaabus.mqtt.bridge.in": "shared/#",
            "aaabus.mqtt.bridge.out": "shared/#",
            "aaabus.mqtt.bridge.protocol": "5",
        },
        before=subscribe,
    )
    (watch,) = watcher
    try:
        wait_until("the bridge subscribed at the broker", lambda: subscribed(config), 10)
        with Client(config, 0) as client, client.subscribe("shared/#") as on_bus:
            client.publish("shared/from-bus", b"b")
            assert watch.receive(1)[0][:2] == ("shared/from-bus", b"b")
            watch.publish("shared/from-cloud", b"c", 1)
            assert watch.receive(1)[0][:2] == ("shared/from-cloud", b"c")  # its own, once
            first, second = on_bus.get(10), on_bus.get(10)
            assert first is not None and first.topic == "shared/from-bus"
            assert second is not None and second.topic == "shared/from-cloud"
            client.publish("shared/marker", b"m")
            assert watch.receive(1)[0][:2] == ("shared/marker", b"m")  # nothing before it
            marker = on_bus.get(10)
            assert marker is not None and marker.topic == "shared/marker"  # nor on the bus
        figures = wait_until(  # PUBACKs may reach the bridge after the watcher read the marker
            "the broker acknowledged both",
            lambda: (f := bridge_figures(config))["sent"] >= 2 and f,
            10,
        )
        assert (figures["sent"], figures["received"], figures["skipped"]) == (2, 1, 1)
    finally:
        watch.close()


class Device5:
    """A paho MQTT 5.0 client whose messages (topic, payload, properties) land in ``inbox``."""

    def __init__(self, port: int, client_id: str) -> None:
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5
        )
        self.inbox: queue.Queue[tuple[str, bytes, Any]] = queue.Queue()
        self.acks: queue.Queue[Any] = queue.Queue()
        self.client.on_message = lambda _c, _u, m: self.inbox.put(
            (m.topic, bytes(m.payload), m.properties)
        )
        self.client.on_connect = lambda _c, _u, _f, rc, _p: self.acks.put(rc)
        self.client.on_subscribe = lambda _c, _u, _m, rcs, _p: self.acks.put(rcs)
        self.client.connect("127.0.0.1", port, keepalive=30)
        self.client.loop_start()
        assert not self.acks.get(timeout=10).is_failure

    def subscribe(self, topic_filter: str) -> None:
        self.client.subscribe(topic_filter, 1)
        self.acks.get(timeout=10)

    def publish(self, topic: str, payload: bytes, **props: Any) -> None:
        properties = Properties(PacketTypes.PUBLISH)
        for name, value in props.items():
            setattr(properties, name, value)
        self.client.publish(topic, payload, 1, properties=properties).wait_for_publish(10)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


@needs_broker
def test_mqtt5_request_and_response_cross_the_bridge_with_their_properties(
    bridged: Start,
) -> None:
    """A 5.0 device on the bus asks a service at the broker (response topic, correlation data,
    user properties, content type) and gets its answer back through the bridge."""
    services: list[Device5] = []

    def serve(broker: Broker) -> None:
        service = Device5(broker.port, "service")
        service.subscribe("req/#")
        services.append(service)

    (listener,) = free_ports(1)
    _broker, _bus, config = bridged(
        {
            "aaabus.mqtt.bridge.out": "req/#",
            "aaabus.mqtt.bridge.in": "resp/#",
            "aaabus.mqtt.bridge.protocol": "5",
            "aaabus.mqtt.port": str(listener),
            "aaabus.mqtt.anonymous": "true",
        },
        before=serve,
    )
    (service,) = services
    device = Device5(listener, "meter-9")
    try:
        device.subscribe("resp/#")
        wait_until("the bridge subscribed at the broker", lambda: subscribed(config), 10)
        device.publish(
            "req/price",
            b"how much?",
            ResponseTopic="resp/meter-9",
            CorrelationData=b"call-1",
            UserProperty=[("site", "7")],
            ContentType="text/plain",
        )
        topic, payload, asked = service.inbox.get(timeout=10)
        assert (topic, payload) == ("req/price", b"how much?")
        assert asked.ResponseTopic == "resp/meter-9" and asked.ContentType == "text/plain"
        assert asked.CorrelationData == b"call-1" and asked.UserProperty == [("site", "7")]
        service.publish(
            asked.ResponseTopic,
            b"12",
            CorrelationData=asked.CorrelationData,
            UserProperty=[("unit", "cent")],
        )
        topic, payload, answer = device.inbox.get(timeout=10)
        assert (topic, payload) == ("resp/meter-9", b"12")
        assert answer.CorrelationData == b"call-1" and answer.UserProperty == [("unit", "cent")]
    finally:
        device.close()
        service.close()


@needs_broker
def test_nothing_is_lost_when_the_broker_is_killed_and_restarted(bridged: Start) -> None:
    """The broker is frozen with messages on their way (sent, not acknowledged), SIGKILLed,
    and restarted on the same port while the bus goes on publishing: after the bridge
    reconnects, the broker's subscriber has every message (duplicates counted, allowed)."""
    watcher: list[Device] = []

    def subscribe(broker: Broker) -> None:
        device = Device(broker.port, "cloud-watch", clean=False)
        device.connect()
        device.subscribe("meters/#", 1)
        made = time.time()
        # Its session must be in the broker's saved store, to survive the SIGKILL.
        wait_until(
            "the broker saved the subscriber's session",
            lambda: broker.db.exists() and broker.db.stat().st_mtime > made + 0.1,
            10,
        )
        watcher.append(device)

    broker, _bus, config = bridged({"aaabus.mqtt.bridge.out": "meters/#"}, before=subscribe)
    (sub,) = watcher
    try:
        with Client(config, 0) as client:
            for i in range(50):
                client.publish("meters/a", b"%d" % i)
            before = drain(sub, set(numbered(50)))
            sub.pause()  # reconnected by hand after the restart (see tests/support/mqtt.py)
            broker.signal(signal.SIGSTOP)  # what the bridge sends now is never acknowledged
            for i in range(50, 100):
                client.publish("meters/a", b"%d" % i)
            wait_until("sends in flight", lambda: bridge_figures(config)["in_flight"] > 0, 10)
            broker.kill()  # frozen: it processes nothing more
            for i in range(100, 250):  # more than the bridge's window: from the store, later
                client.publish("meters/a", b"%d" % i)  # the broker is away
            wait_until("bridge down", lambda: not bridge_figures(config)["connected"], 10)
            broker.start()
            assert sub.resume()[1]  # its session came back with the broker's store
            after = drain(sub, set(numbered(200, 50)))
        order, duplicates = first_seen(before + after)
        assert order == numbered(250)
        print(f"broker killed: 250 messages, {duplicates} duplicates")
        wait_until("the mailbox emptied", lambda: bridge_figures(config)["waiting"] == 0, 10)
        assert bridge_figures(config)["reconnections"] >= 1
    finally:
        sub.close()


@needs_broker
def test_what_the_broker_had_not_acknowledged_goes_again_after_the_server_is_killed(
    bridged: Start,
) -> None:
    """Bus -> broker across a SIGKILL of the server: its mailbox still holds what the frozen
    broker never acknowledged, and the restarted bridge sends it (at least once)."""
    watcher: list[Device] = []

    def subscribe(broker: Broker) -> None:
        device = Device(broker.port, "cloud-watch")
        device.connect()
        device.subscribe("meters/#", 1)
        watcher.append(device)

    broker, bus, config = bridged({"aaabus.mqtt.bridge.out": "meters/#"}, before=subscribe)
    (sub,) = watcher
    try:
        with Client(config, 0) as client:
            for i in range(20):
                client.publish("meters/a", b"%d" % i)
            before = drain(sub, set(numbered(20)))
            broker.signal(signal.SIGSTOP)  # from now on the broker acknowledges nothing
            for i in range(20, 170):  # more than the window: the rest waits in the mailbox
                client.publish("meters/a", b"%d" % i)
            wait_until("sends in flight", lambda: bridge_figures(config)["in_flight"] > 0, 10)
        bus[0].kill()
        broker.signal(signal.SIGCONT)
        bus[0].start().wait_ready(30)
        after = drain(sub, set(numbered(150, 20)))
        order, duplicates = first_seen(before + after)
        assert order == numbered(170)
        print(f"server killed with 150 unacknowledged: {duplicates} duplicates")
        wait_until("the mailbox emptied", lambda: bridge_figures(config)["waiting"] == 0, 10)
    finally:
        sub.close()


@needs_broker
def test_nothing_is_lost_when_the_server_is_killed_while_the_broker_publishes(
    bridged: Start,
) -> None:
    """The server is SIGKILLed while the broker is delivering to the bridge (messages in
    flight, some on the bus but not acknowledged to the broker), and more are published while
    it is dead: the bridge's persistent session at the broker keeps them all."""
    broker, bus, config = bridged({"aaabus.mqtt.bridge.in": "cmd/#"})
    with Client(config, 0) as client:
        client.subscribe("cmd/#", name="watch").close()  # durable: kept across the kill
    wait_until("the bridge subscribed at the broker", lambda: subscribed(config), 10)
    cloud = Device(broker.port, "cloud-app")
    cloud.connect()
    try:
        for i in range(200):
            cloud.publish("cmd/x", b"%d" % i, 1)
        wait_until("50 on the bus", lambda: bridge_figures(config)["received"] >= 50, 20)
        bus[0].kill()
        for i in range(200, 300):
            cloud.publish("cmd/x", b"%d" % i, 1)  # the bridge's session at the broker keeps them
        bus[0].start().wait_ready(30)
        got: list[bytes] = []
        with Client(config, 0) as client, client.subscribe("cmd/#", name="watch") as on_bus:
            while not set(numbered(300)) <= set(got):
                item = on_bus.get(20)
                assert item is not None, f"{len(set(got))} of 300 arrived"
                got.append(item.payload)
        order, duplicates = first_seen(got)
        assert order == numbered(300)
        print(f"server killed: 300 messages, {duplicates} duplicates")
    finally:
        cloud.close()


@needs_broker
@pytest.mark.skipif(shutil.which("mosquitto_passwd") is None, reason="mosquitto_passwd")
def test_the_bridge_speaks_tls_with_a_password_from_a_private_file(
    tmp_path: Path, bridged: Start
) -> None:
    cert, key = make_certificate(tmp_path)
    users = tmp_path / "broker-users"
    for user, password in (("edge", "s3cret edge"), ("app", "app pw")):
        create = [] if users.exists() else ["-c"]
        subprocess.run(
            ["mosquitto_passwd", *create, "-b", str(users), user, password],
            check=True,
            capture_output=True,
            timeout=30,
        )
    (tmp_path / "bridge.pw").write_text("s3cret edge\n")
    (tmp_path / "bridge.pw").chmod(0o600)
    watcher: list[Device] = []

    def subscribe(broker: Broker) -> None:
        device = Device(broker.port, "cloud-app", user="app", password="app pw", tls_ca=str(cert))
        assert device.connect()[0] == 0
        device.subscribe("up/#", 1)
        watcher.append(device)

    _broker, _bus, config = bridged(
        {
            "aaabus.mqtt.bridge.out": "up/#",
            "aaabus.mqtt.bridge.in": "down/#",
            "aaabus.mqtt.bridge.username": "edge",
            "aaabus.mqtt.bridge.password_file": "bridge.pw",
            "aaabus.mqtt.bridge.tls.ca": cert.name,
        },
        before=subscribe,
        broker_conf=(
            f"certfile {cert}\nkeyfile {key}\nallow_anonymous false\npassword_file {users}\n"
        ),
    )
    (app,) = watcher
    try:
        wait_until("the bridge subscribed at the broker", lambda: subscribed(config), 10)
        with Client(config, 0) as client, client.subscribe("down/#") as on_bus:
            for i in range(20):
                client.publish("up/x", b"%d" % i)
                app.publish("down/y", b"%d" % i, 1)
            assert [p for _t, p, _q, _r in app.receive(20)] == numbered(20)
            got = [on_bus.get(10) for _ in range(20)]
            assert [p.payload for p in got if p is not None] == numbered(20)
    finally:
        app.close()


@needs_broker
@pytest.mark.skipif(shutil.which("mosquitto_passwd") is None, reason="mosquitto_passwd")
def test_a_refused_connect_is_retried_with_one_log_line_while_the_bus_runs_on(
    tmp_path: Path, bridged: Start
) -> None:
    users = tmp_path / "broker-users"
    subprocess.run(
        ["mosquitto_passwd", "-c", "-b", str(users), "edge", "right"],
        check=True,
        capture_output=True,
        timeout=30,
    )
    (tmp_path / "bridge.pw").write_text("wrong\n")
    (tmp_path / "bridge.pw").chmod(0o600)
    _broker, bus, config = bridged(
        {
            "aaabus.mqtt.bridge.out": "up/#",
            "aaabus.mqtt.bridge.username": "edge",
            "aaabus.mqtt.bridge.password_file": "bridge.pw",
        },
        broker_conf=f"allow_anonymous false\npassword_file {users}\n",
    )
    wait_until("three refusals", lambda: bridge_figures(config)["refused"] >= 3, 20)
    with Client(config, 0) as client:
        for i in range(5):
            client.publish("up/x", b"%d" % i)  # the bus runs on; the items wait
    figures = bridge_figures(config)
    assert not figures["connected"] and figures["sent"] == 0 and figures["waiting"] == 5
    down = [line for line in bus[0].lines if "MQTT bridge to" in line and "is down" in line]
    assert len(down) == 1 and "CONNACK" in down[0], down


def test_the_bridge_mailbox_follows_the_out_filters_and_goes_with_the_bridge(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """In-process, no broker needed (it retries meanwhile): a restart with other out filters
    moves the mailbox's subscriptions; a restart without the bridge deletes the mailbox."""
    (nobody,) = free_ports(1)
    address = {"aaabus.mqtt.bridge.address": f"127.0.0.1:{nobody}"}

    def boot(props: dict[str, str]) -> AgentServer:
        server = AgentServer(load_config(make_config(properties=props)), 0, storage=tmp_path / "s")
        server.start()
        return server

    def local_filters(server: AgentServer) -> list[str]:
        def read() -> list[str]:
            assert server.store is not None
            rep = server.store.agents.get((0, TOPICS_STAMP))
            return sorted(rep.local.keys())

        return server.call(read)

    server = boot({**address, "aaabus.mqtt.bridge.out": "a/#,b/#"})
    try:
        wait_until("subscribed", lambda: local_filters(server) == ["a/#", "b/#"], 10)
        assert any(t.name == "mqtt-bridge-0" for t in threading.enumerate())
    finally:
        server.stop()
    server = boot({**address, "aaabus.mqtt.bridge.out": "b/#,c/#"})
    try:
        wait_until("moved", lambda: local_filters(server) == ["b/#", "c/#"], 10)
    finally:
        server.stop()
    assert not any(t.name == "mqtt-bridge-0" for t in threading.enumerate())
    server = boot({})
    try:
        wait_until("gone", lambda: local_filters(server) == [], 10)
        assert server.status()["topics"]["subscribers"] == 0
    finally:
        server.stop()


def run_refused(tmp_path: Path, make_config: Callable[..., Path], props: dict[str, str]) -> str:
    """Start a server process that must refuse to start; its one line."""
    config = make_config(properties=props)
    storage = str(tmp_path / "s0")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "aaabus",
            "server",
            "--id",
            "0",
            "--config",
            str(config),
            "--storage",
            storage,
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    ("props", "expected"),
    [
        ({"aaabus.mqtt.bridge.out": "a/#"}, "aaabus.mqtt.bridge.address"),
        ({"aaabus.mqtt.bridge.address": "127.0.0.1:1", "aaabus.mqtt.bridge.out": "a/#/b"}, "#"),
        (
            {
                "aaabus.mqtt.bridge.address": "127.0.0.1:1",
                "aaabus.mqtt.bridge.out": "site/#",
                "aaabus.mqtt.bridge.in": "site/cmd/+",
            },
            "protocol=5",
        ),
        ({"aaabus.mqtt.bridge.address": "127.0.0.1:1"}, "neither"),
        ({"aaabus.mqtt.bridge.protocol": "4"}, "expected 3"),
        (
            {
                "aaabus.mqtt.bridge.address": "127.0.0.1:1",
                "aaabus.mqtt.bridge.in": "x",
                "aaabus.mqtt.bridge.password_file": "bridge.pw",
            },
            "chmod 600",
        ),
        ({"aaabus.mqtt.bridge.address": "cloud.example.net"}, "host:port"),
        (
            {
                "aaabus.mqtt.bridge.address": "127.0.0.1:1",
                "aaabus.mqtt.bridge.out": "x",
                "aaabus.mqtt.bridge.prefix_out": "site7",
            },
            "ending with /",
        ),
        (
            {
                "aaabus.mqtt.bridge.address": "127.0.0.1:1",
                "aaabus.mqtt.bridge.out": "x",
                "aaabus.mqtt.bridge.tls.ca": "absent.pem",
            },
            "aaabus.mqtt.bridge.tls.ca",
        ),
        (
            {
                "aaabus.mqtt.bridge.address": "127.0.0.1:1",
                "aaabus.mqtt.bridge.out": "x",
                "aaabus.mqtt.bridge.password_file": "absent.pw",
            },
            "No such file",
        ),
    ],
    ids=[
        "no-address",
        "bad-filter",
        "echo",
        "no-filters",
        "protocol",
        "open-password",
        "no-port",
        "prefix",
        "no-ca",
        "no-password-file",
    ],
)
def test_a_bad_bridge_configuration_is_refused_in_one_line(
    tmp_path: Path, make_config: Callable[..., Path], props: dict[str, str], expected: str
) -> None:
    password = tmp_path / "bridge.pw"
    password.write_text("secret\n")
    password.chmod(0o644)
    assert expected in run_refused(tmp_path, make_config, props)


def test_filters_meet_when_one_topic_could_match_both() -> None:
    assert filters_meet("a/#", "a/b/c") and filters_meet("+/b", "a/+")
    assert filters_meet("a", "a/#") and filters_meet("#", "x")
    assert not filters_meet("a/+", "a/b/c") and not filters_meet("a/b", "a/c")
    assert not filters_meet("a/b/c", "a/b")
