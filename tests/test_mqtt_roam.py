"""Roaming MQTT sessions (issue 32, point 3): a device's persistent session follows it to the
listeners of servers in other domains, against real server processes and paho-mqtt.

The bus: three domains joined by routers, ``D0 = {0, 1}``, ``D1 = {1, 2, 3}``, ``D2 = {3, 4}``;
MQTT listeners on 0, 2 and 4 (one per domain, the routers 1 and 3 between them) and on router 1
for the publishers that stay put; ``aaabus.mqtt.roaming`` on, the directory on server 0 (the
lowest id, the default)."""

from __future__ import annotations

import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from aaabus import Client
from aaabus.mqtt import codes as mq
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.mqtt import Device
from tests.support.topics import wait_until

# Real server processes: not in the fast lane.
pytestmark = pytest.mark.slow

LAYOUT = [[0, 1], [1, 2, 3], [3, 4]]
LISTENERS = (0, 2, 4)  # one per domain: where devices roam
PUBLISHERS = 1  # a router with a listener: publishers that never move


class RoamBus:
    """The running bus: ``port[sid]`` of each listener."""

    def __init__(self, bus: Bus, config: Path, port: dict[int, int]) -> None:
        self.bus, self.config, self.port = bus, config, port

    def mqtt(self, sid: int) -> dict[str, Any]:
        figures: dict[str, Any] = Client(self.config, sid).status()["mqtt"]
        return figures

    def knows(self, sid: int, remote_filters: int = 1, retained: int = 0) -> None:
        """Until server ``sid``'s representative knows ``remote_filters`` filters subscribed on
        other servers (and holds ``retained`` retained topics): a subscription reaches the
        other servers as a message does, so a publication made elsewhere right after a SUBACK
        may not be for it yet (the bus promises it for publications causally after it)."""

        def known() -> bool:
            topics = Client(self.config, sid).status()["topics"]
            return bool(
                topics["remote_filters"] >= remote_filters and topics["retained"] >= retained
            )

        wait_until(f"server {sid} knows the subscriptions", known)

    def restart(self, sid: int) -> None:
        """SIGKILL server ``sid`` and start it again (its store as the crash left it)."""
        self.bus[sid].kill()
        self.bus[sid].start().wait_ready(60)


@pytest.fixture
def roam_bus(tmp_path: Path, make_config: Callable[..., Path]) -> Iterator[RoamBus]:
    ports = dict(zip((*LISTENERS, PUBLISHERS), free_ports(4), strict=True))
    extra = {
        sid: f'<property name="aaabus.mqtt.port" value="{port}"/>' for sid, port in ports.items()
    }
    config = make_config(
        layout=LAYOUT,
        extra=extra,
        properties={
            "aaabus.mqtt.anonymous": "true",
            "aaabus.mqtt.roaming": "true",
            "aaabus.mqtt.connect_ms": "3000",
            # Small frames: a backlog of a few dozen kilobytes moves in several parts.
            "aaabus.max_frame": "16384",
        },
    )
    bus = Bus(config, range(5), tmp_path / "store", cwd=REPO_ROOT).start()
    try:
        yield RoamBus(bus, config, ports)
    finally:
        bus.stop()


class Roamer:
    """One device: one paho client whose MQTT session state (its QoS 2 flows) is kept across
    moves, connecting where it is told and never on its own (``reconnect_on_failure`` off).
    ``version`` 5: MQTT 5.0 with a long Session Expiry Interval."""

    def __init__(self, client_id: str, *, version: int = 4, user: str | None = None) -> None:
        self.version = version
        if version == 5:
            self.client = paho.Client(
                CallbackAPIVersion.VERSION2,
                client_id=client_id,
                protocol=MQTTProtocolVersion.MQTTv5,
                reconnect_on_failure=False,
            )
        else:
            self.client = paho.Client(
                CallbackAPIVersion.VERSION2,
                client_id=client_id,
                clean_session=False,
                reconnect_on_failure=False,
            )
        if user is not None:
            self.client.username_pw_set(user, "unused")
        self.inbox: queue.Queue[bytes] = queue.Queue()
        self.connack: queue.Queue[tuple[int, bool]] = queue.Queue()
        self.disconnects: queue.Queue[int] = queue.Queue()
        self.client.on_message = lambda _c, _u, m: self.inbox.put(bytes(m.payload))
        self.client.on_connect = lambda _c, _u, flags, rc, _p: self.connack.put(
            (rc.value, flags.session_present)
        )
        self.client.on_disconnect = lambda _c, _u, _f, rc, _p: self.disconnects.put(rc.value)

    def connect_at(self, port: int, timeout: float = 15.0) -> tuple[int, bool]:
        """One CONNECT at ``port``: (reason code, session present); ConnectionError if the
        server is not listening."""
        self.client.loop_stop()  # a network thread that ended (refused, closed) or not
        if self.version == 5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 3600
            self.client.connect(
                "127.0.0.1", port, keepalive=30, clean_start=False, properties=props
            )
        else:
            self.client.connect("127.0.0.1", port, keepalive=30)
        self.client.loop_start()
        return self.connack.get(timeout=timeout)

    def move_to(self, port: int, timeout: float = 60.0) -> tuple[bool, list[int]]:
        """Connect at ``port`` until accepted, as a device does: a refusal (busy, server
        unavailable) or a server not listening (restarting) is retried. Returns session present
        and the refusal codes seen."""
        deadline = time.monotonic() + timeout
        refusals: list[int] = []
        while True:
            try:
                code, present = self.connect_at(port)
            except (OSError, queue.Empty):
                code, present = -1, False
            if code == 0:
                return present, refusals
            refusals.append(code)
            if time.monotonic() > deadline:
                raise AssertionError(f"not accepted at {port} in {timeout} s: {refusals}")
            threading.Event().wait(0.2)  # a device's back-off before it tries again

    def subscribe(self, topic_filter: str, qos: int) -> None:
        done = threading.Event()
        self.client.on_subscribe = lambda *_args: done.set()
        self.client.subscribe(topic_filter, qos)
        assert done.wait(10), "no SUBACK"

    def unsubscribe(self, topic_filter: str) -> None:
        done = threading.Event()
        self.client.on_unsubscribe = lambda *_args: done.set()
        self.client.unsubscribe(topic_filter)
        assert done.wait(10), "no UNSUBACK"

    def publish(self, topic: str, payload: bytes, qos: int) -> None:
        self.client.publish(topic, payload, qos).wait_for_publish(10)

    def leave(self) -> None:
        """DISCONNECT: the session stays, and what is published meanwhile waits for it."""
        self.client.disconnect()
        self.client.loop_stop()

    def receive(self, count: int, timeout: float = 30.0) -> list[bytes]:
        deadline = time.monotonic() + timeout
        return [
            self.inbox.get(timeout=max(0.01, deadline - time.monotonic())) for _ in range(count)
        ]

    def nothing_before(self, topic: str, via: Device) -> bool:
        """Whether nothing else arrives before a marker published now on ``topic`` by ``via``
        (the bus keeps one publisher's order). At QoS 2: a QoS 1 marker may come again after a
        move, as QoS 1 allows (its acknowledgement is committed lazily)."""
        marker = f"marker {time.monotonic_ns()}".encode()
        via.publish(topic, marker, 2)
        return self.receive(1)[0] == marker


def _collect(device: Roamer, count: int, timeout: float) -> list[bytes]:
    """Up to ``count`` payloads, or what came before ``timeout``: a failure shows what is
    missing instead of an empty queue's exception."""
    deadline = time.monotonic() + timeout
    got: list[bytes] = []
    while len(got) < count:
        try:
            got.append(device.inbox.get(timeout=max(0.01, deadline - time.monotonic())))
        except queue.Empty:
            break
    return got


def numbers(prefix: str, low: int, high: int) -> list[bytes]:
    return [f"{prefix}{i}".encode() for i in range(low, high)]


def test_a_session_follows_its_device_across_domains_with_its_backlog(roam_bus: RoamBus) -> None:
    port = roam_bus.port
    device = Roamer("walker")
    pub = Device(port[PUBLISHERS], "pub-a")
    try:
        assert device.move_to(port[0]) == (False, [])
        device.subscribe("walk/#", 2)
        roam_bus.knows(PUBLISHERS)
        assert pub.connect()[0] == 0
        for i in range(10):
            pub.publish("walk/a", f"m{i}".encode(), 2)
        assert device.receive(10) == numbers("m", 0, 10)
        device.leave()
        for i in range(10, 30):  # published while the device travels
            pub.publish("walk/a", f"m{i}".encode(), 2)
        assert device.move_to(port[4]) == (True, [])  # another domain, two routers away
        assert device.receive(20) == numbers("m", 10, 30)  # the backlog, in order
        for i in range(30, 40):  # live, forwarded by the anchor (server 0)
            pub.publish("walk/a", f"m{i}".encode(), 2)
        assert device.receive(10) == numbers("m", 30, 40)
        assert device.nothing_before("walk/marker", via=pub)
        # The session left server 0: its listener holds none; server 4's does.
        assert roam_bus.mqtt(0)["sessions_stored"] == 0
        assert roam_bus.mqtt(4)["sessions_stored"] == 1
        device.leave()
        for i in range(40, 45):
            pub.publish("walk/a", f"m{i}".encode(), 2)
        # Back to the anchor's own listener, through the middle domain's.
        assert device.move_to(port[2]) == (True, [])
        assert device.receive(5) == numbers("m", 40, 45)
        device.leave()
        assert device.move_to(port[0]) == (True, [])
        for i in range(45, 50):
            pub.publish("walk/a", f"m{i}".encode(), 2)
        assert device.receive(5) == numbers("m", 45, 50)
        assert device.nothing_before("walk/marker", via=pub)
        assert roam_bus.mqtt(4)["sessions_stored"] == 0
    finally:
        device.leave()
        pub.close()


def test_a_backlog_larger_than_a_frame_moves_in_parts(roam_bus: RoamBus) -> None:
    port = roam_bus.port
    device = Roamer("hauler")
    pub = Device(port[PUBLISHERS], "pub-p")
    pad = b"." * 1000
    try:
        assert device.move_to(port[2]) == (False, [])
        device.subscribe("haul/#", 2)
        roam_bus.knows(PUBLISHERS)
        device.leave()
        assert pub.connect()[0] == 0
        for i in range(60):  # 60 kB: fifteen times a part (a quarter of aaabus.max_frame)
            pub.publish("haul/x", f"h{i}".encode() + pad, 2)
        assert device.move_to(port[0]) == (True, [])
        assert device.receive(60) == [f"h{i}".encode() + pad for i in range(60)]
        assert device.nothing_before("haul/marker", via=pub)
    finally:
        device.leave()
        pub.close()


def test_subscriptions_changed_away_from_the_anchor_are_made_there(roam_bus: RoamBus) -> None:
    port = roam_bus.port
    device = Roamer("nomad")
    pub = Device(port[PUBLISHERS], "pub-s")
    try:
        assert device.move_to(port[0]) == (False, [])  # anchored at 0
        device.subscribe("old/#", 2)
        device.leave()
        assert device.move_to(port[4]) == (True, [])
        assert pub.connect()[0] == 0
        pub.publish("new/keep", b"retained", 2, retain=True)
        roam_bus.knows(0, remote_filters=0, retained=1)  # the anchor has the retained copy
        device.subscribe("new/#", 2)  # at 4: the anchor's mailbox subscribes
        roam_bus.knows(PUBLISHERS, 2)
        assert device.receive(1) == [b"retained"]  # the retained copy, through the anchor
        device.unsubscribe("old/#")  # UNSUBACK: nothing more for it, even on its way
        pub.publish("old/x", b"not owed", 2)
        pub.publish("new/x", b"n1", 2)
        assert device.receive(1) == [b"n1"]  # "old/x" came before it: unsubscribed
        device.leave()
        pub.publish("new/x", b"n2", 2)
        assert device.move_to(port[2]) == (True, [])
        assert device.receive(1) == [b"n2"]
        assert device.nothing_before("new/marker", via=pub)
    finally:
        device.leave()
        pub.publish("new/keep", b"", 2, retain=True)
        pub.close()


def test_a_session_ended_at_its_holder_is_forgotten_by_the_bus(roam_bus: RoamBus) -> None:
    port = roam_bus.port
    device = Roamer("temp")
    pub = Device(port[PUBLISHERS], "pub-g")
    try:
        assert device.move_to(port[0]) == (False, [])
        device.subscribe("gone/#", 2)
        device.leave()
        assert device.move_to(port[4]) == (True, [])
        device.leave()
        # A clean session at its holder ends it: the holder drops it, the anchor (0) its
        # mailbox and subscriptions, the directory its entry.
        clean = Device(port[4], "temp")
        assert clean.connect() == (0, False)
        clean.close()
        assert pub.connect()[0] == 0
        pub.publish("gone/x", b"nobody's", 2)

        def created_anew() -> bool:
            fresh = Roamer("temp")
            try:
                present, _codes = fresh.move_to(port[2])  # busy until the directory forgot it
            finally:
                fresh.leave()
            return not present

        wait_until("a persistent CONNECT creates a new session", created_anew)
        assert roam_bus.mqtt(0)["sessions_stored"] == 0
        assert roam_bus.mqtt(4)["sessions_stored"] == 0
    finally:
        pub.close()


def test_a_connect_elsewhere_takes_the_session_over_and_closes_the_old_connection(
    roam_bus: RoamBus,
) -> None:
    port = roam_bus.port
    old = Roamer("phone", version=5)
    new = Roamer("phone", version=5)  # the same device id, from another site
    pub = Device(port[PUBLISHERS], "pub-b")
    try:
        assert old.move_to(port[2]) == (False, [])
        old.subscribe("calls/#", 2)
        roam_bus.knows(PUBLISHERS)
        assert pub.connect()[0] == 0
        for i in range(5):
            pub.publish("calls/x", f"c{i}".encode(), 2)
        assert old.receive(5) == numbers("c", 0, 5)
        assert new.move_to(port[4]) == (True, [])
        # The old connection is closed as a takeover (5.0 DISCONNECT 0x8E).
        assert old.disconnects.get(timeout=10) == mq.SESSION_TAKEN_OVER
        for i in range(5, 15):
            pub.publish("calls/x", f"c{i}".encode(), 2)
        assert new.receive(10) == numbers("c", 5, 15)
        assert new.nothing_before("calls/marker", via=pub)
        assert old.inbox.empty()
    finally:
        old.client.loop_stop()
        new.leave()
        pub.close()


def test_what_a_device_publishes_before_and_after_a_move_arrives_in_order(
    roam_bus: RoamBus,
) -> None:
    port = roam_bus.port
    device = Roamer("sensor")
    watcher = Device(port[PUBLISHERS], "watcher", clean=False)
    try:
        assert watcher.connect()[0] == 0
        watcher.subscribe("sensor/#", 2)
        roam_bus.knows(0)
        roam_bus.knows(4)
        assert device.move_to(port[0]) == (False, [])
        for i in range(20):
            device.publish("sensor/t", f"s{i}".encode(), 2)
        device.leave()
        assert device.move_to(port[4]) == (True, [])
        for i in range(20, 40):  # at once, from the other end of the bus
            device.publish("sensor/t", f"s{i}".encode(), 2)
        got = [payload for _t, payload, _q, _r in watcher.receive(40)]
        assert got == numbers("s", 0, 40)
    finally:
        device.leave()
        watcher.close()


#: The listeners a device visits (from 0), and the moves at which the server it leaves is
#: SIGKILLed under it: 2 (a holder), 0 (the directory and the session's anchor), 4.
PATH = [2, 4, 0, 4, 2, 0, 2, 4, 0, 2]
CRASHES = {1: "after", 3: "during", 5: "after", 7: "during"}


def test_moves_with_crashes_lose_and_duplicate_nothing(roam_bus: RoamBus) -> None:
    port = roam_bus.port
    total = 150
    device = Roamer("rover")
    pub = Device(port[PUBLISHERS], "pub-d")
    failures: list[BaseException] = []
    try:
        assert device.move_to(port[0]) == (False, [])
        device.subscribe("rover/#", 2)
        roam_bus.knows(PUBLISHERS)
        assert pub.connect()[0] == 0

        def publish() -> None:
            try:
                for i in range(total):
                    pub.publish("rover/x", f"r{i}".encode(), 2)
                    threading.Event().wait(0.03)  # spread over the moves
            except BaseException as exc:  # reported by the test thread
                failures.append(exc)

        publisher = threading.Thread(target=publish, name="publisher")
        publisher.start()
        here = 0
        for move, there in enumerate(PATH):
            crash = CRASHES.get(move)
            if crash is None:
                device.leave()
            else:
                roam_bus.bus[here].kill()  # under the device, which then goes elsewhere
                if crash == "during":
                    # The move starts while the server holding the session is down: it waits
                    # in the bus's queues, the device's CONNECT is refused at its deadline.
                    code, _present = device.connect_at(port[there])
                    assert code == mq.SERVER_UNAVAILABLE, f"move {move}: {code}"
                roam_bus.bus[here].start().wait_ready(60)
            present, _codes = device.move_to(port[there])
            assert present, f"move {move}: session lost"
            here = there
        publisher.join(120)
        assert not failures, failures
        got = _collect(device, total, timeout=60)
        warnings = [
            f"s{sid}: {line}"
            for sid in range(5)
            for line in roam_bus.bus[sid].lines
            if "WARNING" in line or "ERROR" in line or "Traceback" in line
        ]
        missing = sorted(set(numbers("r", 0, total)) - set(got))
        assert got == numbers("r", 0, total), (
            f"lost, duplicated or out of order: {len(got)} received, missing {missing[:20]}, "
            f"order {got[:5]}...{got[-5:]}; server warnings: {warnings[-20:]}"
        )
        assert device.nothing_before("rover/marker", via=pub)
        wait_until("the session is held by one server", lambda: _held_by(roam_bus, here))
    finally:
        device.leave()
        pub.close()


def test_another_users_claim_is_refused_and_moves_nothing(roam_bus: RoamBus) -> None:
    port = roam_bus.port
    owner = Roamer("meter-7", user="alice")
    thief = Roamer("meter-7", user="mallory")
    pub = Device(port[PUBLISHERS], "pub-e")
    try:
        assert owner.move_to(port[0]) == (False, [])
        owner.subscribe("meter/#", 2)
        roam_bus.knows(PUBLISHERS)
        owner.leave()
        assert pub.connect()[0] == 0
        for i in range(10):
            pub.publish("meter/v", f"v{i}".encode(), 2)
        # 3.1.1 "not authorized" (0x05, which paho reports as 5.0's 0x87); its CONNECT
        # elsewhere moves nothing.
        assert thief.connect_at(port[4])[0] == mq.NOT_AUTHORIZED
        thief.client.loop_stop()
        assert thief.inbox.empty()
        assert roam_bus.mqtt(4)["sessions_stored"] == 0
        assert roam_bus.mqtt(0)["sessions_stored"] == 1
        assert owner.move_to(port[2]) == (True, [])
        assert owner.receive(10) == numbers("v", 0, 10)
        assert owner.nothing_before("meter/marker", via=pub)
    finally:
        owner.leave()
        pub.close()


def test_a_roam_request_for_a_session_mid_move_is_refused_busy_and_retried(
    roam_bus: RoamBus,
) -> None:
    port = roam_bus.port
    device = Roamer("van", version=5)
    pub = Device(port[PUBLISHERS], "pub-f")
    try:
        assert device.move_to(port[0]) == (False, [])
        device.subscribe("van/#", 2)
        roam_bus.knows(PUBLISHERS)
        device.leave()
        assert device.move_to(port[4]) == (True, [])  # held at 4, anchored at 0
        device.leave()
        assert pub.connect()[0] == 0
        for i in range(10):
            pub.publish("van/p", f"p{i}".encode(), 2)
        # The holder stops answering: a move towards 2 starts and cannot finish.
        roam_bus.bus[4].proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
        try:
            code, _present = device.connect_at(port[2])
            assert code == mq.SERVER_UNAVAILABLE  # its session did not arrive in time
            device.client.loop_stop()
            # Meanwhile, from elsewhere: that session is moving, "server busy".
            code, _present = device.connect_at(port[0])
            assert code == mq.SERVER_BUSY
            device.client.loop_stop()
        finally:
            roam_bus.bus[4].proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
        for i in range(10, 20):
            pub.publish("van/p", f"p{i}".encode(), 2)
        present, _codes = device.move_to(port[0])  # retried until the move is over
        assert present
        assert device.receive(20) == numbers("p", 0, 20)
        assert device.nothing_before("van/marker", via=pub)
        wait_until("the session is held by server 0 only", lambda: _held_by(roam_bus, 0))
    finally:
        device.leave()
        pub.close()


def _held_by(roam_bus: RoamBus, sid: int) -> bool:
    return all(
        roam_bus.mqtt(other)["sessions_stored"] == (1 if other == sid else 0) for other in LISTENERS
    )


def _until_reached(pub: Device, topic: str, got: Callable[[float], bytes | None]) -> None:
    """Publish probes on ``topic`` until one arrives: a group just made on a server receives
    only once the publisher's server knows that server's new interest (it travels as any
    subscription does); probes published before are not delivered, none comes late."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        pub.publish(topic, b"probe", 2)
        if got(0.2) == b"probe":
            return
    raise AssertionError(f"no probe on {topic} reached the group in 20 s")


def test_a_roaming_member_of_a_shared_subscription_joins_the_group_where_it_arrives(
    roam_bus: RoamBus,
) -> None:
    """Groups are a server's: the member leaves server 0's group when its session moves (what
    the group had handed it moves with its backlog) and joins server 4's, which then hands it
    what is published; server 0's group, whose only member left, is gone."""
    port = roam_bus.port
    member = Roamer("worker", version=5)
    other = Device(port[0], "stay-put")
    pub = Device(port[PUBLISHERS], "pub-j")

    def member_got(timeout: float) -> bytes | None:
        try:
            return member.inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def other_got(timeout: float) -> bytes | None:
        try:
            return other.inbox.get(timeout=timeout)[1]
        except queue.Empty:
            return None

    try:
        assert member.move_to(port[0]) == (False, [])
        member.subscribe("$share/crew/jobs/#", 2)
        assert pub.connect()[0] == 0
        _until_reached(pub, "jobs/probe", member_got)
        for i in range(5):
            pub.publish("jobs/a", f"j{i}".encode(), 2)
        assert member.receive(5) == numbers("j", 0, 5)  # the only member: all of them
        member.leave()
        assert member.move_to(port[4]) == (True, [])
        _until_reached(pub, "jobs/probe", member_got)  # 4's group, joined on arrival
        for i in range(5, 10):
            pub.publish("jobs/a", f"j{i}".encode(), 2)
        assert member.receive(5) == numbers("j", 5, 10)
        assert roam_bus.mqtt(0)["sessions_stored"] == 0
        # A member joining at 0 makes a new group there: both groups get each message.
        assert other.connect()[0] == 0
        other.subscribe("$share/crew/jobs/#", 2)
        _until_reached(pub, "jobs/probe", other_got)
        while member_got(0.5) is not None:  # the probes that reached 4's group meanwhile
            pass
        pub.publish("jobs/a", b"both", 2)
        assert member.receive(1) == [b"both"]
        assert other_got(20) == b"both"
    finally:
        member.leave()
        other.close()
        pub.close()
