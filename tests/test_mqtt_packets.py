"""The MQTT listener's sans-IO parts: framing and decoding (amqtt's codec behind our checks),
the credentials file, and a fuzz of the packet handling (any bytes: a packet, a refusal with one
line, or "more bytes needed" — never another exception)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aaabus.errors import ConfigError, MqttProtocolError
from aaabus.io import mqttpackets as mp
from aaabus.io.mqttauth import Credentials, hash_password, main

MAX = 1 << 16


def connect_packet(
    client_id: str | bytes = "dev", level: int = 4, flags: int = 0x02, extra: bytes = b""
) -> bytes:
    """A CONNECT built by hand (the codec under test must not build its own input)."""

    def text(s: str | bytes) -> bytes:
        raw = s if isinstance(s, bytes) else s.encode()
        return len(raw).to_bytes(2, "big") + raw

    body = text("MQTT") + bytes([level, flags]) + (60).to_bytes(2, "big") + text(client_id) + extra
    return bytes([0x10, len(body)]) + body


def publish_packet(topic: bytes, payload: bytes = b"x", qos: int = 1, pid: int = 7) -> bytes:
    body = len(topic).to_bytes(2, "big") + topic
    if qos:
        body += pid.to_bytes(2, "big")
    body += payload
    return bytes([0x30 | qos << 1, len(body)]) + body


def decode_one(packet: bytes) -> object:
    found = mp.split(packet, MAX)
    assert found is not None
    first, total, whole = found
    assert total == len(packet)
    return mp.decode(first, whole)


def test_split_waits_for_a_whole_packet_and_returns_it_with_its_length() -> None:
    packet = publish_packet(b"a/b", b"payload")
    for cut in range(len(packet)):
        assert mp.split(packet[:cut], MAX) is None
    assert mp.split(packet + b"\xc0\x00", MAX) == (packet[0], len(packet), packet)


def test_split_refuses_an_oversized_packet_before_its_body_arrives() -> None:
    header = bytes([0x30, 0xFF, 0xFF, 0x7F])  # 2 MiB announced, nothing of it sent
    with pytest.raises(MqttProtocolError, match="over the limit"):
        mp.split(header, MAX)
    with pytest.raises(MqttProtocolError, match="longer than 4 bytes"):
        mp.split(bytes([0x30, 0xFF, 0xFF, 0xFF, 0xFF, 0x01]), 1 << 30)


def test_publish_round_trip_keeps_topic_payload_qos_retain_and_id() -> None:
    packet = mp.publish("site/1/temp", b"\x00\xff21.5", 513, 2, True, True)
    decoded = decode_one(packet)
    assert (decoded.topic_name, decoded.data, decoded.qos) == ("site/1/temp", b"\x00\xff21.5", 2)  # type: ignore[attr-defined]
    assert decoded.packet_id == 513 and decoded.retain_flag and decoded.dup_flag  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("packet", "reason"),
    [
        (publish_packet(b"a/+/b"), "wildcard"),
        (publish_packet(b"a/#"), "wildcard"),
        (publish_packet(b"a/\xff\xfe"), "UTF-8"),
        (publish_packet(b""), "empty"),
        (publish_packet(b"a", qos=3), "QoS 3"),
        (bytes([0x60, 0x02, 0x00, 0x01]), "reserved flags"),  # PUBREL must carry flags 0x2
        (bytes([0x20, 0x02, 0x00, 0x00]), "not one a client sends"),  # CONNACK
        (bytes([0xC0, 0x01, 0x00]), "with a body"),  # PINGREQ with a body
        (bytes([0x82, 0x02, 0x00, 0x01]), "without a topic filter"),  # SUBSCRIBE of nothing
        (bytes([0x82, 0x08, 0x00, 0x01, 0x00, 0x03]) + b"a/\xff" + b"\x01", "filter is not valid"),
        (bytes([0xA2, 0x07, 0x00, 0x02, 0x00, 0x03]) + b"a\x00b", "filter holds a NUL"),
        (connect_packet(b"d\xff"), "client id is not valid"),
        # User name flag set: the name, then a password of raw bytes (any bytes are fine there).
        (
            connect_packet(flags=0xC2, extra=b"\x00\x02\xc3\x28\x00\x02\xff\xfe"),
            "user name is not valid",
        ),
        (connect_packet(flags=0x06, extra=b"\x00\x02w\x00\x00\x01m"), "will topic holds a NUL"),
        (connect_packet(flags=0x82, extra=b"\x00\x09ab"), "user name runs past"),
    ],
)
def test_decode_refuses_what_mqtt_forbids(packet: bytes, reason: str) -> None:
    with pytest.raises(MqttProtocolError, match=reason):
        decode_one(packet)


def test_connect_of_another_protocol_level_is_refused_with_connack_code_1() -> None:
    with pytest.raises(MqttProtocolError) as refused:
        decode_one(connect_packet(level=5))
    assert refused.value.code == mp.UNACCEPTABLE_PROTOCOL
    connect = decode_one(connect_packet())
    assert connect.client_id == "dev" and connect.clean_session_flag  # type: ignore[attr-defined]


def test_credentials_accept_the_right_password_only(tmp_path: Path) -> None:
    path = tmp_path / "mqtt.passwd"
    path.write_text(f"# devices\nsensor:{hash_password('s3cret')}\n\n")
    creds = Credentials.load(path)
    assert creds.check("sensor", "s3cret")
    assert not creds.check("sensor", "s3cret ")
    assert not creds.check("other", "s3cret")
    assert not creds.check(None, None)


def test_a_malformed_credentials_line_is_one_config_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "mqtt.passwd"
    path.write_text(f"sensor:{hash_password('x')}\nbroken line\n")
    with pytest.raises(ConfigError, match=r"line 2 is not user:scrypt"):
        Credentials.load(path)
    with pytest.raises(ConfigError, match="unreadable"):
        Credentials.load(tmp_path / "missing")


def test_the_hashing_command_prints_a_line_the_file_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("pw\n"))
    assert main(["meter"]) == 0
    path = tmp_path / "f"
    path.write_text(capsys.readouterr().out)
    assert Credentials.load(path).check("meter", "pw")


def _valid_packets() -> list[bytes]:
    return [
        connect_packet(),
        connect_packet("é-dev", flags=0xC6, extra=b"\x00\x01w\x00\x01m\x00\x02us\x00\x02\xff\xfe"),
        publish_packet(b"a/b", b"hello", qos=0),
        publish_packet(b"a/b", b"hello", qos=2, pid=9),
        bytes([0x82, 0x08, 0x00, 0x01, 0x00, 0x03]) + b"a/#" + b"\x01",
        bytes([0xA2, 0x07, 0x00, 0x02, 0x00, 0x03]) + b"a/#",
        bytes([0x40, 0x02, 0x00, 0x05]),
        bytes([0x62, 0x02, 0x00, 0x05]),
        bytes([0xC0, 0x00]),
        bytes([0xE0, 0x00]),
    ]


def _feed(data: bytes) -> None:
    """What a connection does with ``data``: split and decode packets until it needs more
    bytes or refuses; anything but MqttProtocolError escaping is a bug."""
    buffer = bytearray(data)
    try:
        while (found := mp.split(buffer, MAX)) is not None:
            first, total, packet = found
            del buffer[:total]
            mp.decode(first, packet)
    except MqttProtocolError as exc:
        assert "\n" not in str(exc)


@settings(max_examples=400, deadline=None, derandomize=True)
@given(st.binary(max_size=300))
def test_fuzz_any_bytes_decode_or_are_refused_in_one_line(data: bytes) -> None:
    _feed(data)


def test_fuzz_mutated_valid_packets_decode_or_are_refused_in_one_line() -> None:
    rng = random.Random(16)
    packets = _valid_packets()
    for _ in range(20000):
        data = bytearray(rng.choice(packets))
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(data) + 1)
            op = rng.random()
            if op < 0.6 and i < len(data):
                data[i] = rng.randrange(256)
            elif op < 0.8 and i < len(data):
                del data[i]
            else:
                data.insert(i, rng.randrange(256))
        _feed(bytes(data))
