"""MQTT 3.1.1 packets: framing, decoding and encoding, sans-IO (bytes in, values out).

The codec is ``amqtt``'s packet classes (see pyproject.toml's ``[mqtt]`` extra); this module
frames packets itself — the fixed header's type byte and remaining-length varint, the only bytes
parsed by hand — so that a packet reaches the codec whole and within ``aaabus.mqtt.max_packet``,
and drives amqtt's ``async`` decoders synchronously over an in-memory buffer (they never wait:
the buffer holds the whole packet). What amqtt checks loosely is checked here: the protocol name
and level of CONNECT (3.1.1 only: amqtt would misread 5.0 as 3.1.1), the reserved flag bits of
each packet type, and the strict UTF-8 (without NUL) of every string a client sends: PUBLISH
topics, SUBSCRIBE and UNSUBSCRIBE filters, a CONNECT's client id, will topic and user name
(amqtt turns invalid UTF-8 into the text of a bytes literal instead of refusing it).

Every refusal raises :class:`~aaabus.errors.MqttProtocolError`, one line; its ``code`` is the
CONNACK return code when the protocol has one for it.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from amqtt.adapters import BufferReader
from amqtt.mqtt.connack import ConnackPacket
from amqtt.mqtt.connect import ConnectPacket
from amqtt.mqtt.packet import (
    CONNECT,
    DISCONNECT,
    PINGREQ,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREC,
    PUBREL,
    SUBSCRIBE,
    UNSUBSCRIBE,
)
from amqtt.mqtt.pingresp import PingRespPacket
from amqtt.mqtt.puback import PubackPacket
from amqtt.mqtt.pubcomp import PubcompPacket
from amqtt.mqtt.publish import PublishPacket
from amqtt.mqtt.pubrec import PubrecPacket
from amqtt.mqtt.pubrel import PubrelPacket
from amqtt.mqtt.suback import SubackPacket
from amqtt.mqtt.subscribe import SubscribePacket
from amqtt.mqtt.unsuback import UnsubackPacket
from amqtt.mqtt.unsubscribe import UnsubscribePacket

from aaabus.errors import MqttProtocolError

__all__ = [
    "CONNECT",
    "DISCONNECT",
    "PINGREQ",
    "PUBACK",
    "PUBCOMP",
    "PUBLISH",
    "PUBREC",
    "PUBREL",
    "SUBSCRIBE",
    "UNSUBSCRIBE",
    "connack",
    "decode",
    "pingresp",
    "puback",
    "pubcomp",
    "publish",
    "pubrec",
    "pubrel",
    "split",
    "suback",
    "unsuback",
]

#: CONNACK return codes of MQTT 3.1.1.
UNACCEPTABLE_PROTOCOL = 0x01
IDENTIFIER_REJECTED = 0x02
BAD_CREDENTIALS = 0x04
NOT_AUTHORIZED = 0x05

_CLASSES: dict[int, Any] = {
    CONNECT: ConnectPacket,
    PUBLISH: PublishPacket,
    PUBACK: PubackPacket,
    PUBREC: PubrecPacket,
    PUBREL: PubrelPacket,
    PUBCOMP: PubcompPacket,
    SUBSCRIBE: SubscribePacket,
    UNSUBSCRIBE: UnsubscribePacket,
    PINGREQ: None,
    DISCONNECT: None,
}

#: The flag bits that 3.1.1 fixes for each packet a client may send (PUBLISH's are free).
_FLAGS = {PUBREL: 0x2, SUBSCRIBE: 0x2, UNSUBSCRIBE: 0x2}


def split(buffer: bytes | bytearray, max_packet: int) -> tuple[int, int, bytes] | None:
    """The first whole packet of ``buffer`` as ``(first byte, total length, packet bytes)``, or
    None if more bytes are needed. Refuses a varint over 4 bytes and a packet over
    ``max_packet`` as soon as its length is known (before its body arrives)."""
    length = 0
    for i in range(1, 5):
        if i >= len(buffer):
            return None
        byte = buffer[i]
        length |= (byte & 0x7F) << (7 * (i - 1))
        if not byte & 0x80:
            total = i + 1 + length
            if total > max_packet:
                raise MqttProtocolError(f"packet of {total} bytes over the limit {max_packet}")
            if len(buffer) < total:
                return None
            return buffer[0], total, bytes(buffer[:total])
    raise MqttProtocolError("remaining length longer than 4 bytes")


def _run(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run an amqtt decoder to its end: over a memory buffer it never suspends."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise MqttProtocolError("decoder waited for input it should have had")


def _body(packet: bytes) -> int:
    """Where the variable header starts: after the type byte and the remaining-length varint."""
    start = 1
    while packet[start] & 0x80:
        start += 1
    return start + 1


def _field(packet: bytes, at: int, what: str) -> tuple[bytes, int]:
    """The length-prefixed field at ``at`` and where the next one starts."""
    size = int.from_bytes(packet[at : at + 2], "big")
    raw = packet[at + 2 : at + 2 + size]
    if at + 2 > len(packet) or len(raw) != size:
        raise MqttProtocolError(f"{what} runs past the packet")
    return raw, at + 2 + size


def _text(raw: bytes, what: str) -> str:
    """A string field, strictly: UTF-8 without NUL (MQTT 3.1.1, section 1.5.3)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MqttProtocolError(f"{what} is not valid UTF-8") from None
    if "\0" in text:
        raise MqttProtocolError(f"{what} holds a NUL character")
    return text


def _strict_topic(packet: bytes) -> None:
    raw, _ = _field(packet, _body(packet), "PUBLISH topic")
    topic = _text(raw, "PUBLISH topic")
    if not topic or "+" in topic or "#" in topic:
        raise MqttProtocolError(f"PUBLISH topic {topic[:60]!r} is empty or has a wildcard")


def _strict_strings(kind: int, packet: bytes) -> None:
    """The string fields amqtt would decode loosely, checked on the raw bytes: a CONNECT's
    client id, will topic and user name; the filters of a SUBSCRIBE or UNSUBSCRIBE."""
    at = _body(packet)
    if kind == CONNECT:
        if len(packet) < at + 10:
            raise MqttProtocolError("CONNECT shorter than its variable header")
        flags = packet[at + 7]
        raw, at = _field(packet, at + 10, "CONNECT client id")
        _text(raw, "CONNECT client id")
        if flags & 0x04:  # will flag: a will topic (string), then a will message (bytes)
            raw, at = _field(packet, at, "CONNECT will topic")
            _text(raw, "CONNECT will topic")
            _raw, at = _field(packet, at, "CONNECT will message")
        if flags & 0x80:  # user name flag
            raw, at = _field(packet, at, "CONNECT user name")
            _text(raw, "CONNECT user name")
        return
    at += 2  # the packet identifier
    while at < len(packet):
        raw, at = _field(packet, at, "topic filter")
        _text(raw, "topic filter")
        if kind == SUBSCRIBE:
            at += 1  # the requested QoS


def decode(first: int, packet: bytes) -> Any:
    """Decode one whole client packet (from :func:`split`): an amqtt packet object, or the
    packet type (``PINGREQ``, ``DISCONNECT``) for those that carry nothing."""
    kind, flags = first >> 4, first & 0x0F
    if kind not in _CLASSES:
        raise MqttProtocolError(f"packet type {kind} is not one a client sends")
    if kind != PUBLISH and flags != _FLAGS.get(kind, 0):
        raise MqttProtocolError(f"packet type {kind} with reserved flags {flags:#x}")
    cls = _CLASSES[kind]
    if kind == PUBLISH:
        if (flags >> 1) & 3 == 3:
            raise MqttProtocolError("PUBLISH with QoS 3")
        _strict_topic(packet)
    if kind in (CONNECT, SUBSCRIBE, UNSUBSCRIBE):
        _strict_strings(kind, packet)
    if cls is None:
        if len(packet) != 2:
            raise MqttProtocolError(f"packet type {kind} with a body")
        return kind
    try:
        decoded = _run(cls.from_stream(BufferReader(packet)))
    except MqttProtocolError:
        raise
    except Exception as exc:  # amqtt raises a mix of its own errors, ValueError, struct.error
        raise MqttProtocolError(f"malformed packet type {kind} ({type(exc).__name__})") from None
    if kind == CONNECT:
        if decoded.proto_name != "MQTT" or decoded.proto_level != 4:
            raise MqttProtocolError(
                f"protocol {decoded.proto_name!r} level {decoded.proto_level}: only MQTT 3.1.1",
                UNACCEPTABLE_PROTOCOL,
            )
        if decoded.reserved_flag:
            raise MqttProtocolError("CONNECT with the reserved flag set")
    elif kind in (SUBSCRIBE, UNSUBSCRIBE) and not decoded.payload.topics:
        raise MqttProtocolError(f"packet type {kind} without a topic filter")
    return decoded


def connack(session_present: bool, code: int) -> bytes:
    return ConnackPacket.build(int(session_present), code).to_bytes()


def publish(
    topic: str, payload: bytes, packet_id: int | None, qos: int, retain: bool, dup: bool
) -> bytes:
    return PublishPacket.build(topic, payload, packet_id, dup, qos, retain).to_bytes()


def puback(packet_id: int) -> bytes:
    return PubackPacket.build(packet_id).to_bytes()


def pubrec(packet_id: int) -> bytes:
    return PubrecPacket.build(packet_id).to_bytes()


def pubrel(packet_id: int) -> bytes:
    return PubrelPacket.build(packet_id).to_bytes()


def pubcomp(packet_id: int) -> bytes:
    return PubcompPacket.build(packet_id).to_bytes()


def suback(packet_id: int, codes: list[int]) -> bytes:
    return SubackPacket.build(packet_id, codes).to_bytes()


def unsuback(packet_id: int) -> bytes:
    return UnsubackPacket.build(packet_id).to_bytes()


def pingresp() -> bytes:
    return PingRespPacket.build().to_bytes()
