"""MQTT shared subscriptions, ``$share/{group}/{filter}`` (issue 32.1): each message to one member
of the group, in order per publisher, handed to another member when its receiver disconnects
without acknowledging. Against real server processes, with paho-mqtt (3.1.1 and 5.0), raw
sockets for what a library would not do, and member processes SIGKILLed."""

from __future__ import annotations

import collections
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.mqtt import (
    Device,
    Device5,
    RawDevice,
    RawDevice5,
    connect_packet,
    needs_tools,
    subscribe_packet,
)
from tests.support.topics import wait_until

# Real server processes and client processes: not in the fast lane.
pytestmark = pytest.mark.slow

MEMBER = str(REPO_ROOT / "tests" / "support" / "share_member.py")


@pytest.fixture
def mqtt_bus(
    tmp_path: Path, make_config: Callable[..., Path]
) -> Iterator[Callable[..., tuple[int, Bus]]]:
    """``start(properties) -> (port, bus)``: a one-server bus with an MQTT listener."""
    buses: list[Bus] = []

    def start(properties: dict[str, str] | None = None) -> tuple[int, Bus]:
        (port,) = free_ports(1)
        props = {"aaabus.mqtt.port": str(port), "aaabus.mqtt.anonymous": "true"}
        config = make_config(properties={**props, **(properties or {})})
        bus = Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT).start()
        buses.append(bus)
        return port, bus

    try:
        yield start
    finally:
        for bus in buses:
            bus.stop()


def collected(devices: dict[str, Device], got: dict[str, list[tuple[str, str]]]) -> int:
    """Move what each device received so far into ``got`` (by device name, (topic, payload
    text) in arrival order); how many ``got`` holds in all."""
    for name, device in devices.items():
        while True:
            try:
                topic, payload, _qos, _retained = device.inbox.get_nowait()
            except queue.Empty:
                break
            got[name].append((topic, payload.decode()))
    return sum(len(messages) for messages in got.values())


def check_shares(got: dict[str, list[tuple[str, str]]], sent: dict[str, int]) -> None:
    """Every message of ``sent`` (publisher -> count, payloads ``publisher i``) reached exactly
    one member of ``got`` (member -> (topic, payload) in arrival order), and each member
    received each publisher's messages in their order."""
    seen: collections.Counter[str] = collections.Counter()
    for member, messages in got.items():
        last: dict[str, int] = {}
        for _topic, payload in messages:
            publisher, i = payload.split()
            assert int(i) > last.get(publisher, -1), f"{member}: {payload} after {last}"
            last[publisher] = int(i)
            seen[payload] += 1
    expected = {f"{p} {i}" for p, n in sent.items() for i in range(n)}
    assert set(seen) == expected, (len(expected - set(seen)), sorted(set(seen) - expected)[:5])
    assert [m for m, n in seen.items() if n > 1] == []


def test_members_share_the_messages_each_publisher_to_one_member_in_order(
    mqtt_bus: Callable[..., tuple[int, Bus]],
) -> None:
    """3 members (MQTT 3.1.1, as Mosquitto accepts $share from 3.1.1 devices), 3 publishers:
    disjoint shares whose union is everything, each publisher's order kept, a publisher per
    member (a new publisher goes to the member with the fewest); an ordinary subscription to
    the same filter still receives everything."""
    port, _bus = mqtt_bus()
    members = {f"m{k}": Device(port, f"m{k}") for k in range(3)}
    plain = Device(port, "plain")
    publishers = [Device(port, f"p{k}") for k in range(3)]
    try:
        for member in members.values():
            member.connect()
            member.subscribe("$share/workers/jobs/#", 2)
        plain.connect()
        plain.subscribe("jobs/#", 1)
        for publisher in publishers:
            publisher.connect()
        sent = 40

        def publish_all(k: int) -> None:
            for i in range(sent):
                publishers[k].publish(f"jobs/{i % 2}", f"p{k} {i}".encode(), 1)

        threads = [threading.Thread(target=publish_all, args=(k,)) for k in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        got: dict[str, list[tuple[str, str]]] = {name: [] for name in members}
        wait_until("every message at a member", lambda: collected(members, got) >= 3 * sent)
        assert len(plain.receive(3 * sent)) == 3 * sent
        check_shares(got, {f"p{k}": sent for k in range(3)})
        owners = [{p.split()[0] for _t, p in v} for v in got.values()]
        assert sorted(len(o) for o in owners) == [1, 1, 1], owners  # one publisher each
        # Nothing more comes (no copy to a second member): one last message per publisher
        # arrives after everything its publisher sent, at its member.
        for k, publisher in enumerate(publishers):
            publisher.publish("jobs/end", f"p{k} {sent}".encode(), 1)
        wait_until("the last messages", lambda: collected(members, got) >= 3 * sent + 3)
        check_shares(got, {f"p{k}": sent + 1 for k in range(3)})
    finally:
        for device in (*members.values(), plain, *publishers):
            device.close()


def test_a_member_that_leaves_unacknowledged_hands_its_messages_to_another(
    mqtt_bus: Callable[..., tuple[int, Bus]],
) -> None:
    """A member whose socket reads nothing (QoS 1, its messages sent and never acknowledged)
    dies: every message it had reaches the other member, in order."""
    port, _bus = mqtt_bus()
    dead = RawDevice(port, rcvbuf=4096)
    other = Device(port, "other")
    publisher = Device(port, "pub")
    try:
        dead.send(connect_packet("dead", flags=0x02))
        assert dead.packet()[0] == 0x20  # CONNACK
        dead.send(subscribe_packet(["$share/g/orders"], qos=1))
        assert dead.packet()[0] == 0x90  # SUBACK
        publisher.connect()
        publisher.publish("orders", b"pub 0", 1)  # assigns the publisher to the only member
        first, body = dead.packet()
        assert first & 0xF0 == 0x30 and body.endswith(b"pub 0")  # received, not acknowledged
        other.connect()
        other.subscribe("$share/g/orders", 1)
        for i in range(1, 30):
            publisher.publish("orders", f"pub {i}".encode(), 1)
        dead.sock.close()  # the connection ends without a PUBACK
        got = other.receive(30)
        assert [p for _t, p, _q, _r in got] == [f"pub {i}".encode() for i in range(30)]
    finally:
        other.close()
        publisher.close()


def test_a_qos2_member_keeps_what_it_pubrecd_and_the_rest_goes_to_another(
    mqtt_bus: Callable[..., tuple[int, Bus]],
) -> None:
    """MQTT 5.0, QoS 2: the member PUBRECs the first 3 messages (the server answers PUBREL:
    they are its own now), then its connection dies. The other member receives the other 7,
    in order, and never the 3."""
    port, _bus = mqtt_bus()
    dead = RawDevice5(port)
    other = Device5(port, "other")
    publisher = Device5(port, "pub")
    try:
        assert dead.connect("dead").code == 0
        dead.send(mc.Subscribe(1, [("$share/g/pay", 2)]))
        assert dead.until(mc.SubAck).codes == [2]
        publisher.connect()
        for i in range(10):
            publisher.publish("pay", f"pub {i}".encode(), 2)
        publishes = [dead.until(mc.Publish) for _ in range(10)]
        assert [p.payload for p in publishes] == [f"pub {i}".encode() for i in range(10)]
        for p in publishes[:3]:
            dead.send(mc.Ack(mq.PUBREC, p.packet_id or 0))
        released = [dead.until(mc.Ack) for _ in range(3)]
        assert [(a.kind, a.packet_id) for a in released] == [
            (mq.PUBREL, p.packet_id) for p in publishes[:3]
        ]
        other.connect()
        other.subscribe("$share/g/pay", 2)
        dead.close()
        got = other.receive(7)
        assert [p for _t, p, _q, _r in got] == [f"pub {i}".encode() for i in range(3, 10)]
        publisher.publish("pay", b"pub 10", 2)
        assert other.receive(1)[0][1] == b"pub 10"  # nothing else came before it
    finally:
        other.close()
        publisher.close()


def test_a_group_keeps_messages_while_no_member_is_connected(
    mqtt_bus: Callable[..., tuple[int, Bus]],
) -> None:
    port, _bus = mqtt_bus()
    member = Device(port, "member", clean=False)
    publisher = Device(port, "pub")
    try:
        member.connect()
        member.subscribe("$share/g/logs/+", 1)
        member.close()  # the session stays, its device gone
        publisher.connect()
        for i in range(10):
            publisher.publish(f"logs/{i % 3}", f"pub {i}".encode(), 1)
        member = Device(port, "member", clean=False)
        assert member.connect() == (0, True)
        assert [p for _t, p, _q, _r in member.receive(10)] == [
            f"pub {i}".encode() for i in range(10)
        ]
    finally:
        member.close()
        publisher.close()


def test_after_a_crash_the_dead_connections_messages_go_to_a_member_that_connects(
    mqtt_bus: Callable[..., tuple[int, Bus]],
) -> None:
    """The server is SIGKILLed while a member holds unacknowledged messages: at boot its
    connection is gone, and they go to the first member that connects, in order."""
    port, bus = mqtt_bus()
    dead = RawDevice(port, rcvbuf=4096)
    member = Device(port, "member", clean=False)
    publisher = Device(port, "pub")
    try:
        dead.send(connect_packet("dead", flags=0x00))  # a persistent session
        assert dead.packet()[0] == 0x20
        dead.send(subscribe_packet(["$share/g/crash/+"], qos=1))
        assert dead.packet()[0] == 0x90
        member.connect()
        member.subscribe("$share/g/crash/+", 1)
        member.close()  # away: the publisher goes to the connected member, "dead"
        publisher.connect()
        for i in range(10):
            publisher.publish(f"crash/{i % 2}", f"pub {i}".encode(), 1)
        bus[0].kill()  # "dead" holds them, unacknowledged
        bus[0].start().wait_ready(30)
        member = Device(port, "member", clean=False)
        assert member.connect() == (0, True)
        assert [p for _t, p, _q, _r in member.receive(10)] == [
            f"pub {i}".encode() for i in range(10)
        ]
    finally:
        dead.sock.close()
        member.close()
        publisher.close()


def test_malformed_shared_filters_are_refused_alone(
    mqtt_bus: Callable[..., tuple[int, Bus]],
) -> None:
    """3.1.1 knows no $share: a malformed one gets SUBACK 0x80, the other filters of the
    SUBSCRIBE are granted. 5.0 refuses the SUBSCRIBE (0x8F), and no-local on a shared
    subscription is a protocol error (0x82), as the spec says."""
    port, _bus = mqtt_bus()
    raw = RawDevice(port)
    raw.send(connect_packet("raw"))
    assert raw.packet()[0] == 0x20
    raw.send(subscribe_packet(["$share/+/a", "$share//a", "$share/g", "ok", "$share/g/ok"], 1))
    first, body = raw.packet()
    assert first == 0x90 and body[2:] == bytes([0x80, 0x80, 0x80, 1, 1])
    for options, code in ((0x04 | 1, mq.PROTOCOL_ERROR),):
        raw5 = RawDevice5(port)
        assert raw5.connect("raw5").code == 0
        raw5.send(mc.Subscribe(1, [("$share/g/a", options)]))
        assert raw5.until(mc.Disconnect).code == code
        raw5.close()
    raw5 = RawDevice5(port)
    assert raw5.connect("raw5b").code == 0
    raw5.sock.sendall(subscribe_packet5("$share/g+/a"))
    assert raw5.until(mc.Disconnect).code == mq.TOPIC_FILTER_INVALID
    raw5.close()


@needs_tools
def test_mosquitto_sub_5_members_share_the_messages(
    mqtt_bus: Callable[..., tuple[int, Bus]],
) -> None:
    """Another 5.0 client: two ``mosquitto_sub -V mqttv5`` members, two publishers."""
    port, _bus = mqtt_bus()
    members: dict[str, subprocess.Popen[str]] = {}
    lines: dict[str, queue.Queue[str]] = {}
    publishers = [Device5(port, f"p{k}") for k in range(2)]

    def read(name: str) -> None:
        stdout = members[name].stdout
        assert stdout is not None
        for line in stdout:
            lines[name].put(line.rstrip("\n"))

    try:
        for name in ("ms0", "ms1"):
            lines[name] = queue.Queue()
            # stdbuf: its debug lines (the SUBACK we wait for) are block-buffered into a pipe.
            members[name] = subprocess.Popen(
                [
                    *(
                        "stdbuf",
                        "-oL",
                        "mosquitto_sub",
                        "-V",
                        "mqttv5",
                        "-h",
                        "127.0.0.1",
                        "-p",
                        str(port),
                    ),
                    *("-i", name, "-q", "2", "-t", "$share/tools/tools/#", "-v", "-d"),
                ],
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
            threading.Thread(target=read, args=(name,), daemon=True).start()
            while "SUBACK" not in lines[name].get(timeout=10):
                pass
        for publisher in publishers:
            publisher.connect()
        sent = 20
        for i in range(sent):
            for k, publisher in enumerate(publishers):
                publisher.publish(f"tools/{k}", f"p{k} {i}".encode(), 2)
        got: dict[str, list[tuple[str, str]]] = {name: [] for name in members}

        def count() -> int:
            for name, q in lines.items():
                while not q.empty():
                    line = q.get()
                    if line.startswith("tools/"):
                        topic, _, payload = line.partition(" ")
                        got[name].append((topic, payload))
            return sum(len(v) for v in got.values())

        wait_until("every message at a member", lambda: count() >= 2 * sent)
        check_shares(got, {"p0": sent, "p1": sent})
        assert all(got.values())  # a publisher each
    finally:
        for proc in members.values():
            proc.kill()
            proc.wait(10)
        for publisher in publishers:
            publisher.close()


def subscribe_packet5(topic_filter: str) -> bytes:
    """A 5.0 SUBSCRIBE built by hand (the codec refuses to encode a malformed one)."""
    raw = topic_filter.encode()
    body = (1).to_bytes(2, "big") + b"\x00" + len(raw).to_bytes(2, "big") + raw + b"\x01"
    return bytes([0x82, len(body)]) + body


class MemberProcess:
    """A member process (tests/support/share_member.py) whose lines land in :attr:`lines`."""

    def __init__(
        self, port: int, client_id: str, *args: str, topic_filter: str = "$share/acc/acc/#"
    ) -> None:
        self.client_id = client_id
        self.proc = subprocess.Popen(
            [sys.executable, MEMBER, str(port), client_id, topic_filter, *args],
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.got: list[tuple[str, str]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))

    def ready(self, timeout: float = 20.0) -> None:
        assert self.lines.get(timeout=timeout) == "ready"

    def take(self) -> int:
        """Move the lines read so far into :attr:`got`; how many it holds."""
        while True:
            try:
                line = self.lines.get_nowait()
            except queue.Empty:
                return len(self.got)
            topic, _, payload = line.partition(" ")
            self.got.append((topic, payload))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def test_acceptance_three_member_processes_one_sigkilled_halfway_qos2(
    mqtt_bus: Callable[..., tuple[int, Bus]],
) -> None:
    """Issue 32's acceptance: 3 members, 10,000 QoS 2 messages from 3 publishers, one member
    SIGKILLed halfway: every message delivered, none to two members, each publisher's order
    kept at each member.

    The member killed (m1) blocks in ``on_message`` after its 1,500th message and is killed
    then; its Receive Maximum of 1 (5.0) means the server had sent it nothing beyond that
    message, which it had PUBREC'd (paho delivers on PUBREL): it is m1's, the rest of its
    backlog goes to the others."""
    port, _bus = mqtt_bus()
    counts = {"p0": 3334, "p1": 3333, "p2": 3333}
    block = 1500
    members = [
        MemberProcess(port, "m0"),
        MemberProcess(port, "m1", "--receive-max", "1", "--block-after", str(block)),
        MemberProcess(port, "m2"),
    ]
    publishers = [Device5(port, name) for name in counts]
    started = time.monotonic()
    try:
        for member in members:
            member.ready()
        for publisher in publishers:
            publisher.client.max_inflight_messages_set(50)
            publisher.connect()

        def publish(publisher: Device5, name: str) -> None:
            infos = [
                publisher.client.publish(f"acc/{i % 4}", f"{name} {i}".encode(), 2)
                for i in range(counts[name])
            ]
            for info in infos:
                info.wait_for_publish(60)

        threads = [
            threading.Thread(target=publish, args=(p, name), daemon=True)
            for p, name in zip(publishers, counts, strict=True)
        ]
        for thread in threads:
            thread.start()
        killed = members[1]
        wait_until("m1 reached its block", lambda: killed.take() >= block, timeout=60)
        killed.proc.send_signal(signal.SIGKILL)
        killed.proc.wait(10)
        killed.take()
        total = sum(counts.values())
        wait_until(
            "every message delivered", lambda: sum(m.take() for m in members) >= total, timeout=90
        )
        for thread in threads:
            thread.join(30)
        # One more from each publisher: it comes after all that publisher's messages at its
        # member, so anything still on its way (a copy to a second member) would show.
        for publisher, name in zip(publishers, counts, strict=True):
            publisher.publish("acc/end", f"{name} {counts[name]}".encode(), 2)
        wait_until("the last messages", lambda: sum(m.take() for m in members) >= total + 3)
        assert len(killed.got) == block
        check_shares(
            {m.client_id: m.got for m in members}, {name: n + 1 for name, n in counts.items()}
        )
        shares = {
            m.client_id: collections.Counter(p.split()[0] for _t, p in m.got) for m in members
        }
        print(f"acceptance: {total} messages in {time.monotonic() - started:.1f} s: {shares}")
    finally:
        for member in members:
            member.stop()
        for publisher in publishers:
            publisher.close()
