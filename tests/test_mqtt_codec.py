"""The owned MQTT 3.1.1/5.0 codec (aaabus.mqtt.codec): byte vectors written by hand from the
specifications, refusals with their codes, round trips of every packet type in both versions,
what paho-mqtt sends, and a seeded fuzz of framing and decoding."""

from __future__ import annotations

import random
import socket
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as paho
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties as PahoProperties
from paho.mqtt.subscribeoptions import SubscribeOptions

from aaabus.errors import MqttProtocolError
from aaabus.mqtt import codes as mq
from aaabus.mqtt.codec import (
    Ack,
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    Packet,
    PingReq,
    PingResp,
    Publish,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
    Will,
    decode,
    encode,
    encode_ack,
    encode_publish,
    split,
)
from aaabus.mqtt.codes import (
    CONNACK,
    CONNECT,
    PROPERTIES,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    REASON_CODES,
    SUBACK,
    SUBSCRIBE,
    UNSUBACK,
    UNSUBSCRIBE,
    V5,
    V311,
)

MAX = 1 << 20
MALFORMED, PROTOCOL_ERROR = mq.MALFORMED, mq.PROTOCOL_ERROR


def h(text: str) -> bytes:
    """Bytes written as spaced hex (the specifications' figures), ``#`` starting a comment."""
    return bytes.fromhex(" ".join(line.split("#")[0] for line in text.splitlines()))


def read(data: bytes, version: int, *, from_client: bool = True) -> Packet:
    """Frame then decode one whole packet, checking that it is exactly ``data``."""
    found = split(data, MAX)
    assert found is not None
    first, offset, total = found
    assert total == len(data)
    return decode(first, data[offset:], version, from_client=from_client)


def refusal(data: bytes, version: int, *, from_client: bool = True) -> MqttProtocolError:
    with pytest.raises(MqttProtocolError) as caught:
        read(data, version, from_client=from_client)
    assert "\n" not in str(caught.value)
    return caught.value


# -- hand-built packets (not by the codec under test) -------------------------------------------


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, low = divmod(n, 128)
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def frame(first: int, body: bytes) -> bytes:
    return bytes([first]) + varint(len(body)) + body


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return len(raw).to_bytes(2, "big") + raw


def connect(
    level: int = 4,
    flags: int = 0x02,
    client_id: str | bytes = "dev",
    props: bytes = b"\x00",
    rest: bytes = b"",
    name: bytes = b"MQTT",
) -> bytes:
    head = s(name) + bytes([level, flags]) + b"\x00\x3c"
    return frame(0x10, head + (props if level == 5 else b"") + s(client_id) + rest)


def publish(
    topic: str | bytes = "a/b",
    qos: int = 1,
    props: bytes = b"\x00",
    version: int = 4,
    pid: int = 7,
    flags: int | None = None,
) -> bytes:
    body = s(topic) + (pid.to_bytes(2, "big") if qos else b"") + (props if version == 5 else b"")
    return frame(0x30 | (qos << 1 if flags is None else flags), body + b"data")


def subscribe(*pairs: tuple[str | bytes, int], props: bytes = b"\x00", version: int = 4) -> bytes:
    body = b"\x00\x01" + (props if version == 5 else b"")
    for topic_filter, options in pairs:
        body += s(topic_filter) + bytes([options])
    return frame(0x82, body)


def unsubscribe(*filters: str | bytes, props: bytes = b"\x00", version: int = 4) -> bytes:
    return frame(0xA2, b"\x00\x01" + (props if version == 5 else b"") + b"".join(map(s, filters)))


def publish5(properties: bytes) -> bytes:
    """A 5.0 PUBLISH QoS 1 with the given property items."""
    return publish(props=props(properties), version=5)


def subscribe5(*pairs: tuple[str | bytes, int]) -> bytes:
    return subscribe(*pairs, version=5)


def props(*items: bytes) -> bytes:
    raw = b"".join(items)
    return varint(len(raw)) + raw


# -- framing ------------------------------------------------------------------------------------


def test_split_waits_for_a_whole_packet_and_tells_where_its_body_starts() -> None:
    packet = publish("a/b")
    for cut in range(len(packet)):
        assert split(packet[:cut], MAX) is None
    assert split(packet + b"\xc0\x00", MAX) == (packet[0], 2, len(packet))
    assert split(bytearray(packet), MAX) == (packet[0], 2, len(packet))
    assert split(memoryview(packet + b"\x00"), MAX) == (packet[0], 2, len(packet))


@pytest.mark.parametrize(
    ("length", "encoded"),
    [  # the boundaries of the remaining-length table (3.1.1 and 5.0 §2.1.4 / §1.5.5)
        (0, "00"),
        (127, "7F"),
        (128, "80 01"),
        (16_383, "FF 7F"),
        (16_384, "80 80 01"),
        (2_097_151, "FF FF 7F"),
        (2_097_152, "80 80 80 01"),
        (268_435_455, "FF FF FF 7F"),
    ],
)
def test_split_reads_remaining_lengths_of_one_to_four_bytes(length: int, encoded: str) -> None:
    header = b"\x30" + h(encoded)
    assert split(header, 1 << 30) is None or length == 0
    offset = len(header)
    if length <= 2_097_152:  # build the body only where it stays small
        assert split(header + bytes(length), 1 << 30) == (0x30, offset, offset + length)


def split_refusal(data: bytes, max_packet: int) -> MqttProtocolError:
    with pytest.raises(MqttProtocolError) as caught:
        split(data, max_packet)
    return caught.value


def test_split_refuses_a_packet_over_the_limit_before_its_body_arrives() -> None:
    error = split_refusal(b"\x30\xff\xff\x7f", 1000)  # 2 MiB announced, none of it sent
    assert error.code == mq.PACKET_TOO_LARGE and "over the limit" in str(error)
    assert split(b"\x30\x05" + bytes(5), 7) is not None  # the limit counts the whole packet
    assert split_refusal(b"\x30\x06", 7).code == mq.PACKET_TOO_LARGE


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ("30 FF FF FF FF 01", "longer than 4 bytes"),
        ("30 80 80 80 80", "longer than 4 bytes"),  # refused on the 4th byte's continuation bit
        ("30 80 00", "not minimally encoded"),
        ("30 FF 80 00", "not minimally encoded"),
    ],
)
def test_split_refuses_remaining_lengths_over_4_bytes_or_not_minimal(
    header: str, reason: str
) -> None:
    error = split_refusal(h(header), 1 << 30)
    assert reason in str(error) and error.code == MALFORMED


# -- vectors written from the specifications -----------------------------------------------------

CONNECT_311 = h("""
    10 22                   # CONNECT, remaining length 34
    00 04 4D 51 54 54       # protocol name "MQTT"
    04                      # level 4: 3.1.1
    CE                      # user name, password, will QoS 1, will, clean session
    00 0A                   # keep alive 10 s
    00 04 64 65 76 31       # client id "dev1"
    00 03 77 2F 74          # will topic "w/t"
    00 03 62 79 65          # will message "bye"
    00 01 75                # user name "u"
    00 03 70 00 77          # password, binary: "p", NUL, "w"
""")

CONNECT_5 = h("""
    10 30                   # CONNECT, remaining length 48
    00 04 4D 51 54 54 05 CE 00 0A
    05 11 00 00 00 0A       # properties: session expiry 10 (the 5.0 §3.1.2.12 example)
    00 04 64 65 76 31       # client id "dev1"
    07 18 00 00 00 05 01 01 # will properties: will delay 5, payload format 1 (UTF-8)
    00 03 77 2F 74 00 03 62 79 65 00 01 75 00 03 70 00 77
""")

PUBLISH_PROPS = h("""
    25                      # 37 bytes of properties
    01 01                   # payload format: UTF-8
    02 00 00 00 3C          # message expiry 60 s
    23 00 05                # topic alias 5
    08 00 05 72 2F 61 2F 62 # response topic "r/a/b"
    09 00 02 AB CD          # correlation data
    26 00 01 6B 00 01 76    # user property k=v
    03 00 04 74 65 78 74    # content type "text"
""")

VECTORS: list[tuple[str, int, bool, bytes, Packet]] = [
    (
        "3.1.1 CONNECT with will, user name and password",
        V311,
        True,
        CONNECT_311,
        Connect(V311, "dev1", True, 10, "u", b"p\x00w", Will("w/t", b"bye", 1, False, {}), {}),
    ),
    (
        "5.0 CONNECT with will, user name, password and properties",
        V5,
        True,
        CONNECT_5,
        Connect(
            V5,
            "dev1",
            True,
            10,
            "u",
            b"p\x00w",
            Will("w/t", b"bye", 1, False, {mq.WILL_DELAY: 5, mq.PAYLOAD_FORMAT: 1}),
            {mq.SESSION_EXPIRY: 10},
        ),
    ),
    ("3.1.1 CONNACK, session present", V311, False, h("20 02 01 00"), ConnAck(True, 0, {})),
    (
        "5.0 CONNACK with properties",
        V5,
        False,
        h("20 0E 00 00 0B 22 00 0A 24 01 12 00 03 61 62 63"),
        ConnAck(
            False,
            0,
            {mq.TOPIC_ALIAS_MAXIMUM: 10, mq.MAXIMUM_QOS: 1, mq.ASSIGNED_CLIENT_ID: "abc"},
        ),
    ),
    (
        "3.1.1 PUBLISH QoS 0",
        V311,
        True,
        h("30 0A 00 03 61 2F 62 68 65 6C 6C 6F"),
        Publish("a/b", b"hello", 0, False, False, None, {}),
    ),
    (
        "3.1.1 PUBLISH QoS 1 (the 3.1.1 §3.3.2.3 example: a/b, packet id 10)",
        V311,
        True,
        h("32 0C 00 03 61 2F 62 00 0A 68 65 6C 6C 6F"),
        Publish("a/b", b"hello", 1, False, False, 10, {}),
    ),
    (
        "3.1.1 PUBLISH QoS 2, DUP, retain",
        V311,
        True,
        h("3D 0C 00 03 61 2F 62 00 0A 68 65 6C 6C 6F"),
        Publish("a/b", b"hello", 2, True, True, 10, {}),
    ),
    (
        "5.0 PUBLISH QoS 0 without properties",
        V5,
        True,
        h("30 0B 00 03 61 2F 62 00 68 65 6C 6C 6F"),
        Publish("a/b", b"hello", 0, False, False, None, {}),
    ),
    (
        "5.0 PUBLISH QoS 1 with every PUBLISH property a client may send",
        V5,
        True,
        h("32 32 00 03 61 2F 62 00 0A") + PUBLISH_PROPS + b"hello",
        Publish(
            "a/b",
            b"hello",
            1,
            False,
            False,
            10,
            {
                mq.PAYLOAD_FORMAT: 1,
                mq.MESSAGE_EXPIRY: 60,
                mq.TOPIC_ALIAS: 5,
                mq.RESPONSE_TOPIC: "r/a/b",
                mq.CORRELATION_DATA: b"\xab\xcd",
                mq.USER_PROPERTY: [("k", "v")],
                mq.CONTENT_TYPE: "text",
            },
        ),
    ),
    (
        "5.0 PUBLISH QoS 2 from a server with two subscription identifiers",
        V5,
        False,
        h("34 12 00 03 61 2F 62 00 0B 05 0B 01 0B C8 01 68 65 6C 6C 6F"),
        Publish("a/b", b"hello", 2, False, False, 11, {mq.SUBSCRIPTION_ID: [1, 200]}),
    ),
    (
        "5.0 PUBLISH with an empty topic and a topic alias",
        V5,
        True,
        h("30 0B 00 00 03 23 00 05 68 65 6C 6C 6F"),
        Publish("", b"hello", 0, False, False, None, {mq.TOPIC_ALIAS: 5}),
    ),
    (
        "3.1.1 SUBSCRIBE (the 3.1.1 §3.8.3 example: a/b QoS 1, c/d QoS 2)",
        V311,
        True,
        h("82 0E 00 0A 00 03 61 2F 62 01 00 03 63 2F 64 02"),
        Subscribe(10, [("a/b", 1), ("c/d", 2)], {}),
    ),
    (
        "5.0 SUBSCRIBE with options and a subscription identifier",
        V5,
        True,
        h("""
            82 1A 00 0A
            02 0B 07                # properties: subscription id 7
            00 03 61 2F 2B 1D       # a/+: QoS 1, no local, retain as published, handling 1
            00 0C 24 73 68 61 72 65 2F 67 2F 63 2F 23 22  # $share/g/c/#: QoS 2, handling 2
        """),
        Subscribe(10, [("a/+", 0x1D), ("$share/g/c/#", 0x22)], {mq.SUBSCRIPTION_ID: [7]}),
    ),
    ("3.1.1 SUBACK", V311, False, h("90 05 00 0A 01 02 80"), SubAck(10, [1, 2, 0x80], {})),
    (
        "5.0 SUBACK with a reason string",
        V5,
        False,
        h("90 0B 00 0A 05 1F 00 02 6F 6B 01 8F A2"),
        SubAck(10, [1, 0x8F, 0xA2], {mq.REASON_STRING: "ok"}),
    ),
    (
        "3.1.1 UNSUBSCRIBE",
        V311,
        True,
        h("A2 0A 00 0B 00 03 61 2F 62 00 01 23"),
        Unsubscribe(11, ["a/b", "#"], {}),
    ),
    (
        "5.0 UNSUBSCRIBE",
        V5,
        True,
        h("A2 08 00 0B 00 00 03 61 2F 62"),
        Unsubscribe(11, ["a/b"], {}),
    ),
    ("3.1.1 UNSUBACK", V311, False, h("B0 02 00 0B"), UnsubAck(11, [], {})),
    ("5.0 UNSUBACK", V5, False, h("B0 05 00 0B 00 00 11"), UnsubAck(11, [0, 0x11], {})),
    ("3.1.1 PUBACK", V311, True, h("40 02 00 0A"), Ack(PUBACK, 10)),
    ("3.1.1 PUBREC", V311, True, h("50 02 00 0A"), Ack(PUBREC, 10)),
    ("3.1.1 PUBREL", V311, True, h("62 02 00 0A"), Ack(PUBREL, 10)),
    ("3.1.1 PUBCOMP", V311, True, h("70 02 00 0A"), Ack(PUBCOMP, 10)),
    ("5.0 PUBACK, 2 bytes: success", V5, True, h("40 02 00 0A"), Ack(PUBACK, 10)),
    ("5.0 PUBACK, 3 bytes: a code", V5, True, h("40 03 00 0A 10"), Ack(PUBACK, 10, 0x10)),
    ("5.0 PUBREL, 3 bytes: a code", V5, True, h("62 03 00 0A 92"), Ack(PUBREL, 10, 0x92)),
    (
        "5.0 PUBREC, 4+ bytes: a code and properties",
        V5,
        True,
        h("50 0A 00 0A 80 06 1F 00 03 62 61 64"),
        Ack(PUBREC, 10, 0x80, {mq.REASON_STRING: "bad"}),
    ),
    ("3.1.1 PINGREQ", V311, True, h("C0 00"), PingReq()),
    ("5.0 PINGREQ", V5, True, h("C0 00"), PingReq()),
    ("3.1.1 PINGRESP", V311, False, h("D0 00"), PingResp()),
    ("5.0 PINGRESP", V5, False, h("D0 00"), PingResp()),
    ("3.1.1 DISCONNECT", V311, True, h("E0 00"), Disconnect()),
    ("5.0 DISCONNECT, empty: normal", V5, True, h("E0 00"), Disconnect()),
    ("5.0 DISCONNECT, a code", V5, True, h("E0 01 04"), Disconnect(mq.DISCONNECT_WITH_WILL)),
    (
        "5.0 DISCONNECT from a server with a reason string",
        V5,
        False,
        h("E0 06 8E 04 1F 00 01 78"),
        Disconnect(mq.SESSION_TAKEN_OVER, {mq.REASON_STRING: "x"}),
    ),
    (
        "5.0 DISCONNECT from a client with a session expiry",
        V5,
        True,
        h("E0 07 00 05 11 00 00 00 00"),
        Disconnect(0, {mq.SESSION_EXPIRY: 0}),
    ),
    ("5.0 AUTH, empty: success", V5, True, h("F0 00"), Auth()),
    (
        "5.0 AUTH continuing",
        V5,
        False,
        h("F0 0F 18 0D 15 00 05 53 43 52 41 4D 16 00 02 01 02"),
        Auth(mq.CONTINUE_AUTHENTICATION, {mq.AUTH_METHOD: "SCRAM", mq.AUTH_DATA: b"\x01\x02"}),
    ),
]


@pytest.mark.parametrize(
    ("version", "from_client", "data", "packet"),
    [case[1:] for case in VECTORS],
    ids=[case[0] for case in VECTORS],
)
def test_spec_vectors_decode_to_their_packet_and_encode_back_to_the_same_bytes(
    version: int, from_client: bool, data: bytes, packet: Packet
) -> None:
    assert read(data, version, from_client=from_client) == packet
    assert encode(packet, version) == data


@pytest.mark.parametrize(
    ("data", "packet"),
    [
        (h("40 04 00 0A 00 00"), Ack(PUBACK, 10)),  # code 0, empty properties: 4 bytes
        (h("70 03 00 0A 00"), Ack(PUBCOMP, 10)),  # code 0 given: 3 bytes
        (h("E0 02 00 00"), Disconnect()),
        (h("F0 02 00 00"), Auth()),
    ],
)
def test_5_0_accepts_the_longer_forms_and_encodes_the_shortest(data: bytes, packet: Packet) -> None:
    assert read(data, V5) == packet
    assert len(encode(packet, V5)) < len(data)


def test_decode_takes_bytes_bytearray_and_memoryview_bodies() -> None:
    body = CONNECT_5[2:]
    expected = decode(0x10, body, V5)
    assert decode(0x10, bytearray(body), V5) == expected
    assert decode(0x10, memoryview(CONNECT_5)[2:], V5) == expected


def test_a_5_0_connect_may_have_a_password_without_user_name_and_an_empty_persistent_id() -> None:
    packet = read(connect(5, 0x40, "", rest=s(b"pw")), V311)
    assert packet == Connect(V5, "", False, 60, None, b"pw", None, {})


def test_an_empty_client_id_with_clean_session_is_left_for_the_server_to_assign() -> None:
    assert read(connect(4, 0x02, ""), V311) == Connect(V311, "", True, 60, None, None, None, {})


def test_encode_drops_what_3_1_1_cannot_carry() -> None:
    publish_props = {mq.MESSAGE_EXPIRY: 5}
    assert encode(Publish("t", b"", 0, False, False, None, publish_props), V311) == h(
        "30 03 00 01 74"
    )
    assert encode(Ack(PUBACK, 3, 0x80, {mq.REASON_STRING: "no"}), V311) == h("40 02 00 03")
    assert encode(SubAck(3, [1, 0x87], {}), V311) == h("90 04 00 03 01 80")
    assert encode(UnsubAck(3, [0x11], {}), V311) == h("B0 02 00 03")
    with pytest.raises(ValueError, match="AUTH"):
        encode(Auth(), V311)


@pytest.mark.parametrize(
    ("packet", "reason"),
    [
        (Publish("t", b"", 1, False, False, None), "packet identifier"),
        (Publish("t", b"", 1, False, False, 0x10000), "packet identifier"),
        (Publish("t" * 70_000, b"", 0, False, False, None), "65535"),
        (Ack(PUBACK, 0), "packet identifier"),
        (Ack(SUBACK, 1), "acknowledgement type"),
        (Publish("t", b"", 0, False, False, None, {mq.SESSION_EXPIRY: 1}), "may not appear"),
        (Publish("t", b"", 0, False, False, None, {mq.TOPIC_ALIAS: 0}), "may not be 0"),
        (Publish("t", b"", 0, False, False, None, {mq.PAYLOAD_FORMAT: 2}), "not 0 or 1"),
        (Subscribe(1, [("a", 0)], {mq.SUBSCRIPTION_ID: [1, 2]}), "exactly one"),
        (Subscribe(1, [("a", 0)], {mq.SUBSCRIPTION_ID: [0]}), "out of 1"),
        (Connect(3, "c", True, 0, None, None, None), "protocol level"),
    ],
)
def test_encode_refuses_what_it_cannot_encode_with_value_error(packet: Packet, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        encode(packet, V5)


# -- refusals -----------------------------------------------------------------------------------

BAD_UTF8 = [
    b"\xff",
    b"\xc0\x80",
    b"\xed\xa0\x80",
    b"a\x00b",
]  # invalid, overlong NUL, surrogate, NUL


def will(level: int, topic: str | bytes, message: bytes | None = b"m") -> bytes:
    """A CONNECT's will fields (5.0: with empty will properties first)."""
    return (b"\x00" if level == 5 else b"") + s(topic) + (b"" if message is None else s(message))


# fmt: off
CONNECT_REFUSALS: list[tuple[str, Callable[[int], bytes], int | None, int]] = [
    # (what, the packet at a level, 3.1.1 CONNACK code, 5.0 CONNACK code)
    ("reserved flag", lambda lv: connect(lv, 0x03), None, MALFORMED),
    ("fixed header flags", lambda lv: b"\x11" + connect(lv)[1:], None, MALFORMED),
    ("will QoS 3", lambda lv: connect(lv, 0x1E, rest=will(lv, "w")), None, MALFORMED),
    ("will QoS without a will", lambda lv: connect(lv, 0x0A), None, MALFORMED),
    ("will retain without a will", lambda lv: connect(lv, 0x22), None, MALFORMED),
    ("a byte after the last field", lambda lv: connect(lv, rest=b"\x00"), None, MALFORMED),
    ("client id past the end", lambda lv: frame(0x10, connect(lv)[2:-1]), None, MALFORMED),
    ("will topic with a wildcard", lambda lv: connect(lv, 0x06, rest=will(lv, "w/#")), None,
     mq.TOPIC_NAME_INVALID),
    ("empty will topic", lambda lv: connect(lv, 0x06, rest=will(lv, "")), None,
     mq.TOPIC_NAME_INVALID),
    ("will payload missing", lambda lv: connect(lv, 0x06, rest=will(lv, "w", None)), None,
     MALFORMED),
    ("user name missing", lambda lv: connect(lv, 0x82), None, MALFORMED),
    ("invalid UTF-8 user name", lambda lv: connect(lv, 0x82, rest=s(b"\xff")), None, MALFORMED),
]
# fmt: on


@pytest.mark.parametrize(
    ("build", "code_311", "code_5"),
    [case[1:] for case in CONNECT_REFUSALS],
    ids=[case[0] for case in CONNECT_REFUSALS],
)
def test_connect_refusals_carry_the_connack_code_of_the_version_asked_for(
    build: Callable[[int], bytes], code_311: int | None, code_5: int
) -> None:
    assert refusal(build(4), V311).code == code_311
    assert refusal(build(5), V311).code == code_5


@pytest.mark.parametrize(
    ("packet", "code"),
    [
        (connect(3, name=b"MQIsdp"), mq.UNACCEPTABLE_PROTOCOL),  # MQTT 3.1
        (connect(6), mq.UNACCEPTABLE_PROTOCOL),
        (connect(0), mq.UNACCEPTABLE_PROTOCOL),
        (connect(4, name=b"MQTX"), mq.UNACCEPTABLE_PROTOCOL),
        (connect(5, name=b"mqtt"), mq.UNSUPPORTED_VERSION),
        (frame(0x10, b"\x00\x04MQT"), None),  # no level: no version to answer in
        (frame(0x10, b""), None),
    ],
)
def test_connect_of_a_protocol_it_does_not_speak_is_refused_with_the_right_code(
    packet: bytes, code: int | None
) -> None:
    error = refusal(packet, V5)
    assert error.code == code


@pytest.mark.parametrize("raw", BAD_UTF8)
@pytest.mark.parametrize("level", [4, 5])
def test_connect_strings_must_be_strict_utf8_without_nul(raw: bytes, level: int) -> None:
    for packet in (
        connect(level, client_id=raw),
        connect(level, flags=0x06, rest=will(level, raw)),
        connect(level, flags=0x82, rest=s(raw)),
    ):
        assert refusal(packet, V311).code == (None if level == 4 else MALFORMED)


def test_3_1_1_persistent_session_with_an_empty_client_id_is_identifier_rejected() -> None:
    assert refusal(connect(4, 0x00, ""), V311).code == mq.IDENTIFIER_REJECTED


def test_3_1_1_password_without_user_name_is_refused() -> None:
    assert refusal(connect(4, 0x42, rest=s("pw")), V311).code is None


@pytest.mark.parametrize(
    ("properties", "code", "reason"),
    [
        (props(h("23 00 01")), MALFORMED, "Topic Alias"),  # a PUBLISH-only property
        (props(h("7F 00")), MALFORMED, "unknown property"),
        (props(h("80 01 00")), MALFORMED, "unknown property"),
        (props(h("11 00 00 00 01 11 00 00 00 02")), PROTOCOL_ERROR, "twice"),
        (props(h("21 00 00")), PROTOCOL_ERROR, "Receive Maximum of 0"),
        (props(h("27 00 00 00 00")), PROTOCOL_ERROR, "Maximum Packet Size of 0"),
        (props(h("17 02")), PROTOCOL_ERROR, "not 0 or 1"),
        (props(h("19 05")), PROTOCOL_ERROR, "not 0 or 1"),
        (props(h("16 00 01 00")), PROTOCOL_ERROR, "authentication data but no method"),
        (h("7F 11 00 00 00 01"), MALFORMED, "run past"),  # length over the packet
        (h("05 11 00 00"), MALFORMED, "past"),
        (h("80 00"), MALFORMED, "not minimally encoded"),
        (props(h("11 00 00")), MALFORMED, "past its section"),
        (props(h("15 00 05 41")), MALFORMED, "past the end"),
        (props(h("26 00 01 6B")), MALFORMED, "past the end"),
    ],
)
def test_connect_5_0_properties_are_checked(properties: bytes, code: int, reason: str) -> None:
    error = refusal(connect(5, props=properties), V5)
    assert (error.code, reason in str(error)) == (code, True), str(error)


def test_will_properties_are_only_those_a_will_may_carry() -> None:
    will = props(h("11 00 00 00 01")) + s("w") + s("m")  # session expiry: not a will property
    assert refusal(connect(5, flags=0x06, rest=will), V5).code == MALFORMED
    good = props(h("18 00 00 00 01")) + s("w") + s("m")
    connected = read(connect(5, flags=0x06, rest=good), V5)
    assert isinstance(connected, Connect) and connected.will is not None
    assert connected.will.properties == {mq.WILL_DELAY: 1}


# fmt: off
REFUSALS: list[tuple[str, bytes, int, bool, int]] = [
    # (what, packet, version, from a client, DISCONNECT reason)
    ("packet type 0", h("00 00"), V5, True, MALFORMED),
    ("AUTH in 3.1.1", h("F0 00"), V311, True, MALFORMED),
    ("PUBREL without its flags", h("60 02 00 01"), V311, True, MALFORMED),
    ("SUBSCRIBE without its flags", b"\x80" + subscribe(("a", 0))[1:], V311, True, MALFORMED),
    ("UNSUBSCRIBE flags 0x3", b"\xa3" + unsubscribe("a")[1:], V311, True, MALFORMED),
    ("PUBACK with flags", h("42 02 00 01"), V311, True, MALFORMED),
    ("PINGREQ with flags", h("C1 00"), V311, True, MALFORMED),
    ("PINGREQ with a body", h("C0 01 00"), V311, True, MALFORMED),
    ("DISCONNECT 3.1.1 with a body", h("E0 01 00"), V311, True, MALFORMED),
    ("PUBLISH QoS 3", publish(flags=0x06), V311, True, MALFORMED),
    ("PUBLISH DUP at QoS 0", publish(qos=0, flags=0x08), V311, True, MALFORMED),
    ("PUBLISH packet id 0", publish(pid=0), V311, True, PROTOCOL_ERROR),
    ("PUBLISH topic with +", publish("a/+/b"), V311, True, mq.TOPIC_NAME_INVALID),
    ("PUBLISH topic with #", publish("a/#", version=5), V5, True, mq.TOPIC_NAME_INVALID),
    ("PUBLISH empty topic 3.1.1", publish(""), V311, True, mq.TOPIC_NAME_INVALID),
    ("PUBLISH empty topic, no alias", publish("", version=5), V5, True, PROTOCOL_ERROR),
    ("PUBLISH topic past the end", h("30 03 00 05 61"), V311, True, MALFORMED),
    ("PUBLISH without topic", h("30 01 00"), V311, True, MALFORMED),
    ("PUBLISH id past the end", h("32 04 00 01 61 00"), V311, True, MALFORMED),
    ("PUBLISH alias 0", publish5(h("23 00 00")), V5, True, mq.TOPIC_ALIAS_INVALID),
    ("PUBLISH alias twice", publish5(h("23 00 01 23 00 02")), V5, True, PROTOCOL_ERROR),
    ("PUBLISH payload format 2", publish5(h("01 02")), V5, True, PROTOCOL_ERROR),
    ("PUBLISH subscription id from a client", publish5(h("0B 01")), V5, True, PROTOCOL_ERROR),
    ("PUBLISH subscription id 0", publish5(h("0B 00")), V5, False, PROTOCOL_ERROR),
    ("PUBLISH subscription id of 5 bytes", publish5(h("0B 80 80 80 80 01")), V5, False,
     MALFORMED),
    ("PUBLISH response topic with +", publish5(b"\x08" + s("r/+")), V5, True, PROTOCOL_ERROR),
    ("PUBLISH session expiry", publish5(h("11 00 00 00 01")), V5, True, MALFORMED),
    ("PUBLISH properties past the end", h("30 06 00 01 61 05 01 01"), V5, True, MALFORMED),
    ("PUBACK 3.1.1 with a code", h("40 03 00 01 00"), V311, True, MALFORMED),
    ("PUBACK packet id 0", h("40 02 00 00"), V311, True, PROTOCOL_ERROR),
    ("PUBACK of 1 byte", h("40 01 00"), V5, True, MALFORMED),
    ("PUBACK with a PUBREL code", h("40 03 00 01 92"), V5, True, PROTOCOL_ERROR),
    ("PUBREL with a PUBACK code", h("62 03 00 01 10"), V5, True, PROTOCOL_ERROR),
    ("PUBCOMP bytes after properties", h("70 05 00 01 00 00 00"), V5, True, MALFORMED),
    ("PUBREC with a topic alias", h("50 07 00 01 00 03 23 00 01"), V5, True, MALFORMED),
    ("SUBSCRIBE without a filter", subscribe(), V311, True, PROTOCOL_ERROR),
    ("SUBSCRIBE 5.0 without a filter", subscribe(version=5), V5, True, PROTOCOL_ERROR),
    ("SUBSCRIBE packet id 0", h("82 06 00 00 00 01 61 00"), V311, True, PROTOCOL_ERROR),
    ("SUBSCRIBE 3.1.1 reserved option bits", subscribe(("a", 0x04)), V311, True, MALFORMED),
    ("SUBSCRIBE 3.1.1 QoS 3", subscribe(("a", 0x03)), V311, True, MALFORMED),
    ("SUBSCRIBE 5.0 QoS 3", subscribe5(("a", 0x03)), V5, True, PROTOCOL_ERROR),
    ("SUBSCRIBE 5.0 retain handling 3", subscribe5(("a", 0x30)), V5, True, PROTOCOL_ERROR),
    ("SUBSCRIBE 5.0 reserved option bits", subscribe5(("a", 0x40)), V5, True, MALFORMED),
    ("SUBSCRIBE filter with # inside", subscribe(("a/#/b", 0)), V311, True, 0x8F),
    ("SUBSCRIBE filter mixing + and text", subscribe(("a/b+", 0)), V311, True, 0x8F),
    ("SUBSCRIBE empty filter", subscribe(("", 0)), V311, True, 0x8F),
    ("SUBSCRIBE invalid UTF-8 filter", subscribe((b"\xfe", 0)), V311, True, MALFORMED),
    ("SUBSCRIBE filter without options", h("82 05 00 01 00 01 61"), V311, True, MALFORMED),
    ("SUBSCRIBE two subscription ids", subscribe(("a", 0), props=props(h("0B 01 0B 02")),
     version=5), V5, True, PROTOCOL_ERROR),
    ("SUBSCRIBE shared, wildcard name", subscribe5(("$share/+/a", 0)), V5, True, 0x8F),
    ("SUBSCRIBE shared without filter", subscribe5(("$share/g", 0)), V5, True, 0x8F),
    ("SUBSCRIBE shared, empty name", subscribe5(("$share//a", 0)), V5, True, 0x8F),
    ("SUBSCRIBE shared with no local", subscribe5(("$share/g/a", 4)), V5, True, PROTOCOL_ERROR),
    ("UNSUBSCRIBE without a filter", unsubscribe(), V311, True, PROTOCOL_ERROR),
    ("UNSUBSCRIBE invalid filter", unsubscribe("a+"), V311, True, 0x8F),
    ("UNSUBSCRIBE filter past the end", h("A2 05 00 01 00 05 61"), V311, True, MALFORMED),
    ("UNSUBSCRIBE NUL in filter", unsubscribe(b"a\x00"), V311, True, MALFORMED),
    ("CONNACK from a client", h("20 02 00 00"), V311, True, PROTOCOL_ERROR),
    ("SUBACK from a client", h("90 03 00 01 00"), V311, True, PROTOCOL_ERROR),
    ("UNSUBACK from a client", h("B0 02 00 01"), V311, True, PROTOCOL_ERROR),
    ("PINGRESP from a client", h("D0 00"), V311, True, PROTOCOL_ERROR),
    ("CONNECT from a server", connect(), V311, False, PROTOCOL_ERROR),
    ("SUBSCRIBE from a server", subscribe(("a", 0)), V311, False, PROTOCOL_ERROR),
    ("UNSUBSCRIBE from a server", unsubscribe("a"), V311, False, PROTOCOL_ERROR),
    ("PINGREQ from a server", h("C0 00"), V311, False, PROTOCOL_ERROR),
    ("CONNACK reserved flags", h("20 02 02 00"), V311, False, MALFORMED),
    ("CONNACK 3.1.1 code 6", h("20 02 00 06"), V311, False, PROTOCOL_ERROR),
    ("CONNACK 3.1.1 with a byte more", h("20 03 00 00 00"), V311, False, MALFORMED),
    ("CONNACK session present, refused", h("20 02 01 05"), V311, False, PROTOCOL_ERROR),
    ("CONNACK 5.0 code 0x01", h("20 03 00 01 00"), V5, False, PROTOCOL_ERROR),
    ("CONNACK 5.0 without properties", h("20 02 00 00"), V5, False, MALFORMED),
    ("CONNACK 5.0 maximum QoS 2", h("20 05 00 00 02 24 02"), V5, False, PROTOCOL_ERROR),
    ("SUBACK without codes", h("90 02 00 01"), V311, False, PROTOCOL_ERROR),
    ("SUBACK 3.1.1 code 0x87", h("90 03 00 01 87"), V311, False, PROTOCOL_ERROR),
    ("SUBACK 5.0 code 0x11", h("90 04 00 01 00 11"), V5, False, PROTOCOL_ERROR),
    ("UNSUBACK 3.1.1 with codes", h("B0 03 00 01 00"), V311, False, MALFORMED),
    ("UNSUBACK 5.0 without codes", h("B0 03 00 01 00"), V5, False, PROTOCOL_ERROR),
    ("DISCONNECT 5.0 code 0x01", h("E0 01 01"), V5, True, PROTOCOL_ERROR),
    ("DISCONNECT from a server with a session expiry", h("E0 07 00 05 11 00 00 00 01"), V5,
     False, PROTOCOL_ERROR),
    ("AUTH of one byte", h("F0 01 18"), V5, True, MALFORMED),
    ("AUTH code 0x80", h("F0 02 80 00"), V5, True, PROTOCOL_ERROR),
]
# fmt: on


@pytest.mark.parametrize(
    ("packet", "version", "from_client", "code"),
    [case[1:] for case in REFUSALS],
    ids=[case[0] for case in REFUSALS],
)
def test_refusals_carry_their_5_0_disconnect_reason(
    packet: bytes, version: int, from_client: bool, code: int
) -> None:
    assert refusal(packet, version, from_client=from_client).code == code


@pytest.mark.parametrize("raw", BAD_UTF8)
@pytest.mark.parametrize("version", [V311, V5])
def test_publish_topic_must_be_strict_utf8_without_nul(raw: bytes, version: int) -> None:
    assert refusal(publish(raw, version=version), version).code == MALFORMED


def test_user_property_strings_must_be_strict_utf8() -> None:
    for raw in BAD_UTF8:
        packet = publish(props=props(b"\x26" + s(raw) + s("v")), version=5)
        assert refusal(packet, V5).code == MALFORMED


def test_decode_refuses_an_unknown_protocol_level_argument() -> None:
    with pytest.raises(ValueError, match="protocol level"):
        decode(0xC0, b"", 3)


# -- round trips with hypothesis ----------------------------------------------------------------

TEXT = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=12)
LEVEL = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00/+#"), max_size=6)
TOPIC = st.lists(LEVEL, min_size=1, max_size=4).map("/".join).filter(bool)
PLAIN_FILTER = st.builds(
    lambda levels, tail: "/".join(levels + tail),
    st.lists(st.one_of(LEVEL, st.just("+")), min_size=0, max_size=4),
    st.sampled_from([[], ["#"]]),
).filter(lambda f: f != "" and not f.startswith("$share/"))
SHARED_FILTER = st.builds(lambda name, f: f"$share/{name}/{f}", LEVEL.filter(bool), PLAIN_FILTER)
PID = st.integers(1, 0xFFFF)


def value_of(pid: int, single_id: bool) -> st.SearchStrategy[Any]:
    ptype = PROPERTIES[pid].kind
    if pid == mq.USER_PROPERTY:
        return st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=3)
    if pid == mq.SUBSCRIPTION_ID:
        return st.lists(st.integers(1, mq.MAX_VARINT), min_size=1, max_size=1 if single_id else 3)
    if pid == mq.RESPONSE_TOPIC:
        return TOPIC
    low = 1 if pid in (mq.RECEIVE_MAXIMUM, mq.MAXIMUM_PACKET_SIZE, mq.TOPIC_ALIAS) else 0
    return {
        mq.BYTE: st.integers(0, 1),
        mq.U16: st.integers(low, 0xFFFF),
        mq.U32: st.integers(low, 0xFFFFFFFF),
        mq.UTF8: TEXT,
        mq.BINARY: st.binary(max_size=12),
    }[ptype]


def properties_of(kind: int, *, will: bool = False, leave_out: tuple[int, ...] = ()) -> Any:
    """Any valid property dict of packet ``kind`` (or of a will)."""
    allowed = [
        pid
        for pid, info in PROPERTIES.items()
        if (info.will if will else kind in info.packets) and pid not in leave_out
    ]
    optional = {pid: value_of(pid, kind == SUBSCRIBE) for pid in allowed}
    return st.fixed_dictionaries({}, optional=optional)


@st.composite
def packets(draw: st.DrawFn, kind: int, version: int) -> tuple[Packet, bool]:
    """A valid packet of type ``kind`` and whether a client sends it (or a server)."""
    v5 = version == V5

    def drawn(of: int, **kw: Any) -> dict[int, Any]:
        return draw(properties_of(of, **kw)) if v5 else {}

    from_client = draw(st.booleans())
    if kind == CONNECT:
        clean = draw(st.booleans())
        client_id = draw(TEXT if v5 or clean else TEXT.filter(bool))
        username = draw(st.none() | TEXT)
        password = draw(st.none() | st.binary(max_size=10)) if v5 or username is not None else None
        will = None
        if draw(st.booleans()):
            will = Will(
                draw(TOPIC),
                draw(st.binary(max_size=20)),
                draw(st.integers(0, 2)),
                draw(st.booleans()),
                drawn(0, will=True),
            )
        connect_props = drawn(CONNECT)
        if mq.AUTH_DATA in connect_props:
            connect_props.setdefault(mq.AUTH_METHOD, "m")
        keep_alive = draw(st.integers(0, 0xFFFF))
        return Connect(
            version, client_id, clean, keep_alive, username, password, will, connect_props
        ), True
    if kind == CONNACK:
        codes = sorted(REASON_CODES[CONNACK]) if v5 else list(range(6))
        code = draw(st.sampled_from(codes))
        return ConnAck(draw(st.booleans()) and not code, code, drawn(CONNACK)), False
    if kind == PUBLISH:
        qos = draw(st.integers(0, 2))
        publish_props = drawn(PUBLISH, leave_out=(mq.SUBSCRIPTION_ID,) if from_client else ())
        topic = draw(TOPIC)
        if mq.TOPIC_ALIAS in publish_props and draw(st.booleans()):
            topic = ""
        dup = bool(qos) and draw(st.booleans())
        pid = draw(PID) if qos else None
        return Publish(
            topic, draw(st.binary(max_size=40)), qos, draw(st.booleans()), dup, pid, publish_props
        ), from_client
    if kind in (PUBACK, PUBREC, PUBREL, PUBCOMP):
        code = draw(st.sampled_from(sorted(REASON_CODES[kind]))) if v5 else 0
        return Ack(kind, draw(PID), code, drawn(kind)), from_client
    if kind == SUBSCRIBE:
        topics = []
        for _ in range(draw(st.integers(1, 4))):
            shared = v5 and draw(st.booleans())
            topic_filter = draw(SHARED_FILTER if shared else PLAIN_FILTER)
            options = draw(st.integers(0, 2))
            if v5:
                options |= (not shared and draw(st.booleans())) << 2
                options |= draw(st.booleans()) << 3 | draw(st.integers(0, 2)) << 4
            topics.append((topic_filter, options))
        return Subscribe(draw(PID), topics, drawn(SUBSCRIBE)), True
    if kind == SUBACK:
        valid = sorted(REASON_CODES[SUBACK]) if v5 else [0, 1, 2, 0x80]
        codes = draw(st.lists(st.sampled_from(valid), min_size=1, max_size=5))
        return SubAck(draw(PID), codes, drawn(SUBACK)), False
    if kind == UNSUBSCRIBE:
        filters = draw(st.lists(PLAIN_FILTER, min_size=1, max_size=4))
        return Unsubscribe(draw(PID), filters, drawn(UNSUBSCRIBE)), True
    if kind == UNSUBACK:
        codes = draw(st.lists(st.sampled_from(sorted(REASON_CODES[UNSUBACK])), min_size=1))
        return UnsubAck(draw(PID), codes if v5 else [], drawn(UNSUBACK)), False
    if kind == mq.PINGREQ:
        return PingReq(), True
    if kind == mq.PINGRESP:
        return PingResp(), False
    if kind == mq.DISCONNECT:
        if not v5:
            return Disconnect(), True
        code = draw(st.sampled_from(sorted(REASON_CODES[kind])))
        leave_out = () if from_client else (mq.SESSION_EXPIRY,)
        return Disconnect(code, drawn(kind, leave_out=leave_out)), from_client
    assert kind == mq.AUTH and v5
    return Auth(draw(st.sampled_from(sorted(REASON_CODES[kind]))), drawn(kind)), from_client


ALL_KINDS = [(kind, version) for kind in range(1, 16) for version in (V311, V5)]


@pytest.mark.parametrize(
    ("kind", "version"),
    [case for case in ALL_KINDS if case != (mq.AUTH, V311)],
    ids=[
        f"{mq.NAMES[kind]}-{'5.0' if version == V5 else '3.1.1'}"
        for kind, version in ALL_KINDS
        if (kind, version) != (mq.AUTH, V311)
    ],
)
@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_every_packet_type_decodes_to_what_was_encoded(
    kind: int, version: int, data: st.DataObject
) -> None:
    packet, from_client = data.draw(packets(kind, version))
    raw = encode(packet, version)
    assert raw[0] >> 4 == kind
    assert read(raw, version, from_client=from_client) == packet


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(data=st.data(), version=st.sampled_from([V311, V5]))
def test_the_fast_paths_equal_encode_of_the_same_packet(data: st.DataObject, version: int) -> None:
    publish_packet, _ = data.draw(packets(PUBLISH, version))
    p = publish_packet
    assert isinstance(p, Publish)
    fast = encode_publish(
        p.topic, p.payload, p.qos, p.retain, p.dup, p.packet_id, version, p.properties
    )
    assert fast == encode(p, version)
    assert read(fast, version, from_client=mq.SUBSCRIPTION_ID not in p.properties) == p
    kind = data.draw(st.sampled_from([PUBACK, PUBREC, PUBREL, PUBCOMP]))
    ack, _ = data.draw(packets(kind, version))
    assert isinstance(ack, Ack)
    fast = encode_ack(ack.kind, ack.packet_id, version, ack.code, ack.properties)
    assert fast == encode(ack, version) and read(fast, version) == ack
    # The three 5.0 forms: no code, a code, a code and properties (3.1.1: the first only).
    if version == V311 or not (ack.code or ack.properties):
        assert len(fast) == 4
    elif not ack.properties:
        assert len(fast) == 5
    else:
        assert len(fast) > 6


# -- what paho-mqtt sends -----------------------------------------------------------------------


def capture(
    protocol: paho.MQTTProtocolVersion,
    version: int,
    act: Callable[[paho.Client], None],
    count: int,
    **connect: Any,
) -> list[Packet]:
    """The first ``count`` packets paho sends to a listening socket of ours, decoded: CONNECT,
    then (after our CONNACK) whatever ``act`` makes it send."""
    server = socket.create_server(("127.0.0.1", 0))
    client = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id="paho-dev", protocol=protocol)
    conn = None
    try:
        server.settimeout(5)
        client.username_pw_set("user", "secret")
        will_props = None
        if version == V5:
            will_props = PahoProperties(PacketTypes.WILLMESSAGE)
            will_props.WillDelayInterval = 30
        client.will_set("dev/will", b"gone", qos=1, retain=True, properties=will_props)
        client.connect("127.0.0.1", server.getsockname()[1], keepalive=30, **connect)
        conn, _ = server.accept()
        conn.settimeout(5)
        buffer = bytearray()
        out: list[Packet] = []
        while len(out) < count:
            found = split(buffer, MAX)
            if found is None:
                chunk = conn.recv(65536)
                assert chunk, "paho closed the connection"
                buffer += chunk
                continue
            first, offset, total = found
            out.append(decode(first, bytes(buffer[offset:total]), version))
            del buffer[:total]
            if len(out) == 1:
                conn.sendall(encode(ConnAck(False, 0, {}), version))
                client.loop(timeout=2.0)  # paho reads the CONNACK: it is connected
                assert client.is_connected()
                act(client)
        return out
    finally:
        client.disconnect()  # sends DISCONNECT and closes paho's socket (no loop thread to stop)
        if conn is not None:
            conn.close()
        server.close()


def test_paho_3_1_1_connect_publish_and_subscribe_decode() -> None:
    def act(client: paho.Client) -> None:
        client.publish("dev/1/temp", b"21.5", qos=1)
        client.publish("dev/1/state", b"on", qos=2, retain=True)
        client.subscribe([("cmd/1/#", 1), ("all/+", 2)])

    connected, pub1, pub2, sub = capture(paho.MQTTv311, V311, act, 4)
    assert connected == Connect(
        V311, "paho-dev", True, 30, "user", b"secret", Will("dev/will", b"gone", 1, True, {}), {}
    )
    assert isinstance(pub1, Publish) and isinstance(pub2, Publish)
    assert (pub1.topic, pub1.payload, pub1.qos, pub1.retain) == ("dev/1/temp", b"21.5", 1, False)
    assert (pub2.topic, pub2.payload, pub2.qos, pub2.retain) == ("dev/1/state", b"on", 2, True)
    assert isinstance(sub, Subscribe) and sub.topics == [("cmd/1/#", 1), ("all/+", 2)]


def test_paho_5_0_connect_publish_and_subscribe_decode() -> None:
    connect_props = PahoProperties(PacketTypes.CONNECT)
    connect_props.SessionExpiryInterval = 3600
    connect_props.ReceiveMaximum = 20

    def act(client: paho.Client) -> None:
        publish_props = PahoProperties(PacketTypes.PUBLISH)
        publish_props.MessageExpiryInterval = 60
        publish_props.ContentType = "text/plain"
        publish_props.ResponseTopic = "dev/1/reply"
        publish_props.CorrelationData = b"\x01\x02"
        publish_props.PayloadFormatIndicator = 1
        publish_props.UserProperty = ("k", "v")
        publish_props.UserProperty = ("k", "w")
        client.publish("dev/1/temp", b"21.5", qos=1, properties=publish_props)
        subscribe_props = PahoProperties(PacketTypes.SUBSCRIBE)
        subscribe_props.SubscriptionIdentifier = 42
        options = SubscribeOptions(qos=2, noLocal=True, retainAsPublished=True, retainHandling=1)
        client.subscribe([("cmd/1/#", options)], properties=subscribe_props)

    connected, pub, sub = capture(
        paho.MQTTv5, V5, act, 3, clean_start=False, properties=connect_props
    )
    assert connected == Connect(
        V5,
        "paho-dev",
        False,
        30,
        "user",
        b"secret",
        Will("dev/will", b"gone", 1, True, {mq.WILL_DELAY: 30}),
        {mq.SESSION_EXPIRY: 3600, mq.RECEIVE_MAXIMUM: 20},
    )
    assert isinstance(pub, Publish)
    assert (pub.topic, pub.payload, pub.qos) == ("dev/1/temp", b"21.5", 1)
    assert pub.properties == {
        mq.MESSAGE_EXPIRY: 60,
        mq.CONTENT_TYPE: "text/plain",
        mq.RESPONSE_TOPIC: "dev/1/reply",
        mq.CORRELATION_DATA: b"\x01\x02",
        mq.PAYLOAD_FORMAT: 1,
        mq.USER_PROPERTY: [("k", "v"), ("k", "w")],
    }
    assert isinstance(sub, Subscribe)
    # QoS 2 | no local | retain as published | retain handling 1
    assert sub == Subscribe(sub.packet_id, [("cmd/1/#", 0x1E)], {mq.SUBSCRIPTION_ID: [42]})


# -- fuzz ----------------------------------------------------------------------------------------


def seeds() -> list[tuple[int, bytes]]:
    """Valid packets of every type in both versions, most with properties: what the fuzz
    mutates, with the version each was encoded for."""
    out = [(version, data) for _, version, _, data, _ in VECTORS]
    for version in (V311, V5):
        rich: dict[int, dict[int, Any]] = {}
        for kind in range(1, 16):
            chosen: dict[int, Any] = {}
            for pid, info in PROPERTIES.items():
                if kind in info.packets and not (kind == PUBLISH and pid == mq.SUBSCRIPTION_ID):
                    chosen[pid] = SAMPLE_VALUES[pid]
            rich[kind] = chosen if version == V5 else {}
        will = Will("w/x", b"will", 2, True, {mq.WILL_DELAY: 9, mq.USER_PROPERTY: [("a", "b")]})
        built: list[Packet] = [
            Connect(version, "client-\u00e9", False, 60, "me", b"pw", will, rich[CONNECT]),
            Connect(version, "", True, 0, None, None, None, {}),
            ConnAck(True, 0, rich[CONNACK]),
            Publish("t/\u00fc/x", bytes(range(40)), 1, True, True, 300, rich[PUBLISH]),
            Publish("a", b"", 0, False, False, None, {}),
            Publish("b/c", b"x" * 200, 2, False, False, 65535, rich[PUBLISH]),
            Subscribe(
                9, [("a/+/#", 1), ("b", 2 | (0x2C if version == V5 else 0))], rich[SUBSCRIBE]
            ),
            SubAck(9, [0, 1, 2, 0x80], rich[SUBACK]),
            Unsubscribe(9, ["a/+/#", "b"], rich[UNSUBSCRIBE]),
            UnsubAck(9, [0, 0x11] if version == V5 else [], rich[UNSUBACK]),
            PingReq(),
            PingResp(),
            Disconnect(0x04 if version == V5 else 0, rich[mq.DISCONNECT]),
        ]
        for kind in (PUBACK, PUBREC, PUBREL, PUBCOMP):
            code = 0x80 if kind in (PUBACK, PUBREC) else 0x92
            built.append(Ack(kind, 77, code if version == V5 else 0, rich[kind]))
        if version == V5:
            built.append(Auth(0x18, rich[mq.AUTH]))
            built.append(Publish("s", b"p", 1, False, False, 5, {mq.SUBSCRIPTION_ID: [1, 16384]}))
        out += [(version, encode(packet, version)) for packet in built]
    return out


SAMPLE_VALUES: dict[int, Any] = {
    pid: {
        mq.BYTE: 1,
        mq.U16: 300,
        mq.U32: 70_000,
        mq.UTF8: "t/\u00e9",
        mq.BINARY: b"\x00\xff",
        mq.PAIR: [("k", "v"), ("k2", "")],
        mq.VARINT: [129],
    }[info.kind]
    for pid, info in PROPERTIES.items()
}
SAMPLE_VALUES[mq.RESPONSE_TOPIC] = "reply/to"


def property_offset(data: bytes) -> int | None:
    """Where the 5.0 property section of ``data`` starts (index into the whole packet)."""
    first, offset, total = split(data, MAX) or (0, 0, 0)
    kind, body = first >> 4, data[offset:total]
    if kind == CONNECT:
        at = 10
    elif kind == PUBLISH:
        at = 2 + int.from_bytes(body[:2], "big") + (2 if first & 0x06 else 0)
    elif kind in (CONNACK, SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK):
        at = 2
    elif kind in (PUBACK, PUBREC, PUBREL, PUBCOMP) and len(body) >= 4:
        at = 3
    elif kind in (mq.DISCONNECT, mq.AUTH) and len(body) >= 2:
        at = 1
    else:
        return None
    return offset + at


def read_varint(data: bytes, at: int) -> tuple[int, int] | None:
    """The variable byte integer at ``at`` and where it ends, None if it runs off ``data``."""
    value = shift = 0
    while at < len(data):
        value |= (data[at] & 0x7F) << shift
        at += 1
        if data[at - 1] < 0x80:
            return value, at
        shift += 7
    return None


def rebuild(first: int, body: bytes) -> bytes:
    return bytes([first]) + varint(min(len(body), mq.MAX_VARINT)) + body


def property_soup(rng: random.Random) -> bytes:
    """A run of properties, mostly well-typed, some of them wrong in one way or another."""
    out = bytearray()
    for _ in range(rng.randrange(1, 7)):
        pid = rng.choice([*PROPERTIES, *PROPERTIES, 0, 0x7F, 0x80, rng.randrange(256)])
        out.append(pid)
        ptype = PROPERTIES[pid].kind if pid in PROPERTIES else rng.choice(list(SAMPLE_KINDS))
        out += SAMPLE_KINDS[ptype](rng)
    return bytes(out)


def _fuzz_text(rng: random.Random) -> bytes:
    raw = rng.choice(
        [b"", b"a/b", "\u00e9".encode(), b"\xff", b"\x00", b"+", b"#", b"\xed\xa0\x80"]
    )
    size = len(raw) + rng.choice([0, 0, 0, 0, -1, 1, 300])
    return max(size, 0).to_bytes(2, "big") + raw


SAMPLE_KINDS: dict[str, Callable[[random.Random], bytes]] = {
    mq.BYTE: lambda rng: bytes([rng.choice([0, 1, 1, 2, 255])]),
    mq.U16: lambda rng: rng.choice([0, 1, 0xFFFF]).to_bytes(2, "big")[: rng.choice([2, 2, 1])],
    mq.U32: lambda rng: rng.choice([0, 5, 0xFFFFFFFF]).to_bytes(4, "big")[: rng.choice([4, 4, 3])],
    mq.VARINT: lambda rng: rng.choice(
        [b"\x00", b"\x01", b"\x81\x01", b"\x80\x00", b"\xff\xff\xff\x7f", b"\xff\xff\xff\xff\x01"]
    ),
    mq.UTF8: _fuzz_text,
    mq.BINARY: _fuzz_text,
    mq.PAIR: lambda rng: _fuzz_text(rng) + _fuzz_text(rng),
}


def mutate(rng: random.Random, data: bytes, version: int, seeds_: list[tuple[int, bytes]]) -> bytes:
    """One mutation of valid packet ``data``; the remaining length is mostly kept consistent so
    that the mutated body reaches the decoder."""
    found = split(data, MAX)
    assert found is not None
    first, offset, _ = found
    body = data[offset:]
    how = rng.randrange(10)
    if how == 0:  # bit flips anywhere, the fixed header included
        raw = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return bytes(raw)
    if how == 1:  # bit flips in the body only
        raw = bytearray(body)
        for _ in range(rng.randrange(1, 4)):
            if raw:
                raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return rebuild(first, bytes(raw))
    if how == 2:  # truncation, length fixed (or not: then split waits for more)
        cut = rng.randrange(len(body) + 1)
        return rebuild(first, body[:cut]) if rng.random() < 0.8 else data[: offset + cut]
    if how == 3:  # insertion of random bytes
        at = rng.randrange(len(body) + 1)
        extra = rng.randbytes(rng.randrange(1, 9))
        return rebuild(first, body[:at] + extra + body[at:])
    if how == 4:  # deletion of a slice
        at = rng.randrange(len(body) + 1)
        return rebuild(first, body[:at] + body[at + rng.randrange(1, 6) :])
    if how == 5:  # varint games with the remaining length
        size = len(body)
        length = rng.choice(
            [
                varint(size)[:-1] + bytes([varint(size)[-1] | 0x80, 0]),  # not minimal
                b"\xff\xff\xff\xff\x01",
                varint(max(size + rng.randrange(-3, 4), 0)),
                b"\x80\x80\x80\x80",
                varint(size) + b"\x00",
            ]
        )
        return bytes([first]) + length + body
    if how == 6:  # another first byte: every type, every flag
        return rebuild(rng.randrange(256), body)
    if how in (7, 8):  # property soup in the property section, its length right or nearly
        soup = property_soup(rng)
        section = varint(max(len(soup) + rng.choice([0, 0, 0, 0, -1, 1, 5]), 0)) + soup
        start = property_offset(data)
        old = read_varint(data, start) if start is not None and version == V5 else None
        if start is None or old is None:  # no property section: the soup lands anywhere
            at = rng.randrange(len(body) + 1)
            return rebuild(first, body[:at] + section + body[at:])
        size, after = old
        return rebuild(first, data[offset:start] + section + data[after + size :])
    _, other = rng.choice(seeds_)  # two packets spliced
    cut = rng.randrange(len(body) + 1)
    return rebuild(first, body[:cut] + other[rng.randrange(len(other)) :])


REASONS = {None} | set(range(0x80, 0xA3)) | {0x01, 0x02}


def fuzz_one(data: bytes, versions: tuple[int, ...]) -> int:
    """Frame and decode ``data`` in both directions; what decodes must re-encode and decode to
    the same value. Returns how many decodes succeeded."""
    try:
        found = split(data, MAX)
    except MqttProtocolError as exc:
        assert exc.code in REASONS and "\n" not in str(exc)
        return 0
    if found is None:
        return 0
    first, offset, total = found
    body = memoryview(data)[offset:total]
    decoded = 0
    for version in versions:
        for from_client in (True, False):
            try:
                packet = decode(first, body, version, from_client=from_client)
            except MqttProtocolError as exc:
                assert exc.code in REASONS and "\n" not in str(exc), (exc, exc.code)
                continue
            decoded += 1
            again = encode(packet, version)
            assert read(again, version, from_client=from_client) == packet, data.hex()
    return decoded


def test_fuzzed_packets_decode_or_are_refused_and_what_decodes_round_trips() -> None:
    rng = random.Random(20261123)
    corpus = seeds()
    decoded = refused = 0
    for i in range(100_000):
        if i % 10 == 0:  # random bytes, read as either version
            size = rng.randrange(0, 24)
            if rng.random() < 0.5:
                data = rng.randbytes(size + 2)
            else:
                data = rebuild(rng.randrange(256), rng.randbytes(size))
            versions: tuple[int, ...] = (V311, V5)
        else:
            version, seed = rng.choice(corpus)
            data = mutate(rng, seed, version, corpus)
            if rng.random() < 0.2 and split_ok(data):  # mutations of mutations
                data = mutate(rng, data, version, corpus)
            versions = (version,)
        try:
            ok = fuzz_one(data, versions)
        except AssertionError:
            raise
        except Exception as exc:  # the decoder (or encode of what it accepted) failing
            raise AssertionError(f"iteration {i}: {type(exc).__name__} on {data.hex()}") from exc
        decoded += ok > 0
        refused += ok == 0
    # The mutations must reach deep: plenty decode (about 16,000 with this seed), most do not.
    assert decoded > 10_000 and refused > 50_000, (decoded, refused)


def split_ok(data: bytes) -> bool:
    try:
        found = split(data, MAX)
    except MqttProtocolError:
        return False
    return found is not None and found[2] == len(data)
