"""MQTT 5.0, the messages' side (issue 32.1): message properties carried across the bus and
stripped for 3.1.1, message expiry, request/response, subscription options (no-local,
retain-as-published, retain handling, subscription identifiers) and the payload format check.

Against one bus of two real server processes in one domain, each with a listener, shared by the
module's tests (each uses its own topics and client ids), with paho-mqtt in 5.0 mode, the Debian
mosquitto tools (-V mqttv5) and raw 5.0 packets for exact reason codes; the pure functions of
aaabus.mqtt.messages below them."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from aaabus import Client
from aaabus.config.secret import ensure_secret
from aaabus.config.topology import render
from aaabus.model.pubsub import MessageProps
from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq
from aaabus.mqtt import messages as mm
from aaabus.mqtt.sessions import Delivery
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, TEST_TRUST, contiguous_free_base, free_ports
from tests.support.mqtt import Device, Device5, RawDevice5, needs_tools, tool
from tests.support.topics import wait_until

USER = [("k", "1"), ("other", "x"), ("k", "2")]  # ordered, a name repeated


class Sub5(Device5):
    """A 5.0 device that also keeps every message paho hands it (:attr:`messages`, with its
    properties) and subscribes with 5.0's options."""

    def __init__(self, port: int, client_id: str, **kwargs: Any) -> None:
        super().__init__(port, client_id, **kwargs)
        self.messages: queue.Queue[Any] = queue.Queue()
        inner: Any = self.client.on_message

        def message(client: Any, userdata: Any, msg: Any) -> None:
            inner(client, userdata, msg)
            self.messages.put(msg)  # after the inbox: next() finds it there too

        self.client.on_message = message

    def subscribe5(
        self,
        topic_filter: str,
        qos: int = 1,
        *,
        no_local: bool = False,
        as_published: bool = False,
        handling: int = 0,
        sub_id: int | None = None,
    ) -> None:
        options = SubscribeOptions(qos, no_local, as_published, handling)
        props = None
        if sub_id is not None:
            props = Properties(PacketTypes.SUBSCRIBE)
            props.SubscriptionIdentifier = sub_id
        self.client.subscribe(topic_filter, options=options, properties=props)
        self.suback.get(timeout=10)

    def next(self, timeout: float = 20.0) -> Any:
        """The next message paho received (its topic, payload, retain flag and properties)."""
        msg = self.messages.get(timeout=timeout)
        self.inbox.get_nowait()  # keep the two queues in step
        return msg

    def marked(self, via: Device, topic: str) -> list[Any]:
        """Every message received before a marker ``via`` publishes now on ``topic``."""
        marker = f"marker {time.monotonic_ns()}".encode()
        via.publish(topic, marker, 1)
        before = []
        while (msg := self.next()).payload != marker:
            before.append(msg)
        return before


def props_of(msg: Any) -> dict[str, Any]:
    """The 5.0 properties of a paho message, by paho's names."""
    got: dict[str, Any] = msg.properties.json() if msg.properties is not None else {}
    return got


def publish_props(**values: Any) -> Properties:
    props = Properties(PacketTypes.PUBLISH)
    for name, value in values.items():
        setattr(props, name, value)
    return props


class TwoServers:
    """The module's bus: servers 0 and 1 in one domain, a listener on each."""

    def __init__(self, root: Path) -> None:
        self.ports = free_ports(2)
        common = {
            "aaabus.trust": TEST_TRUST,
            "aaabus.mqtt.anonymous": "true",
        }
        text = render([[0, 1]], 2, base_port=contiguous_free_base(6), properties=common)
        for sid, port in enumerate(self.ports):
            start = text.index(f'<server id="{sid}"')
            end = text.index("</server>", start)
            xml = f'  <property name="aaabus.mqtt.port" value="{port}"/>\n  '
            text = text[:end] + xml + text[end:]
        self.config = root / "a3.xml"
        self.config.write_text(text)
        ensure_secret(root / "bus.key")
        self.bus = Bus(self.config, [0, 1], root / "store", cwd=REPO_ROOT)


@pytest.fixture(scope="module")
def bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoServers]:
    servers = TwoServers(tmp_path_factory.mktemp("mqtt5msg"))
    servers.bus.start()
    try:
        yield servers
    finally:
        servers.bus.stop()


def connected(device: Device, *more: Device) -> None:
    for d in (device, *more):
        assert d.connect()[0] == 0


def heard(pub: Device, topic: str, takers: list[Callable[[float], bytes | None]]) -> None:
    """Publish probes on ``topic`` until every taker (``take(timeout)``: a payload received, or
    None) has received one, then drain each up to the last probe: a subscription made on
    another server is in force here once its interest has crossed the bus, which nothing but
    a delivery shows. One publisher's probes arrive in order, so nothing of them is left."""
    deadline = time.monotonic() + 20
    latest: list[bytes | None] = [None] * len(takers)
    n, last = 0, b""
    while None in latest:
        assert time.monotonic() < deadline, "a subscription made on another server not in force"
        n += 1
        last = f"probe {n}".encode()
        pub.publish(topic, last, 1)
        for i, take in enumerate(takers):
            if latest[i] is None:
                latest[i] = take(0.3)
    for i, take in enumerate(takers):
        while latest[i] != last:
            latest[i] = take(max(0.01, deadline + 20 - time.monotonic()))
            assert latest[i] is not None, f"receiver {i} of the probes: no {last!r}"


def taker(device: Sub5 | Device) -> Callable[[float], bytes | None]:
    def take(timeout: float) -> bytes | None:
        try:
            if isinstance(device, Sub5):
                payload: bytes = device.next(timeout).payload
                return payload
            return device.inbox.get(timeout=timeout)[1]
        except queue.Empty:
            return None

    return take


# -- properties across the bus --------------------------------------------------------------------


@pytest.mark.slow
def test_properties_reach_5_0_subscribers_as_sent_here_and_on_another_server_not_3_1_1(
    bus: TwoServers,
) -> None:
    here, there = Sub5(bus.ports[0], "props-here"), Sub5(bus.ports[1], "props-there")
    old = Device(bus.ports[0], "props-311")
    pub = Sub5(bus.ports[0], "props-pub")
    try:
        connected(here, there, old, pub)
        for device in (here, there):
            device.subscribe5("props/#", 2)
        old.subscribe("props/#", 2)
        with Client(bus.config, 1) as client, client.subscribe("props/#", name="p") as agent:

            def from_agent(timeout: float) -> bytes | None:
                item = agent.get(timeout=timeout)
                return None if item is None else item.payload

            heard(pub, "props/probe", [taker(here), taker(there), taker(old), from_agent])
            sent = publish_props(
                PayloadFormatIndicator=1,
                ContentType="application/json",
                ResponseTopic="props/reply",
                CorrelationData=b"\x00\x01req-7",
                UserProperty=USER,
                MessageExpiryInterval=3600,
            )
            pub.publish_props("props/a", b'{"v": 1}', 1, sent)
            pub.publish("props/b", b"plain", 1)  # none: none arrive
            for device in (here, there):
                first, second = device.next(), device.next()
                got = props_of(first)
                assert (first.topic, first.payload) == ("props/a", b'{"v": 1}')
                assert got["PayloadFormatIndicator"] == 1
                assert got["ContentType"] == "application/json"
                assert got["ResponseTopic"] == "props/reply"
                assert bytes.fromhex(got["CorrelationData"]) == b"\x00\x01req-7"
                assert [tuple(p) for p in got["UserProperty"]] == USER
                assert 3590 <= got["MessageExpiryInterval"] < 3600  # what remains, rounded down
                assert (second.payload, props_of(second)) == (b"plain", {})
            # 3.1.1 receives the payload exactly: no property bytes in front of it.
            assert [(t, p) for t, p, _q, _r in old.receive(2)] == [
                ("props/a", b'{"v": 1}'),
                ("props/b", b"plain"),
            ]
            # An agent-side consumer on the other server sees them on the Publication.
            item = agent.get(timeout=10)
            assert item is not None and item.payload == b'{"v": 1}'
            assert item.origin == "props-pub"
            assert item.props is not None
            assert (item.props.content_type, item.props.user) == ("application/json", tuple(USER))
            assert item.props.correlation == b"\x00\x01req-7"
    finally:
        for device in (here, there, pub):
            device.close()
        old.close()


@pytest.mark.slow
@needs_tools
def test_mosquitto_tools_in_5_0_send_and_print_properties(bus: TwoServers) -> None:
    port0 = str(bus.ports[0])
    watcher = Sub5(bus.ports[1], "tools-watch")
    try:
        connected(watcher)
        watcher.subscribe5("tools/#", 1)
        heard(watcher, "tools/probe", [taker(watcher)])  # s1's own: in force at once
        done = tool(
            *("mosquitto_pub", "-V", "mqttv5", "-p", port0, "-q", "1", "-t", "tools/in"),
            *("-m", "hello", "-D", "PUBLISH", "user-property", "site", "north"),
            *("-D", "PUBLISH", "user-property", "site", "south"),
            *("-D", "PUBLISH", "content-type", "text/plain"),
            *("-D", "PUBLISH", "correlation-data", "c-1"),
            *("-D", "PUBLISH", "response-topic", "tools/back"),
        )
        assert done.returncode == 0, done.stderr
        msg = watcher.next()
        got = props_of(msg)
        assert msg.payload == b"hello"
        assert [tuple(p) for p in got["UserProperty"]] == [("site", "north"), ("site", "south")]
        assert (got["ContentType"], got["ResponseTopic"]) == ("text/plain", "tools/back")
        assert bytes.fromhex(got["CorrelationData"]) == b"c-1"
        # And mosquitto_sub on s0 prints what paho publishes through s1: published until the
        # tool has one (its subscription crosses the bus first), each the same message.
        sub = subprocess.Popen(
            [
                *("mosquitto_sub", "-V", "mqttv5", "-p", port0, "-q", "1", "-t", "tools/out"),
                *("-C", "1", "-W", "20", "-F", "%t|%C|%P|%R|%p"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        props = publish_props(ContentType="text/x", UserProperty=USER, ResponseTopic="tools/r")
        deadline = time.monotonic() + 20
        while sub.poll() is None and time.monotonic() < deadline:
            watcher.publish_props("tools/out", b"world", 1, props)
            with contextlib.suppress(subprocess.TimeoutExpired):
                sub.wait(0.3)
        out, err = sub.communicate(timeout=20)
        assert sub.returncode == 0, err
        assert out.strip() == "tools/out|text/x|k:1 other:x k:2|tools/r|world"
    finally:
        watcher.close()


@pytest.mark.slow
def test_gmqtt_sends_and_receives_properties_with_no_local_and_an_identifier(
    bus: TwoServers,
) -> None:
    from gmqtt import Client as GmqttClient
    from gmqtt.mqtt.constants import MQTTv50

    port = bus.ports[0]
    watcher = Sub5(port, "gm-watch")
    connected(watcher)
    watcher.subscribe5("gm/#", 1)

    async def session() -> tuple[Any, Any]:
        got: asyncio.Queue[tuple[str, bytes, dict[str, Any]]] = asyncio.Queue()
        subscribed = asyncio.Event()
        client = GmqttClient("gm-props")

        def message(_c: Any, topic: str, payload: bytes, _q: int, props: dict[str, Any]) -> int:
            got.put_nowait((topic, payload, props))
            return 0  # gmqtt's PUBACK reason code

        client.on_message = message
        client.on_subscribe = lambda *_a: subscribed.set()
        await client.connect("127.0.0.1", port, version=MQTTv50, keepalive=30)
        client.subscribe("gm/#", qos=1, no_local=True, subscription_identifier=11)
        await asyncio.wait_for(subscribed.wait(), 10)
        client.publish(
            "gm/own", b"from gmqtt", qos=1, user_property=[("who", "gmqtt")], content_type="a/b"
        )
        own = await asyncio.to_thread(watcher.next)  # published: the watcher has it
        await asyncio.to_thread(
            watcher.publish_props,
            "gm/paho",
            b"from paho",
            1,
            publish_props(UserProperty=USER, CorrelationData=b"\x07", PayloadFormatIndicator=1),
        )
        first = await asyncio.wait_for(got.get(), 10)  # its own did not come back first
        await client.disconnect()
        return own, first

    try:
        own, (topic, payload, props) = asyncio.run(session())
    finally:
        watcher.close()
    assert (own.payload, props_of(own)["ContentType"]) == (b"from gmqtt", "a/b")
    assert [tuple(p) for p in props_of(own)["UserProperty"]] == [("who", "gmqtt")]
    assert (topic, payload) == ("gm/paho", b"from paho")
    assert [tuple(p) for p in props["user_property"]] == USER
    assert props["correlation_data"] == [b"\x07"]
    assert props["payload_format_id"] == [1]
    assert props["subscription_identifier"] == [11]


# -- request / response ---------------------------------------------------------------------------


@pytest.mark.slow
def test_request_response_across_two_servers_passes_topic_and_correlation_through(
    bus: TwoServers,
) -> None:
    requester = Sub5(bus.ports[0], "rr-requester")
    responder = Sub5(bus.ports[1], "rr-responder")
    try:
        connected(requester, responder)
        requester.subscribe5("rr/reply/requester", 1)
        responder.subscribe5("rr/service", 1)
        heard(requester, "rr/service", [taker(responder)])
        heard(responder, "rr/reply/requester", [taker(requester)])
        for n in range(3):
            correlation = bytes([n, 0xFF, 0]) + b"id"
            request = publish_props(ResponseTopic="rr/reply/requester", CorrelationData=correlation)
            requester.publish_props("rr/service", f"question {n}".encode(), 1, request)
            asked = responder.next()
            got = props_of(asked)
            # The responder answers where it is told, with what it was given.
            answer = publish_props(CorrelationData=bytes.fromhex(got["CorrelationData"]))
            responder.publish_props(got["ResponseTopic"], b"answer " + asked.payload, 1, answer)
            reply = requester.next()
            assert reply.topic == "rr/reply/requester"
            assert reply.payload == f"answer question {n}".encode()
            assert bytes.fromhex(props_of(reply)["CorrelationData"]) == correlation
    finally:
        requester.close()
        responder.close()


@pytest.mark.slow
@needs_tools
def test_mosquitto_rr_gets_its_answer_from_a_paho_responder_on_another_server(
    bus: TwoServers,
) -> None:
    responder = Sub5(bus.ports[1], "rr-tool-responder")
    probe = Sub5(bus.ports[0], "rr-tool-probe")
    try:
        connected(responder, probe)
        responder.subscribe5("rrt/service", 1)
        heard(probe, "rrt/service", [taker(responder)])
        rr = subprocess.Popen(
            [
                *("mosquitto_rr", "-V", "mqttv5", "-p", str(bus.ports[0]), "-q", "1"),
                *("-t", "rrt/service", "-e", "rrt/answer", "-m", "ping", "-W", "20"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        # mosquitto_rr subscribes to its response topic, then asks; the answer must reach it
        # across the bus: the responder answers each request until the tool is done.
        deadline = time.monotonic() + 20
        while rr.poll() is None and time.monotonic() < deadline:
            try:
                asked = responder.next(0.3)
            except queue.Empty:
                continue
            got = props_of(asked)
            assert got["ResponseTopic"] == "rrt/answer"
            answer = publish_props()
            if "CorrelationData" in got:
                answer.CorrelationData = bytes.fromhex(got["CorrelationData"])
            responder.publish_props(got["ResponseTopic"], b"pong", 1, answer)
        out, err = rr.communicate(timeout=20)
        assert rr.returncode == 0, err
        assert out.strip() == "pong"
    finally:
        responder.close()
        probe.close()


# -- message expiry -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_message_expires_before_its_persistent_subscriber_returns_and_one_not_is_shorter(
    bus: TwoServers,
) -> None:
    sub = Sub5(bus.ports[0], "exp-sub", clean_start=False, expiry=300)
    pub = Sub5(bus.ports[0], "exp-pub")
    try:
        connected(sub, pub)
        sub.subscribe5("exp/#", 1)
        sub.close()
        published = time.time()
        pub.publish_props("exp/short", b"gone", 1, publish_props(MessageExpiryInterval=1))
        pub.publish_props("exp/long", b"kept", 1, publish_props(MessageExpiryInterval=60))
        pub.publish("exp/none", b"forever", 1)
        # What is tested is the clock: the short one's deadline must pass while it waits.
        wait_until("the short message's deadline passed", lambda: time.time() > published + 2.1)
        again = Sub5(bus.ports[0], "exp-sub", clean_start=False, expiry=300)
        try:
            assert again.connect() == (0, True)
            got = again.marked(pub, "exp/marker")
            assert [m.payload for m in got] == [b"kept", b"forever"]
            assert 50 <= props_of(got[0])["MessageExpiryInterval"] <= 57
            assert props_of(got[1]) == {}
        finally:
            again.close(expiry=0)
    finally:
        pub.close()


# -- subscription options -------------------------------------------------------------------------


@pytest.mark.slow
def test_no_local_keeps_a_device_own_messages_from_it_on_those_filters_only(
    bus: TwoServers,
) -> None:
    me, other = Sub5(bus.ports[0], "nl-me"), Sub5(bus.ports[0], "nl-other")
    try:
        connected(me, other)
        me.subscribe5("nl/quiet/#", 1, no_local=True, sub_id=3)
        me.subscribe5("nl/loud/#", 1)
        me.subscribe5("nl/+/both", 1, sub_id=4)  # matches with each of the two above
        other.subscribe5("nl/#", 1, no_local=True)  # not its own: it gets mine
        me.publish("nl/quiet/a", b"mine quiet", 1)
        me.publish("nl/loud/a", b"mine loud", 1)
        me.publish("nl/quiet/both", b"mine both", 1)
        other.publish("nl/quiet/b", b"theirs", 1)
        got = me.marked(other, "nl/loud/marker")
        assert [m.payload for m in got] == [b"mine loud", b"mine both", b"theirs"]
        # Delivered by the filters that are left: the no-local one's identifier is not there.
        assert props_of(got[1])["SubscriptionIdentifier"] == [4]
        assert props_of(got[2])["SubscriptionIdentifier"] == [3]
        mine = [m.payload for m in other.marked(me, "nl/loud/marker2")]
        assert mine == [b"mine quiet", b"mine loud", b"mine both"]
    finally:
        me.close()
        other.close()


@pytest.mark.slow
def test_retain_as_published_keeps_the_flag_of_a_live_message_otherwise_0(
    bus: TwoServers,
) -> None:
    keeps, drops = Sub5(bus.ports[0], "rap-keeps"), Sub5(bus.ports[1], "rap-drops")
    pub = Sub5(bus.ports[0], "rap-pub")
    old = Device(bus.ports[0], "rap-311")
    try:
        connected(keeps, drops, pub, old)
        keeps.subscribe5("rap/#", 1, as_published=True)
        drops.subscribe5("rap/#", 1)
        old.subscribe("rap/#", 1)
        heard(pub, "rap/probe", [taker(keeps), taker(drops), taker(old)])
        pub.publish("rap/state", b"on", 1, retain=True)
        pub.publish("rap/event", b"tick", 1)
        assert [(m.payload, m.retain) for m in (keeps.next(), keeps.next())] == [
            (b"on", True),
            (b"tick", False),
        ]
        assert [(m.payload, m.retain) for m in (drops.next(), drops.next())] == [
            (b"on", False),
            (b"tick", False),
        ]
        assert [(p, r) for _t, p, _q, r in old.receive(2)] == [(b"on", False), (b"tick", False)]
        # A retained copy sent at subscribe has the flag whatever the option.
        late = Sub5(bus.ports[1], "rap-late")
        connected(late)
        late.subscribe5("rap/state", 1)
        msg = late.next()
        assert (msg.payload, msg.retain) == (b"on", True)
        late.close()
    finally:
        pub.publish("rap/state", b"", 1, retain=True)  # cleared for the others
        for device in (keeps, drops, pub, old):
            device.close()


@pytest.mark.slow
def test_retain_handling_0_always_1_if_new_2_never(bus: TwoServers) -> None:
    pub = Sub5(bus.ports[0], "rh-pub")
    sub = Sub5(bus.ports[0], "rh-sub")
    try:
        connected(pub, sub)
        pub.publish("rh/a", b"A", 1, retain=True)
        sub.subscribe5("rh/a", 1, handling=2)  # never
        assert sub.marked(pub, "rh/a") == []
        sub.subscribe5("rh/+", 1, handling=1)  # new: sent
        assert [m.payload for m in sub.marked(pub, "rh/a")] == [b"A"]
        sub.subscribe5("rh/+", 1, handling=1)  # exists: not sent again
        assert sub.marked(pub, "rh/a") == []
        sub.subscribe5("rh/+", 1, handling=0)  # always
        assert [m.payload for m in sub.marked(pub, "rh/a")] == [b"A"]
    finally:
        pub.publish("rh/a", b"", 1, retain=True)
        pub.close()
        sub.close()


@pytest.mark.slow
def test_subscription_identifiers_per_filter_survive_reconnection_and_a_sigkill(
    bus: TwoServers,
) -> None:
    sub = Sub5(bus.ports[0], "sid-sub", clean_start=False, expiry=300)
    pub = Sub5(bus.ports[0], "sid-pub")
    try:
        connected(sub, pub)
        sub.subscribe5("sid/#", 1, sub_id=7)
        sub.subscribe5("sid/+/x", 1, sub_id=268_435_455)  # the largest there is
        sub.subscribe5("sid/a/#", 1)  # none
        sub.subscribe5("sid/gone/#", 1, sub_id=9)
        sub.subscribe5("sid/gone/#", 1)  # replaced: its identifier with it

        rounds = iter(range(3))

        def ids() -> list[list[int] | None]:
            r = next(rounds)
            sent = [f"{r}-{n}".encode() for n in range(3)]
            for topic, payload in zip(("sid/a/x", "sid/b/y", "sid/gone/z"), sent, strict=True):
                pub.publish(topic, payload, 1)
            got: list[Any] = []
            while len(got) < 3:
                msg = sub.next()
                if msg.payload in sent:  # not a resend of the round before (QoS 1 allows it)
                    got.append(msg)
            assert [m.payload for m in got] == sent
            return [sorted(props_of(m).get("SubscriptionIdentifier", [])) or None for m in got]

        expected = [[7, 268_435_455], [7], [7]]
        assert ids() == expected
        sub.close()
        sub = Sub5(bus.ports[0], "sid-sub", clean_start=False, expiry=300)
        assert sub.connect() == (0, True)
        assert ids() == expected
        sub.pause()
        pub.pause()
        bus.bus[0].kill()
        bus.bus[0].start().wait_ready(30)
        sub = Sub5(bus.ports[0], "sid-sub", clean_start=False, expiry=300)
        pub = Sub5(bus.ports[0], "sid-pub")
        assert sub.connect() == (0, True)
        connected(pub)
        assert ids() == expected
    finally:
        sub.close(expiry=0)
        pub.close()


# -- payload format -------------------------------------------------------------------------------


@pytest.mark.slow
def test_payload_format_utf8_with_bytes_that_are_not_is_refused_0x99_and_not_published(
    bus: TwoServers,
) -> None:
    watcher = Sub5(bus.ports[0], "pf-watch")
    raw = RawDevice5(bus.ports[0])
    try:
        connected(watcher)
        watcher.subscribe5("pf/#", 2)
        assert raw.connect("pf-raw").code == 0
        text = {mq.PAYLOAD_FORMAT: 1}
        raw.send(
            mc.Publish("pf/bad", b"\xff\xfe", 1, False, False, 1, text),
            mc.Publish("pf/bad", b"\xc3(", 2, False, False, 2, text),
            mc.Publish("pf/good", "é".encode(), 1, False, False, 3, text),
            mc.Publish("pf/raw", b"\xff", 1, False, False, 4, {}),  # no claim: any bytes
        )
        acks = [raw.until(mc.Ack) for _ in range(4)]
        assert [(a.kind, a.packet_id, a.code) for a in acks] == [
            (mq.PUBACK, 1, mq.PAYLOAD_FORMAT_INVALID),
            (mq.PUBREC, 2, mq.PAYLOAD_FORMAT_INVALID),
            (mq.PUBACK, 3, mq.SUCCESS),
            (mq.PUBACK, 4, mq.SUCCESS),
        ]
        got = [m.payload for m in watcher.marked(watcher, "pf/marker")]
        assert got == ["é".encode(), b"\xff"]
    finally:
        raw.close()
        watcher.close()


# -- the pure functions ---------------------------------------------------------------------------


def delivery(**fields: Any) -> Delivery:
    base: dict[str, Any] = {
        "seq": 1,
        "topic": "t",
        "payload": b"x",
        "qos": 1,
        "retained": False,
        "release": False,
        "filters": ("t",),
    }
    return Delivery(**{**base, **fields})


def test_message_props_take_the_message_properties_only_and_make_expiry_a_deadline() -> None:
    assert mm.message_props({mq.TOPIC_ALIAS: 3}, 100.0) is None
    props = mm.message_props(
        {mq.MESSAGE_EXPIRY: 30, mq.USER_PROPERTY: [("a", "1"), ("a", "2")]}, 100.0
    )
    assert props == MessageProps(user=(("a", "1"), ("a", "2")), expires_at=130.0)


def test_outgoing_applies_expiry_no_local_retain_as_published_and_identifiers() -> None:
    props = MessageProps(1, "text/plain", expires_at=130.0)
    item = delivery(props=props, retain=True, origin="me", filters=("a", "b"))
    options = {"a": (mm.NO_LOCAL, 5), "b": (mm.RETAIN_AS_PUBLISHED, 6)}
    # Mine: only b is left, whose retain-as-published keeps the flag.
    assert mm.outgoing(item, options, "me", True, 100.9) == (
        ("b",),
        True,
        {
            mq.PAYLOAD_FORMAT: 1,
            mq.MESSAGE_EXPIRY: 29,
            mq.CONTENT_TYPE: "text/plain",
            mq.SUBSCRIPTION_ID: [6],
        },
    )
    # Someone else's: both filters, both identifiers; to 3.1.1 no properties at all.
    assert mm.outgoing(item, options, "you", True, 100.0)[2][mq.SUBSCRIPTION_ID] == [5, 6]  # type: ignore[index]
    assert mm.outgoing(item, options, "you", False, 100.0) == (("a", "b"), True, None)
    assert mm.outgoing(item, {"a": (mm.NO_LOCAL, 0)}, "me", True, 100.0) == (
        ("b",),
        False,
        {mq.PAYLOAD_FORMAT: 1, mq.MESSAGE_EXPIRY: 30, mq.CONTENT_TYPE: "text/plain"},
    )
    assert mm.outgoing(item, {"a": (mm.NO_LOCAL, 0), "b": (mm.NO_LOCAL, 0)}, "me", True, 1) is None
    assert mm.outgoing(item, {}, "me", True, 130.0) is None  # expired
    assert mm.outgoing(item, {}, "me", True, 129.99)[2][mq.MESSAGE_EXPIRY] == 1  # type: ignore[index]


def test_subscription_options_keep_what_a_subscribe_asks_beyond_qos() -> None:
    topics = [("a", 1), ("b", 2 | mm.NO_LOCAL | mm.RETAIN_NEVER)]
    assert mm.subscription_options(topics, {}) == {"b": (mm.NO_LOCAL | mm.RETAIN_NEVER, 0)}
    assert mm.subscription_options([("a", 1)], {}) is None
    assert mm.subscription_options(topics, {mq.SUBSCRIPTION_ID: [9]}) == {
        "a": (0, 9),
        "b": (mm.NO_LOCAL | mm.RETAIN_NEVER, 9),
    }


def test_bad_payload_only_when_it_claims_utf8() -> None:
    assert mm.bad_payload(MessageProps(1), b"\xff")
    assert not mm.bad_payload(MessageProps(1), "é".encode())
    assert not mm.bad_payload(MessageProps(0), b"\xff")
    assert not mm.bad_payload(None, b"\xff")
