"""MQTT access control (issue 32.2): the ACL file (aaabus.mqtt.acl), its checks on PUBLISH,
SUBSCRIBE and will topics against a real server process, client-id ownership, and the
listener's own ``$SYS`` topics."""

from __future__ import annotations

import itertools
import queue
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.enums import CallbackAPIVersion

from aaabus import Client
from aaabus.errors import ConfigError
from aaabus.model.topicnames import matches
from aaabus.mqtt.acl import Acl, covers, overlaps
from aaabus.mqtt.auth import hash_password
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.mqtt import (
    Device,
    RawDevice,
    connect_packet,
    needs_tools,
    subscribe_packet,
    tool,
    varint,
)
from tests.support.topics import wait_until

# -- the rules, in process ----------------------------------------------------------------------

LEVELS = ["a", "b", "$s"]
#: Topic levels of the brute force: the filters' literals and one none of them names (``z``
#: stands for every other level), plus the empty level.
NAME_LEVELS = [*LEVELS, "z", ""]


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.sampled_from([*LEVELS, "", "+"]), min_size=0, max_size=3))
    if not levels or draw(st.booleans()):
        levels.append("#")
    return "/".join(levels) or "+"  # a filter of one empty level is no filter


def _names(depth: int) -> list[str]:
    out = []
    for n in range(1, depth + 1):
        for levels in itertools.product(NAME_LEVELS, repeat=n):
            name = "/".join(levels)
            if name:
                out.append(name)
    return out


#: Every name up to one level deeper than the longest filter: enough to tell `#` from `+`.
NAMES = _names(5)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(grant=filters(), wanted=filters())
def test_covers_is_every_name_the_filter_matches_matched_by_the_grant(
    grant: str, wanted: str
) -> None:
    brute = all(matches(grant, name) for name in NAMES if matches(wanted, name))
    assert covers(grant, wanted) == brute, (grant, wanted)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(first=filters(), second=filters())
def test_overlaps_is_some_name_matched_by_both(first: str, second: str) -> None:
    brute = any(matches(first, name) and matches(second, name) for name in NAMES)
    assert overlaps(first, second) == brute, (first, second)
    assert overlaps(second, first) == brute


@pytest.mark.parametrize(
    ("grant", "wanted", "expected"),
    [
        ("sensors/#", "sensors/+/t", True),
        ("sensors/#", "sensors", True),
        ("sensors/#", "#", False),
        ("#", "#", True),
        ("#", "$SYS/#", False),  # MQTT 4.7.2: # does not match $ names
        ("+/x", "+/x", True),
        ("$SYS/#", "$SYS/aaabus/0/uptime_s", True),
        ("a/+", "a/#", False),
    ],
)
def test_covers_examples(grant: str, wanted: str, expected: bool) -> None:
    assert covers(grant, wanted) is expected


ACL = """\
# anonymous devices: public only
topic read public/#

user alice
topic readwrite alice/#
topic deny alice/secret
topic read sensors/#
user bob
topic write bob/out
pattern read devices/%u/in/#
pattern write devices/%c/out
pattern deny %u/private/#
"""


def test_users_patterns_and_anonymous_devices() -> None:
    acl = Acl.parse(ACL)
    assert acl.may_publish("alice", "c1", "alice/x")
    assert not acl.may_publish("alice", "c1", "alice/secret")  # deny wins
    assert not acl.may_publish("alice", "c1", "sensors/t")  # read only
    assert acl.may_subscribe("alice", "c1", "sensors/+/t")
    assert not acl.may_subscribe("alice", "c1", "#")
    assert not acl.may_subscribe("alice", "c1", "alice/#")  # overlaps alice/secret
    assert not acl.may_subscribe("alice", "c1", "alice/+/x")  # reaches alice/private/x
    assert acl.may_subscribe("alice", "c1", "alice/x/+")  # reaches neither deny
    assert acl.may_publish("bob", "c2", "bob/out")
    assert not acl.may_publish("carol", "c3", "bob/out")
    # Patterns apply to everybody, with %u and %c.
    assert acl.may_subscribe("bob", "c2", "devices/bob/in/#")
    assert not acl.may_subscribe("bob", "c2", "devices/alice/in/#")
    assert acl.may_publish("carol", "dev7", "devices/dev7/out")
    assert not acl.may_publish("carol", "dev7", "devices/dev8/out")
    # Anonymous: the lines before any `user`, and the patterns without %u.
    assert acl.may_subscribe(None, "x", "public/#")
    assert not acl.may_subscribe("alice", "c1", "public/#")
    assert acl.may_publish(None, "anon1", "devices/anon1/out")
    assert not acl.may_subscribe(None, "x", "devices/+/in/#")


def test_a_substituted_value_that_changes_the_filter_fails_closed() -> None:
    acl = Acl.parse(ACL)
    # %c with a / would reach another device's topic: grants nothing...
    assert not acl.may_publish("carol", "dev7/x", "devices/dev7/x/out")
    # ...and a deny line so substituted denies everything to that device.
    assert acl.may_publish("alice", "c1", "alice/x")
    assert not acl.may_publish("al/ice", "c1", "devices/c1/out")
    assert not acl.may_publish("al+", "c1", "devices/c1/out")


def test_the_write_decision_is_cached_per_device_and_topic() -> None:
    acl = Acl.parse("user u\ntopic write t/#\n")
    assert acl.may_publish("u", "c", "t/1")
    principal = acl._principal("u", "c")
    assert principal.written == {"t/1": True}
    assert acl._principal("u", "other") is principal  # no %c: one per user


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("user a\ntopic rw a/#\n", 2, "unknown access 'rw'"),
        ("user a\n\ntopic read a/#b\n", 3, "wildcard"),
        ("topic read a/%u\n", 1, "pattern"),
        ("user\n", 1, "user NAME"),
        ("users a\n", 1, "unknown keyword"),
        ("pattern deny\n", 1, "without a topic filter"),
        ("# ok\ntopic read a/#/b\n", 2, "last level"),
    ],
)
def test_a_bad_line_is_refused_naming_file_and_line(text: str, line: int, words: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Acl.parse(text, "acl.txt")
    assert caught.value.where == f"acl.txt:{line}"
    assert "\n" not in str(caught.value)
    assert words in str(caught.value), str(caught.value)


def test_an_unreadable_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"aaabus\.mqtt\.acl"):
        Acl.load(tmp_path / "missing.acl")


# -- against a real server process -------------------------------------------------------------

SERVER_ACL = """\
user alice
topic readwrite alice/#
topic read sensors/#
topic read $SYS/aaabus/#
user bob
topic readwrite bob/#
topic readwrite sensors/#
user mallory
topic read #
topic write mallory/#
"""
USERS = {"alice": "pa", "bob": "pb", "mallory": "pm"}
NOT_AUTHORIZED = 0x87  # paho reports 3.1.1's CONNACK 0x05 as its 5.0 equivalent


class AclServer:
    def __init__(self, port: int, bus: Bus, config: Path) -> None:
        self.port, self.bus, self.config = port, bus, config
        self._client = Client(config, 0)

    def mqtt(self) -> dict[str, Any]:
        figures: dict[str, Any] = self._client.status()["mqtt"]
        return figures

    def device(self, client_id: str, user: str | None = None, **kwargs: Any) -> Device:
        password = USERS.get(user) if user is not None else None
        return Device(self.port, client_id, user=user, password=password, **kwargs)

    def raw(self, client_id: str, user: str, version: int = 4) -> RawDevice:
        """A bare-socket device connected as ``user`` (asserts the CONNACK's success)."""
        device, code = self.raw_connect(client_id, user, version)
        assert code == 0, code
        return device

    def raw_connect(
        self, client_id: str, user: str, version: int, will: str | None = None, clean: bool = True
    ) -> tuple[RawDevice, int]:
        """A bare-socket CONNECT as ``user`` (``will``: a QoS 1 will on that topic); the
        device and its CONNACK's code (3.1.1) or reason (5.0)."""
        device = RawDevice(self.port)
        flags = 0xC0 | (0x02 if clean else 0)
        extra = b""
        if will is not None:
            flags |= 0x04 | 0x08
            extra = (b"\x00" if version == 5 else b"") + _text(will) + _text("gone")
        extra += _text(user) + _text(USERS[user])
        props = b"\x00" if version == 5 else b""
        device.send(connect_packet(client_id, level=version, flags=flags, extra=extra, props=props))
        first, body = device.packet()
        assert first == 0x20, first
        return device, body[1]

    def close(self) -> None:
        self._client.close()


def _text(value: str) -> bytes:
    raw = value.encode()
    return len(raw).to_bytes(2, "big") + raw


@pytest.fixture
def acl_server(
    tmp_path: Path, make_config: Callable[..., Path]
) -> Iterator[Callable[..., AclServer]]:
    started: list[AclServer] = []

    def start(acl: str | None = SERVER_ACL, users: bool = True) -> AclServer:
        (port,) = free_ports(1)
        props = {"aaabus.mqtt.port": str(port), "aaabus.mqtt.sys_interval_s": "1"}
        if users:
            lines = "".join(f"{u}:{hash_password(pw)}\n" for u, pw in USERS.items())
            (tmp_path / "mqtt.passwd").write_text(lines)
            props["aaabus.mqtt.credentials"] = "mqtt.passwd"
        else:
            props["aaabus.mqtt.anonymous"] = "true"
        if acl is not None:
            (tmp_path / "mqtt.acl").write_text(acl)
            props["aaabus.mqtt.acl"] = "mqtt.acl"
        config = make_config(properties=props)
        bus = Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT).start()
        server = AclServer(port, bus, config)
        started.append(server)
        return server

    try:
        yield start
    finally:
        for each in started:
            each.close()
            each.bus.stop()


@pytest.mark.slow
def test_a_denied_publish_is_dropped_and_still_acknowledged_in_311(
    acl_server: Callable[..., AclServer],
) -> None:
    server = acl_server()
    bob = server.device("bob-1", "bob")
    assert bob.connect() == (0, False)
    bob.subscribe("bob/#", 1)
    bob.subscribe("sensors/#", 1)
    alice = server.device("alice-1", "alice")
    assert alice.connect() == (0, False)
    # Each is acknowledged (paho's wait would time out otherwise), none is published.
    for qos in (0, 1, 2):
        alice.publish("bob/x", f"denied {qos}".encode(), qos)
        alice.publish("sensors/t", f"read only {qos}".encode(), qos)
    alice.publish("$SYS/aaabus/0/connected", b"forged", 1)
    # The connection goes on: what it may publish still goes through, after nothing else.
    alice.publish("alice/ok", b"fine", 1)
    assert bob.nothing_before("bob/marker")
    assert server.mqtt()["refused"] >= 7
    bob.close()
    alice.close()


@pytest.mark.slow
def test_a_denied_filter_gets_0x80_while_the_others_of_its_subscribe_are_granted(
    acl_server: Callable[..., AclServer],
) -> None:
    server = acl_server()
    bob = server.device("bob-1", "bob")
    assert bob.connect() == (0, False)
    bob.publish("sensors/a/t", b"retained", 1, retain=True)
    bob.publish("bob/private", b"bob's", 1, retain=True)
    alice = server.raw("alice-raw", "alice")
    filters = [
        "alice/#",
        "#",
        "sensors/+/t",
        "bob/#",
        "$SYS/#",
        "$share/g/bob/#",
        "$share/g/alice/x",
    ]
    alice.send(subscribe_packet(filters, 1, pid=9))
    first, body = alice.packet()
    assert first == 0x90 and body[:2] == b"\x00\x09"
    # A shared subscription is checked on its filter.
    assert list(body[2:]) == [1, 0x80, 1, 0x80, 0x80, 0x80, 1]
    # The retained message of the granted filter arrives; bob's (denied filter) does not.
    first, body = alice.packet()
    assert first >> 4 == 3 and b"sensors/a/t" in body and body.endswith(b"retained")
    sender = server.device("alice-2", "alice")
    assert sender.connect() == (0, False)
    sender.publish("bob/x", b"denied", 1)
    sender.publish("alice/x", b"after", 1)
    first, body = alice.packet()
    assert first >> 4 == 3 and body.endswith(b"after"), body
    for device in (alice, bob, sender):
        device.close()


@pytest.mark.slow
def test_a_denied_will_topic_refuses_the_connect_and_stores_nothing(
    acl_server: Callable[..., AclServer],
) -> None:
    server = acl_server()
    watcher = server.device("mallory-1", "mallory")
    assert watcher.connect() == (0, False)
    watcher.subscribe("bob/#", 1)
    stored = server.mqtt()["sessions_stored"]
    intruder = server.device("alice-w", "alice", clean=False, will=("bob/will", b"x", 1))
    assert intruder.connect()[0] == NOT_AUTHORIZED
    intruder.client.loop_stop()
    assert server.mqtt()["sessions_stored"] == stored
    honest = server.device("alice-w", "alice", clean=False, will=("alice/will", b"x", 1))
    assert honest.connect() == (0, False)
    bob = server.device("bob-m", "bob")
    assert bob.connect() == (0, False)
    assert watcher.nothing_before("bob/marker", via=bob)
    for device in (honest, watcher, bob):
        device.close()


@pytest.mark.slow
def test_another_user_cannot_take_a_client_id_its_session_or_its_will(
    acl_server: Callable[..., AclServer],
) -> None:
    server = acl_server()
    watcher = server.device("mallory-1", "mallory")
    assert watcher.connect() == (0, False)
    watcher.subscribe("alice/will", 1)
    victim = server.device("dev-1", "alice", clean=False, will=("alice/will", b"victim died", 1))
    assert victim.connect() == (0, False)
    victim.subscribe("alice/in", 1)
    # Connected: the attacker is refused, the victim's connection goes on, no will.
    attacker = server.device("dev-1", "bob", clean=False)
    assert attacker.connect()[0] == NOT_AUTHORIZED
    attacker.client.loop_stop()
    sender = server.device("alice-2", "alice")
    assert sender.connect() == (0, False)
    sender.publish("alice/in", b"live", 1)
    assert victim.receive(1)[0][:2] == ("alice/in", b"live")
    # Away with a backlog: refused again (a clean CONNECT would have dropped the session).
    victim.close()
    for i in range(3):
        sender.publish("alice/in", f"queued {i}".encode(), 1)
    for clean in (True, False):
        attacker = server.device("dev-1", "bob", clean=clean)
        assert attacker.connect()[0] == NOT_AUTHORIZED
        attacker.client.loop_stop()
    back = server.device("dev-1", "alice", clean=False)
    assert back.connect() == (0, True)
    assert [m[1] for m in back.receive(3)] == [b"queued 0", b"queued 1", b"queued 2"]
    assert watcher.nothing_before("alice/will", via=sender)
    for device in (back, sender, watcher):
        device.close()


@pytest.mark.slow
def test_anonymous_and_named_devices_do_not_take_each_others_ids(
    acl_server: Callable[..., AclServer],
) -> None:
    server = acl_server(acl=None, users=False)  # names are not verified, but still owners
    named = server.device("named-1", "alice", clean=False)
    assert named.connect() == (0, False)
    anonymous = server.device("anon-1", clean=False)
    assert anonymous.connect() == (0, False)
    for cid, user in (("named-1", None), ("anon-1", "alice")):
        thief = server.device(cid, user)
        assert thief.connect()[0] == NOT_AUTHORIZED
        thief.client.loop_stop()
    # The same user takes its own id over, as MQTT says.
    again = server.device("named-1", "alice", clean=False)
    assert again.connect() == (0, True)
    for device in (again, anonymous):
        device.close()


@pytest.mark.slow
def test_a_stored_subscription_the_new_acl_no_longer_grants_is_dropped_at_reconnection(
    tmp_path: Path, acl_server: Callable[..., AclServer]
) -> None:
    server = acl_server()
    alice = server.device("alice-p", "alice", clean=False)
    assert alice.connect() == (0, False)
    alice.subscribe("sensors/#", 1)
    alice.subscribe("alice/#", 1)
    alice.subscribe("$SYS/aaabus/0/uptime_s", 0)
    alice.receive(1)  # the $SYS value at once
    alice.close()
    server.close()
    server.bus.stop()
    # The operator withdraws alice's read grant on sensors/# and restarts the server.
    (tmp_path / "mqtt.acl").write_text(SERVER_ACL.replace("topic read sensors/#\n", "", 1))
    server.bus = Bus(server.config, [0], tmp_path / "store", cwd=REPO_ROOT).start()
    server._client = Client(server.config, 0)
    alice = server.device("alice-p", "alice", clean=False)
    assert alice.connect() == (0, True)
    assert alice.receive(1)[0][0] == "$SYS/aaabus/0/uptime_s"  # $SYS comes back at once
    bob = server.device("bob-1", "bob")
    assert bob.connect() == (0, False)
    bob.publish("sensors/t", b"no longer alice's", 1)
    sender = server.device("alice-2", "alice")
    assert sender.connect() == (0, False)
    sender.publish("alice/marker", b"marker", 1)
    seen: list[str] = []
    while not seen or seen[-1] != "alice/marker":
        seen.append(alice.receive(1)[0][0])
    assert set(seen) <= {"alice/marker", "$SYS/aaabus/0/uptime_s"}, seen  # $SYS: each second
    for device in (alice, bob, sender):
        device.close()


@pytest.mark.slow
def test_sys_topics_only_where_the_acl_grants_them(
    acl_server: Callable[..., AclServer],
) -> None:
    server = acl_server()
    alice = server.device("alice-sys", "alice")
    assert alice.connect() == (0, False)
    alice.subscribe("$SYS/aaabus/0/#", 0)
    # At once, the current values (retain set); then every sys_interval_s (1 s here).
    first = {m[0]: m for m in alice.receive(8, timeout=5)}
    assert first["$SYS/aaabus/0/connected"][1:] == (b"1", 0, True)
    mallory = server.device("mallory-1", "mallory")
    assert mallory.connect() == (0, False)
    mallory.subscribe("#", 0)  # granted, but # never matches a $ topic
    bob = server.device("bob-1", "bob")
    assert bob.connect() == (0, False)
    for user in ("mallory", "bob"):  # mallory's `#` does not cover $SYS; bob has no grant
        raw = server.raw(f"{user}-raw", user)
        raw.send(subscribe_packet(["$SYS/#"], 0, pid=2))
        assert raw.packet() == (0x90, b"\x00\x02\x80")
        raw.close()

    def periodic() -> bool:
        topic, payload, _qos, retained = alice.inbox.get(timeout=5)
        return topic == "$SYS/aaabus/0/connected" and not retained and payload == b"3"

    wait_until("a periodic $SYS round counting 3 devices", periodic)
    assert mallory.nothing_before("bob/marker", via=bob)
    for device in (alice, mallory, bob):
        device.close()


@pytest.mark.slow
def test_a_bad_acl_line_stops_the_server_and_the_check_naming_file_and_line(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    (tmp_path / "mqtt.acl").write_text("user a\ntopic read a/#\ntopic rw b/#\n")
    (port,) = free_ports(1)
    config = make_config(
        properties={
            "aaabus.mqtt.port": str(port),
            "aaabus.mqtt.anonymous": "true",
            "aaabus.mqtt.acl": "mqtt.acl",
        }
    )
    where = f"{tmp_path / 'mqtt.acl'}:3"
    for command in (
        ["aaabus-server", "--id", "0", "--config", str(config), "--storage", str(tmp_path / "s")],
        ["aaabus", "check", str(config)],
    ):
        done = subprocess.run(
            [str(Path(sys.executable).parent / command[0]), *command[1:]],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO_ROOT,
        )
        assert done.returncode != 0
        lines = done.stderr.strip().splitlines()
        assert lines[-1].startswith(command[0]), lines
        assert f": error: {where}: unknown access 'rw'" in lines[-1], lines


# -- MQTT 5.0: the same checks, told with reason codes ---------------------------------------------


def _publish5(topic: str, payload: bytes, qos: int, pid: int) -> bytes:
    body = _text(topic) + (pid.to_bytes(2, "big") if qos else b"") + b"\x00" + payload
    return bytes([0x30 | qos << 1]) + varint(len(body)) + body


def _subscribe5(filters: list[str], pid: int) -> bytes:
    body = pid.to_bytes(2, "big") + b"\x00"
    for topic_filter in filters:
        body += _text(topic_filter) + b"\x01"
    return bytes([0x82]) + varint(len(body)) + body


@pytest.mark.slow
def test_50_denied_publish_subscribe_will_and_client_id_get_0x87(
    acl_server: Callable[..., AclServer],
) -> None:
    server = acl_server()
    bob = server.device("bob-1", "bob")
    assert bob.connect() == (0, False)
    bob.subscribe("bob/#", 1)
    alice = server.raw("alice-5", "alice", version=5)
    # PUBLISH: PUBACK / PUBREC with 0x87, nothing published; the allowed one goes on.
    alice.send(_publish5("bob/x", b"denied", 1, pid=3))
    assert alice.packet() == (0x40, b"\x00\x03\x87")
    alice.send(_publish5("bob/x", b"denied", 2, pid=4))
    assert alice.packet() == (0x50, b"\x00\x04\x87")
    alice.send(_publish5("$SYS/aaabus/0/connected", b"forged", 1, pid=5))
    assert alice.packet() == (0x40, b"\x00\x05\x87")
    alice.send(_publish5("alice/ok", b"fine", 1, pid=6))
    assert alice.packet() == (0x40, b"\x00\x06\x10")  # allowed; no subscriber: 0x10
    # SUBSCRIBE: 0x87 for the denied filters, the others granted.
    alice.send(_subscribe5(["alice/#", "#", "sensors/+/t", "$SYS/#"], pid=7))
    first, body = alice.packet()
    assert first == 0x90 and body[:2] == b"\x00\x07"
    assert list(body[3:]) == [1, 0x87, 1, 0x87]  # after the empty property block
    # Will topic not the device's: CONNACK 0x87. Another user's client id: 0x87.
    refused, code = server.raw_connect("alice-w5", "alice", 5, will="bob/will", clean=False)
    assert code == 0x87
    refused.close()
    refused, code = server.raw_connect("alice-5", "bob", 5)
    assert code == 0x87
    refused.close()
    # alice's connection is untouched by the refused takeover: it still publishes.
    alice.send(_publish5("alice/ok", b"still", 1, pid=8))
    assert alice.packet() == (0x40, b"\x00\x08")  # her own alice/# matches it now
    assert bob.nothing_before("bob/marker")
    alice.close()
    bob.close()


@pytest.mark.slow
def test_50_paho_is_told_0x87_for_a_denied_publish_and_filter(
    acl_server: Callable[..., AclServer],
) -> None:
    server = acl_server()
    client = paho.Client(CallbackAPIVersion.VERSION2, "alice-paho5", protocol=paho.MQTTv5)
    client.username_pw_set("alice", USERS["alice"])
    answers: queue.Queue[tuple[str, Any]] = queue.Queue()
    client.on_connect = lambda _c, _u, _f, rc, _p: answers.put(("connack", rc.value))
    client.on_publish = lambda _c, _u, mid, rc, _p: answers.put(("puback", (mid, rc.value)))
    client.on_subscribe = lambda _c, _u, _m, rcs, _p: answers.put(
        ("suback", [rc.value for rc in rcs])
    )
    client.connect("127.0.0.1", server.port, keepalive=30)
    client.loop_start()
    try:
        assert answers.get(timeout=10) == ("connack", 0)
        denied = client.publish("bob/x", b"denied", 1)
        assert answers.get(timeout=10) == ("puback", (denied.mid, 0x87))
        client.subscribe([("alice/#", 1), ("#", 1), ("$SYS/aaabus/0/connected", 0)])
        assert answers.get(timeout=10) == ("suback", [1, 0x87, 0])
    finally:
        client.disconnect()
        client.loop_stop()


@needs_tools
@pytest.mark.slow
def test_50_mosquitto_clients_are_told_not_authorized(
    acl_server: Callable[..., AclServer],
) -> None:
    server = acl_server()

    def run(tool_name: str, user: str, *args: str) -> tuple[str, str]:
        done = tool(
            tool_name, "-V", "mqttv5", "-p", str(server.port), "-u", user, "-P", USERS[user], *args
        )
        assert done.returncode == 0, done.stderr
        return done.stdout, done.stderr

    assert "Not authorized" in run("mosquitto_pub", "alice", "-t", "bob/x", "-m", "x", "-q", "1")[1]
    sub = ("-C", "1", "-W", "5", "-v")
    assert "denied" in run("mosquitto_sub", "alice", "-t", "#", *sub)[1]
    assert "denied" in run("mosquitto_sub", "bob", "-t", "$SYS/#", *sub)[1]
    assert run("mosquitto_sub", "alice", "-t", "$SYS/aaabus/0/connected", *sub)[0] == (
        "$SYS/aaabus/0/connected 1\n"
    )


def test_the_example_of_the_docs_reads_as_it_says() -> None:
    text = (REPO_ROOT / "docs" / "mqtt.md").read_text()
    section = text[text.index("## Access control") :]
    block = section[section.index("```text\n") + 8 : section.index("```\n", 8)]
    acl = Acl.parse(block, "docs/mqtt.md")
    assert acl.may_subscribe(None, "any", "public/#")
    assert not acl.may_publish("alice", "c", "alice/secret")
    assert acl.may_subscribe("alice", "c", "$SYS/aaabus/+/connected")
    assert acl.may_publish("bob", "meter-3", "devices/meter-3/out")
