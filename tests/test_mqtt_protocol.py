"""One connection's MQTT protocol, sans-IO (aaabus.mqtt.protocol): the state table, packets held
while the server decides on a CONNECT, refusals in the client's own version, and a seeded fuzz
of whole packet streams through it."""

from __future__ import annotations

import random

import pytest

from aaabus.errors import MqttProtocolError
from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq
from aaabus.mqtt.protocol import TRANSITIONS, MqttProtocol, State, connack_code
from tests.support.mqtt import connect_packet, publish_packet

MAX = 1 << 16
SUBSCRIBE = bytes([0x82, 0x08, 0x00, 0x05, 0x00, 0x03]) + b"a/#" + bytes([0x01])
PINGREQ = bytes([0xC0, 0x00])
DISCONNECT = bytes([0xE0, 0x00])


def connected(version: int = mq.V311) -> MqttProtocol:
    proto = MqttProtocol(MAX)
    props = b"\x00" if version == mq.V5 else b""
    proto.receive(connect_packet(level=version, props=props))
    packet = proto.next_packet()
    assert isinstance(packet, mc.Connect) and packet.version == version
    proto.accept(False)
    return proto


def test_every_state_has_a_way_out_and_only_the_table_moves_the_state() -> None:
    reachable = {State.AWAIT_CONNECT} | set(TRANSITIONS.values())
    assert reachable == set(State)
    for state in State:
        assert (state, "close") in TRANSITIONS  # a socket can go away in any state


def test_packets_sent_before_connack_wait_until_the_connect_is_accepted() -> None:
    proto = MqttProtocol(MAX)
    # MQTT lets a client pipeline: CONNECT, SUBSCRIBE and PUBLISH in one segment.
    proto.receive(connect_packet() + SUBSCRIBE + publish_packet(b"a/b"))
    assert isinstance(proto.next_packet(), mc.Connect)
    assert proto.state is State.CONNECTING
    assert proto.next_packet() is None  # the server is deciding: nothing more yet
    assert proto.accept(True) == bytes([0x20, 0x02, 0x01, 0x00])
    assert isinstance(proto.next_packet(), mc.Subscribe)
    publish = proto.next_packet()
    assert isinstance(publish, mc.Publish) and publish.topic == "a/b"
    assert proto.next_packet() is None


def test_a_packet_split_across_reads_is_handed_out_once_whole() -> None:
    proto = connected()
    data = publish_packet(b"t", b"payload")
    for byte in data[:-1]:
        proto.receive(bytes([byte]))
        assert proto.next_packet() is None
    proto.receive(data[-1:])
    packet = proto.next_packet()
    assert isinstance(packet, mc.Publish) and packet.payload == b"payload"


@pytest.mark.parametrize(
    ("stream", "message"),
    [
        (PINGREQ, "PINGREQ before CONNECT"),
        (publish_packet(b"a"), "PUBLISH before CONNECT"),
    ],
)
def test_anything_before_connect_is_refused(stream: bytes, message: str) -> None:
    proto = MqttProtocol(MAX)
    proto.receive(stream)
    with pytest.raises(MqttProtocolError, match=message) as refused:
        proto.next_packet()
    assert refused.value.code is None  # no CONNACK for a client that never asked
    assert proto.next_packet() is None  # and nothing more is handed out


def test_a_second_connect_is_a_protocol_error_told_to_a_5_0_client() -> None:
    proto = connected(mq.V5)
    proto.receive(connect_packet(level=5, props=b"\x00"))
    with pytest.raises(MqttProtocolError, match="CONNECT not allowed while connected") as bad:
        proto.next_packet()
    assert bad.value.code == mq.PROTOCOL_ERROR
    # The property length may be left out when there are none (5.0, 3.14.2.2).
    assert proto.disconnect(mq.PROTOCOL_ERROR) == bytes([0xE0, 0x01, mq.PROTOCOL_ERROR])
    assert proto.state is State.CLOSED


def test_a_3_1_1_client_is_not_sent_a_disconnect() -> None:
    proto = connected()
    assert proto.disconnect(mq.PROTOCOL_ERROR) == b""
    assert proto.state is State.CLOSED


def test_after_disconnect_nothing_more_is_handed_out() -> None:
    proto = connected()
    proto.receive(DISCONNECT + PINGREQ)
    assert isinstance(proto.next_packet(), mc.Disconnect)
    assert proto.state is State.CLOSED
    assert proto.next_packet() is None


def test_a_refused_connect_is_answered_in_the_clients_version() -> None:
    v311 = MqttProtocol(MAX)
    v311.receive(connect_packet())
    v311.next_packet()
    # 3.1.1 has no "quota exceeded": it says "server unavailable".
    assert v311.refuse(mq.QUOTA_EXCEEDED) == bytes([0x20, 0x02, 0x00, 0x03])
    v5 = MqttProtocol(MAX)
    v5.receive(connect_packet(level=5, props=b"\x00"))
    v5.next_packet()
    assert v5.refuse(mq.QUOTA_EXCEEDED) == bytes([0x20, 0x03, 0x00, 0x97, 0x00])
    assert v311.state is State.CLOSED and v5.state is State.CLOSED


def test_a_malformed_5_0_connect_is_refused_in_5_0() -> None:
    proto = MqttProtocol(MAX)
    proto.receive(connect_packet(level=5))  # no property block: malformed in 5.0
    with pytest.raises(MqttProtocolError) as bad:
        proto.next_packet()
    assert bad.value.code == mq.MALFORMED and proto.version == mq.V5
    assert proto.refuse(bad.value.code) == bytes([0x20, 0x03, 0x00, mq.MALFORMED, 0x00])


def test_connack_codes_map_to_3_1_1_codes() -> None:
    assert connack_code(mq.NOT_AUTHORIZED, mq.V311) == 0x05
    assert connack_code(mq.BAD_CREDENTIALS, mq.V311) == 0x04
    assert connack_code(mq.CLIENT_ID_NOT_VALID, mq.V311) == 0x02
    assert connack_code(mq.SERVER_BUSY, mq.V311) == 0x03
    assert connack_code(mq.UNACCEPTABLE_PROTOCOL, mq.V311) == 0x01  # a 3.1.1 code already
    assert connack_code(mq.SERVER_BUSY, mq.V5) == mq.SERVER_BUSY


def test_answers_follow_the_negotiated_version() -> None:
    v311, v5 = connected(), connected(mq.V5)
    assert v311.ack(mq.PUBACK, 7, mq.QUOTA_EXCEEDED) == bytes([0x40, 0x02, 0x00, 0x07])
    assert v5.ack(mq.PUBACK, 7, mq.QUOTA_EXCEEDED) == bytes([0x40, 0x03, 0x00, 0x07, 0x97])
    # SUBACK: 3.1.1 says every failure as 0x80.
    assert v311.suback(3, [1, mq.QUOTA_EXCEEDED]) == bytes([0x90, 0x04, 0x00, 0x03, 0x01, 0x80])
    assert v5.suback(3, [1, mq.QUOTA_EXCEEDED]) == bytes([0x90, 0x05, 0x00, 0x03, 0x00, 0x01, 0x97])
    assert v311.pingresp() == bytes([0xD0, 0x00])
    assert mc.decode(0x30, v5.publish("t", b"x", 0, False, False, None)[2:], mq.V5) == mc.Publish(
        "t", b"x", 0, False, False, None, {}
    )


def test_an_oversized_packet_is_refused_before_its_body_arrives() -> None:
    proto = MqttProtocol(128)
    proto.receive(connect_packet())
    proto.next_packet()
    proto.accept(False)
    proto.receive(bytes([0x30, 0xFF, 0x7F]))  # announces 16,383 bytes
    with pytest.raises(MqttProtocolError) as big:
        proto.next_packet()
    assert big.value.code == mq.PACKET_TOO_LARGE


def test_fuzzed_streams_yield_packets_or_one_protocol_error() -> None:
    """100,000 packets' worth of mutated sessions through a fresh protocol each: every
    outcome is a packet, a need for more bytes, or one MqttProtocolError, never another
    exception; and after an error nothing more is handed out."""
    rng = random.Random(31)
    pieces = [
        publish_packet(b"a/b", b"x" * 20, 1, 9),
        publish_packet(b"a", b"", 0),
        publish_packet(b"a/c", b"y", 2, 3),
        SUBSCRIBE,
        PINGREQ,
        bytes([0x40, 0x02, 0x00, 0x09]),
        bytes([0x62, 0x02, 0x00, 0x03]),
        bytes([0xA2, 0x05, 0x00, 0x02, 0x00, 0x01]) + b"a",
        DISCONNECT,
    ]
    packets = 0
    while packets < 100_000:
        level = rng.choice((mq.V311, mq.V5))
        stream = bytearray(connect_packet(level=level, props=b"\x00" if level == mq.V5 else b""))
        for _ in range(rng.randint(1, 12)):
            stream += rng.choice(pieces)
        for _ in range(rng.randint(0, 4)):
            at = rng.randrange(len(stream))
            choice = rng.random()
            if choice < 0.5:
                stream[at] = rng.randrange(256)
            elif choice < 0.75:
                del stream[at]
            else:
                stream.insert(at, rng.randrange(256))
        proto = MqttProtocol(1024)
        at = 0
        while at < len(stream):
            step = rng.randint(1, 64)
            proto.receive(bytes(stream[at : at + step]))
            at += step
            try:
                while (packet := proto.next_packet()) is not None:
                    packets += 1
                    if isinstance(packet, mc.Connect):
                        proto.accept(False)
            except MqttProtocolError as exc:
                assert "\n" not in str(exc)
                assert proto.next_packet() is None
                break
