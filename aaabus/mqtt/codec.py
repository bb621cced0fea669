"""MQTT 3.1.1 and 5.0 packets: framing, decoding and encoding, sans-IO (bytes in, values out).

What it is: pure functions over bytes and small dataclasses, one per packet type. :func:`split`
finds the first whole packet in the bytes a connection has received, :func:`decode` turns its body
into a dataclass, checking everything the specifications let a receiver check on one packet, and
:func:`encode` (with the lean per-message paths :func:`encode_publish` and :func:`encode_ack`)
turns a dataclass back into bytes. No sockets, threads or clocks: the connection decides buffers,
limits and when a packet leaves; the session state (packet ids in flight, topic aliases, the
order of CONNECT, AUTH exchanges) is the protocol layer's, not this module's.

Why owned: the packet libraries available to the bus (docs/mqtt.md, "The packet library") either
speak 3.1.1 only with ``async`` decoders and a broker's dependencies (amqtt), or 5.0 only, or are
clients whose codec is private. Written from the OASIS specifications, MQTT 3.1.1 (2014) and MQTT
5.0 (2019); section numbers below are theirs ("3.1.1 §x" and "5.0 §x").

What is checked, raising :class:`~aaabus.errors.MqttProtocolError` (one line) for each refusal:

* framing: the remaining length is a minimal variable byte integer of at most 4 bytes, and a
  packet over the connection's limit is refused as soon as its length is known;
* the fixed header's reserved flags of every packet type, PUBLISH's QoS (not 3) and DUP (not at
  QoS 0); which side may send each packet type; AUTH only in 5.0;
* every field within the packet, no byte after the last field; packet identifiers non-zero;
* strings strictly UTF-8 (no surrogates, no overlong forms) without U+0000;
* topic names neither empty (5.0: unless a Topic Alias stands for the name) nor with wildcards;
  topic filters by :func:`aaabus.model.topicnames.check_filter`, and 5.0 shared subscriptions'
  ``$share/{name}/{filter}`` form; SUBSCRIBE and UNSUBSCRIBE with at least one filter and valid
  subscription options;
* CONNECT: protocol name and level, reserved flag, will flags, the 3.1.1 password-needs-user-name
  rule, a 3.1.1 persistent session's non-empty client id;
* 5.0 properties: each only in the packets the specification lists (§2.2.2.2), at most once unless
  repeatable, every value in range; reason codes among those each packet type may carry.

``MqttProtocolError.code`` says what to answer: for CONNECT, the CONNACK code in the version the
CONNECT asked for (None: close without CONNACK); for any other packet, the 5.0 DISCONNECT reason
code (a 3.1.1 connection just closes).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, TypeAlias

from aaabus.errors import MqttProtocolError, TopicError
from aaabus.model.topicnames import check_filter
from aaabus.mqtt.codes import (
    ALLOWED,
    AUTH,
    AUTH_DATA,
    AUTH_METHOD,
    BINARY,
    BYTE,
    CLIENT_ID_NOT_VALID,
    CONNACK,
    CONNECT,
    DISCONNECT,
    IDENTIFIER_REJECTED,
    MALFORMED,
    MAX_VARINT,
    MAXIMUM_PACKET_SIZE,
    NAMES,
    NOT_AUTHORIZED_311,
    PACKET_TOO_LARGE,
    PAIR,
    PINGREQ,
    PINGRESP,
    PROPERTIES,
    PROTOCOL_ERROR,
    PUBACK,
    PUBCOMP,
    PUBLISH,
    PUBREL,
    REASON_CODES,
    RECEIVE_MAXIMUM,
    RESPONSE_TOPIC,
    SESSION_EXPIRY,
    SUBACK,
    SUBSCRIBE,
    SUBSCRIPTION_ID,
    SUCCESS,
    TOPIC_ALIAS,
    TOPIC_ALIAS_INVALID,
    TOPIC_FILTER_INVALID,
    TOPIC_NAME_INVALID,
    U16,
    U32,
    UNACCEPTABLE_PROTOCOL,
    UNBOUNDED,
    UNSUBACK,
    UNSUBSCRIBE,
    UNSUPPORTED_VERSION,
    USER_PROPERTY,
    UTF8,
    V5,
    V311,
    VARINT,
    WILL_KEY,
    UserBound,
)

# The API; the packet types, properties and reason codes are aaabus.mqtt.codes' (mq.NAME).
__all__ = [
    "Ack",
    "Auth",
    "ConnAck",
    "Connect",
    "Disconnect",
    "Packet",
    "PingReq",
    "PingResp",
    "Properties",
    "Publish",
    "SubAck",
    "Subscribe",
    "UnsubAck",
    "Unsubscribe",
    "Will",
    "decode",
    "encode",
    "encode_ack",
    "encode_publish",
    "split",
]

#: SUBACK return codes of 3.1.1 (§3.9.3): granted QoS 0-2, or failure.
_SUBACK_311 = frozenset({0x00, 0x01, 0x02, 0x80})

# -- packets --------------------------------------------------------------------------------------

Properties: TypeAlias = dict[int, Any]


@dataclass(slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Connect:
    """``version``: the protocol level asked for (V311 or V5); ``client_id`` "" when the client
    left it to the server; ``clean``: 3.1.1 Clean Session, 5.0 Clean Start."""

    version: int
    client_id: str
    clean: bool
    keep_alive: int
    username: str | None
    password: bytes | None
    will: Will | None
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class ConnAck:
    session_present: bool
    code: int
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Publish:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    packet_id: int | None
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Ack:
    """PUBACK, PUBREC, PUBREL or PUBCOMP (``kind``); ``code`` and ``properties`` are 5.0's."""

    kind: int
    packet_id: int
    code: int = 0
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Subscribe:
    """``topics``: (filter, options byte): QoS in bits 0-1; 5.0: no-local bit 2,
    retain-as-published bit 3, retain handling bits 4-5."""

    packet_id: int
    topics: list[tuple[str, int]]
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class _Answered:
    """The fields of SUBACK and UNSUBACK (two packet types, one layout): a code per filter."""

    packet_id: int
    codes: list[int]
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class SubAck(_Answered):
    """A granted QoS or a failure per filter of the SUBSCRIBE."""


@dataclass(slots=True)
class Unsubscribe:
    packet_id: int
    filters: list[str]
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class UnsubAck(_Answered):
    """``codes`` is empty in 3.1.1, whose UNSUBACK carries none."""


@dataclass(slots=True)
class PingReq:
    pass


@dataclass(slots=True)
class PingResp:
    pass


@dataclass(slots=True)
class Disconnect:
    code: int = 0
    properties: Properties = field(default_factory=dict)


@dataclass(slots=True)
class Auth:
    code: int = 0
    properties: Properties = field(default_factory=dict)


Packet: TypeAlias = (
    Connect
    | ConnAck
    | Publish
    | Ack
    | Subscribe
    | SubAck
    | Unsubscribe
    | UnsubAck
    | PingReq
    | PingResp
    | Disconnect
    | Auth
)

# -- framing --------------------------------------------------------------------------------------


def split(buffer: bytes | bytearray | memoryview, max_packet: int) -> tuple[int, int, int] | None:
    """The first whole packet of ``buffer`` as ``(first byte, offset of its variable header,
    total length)``, or None while more bytes are needed.

    The remaining length must be a minimal variable byte integer of at most 4 bytes (3.1.1 and
    5.0 §1.5.5/§2.2.3); a packet whose total length is over ``max_packet`` is refused as soon as
    the length is known, before its body arrives (code PACKET_TOO_LARGE)."""
    size = len(buffer)
    if size < 2:
        return None
    byte = buffer[1]
    if byte < 0x80:  # one length byte: nearly every packet of an MQTT device
        offset = 2
        total = 2 + byte
    else:
        length = byte & 0x7F
        offset = 2
        shift = 7
        while True:
            if offset >= size:
                return None
            byte = buffer[offset]
            offset += 1
            length |= (byte & 0x7F) << shift
            if byte < 0x80:
                if byte == 0:
                    raise MqttProtocolError(
                        "remaining length not minimally encoded (a final byte of 0)", MALFORMED
                    )
                break
            if offset == 5:
                raise MqttProtocolError("remaining length longer than 4 bytes", MALFORMED)
            shift += 7
        total = offset + length
    if total > max_packet:
        raise MqttProtocolError(
            f"packet of {total} bytes over the limit of {max_packet}", PACKET_TOO_LARGE
        )
    if size < total:
        return None
    return buffer[0], offset, total


# -- decoding helpers -----------------------------------------------------------------------------


def _bad(message: str, code: int | None = MALFORMED) -> MqttProtocolError:
    return MqttProtocolError(message, code)


def _u16(b: bytes, at: int, end: int, what: str) -> int:
    if at + 2 > end:
        raise _bad(f"{what} runs past the end of the packet")
    return b[at] << 8 | b[at + 1]


def _packet_id(b: bytes, kind: int) -> int:
    pid = _u16(b, 0, len(b), f"{NAMES[kind]} packet identifier")
    if not pid:
        # 3.1.1 §2.3.1 and 5.0 §2.2.1: a packet identifier is never 0.
        raise _bad(f"{NAMES[kind]} with packet identifier 0", PROTOCOL_ERROR)
    return pid


def _varint(b: bytes, at: int, end: int, what: str) -> tuple[int, int]:
    value = 0
    for i in range(4):
        if at >= end:
            raise _bad(f"{what} runs past the end of the packet")
        byte = b[at]
        at += 1
        value |= (byte & 0x7F) << (7 * i)
        if byte < 0x80:
            if byte == 0 and i:
                raise _bad(f"{what} not minimally encoded")
            return value, at
    raise _bad(f"{what} longer than 4 bytes")


def _bin(b: bytes, at: int, end: int, what: str) -> tuple[bytes, int]:
    if at + 2 > end:
        raise _bad(f"{what} runs past the end of the packet")
    stop = at + 2 + (b[at] << 8 | b[at + 1])
    if stop > end:
        raise _bad(f"{what} runs past the end of the packet")
    return b[at + 2 : stop], stop


def _str(b: bytes, at: int, end: int, what: str) -> tuple[str, int]:
    raw, at = _bin(b, at, end, what)
    try:
        # Python's strict UTF-8 codec refuses what 3.1.1/5.0 §1.5.3 call ill-formed: overlong
        # forms, encoded surrogates (U+D800..U+DFFF), code points over U+10FFFF.
        text = raw.decode()
    except UnicodeDecodeError:
        raise _bad(f"{what} is not valid UTF-8") from None
    if "\0" in text:
        raise _bad(f"{what} contains U+0000")
    return text, at


def _topic_name(topic: str, what: str) -> None:
    if not topic:
        raise _bad(f"{what} is empty", TOPIC_NAME_INVALID)
    if "+" in topic or "#" in topic:
        raise _bad(f"{what} {topic[:60]!r} contains a wildcard", TOPIC_NAME_INVALID)


def _topic_filter(text: str, v5: bool, what: str) -> None:
    try:
        check_filter(text)
    except TopicError as exc:
        raise _bad(f"{what}: {exc}"[:200], TOPIC_FILTER_INVALID) from None
    if v5 and text.startswith("$share/"):
        # 5.0 §4.8.2: $share/{ShareName}/{filter}, ShareName at least one character and
        # neither "/", "+" nor "#"; the filter after it not empty.
        parts = text.split("/", 2)
        if len(parts) < 3 or not parts[1] or "+" in parts[1] or "#" in parts[1] or not parts[2]:
            raise _bad(f"{what} {text[:60]!r} is not $share/name/filter", TOPIC_FILTER_INVALID)


def _properties(
    b: bytes, at: int, end: int, kind: int, what: str, bound: UserBound = UNBOUNDED
) -> tuple[Properties, int]:
    """The property section at ``at`` (its length, then properties) for packet ``kind``; its
    user properties within ``bound`` (see :data:`UserBound`)."""
    length, at = _varint(b, at, end, f"{what} property length")
    stop = at + length
    if stop > end:
        raise _bad(f"{what} properties run past the end of the packet")
    allowed = ALLOWED[kind]
    props: Properties = {}
    pairs: list[tuple[str, str]] | None = None
    most, room = bound
    while at < stop:
        # Identifiers are variable byte integers, but all defined ones are under 0x80: a first
        # byte of 0x80 or more is an unknown identifier whatever follows.
        pid = b[at]
        at += 1
        info = PROPERTIES.get(pid)
        if info is None:
            raise _bad(f"{what} with unknown property {pid:#04x}")
        if pid not in allowed:
            # 5.0 §2.2.2.2: an identifier not valid for the packet type is a Malformed Packet.
            raise _bad(f"{what} may not carry property {info.name}")
        ptype = info.kind
        value: Any
        if ptype is UTF8:
            value, at = _str(b, at, stop, f"{what} property {info.name}")
        elif ptype is U32:
            if at + 4 > stop:
                raise _bad(f"{what} property {info.name} runs past its section")
            value = int.from_bytes(b[at : at + 4], "big")
            at += 4
        elif ptype is U16:
            value = _u16(b, at, stop, f"{what} property {info.name}")
            at += 2
        elif ptype is BYTE:
            if at >= stop:
                raise _bad(f"{what} property {info.name} runs past its section")
            value = b[at]
            at += 1
            if value > 1:  # every byte property of 5.0 is 0 or 1
                raise _bad(f"{what} property {info.name} is {value}, not 0 or 1", PROTOCOL_ERROR)
        elif ptype is BINARY:
            value, at = _bin(b, at, stop, f"{what} property {info.name}")
        elif ptype is PAIR:
            # Checked against the bound before anything is built for it: a packet of many small
            # pairs costs the loop at most ``bound`` of them, then the connection.
            if at + 2 > stop:
                raise _bad(f"{what} user property runs past the end of the packet")
            mid = at + 2 + (b[at] << 8 | b[at + 1])
            if mid + 2 > stop:
                raise _bad(f"{what} user property runs past the end of the packet")
            after = mid + 2 + (b[mid] << 8 | b[mid + 1])
            if after > stop:
                raise _bad(f"{what} user property runs past the end of the packet")
            most -= 1
            room -= after - at + 1  # the identifier byte, the two strings with their lengths
            if most < 0 or room < 0:
                raise _bad(
                    f"{what} with user properties over {bound[0]} pairs or {bound[1]} bytes "
                    "(aaabus.mqtt.user_properties, user_properties_bytes)",
                    PACKET_TOO_LARGE,
                )
            try:
                key = b[at + 2 : mid].decode()
                val = b[mid + 2 : after].decode()
            except UnicodeDecodeError:
                raise _bad(f"{what} user property is not valid UTF-8") from None
            if "\0" in key or "\0" in val:
                raise _bad(f"{what} user property contains U+0000")
            if pairs is None:
                pairs = props[USER_PROPERTY] = []
            pairs.append((key, val))
            at = after
            continue
        else:  # VARINT: the subscription identifier
            value, at = _varint(b, at, stop, f"{what} subscription identifier")
            if not value:
                raise _bad(f"{what} with subscription identifier 0", PROTOCOL_ERROR)
            ids = props.get(SUBSCRIPTION_ID)
            if ids is None:
                props[SUBSCRIPTION_ID] = [value]
            elif kind == PUBLISH:  # one per matching subscription (5.0 §3.3.2.3.8)
                ids.append(value)
            else:
                raise _bad(f"{what} with two subscription identifiers", PROTOCOL_ERROR)
            continue
        if pid in props:
            raise _bad(f"{what} with property {info.name} twice", PROTOCOL_ERROR)
        if not value and pid in _NONZERO:
            raise _bad(f"{what} with property {info.name} of 0", _NONZERO[pid])
        props[pid] = value
    if RESPONSE_TOPIC in props:
        # 5.0 §3.3.2.3.5: a topic name, so no wildcard (and not empty, as every topic name).
        topic = props[RESPONSE_TOPIC]
        if not topic or "+" in topic or "#" in topic:
            raise _bad(f"{what} response topic {topic[:60]!r} is not a topic name", PROTOCOL_ERROR)
    return props, at


#: Properties whose value 0 is refused, with the reason code (5.0 §3.1.2.11, §3.2.2.3, §3.3.2.3).
_NONZERO = {
    RECEIVE_MAXIMUM: PROTOCOL_ERROR,
    MAXIMUM_PACKET_SIZE: PROTOCOL_ERROR,
    # 5.0 §3.3.2.3.4 forbids alias 0 and answers an out-of-range alias with Topic Alias invalid.
    TOPIC_ALIAS: TOPIC_ALIAS_INVALID,
}


def _end(at: int, end: int, what: str) -> None:
    if at != end:
        raise _bad(f"{what} with {end - at} bytes after its last field")


# -- decoding, per packet type --------------------------------------------------------------------


def _decode_connect(flags: int, b: bytes, bound: UserBound) -> Connect:
    end = len(b)
    # The protocol name and level come first, and decide the version of every refusal's code.
    if end < 2 or end < 3 + (b[0] << 8 | b[1]):
        raise _bad("CONNECT ends before its protocol level", None)
    at = 2 + (b[0] << 8 | b[1])
    name = b[2:at]
    level = b[at]
    if level != V311 and level != V5:
        # 0x01 is 3.1.1's "unacceptable protocol version", which a 3.1 client ("MQIsdp", level 3)
        # reads too; any other client sees a non-zero code, a refusal, whatever it expected.
        raise _bad(
            f"protocol {name[:20]!r} level {level}: only MQTT 3.1.1 (4) and 5.0 (5)",
            UNACCEPTABLE_PROTOCOL,
        )
    if name != b"MQTT":
        raise _bad(
            f"protocol name {name[:20]!r} at level {level}, not 'MQTT'",
            UNACCEPTABLE_PROTOCOL if level == V311 else UNSUPPORTED_VERSION,
        )
    try:
        if flags:
            raise _bad(f"CONNECT with reserved flags {flags:#x}")
        return _decode_connect_rest(b, at + 1, level, bound)
    except MqttProtocolError as exc:
        if level == V311:
            # 3.1.1 has a CONNACK code only for a client id it refuses; for anything else it
            # closes the connection (§3.1.4).
            exc.code = IDENTIFIER_REJECTED if exc.code == CLIENT_ID_NOT_VALID else None
        raise


def _decode_connect_rest(b: bytes, at: int, level: int, bound: UserBound) -> Connect:
    end = len(b)
    v5 = level == V5
    if at + 3 > end:
        raise _bad("CONNECT ends before its keep-alive")
    flags = b[at]
    keep_alive = b[at + 1] << 8 | b[at + 2]
    at += 3
    if flags & 0x01:
        raise _bad("CONNECT with its reserved flag set")
    has_will = flags & 0x04
    will_qos = (flags >> 3) & 3
    will_retain = flags & 0x20
    if will_qos == 3:
        raise _bad("CONNECT with will QoS 3")
    if not has_will and (will_qos or will_retain):
        raise _bad("CONNECT with will QoS or will retain but no will")
    has_user = flags & 0x80
    has_password = flags & 0x40
    if has_password and not has_user and not v5:
        raise _bad("3.1.1 CONNECT with a password but no user name")
    props: Properties = {}
    if v5:
        props, at = _properties(b, at, end, CONNECT, "CONNECT", bound)
    client_id, at = _str(b, at, end, "CONNECT client id")
    will = None
    if has_will:
        will_props: Properties = {}
        if v5:
            will_props, at = _properties(b, at, end, WILL_KEY, "CONNECT will", bound)
        topic, at = _str(b, at, end, "CONNECT will topic")
        payload, at = _bin(b, at, end, "CONNECT will payload")
        will = Will(topic, payload, will_qos, bool(will_retain), will_props)
    username = None
    if has_user:
        username, at = _str(b, at, end, "CONNECT user name")
    password = None
    if has_password:
        password, at = _bin(b, at, end, "CONNECT password")
    _end(at, end, "CONNECT")
    # What is well-formed but not acceptable, once the whole packet has parsed.
    if AUTH_DATA in props and AUTH_METHOD not in props:
        raise _bad("CONNECT with authentication data but no method", PROTOCOL_ERROR)
    if will is not None:
        _topic_name(will.topic, "CONNECT will topic")
    if not client_id and not v5 and not flags & 0x02:
        # 3.1.1 §3.1.3.1: an empty client id needs Clean Session (5.0 drops that rule).
        raise _bad("CONNECT with an empty client id and a persistent session", CLIENT_ID_NOT_VALID)
    return Connect(
        level, client_id, bool(flags & 0x02), keep_alive, username, password, will, props
    )


def _decode_connack(b: bytes, v5: bool) -> ConnAck:
    end = len(b)
    if end < 2:
        raise _bad("CONNACK shorter than 2 bytes")
    ack, code = b[0], b[1]
    if ack & 0xFE:
        raise _bad(f"CONNACK with reserved acknowledge flags {ack:#04x}")
    props: Properties = {}
    if v5:
        if code not in REASON_CODES[CONNACK]:
            raise _bad(f"CONNACK with reason code {code:#04x}", PROTOCOL_ERROR)
        props, at = _properties(b, 2, end, CONNACK, "CONNACK")
        _end(at, end, "CONNACK")
    else:
        _end(2, end, "CONNACK")
        if code > NOT_AUTHORIZED_311:
            raise _bad(f"CONNACK with return code {code:#04x}", PROTOCOL_ERROR)
    if ack and code:
        raise _bad("CONNACK with session present and a refusal", PROTOCOL_ERROR)
    return ConnAck(bool(ack), code, props)


def _decode_publish(flags: int, b: bytes, v5: bool, from_client: bool, bound: UserBound) -> Publish:
    # The per-message path: inline reads, no helper calls when nothing is wrong.
    qos = (flags >> 1) & 3
    if qos == 3:
        raise _bad("PUBLISH with QoS 3")
    if flags & 0x08 and not qos:
        raise _bad("PUBLISH with DUP set at QoS 0")
    end = len(b)
    if end < 2:
        raise _bad("PUBLISH ends before its topic")
    at = 2 + (b[0] << 8 | b[1])
    if at > end:
        raise _bad("PUBLISH topic runs past the end of the packet")
    try:
        topic = b[2:at].decode()
    except UnicodeDecodeError:
        raise _bad("PUBLISH topic is not valid UTF-8") from None
    packet_id = None
    if qos:
        if at + 2 > end:
            raise _bad("PUBLISH packet identifier runs past the end of the packet")
        packet_id = b[at] << 8 | b[at + 1]
        if not packet_id:
            raise _bad("PUBLISH with packet identifier 0", PROTOCOL_ERROR)
        at += 2
    props: Properties
    if not v5:
        props = {}
    elif at < end and not b[at]:  # no properties: one 0 byte
        props = {}
        at += 1
    else:
        props, at = _properties(b, at, end, PUBLISH, "PUBLISH", bound)
        if from_client and SUBSCRIPTION_ID in props:
            # 5.0 §3.3.4: only a server attaches subscription identifiers.
            raise _bad("PUBLISH from a client with a subscription identifier", PROTOCOL_ERROR)
    if "\0" in topic:
        raise _bad("PUBLISH topic contains U+0000")
    if "+" in topic or "#" in topic:
        raise _bad(f"PUBLISH topic {topic[:60]!r} contains a wildcard", TOPIC_NAME_INVALID)
    if not topic and TOPIC_ALIAS not in props:
        # 5.0 §3.3.2.3.4: an empty name stands for the name its alias maps to; the protocol
        # layer resolves aliases. Without an alias (and always in 3.1.1) it is an error.
        raise _bad("PUBLISH with an empty topic", PROTOCOL_ERROR if v5 else TOPIC_NAME_INVALID)
    return Publish(topic, b[at:], qos, bool(flags & 1), bool(flags & 8), packet_id, props)


def _decode_ack(kind: int, b: bytes, v5: bool, bound: UserBound) -> Ack:
    end = len(b)
    if end < 2:
        raise _bad(f"{NAMES[kind]} shorter than 2 bytes")
    packet_id = b[0] << 8 | b[1]
    if not packet_id:
        raise _bad(f"{NAMES[kind]} with packet identifier 0", PROTOCOL_ERROR)
    if end == 2:
        return Ack(kind, packet_id, 0, {})
    if not v5:
        raise _bad(f"{NAMES[kind]} with {end - 2} bytes after its packet identifier")
    # 5.0 §3.4.2.1: the reason code may be left out when 0 with no properties, the property
    # length when there are none: 2, 3 or 4+ bytes.
    code = b[2]
    if code not in REASON_CODES[kind]:
        raise _bad(f"{NAMES[kind]} with reason code {code:#04x}", PROTOCOL_ERROR)
    props: Properties = {}
    if end > 3:
        props, at = _properties(b, 3, end, kind, NAMES[kind], bound)
        _end(at, end, NAMES[kind])
    return Ack(kind, packet_id, code, props)


def _decode_subscribe(b: bytes, v5: bool, bound: UserBound) -> Subscribe:
    end = len(b)
    packet_id = _packet_id(b, SUBSCRIBE)
    at = 2
    props: Properties = {}
    if v5:
        props, at = _properties(b, at, end, SUBSCRIBE, "SUBSCRIBE", bound)
    topics: list[tuple[str, int]] = []
    while at < end:
        topic_filter, at = _str(b, at, end, "SUBSCRIBE topic filter")
        if at >= end:
            raise _bad("SUBSCRIBE topic filter without its options")
        options = b[at]
        at += 1
        if v5:
            if options & 0xC0:
                raise _bad(f"SUBSCRIBE options {options:#04x} with reserved bits set")
            if options & 0x03 == 3:
                raise _bad("SUBSCRIBE with maximum QoS 3", PROTOCOL_ERROR)
            if options & 0x30 == 0x30:
                raise _bad("SUBSCRIBE with retain handling 3", PROTOCOL_ERROR)
        elif options > 2:  # upper 6 bits reserved, QoS 0-2 (3.1.1 §3.8.3.1)
            raise _bad(f"3.1.1 SUBSCRIBE requested QoS byte {options:#04x}")
        topics.append((topic_filter, options))
    if not topics:
        raise _bad("SUBSCRIBE without a topic filter", PROTOCOL_ERROR)
    for topic_filter, options in topics:
        _topic_filter(topic_filter, v5, "SUBSCRIBE topic filter")
        if v5 and options & 0x04 and topic_filter.startswith("$share/"):
            raise _bad("SUBSCRIBE with no-local on a shared subscription", PROTOCOL_ERROR)
    return Subscribe(packet_id, topics, props)


def _decode_suback(b: bytes, v5: bool) -> SubAck:
    end = len(b)
    packet_id = _packet_id(b, SUBACK)
    at = 2
    props: Properties = {}
    valid = _SUBACK_311
    if v5:
        props, at = _properties(b, at, end, SUBACK, "SUBACK")
        valid = REASON_CODES[SUBACK]
    codes = list(b[at:])
    if not codes:
        raise _bad("SUBACK without a return code", PROTOCOL_ERROR)
    for code in codes:
        if code not in valid:
            raise _bad(f"SUBACK with return code {code:#04x}", PROTOCOL_ERROR)
    return SubAck(packet_id, codes, props)


def _decode_unsubscribe(b: bytes, v5: bool, bound: UserBound) -> Unsubscribe:
    end = len(b)
    packet_id = _packet_id(b, UNSUBSCRIBE)
    at = 2
    props: Properties = {}
    if v5:
        props, at = _properties(b, at, end, UNSUBSCRIBE, "UNSUBSCRIBE", bound)
    filters: list[str] = []
    while at < end:
        topic_filter, at = _str(b, at, end, "UNSUBSCRIBE topic filter")
        filters.append(topic_filter)
    if not filters:
        raise _bad("UNSUBSCRIBE without a topic filter", PROTOCOL_ERROR)
    for topic_filter in filters:
        _topic_filter(topic_filter, v5, "UNSUBSCRIBE topic filter")
    return Unsubscribe(packet_id, filters, props)


def _decode_unsuback(b: bytes, v5: bool) -> UnsubAck:
    end = len(b)
    packet_id = _packet_id(b, UNSUBACK)
    if not v5:
        _end(2, end, "UNSUBACK")
        return UnsubAck(packet_id, [], {})
    props, at = _properties(b, 2, end, UNSUBACK, "UNSUBACK")
    codes = list(b[at:])
    if not codes:
        raise _bad("UNSUBACK without a reason code", PROTOCOL_ERROR)
    for code in codes:
        if code not in REASON_CODES[UNSUBACK]:
            raise _bad(f"UNSUBACK with reason code {code:#04x}", PROTOCOL_ERROR)
    return UnsubAck(packet_id, codes, props)


def _decode_coded(
    kind: int, b: bytes, v5: bool, from_client: bool, bound: UserBound
) -> Disconnect | Auth:
    """DISCONNECT or AUTH: a reason code and properties, both of which may be left out."""
    name = NAMES[kind]
    end = len(b)
    if not v5:
        _end(0, end, name)  # 3.1.1 DISCONNECT is empty; 3.1.1 has no AUTH
        return Disconnect()
    code = b[0] if end else SUCCESS
    if code not in REASON_CODES[kind]:
        raise _bad(f"{name} with reason code {code:#04x}", PROTOCOL_ERROR)
    props: Properties = {}
    if end > 1:
        props, at = _properties(b, 1, end, kind, name, bound)
        _end(at, end, name)
    elif end == 1 and kind == AUTH:
        # 5.0 §3.15.2.2: AUTH leaves out both the code and the property length, or neither
        # (DISCONNECT may leave out the property length alone, §3.14.2.2).
        raise _bad("AUTH with a reason code but no property length")
    if kind == AUTH:
        return Auth(code, props)
    if not from_client and SESSION_EXPIRY in props:
        raise _bad("DISCONNECT from a server with a session expiry", PROTOCOL_ERROR)
    return Disconnect(code, props)


#: Fixed-header flags each packet type must carry (3.1.1 §2.2.2, 5.0 §2.1.3); PUBLISH's vary.
_FLAGS = (None, 0, 0, None, 0, 0, 2, 0, 2, 0, 2, 0, 0, 0, 0, 0)
_CLIENT_ONLY = frozenset({CONNECT, SUBSCRIBE, UNSUBSCRIBE, PINGREQ})
_SERVER_ONLY = frozenset({CONNACK, SUBACK, UNSUBACK, PINGRESP})
_PINGREQ = PingReq()
_PINGRESP = PingResp()


def decode(
    first: int,
    body: bytes | bytearray | memoryview,
    version: int,
    *,
    from_client: bool = True,
    bound: UserBound = UNBOUNDED,
) -> Packet:
    """The packet whose first byte is ``first`` and whose bytes after the fixed header are
    ``body`` (see :func:`split`), received on a connection of protocol level ``version`` (V311
    or V5; ignored for CONNECT, which carries its own) from a client (``from_client``) or a
    server. Anything the specifications refuse raises :class:`MqttProtocolError`, nothing else;
    so do user properties over ``bound`` (0x95, see :data:`UserBound`)."""
    kind = first >> 4
    if version != V5 and version != V311 and kind != CONNECT:
        raise ValueError(f"MQTT protocol level {version}: only {V311} and {V5}")
    b = body if type(body) is bytes else bytes(body)
    flags = first & 0x0F
    v5 = version == V5
    if kind == PUBLISH:
        return _decode_publish(flags, b, v5, from_client, bound)
    if kind == 0 or (kind == AUTH and not v5):
        raise _bad(f"reserved packet type {kind}")
    name = NAMES[kind]
    if from_client and kind in _SERVER_ONLY:
        raise _bad(f"{name} from a client: only servers send it", PROTOCOL_ERROR)
    if not from_client and kind in _CLIENT_ONLY:
        raise _bad(f"{name} from a server: only clients send it", PROTOCOL_ERROR)
    if kind == CONNECT:  # checks its flags once it knows the version to answer in
        return _decode_connect(flags, b, bound)
    if flags != _FLAGS[kind]:
        raise _bad(f"{name} with reserved flags {flags:#x}")
    if PUBACK <= kind <= PUBCOMP:
        return _decode_ack(kind, b, v5, bound)
    if kind == SUBSCRIBE:
        return _decode_subscribe(b, v5, bound)
    if kind == UNSUBSCRIBE:
        return _decode_unsubscribe(b, v5, bound)
    if kind == CONNACK:
        return _decode_connack(b, v5)
    if kind == SUBACK:
        return _decode_suback(b, v5)
    if kind == UNSUBACK:
        return _decode_unsuback(b, v5)
    if kind in (PINGREQ, PINGRESP):
        _end(0, len(b), name)
        return _PINGREQ if kind == PINGREQ else _PINGRESP
    return _decode_coded(kind, b, v5, from_client, bound)


# -- encoding -------------------------------------------------------------------------------------

_U16 = struct.Struct(">H").pack
_U32 = struct.Struct(">I").pack


def _encode_varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    if value > MAX_VARINT:
        raise ValueError(f"{value} is over the largest variable byte integer {MAX_VARINT}")
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _encode_bin(data: bytes) -> bytes:
    if len(data) > 0xFFFF:
        raise ValueError(f"a field of {len(data)} bytes is over MQTT's 65535")
    return _U16(len(data)) + data


def _encode_str(text: str) -> bytes:
    # "strict" refuses lone surrogates, which decode refuses too.
    return _encode_bin(text.encode())


def _encode_properties(props: Properties | None, kind: int) -> bytes:
    """The property section (its length, then properties) of packet ``kind``; ValueError for a
    property the packet may not carry or a value out of range."""
    if not props:
        return b"\x00"
    allowed = ALLOWED[kind]
    out = bytearray()
    for pid, value in props.items():
        info = PROPERTIES.get(pid)
        if info is None or pid not in allowed:
            raise ValueError(f"property {pid:#04x} may not appear in packet type {kind}")
        ptype = info.kind
        if ptype is PAIR:
            for key, val in value:
                out.append(pid)
                out += _encode_str(key)
                out += _encode_str(val)
        elif ptype is VARINT:
            if kind != PUBLISH and len(value) != 1:
                raise ValueError("SUBSCRIBE carries exactly one subscription identifier")
            for ident in value:
                if not 0 < ident <= MAX_VARINT:
                    raise ValueError(f"subscription identifier {ident} out of 1..{MAX_VARINT}")
                out.append(pid)
                out += _encode_varint(ident)
        else:
            out.append(pid)
            if ptype is UTF8:
                out += _encode_str(value)
            elif ptype is BINARY:
                out += _encode_bin(value)
            elif ptype is BYTE:
                if value not in (0, 1):
                    raise ValueError(f"property {info.name} is {value}, not 0 or 1")
                out.append(value)
            else:
                if not value and pid in _NONZERO:
                    raise ValueError(f"property {info.name} may not be 0")
                if ptype is U16:
                    out += value.to_bytes(2, "big")
                else:
                    out += value.to_bytes(4, "big")
    return _encode_varint(len(out)) + out


def _fixed(first: int, body: bytes) -> bytes:
    n = len(body)
    if n < 0x80:
        return bytes((first, n)) + body
    return bytes((first,)) + _encode_varint(n) + body


def encode_publish(
    topic: str,
    payload: bytes,
    qos: int,
    retain: bool,
    dup: bool,
    packet_id: int | None,
    version: int,
    properties: Properties | None = None,
) -> bytes:
    """A PUBLISH, without building a :class:`Publish`: the per-message path. ``properties`` are
    dropped in 3.1.1, which has none."""
    raw = topic.encode()
    size = len(raw)
    if size > 0xFFFF:
        raise ValueError(f"topic of {size} bytes is over MQTT's 65535")
    if version == V5:
        props = _encode_properties(properties, PUBLISH) if properties else b"\x00"
    else:
        props = b""
    first = 0x30 | dup << 3 | qos << 1 | retain
    if qos:
        if packet_id is None or not 0 < packet_id < 0x10000 or qos > 2:
            raise ValueError(f"PUBLISH at QoS {qos} with packet identifier {packet_id}")
        n = size + 4 + len(props) + len(payload)
        if n < 0x80:
            head = bytes((first, n, size >> 8, size & 0xFF))
        else:
            head = bytes((first,)) + _encode_varint(n) + _U16(size)
        return b"".join((head, raw, _U16(packet_id), props, payload))
    n = size + 2 + len(props) + len(payload)
    if n < 0x80:
        head = bytes((first, n, size >> 8, size & 0xFF))
    else:
        head = bytes((first,)) + _encode_varint(n) + _U16(size)
    return b"".join((head, raw, props, payload))


def encode_ack(
    kind: int, packet_id: int, version: int, code: int = 0, properties: Properties | None = None
) -> bytes:
    """A PUBACK, PUBREC, PUBREL or PUBCOMP, without building an :class:`Ack`. In 5.0 the reason
    code and property length are left out when the code is 0 without properties (5.0 §3.4.2.1);
    in 3.1.1 both are dropped."""
    if not PUBACK <= kind <= PUBCOMP or not 0 < packet_id < 0x10000:
        raise ValueError(f"acknowledgement type {kind} with packet identifier {packet_id}")
    first = 0x62 if kind == PUBREL else kind << 4
    if version != V5 or not (code or properties):
        return bytes((first, 2, packet_id >> 8, packet_id & 0xFF))
    if not properties:
        return bytes((first, 3, packet_id >> 8, packet_id & 0xFF, code))
    return _fixed(
        first,
        bytes((packet_id >> 8, packet_id & 0xFF, code)) + _encode_properties(properties, kind),
    )


def _pid(packet_id: int) -> bytes:
    if not 0 < packet_id < 0x10000:
        raise ValueError(f"packet identifier {packet_id} out of 1..65535")
    return _U16(packet_id)


def _encode_connect(p: Connect) -> bytes:
    v5 = p.version == V5
    if p.version != V5 and p.version != V311:
        raise ValueError(f"CONNECT of protocol level {p.version}: only {V311} and {V5}")
    flags = 0x02 if p.clean else 0
    parts = [b"\x00\x04MQTT", bytes((p.version,)), b"", _U16(p.keep_alive)]
    if v5:
        parts.append(_encode_properties(p.properties, CONNECT))
    parts.append(_encode_str(p.client_id))
    if p.will is not None:
        will = p.will
        if not 0 <= will.qos <= 2:
            raise ValueError(f"will QoS {will.qos}")
        flags |= 0x04 | will.qos << 3 | (0x20 if will.retain else 0)
        if v5:
            parts.append(_encode_properties(will.properties, WILL_KEY))
        parts.append(_encode_str(will.topic))
        parts.append(_encode_bin(will.payload))
    if p.username is not None:
        flags |= 0x80
        parts.append(_encode_str(p.username))
    if p.password is not None:
        if p.username is None and not v5:
            raise ValueError("a 3.1.1 CONNECT with a password needs a user name")
        flags |= 0x40
        parts.append(_encode_bin(p.password))
    parts[2] = bytes((flags,))
    return _fixed(CONNECT << 4, b"".join(parts))


def _encode_connack(p: ConnAck, v5: bool) -> bytes:
    body = bytes((1 if p.session_present else 0, p.code))
    if v5:
        body += _encode_properties(p.properties, CONNACK)
    return _fixed(CONNACK << 4, body)


def _encode_subscribe(p: Subscribe, v5: bool) -> bytes:
    parts = [_pid(p.packet_id)]
    if v5:
        parts.append(_encode_properties(p.properties, SUBSCRIBE))
    for topic_filter, options in p.topics:
        parts.append(_encode_str(topic_filter))
        parts.append(bytes((options,)))
    return _fixed(SUBSCRIBE << 4 | 2, b"".join(parts))


def _encode_suback(p: SubAck, v5: bool) -> bytes:
    if v5:
        body = _pid(p.packet_id) + _encode_properties(p.properties, SUBACK) + bytes(p.codes)
    else:
        # 3.1.1 has one failure code: any 5.0 failure (0x80 and up) is sent as it.
        body = _pid(p.packet_id) + bytes(min(code, 0x80) for code in p.codes)
    return _fixed(SUBACK << 4, body)


def _encode_unsubscribe(p: Unsubscribe, v5: bool) -> bytes:
    parts = [_pid(p.packet_id)]
    if v5:
        parts.append(_encode_properties(p.properties, UNSUBSCRIBE))
    parts.extend(_encode_str(topic_filter) for topic_filter in p.filters)
    return _fixed(UNSUBSCRIBE << 4 | 2, b"".join(parts))


def _encode_unsuback(p: UnsubAck, v5: bool) -> bytes:
    body = _pid(p.packet_id)
    if v5:
        body += _encode_properties(p.properties, UNSUBACK) + bytes(p.codes)
    return _fixed(UNSUBACK << 4, body)


def _encode_coded(kind: int, code: int, props: Properties, v5: bool) -> bytes:
    if not v5:
        if kind == AUTH:
            raise ValueError("MQTT 3.1.1 has no AUTH packet")
        return bytes((kind << 4, 0))
    if not props:
        if not code:
            return bytes((kind << 4, 0))
        if kind == DISCONNECT:
            return bytes((kind << 4, 1, code))
    return _fixed(kind << 4, bytes((code,)) + _encode_properties(props, kind))


def encode(packet: Packet, version: int) -> bytes:
    """The bytes of ``packet`` on a connection of protocol level ``version`` (a CONNECT uses its
    own). 3.1.1 has no properties and fewer codes: there, properties, ack and UNSUBACK codes
    are dropped, and SUBACK failures become 0x80. ValueError for what cannot be encoded."""
    if version != V5 and version != V311:
        raise ValueError(f"MQTT protocol level {version}: only {V311} and {V5}")
    v5 = version == V5
    if isinstance(packet, Publish):
        return encode_publish(
            packet.topic,
            packet.payload,
            packet.qos,
            packet.retain,
            packet.dup,
            packet.packet_id,
            version,
            packet.properties,
        )
    if isinstance(packet, Ack):
        return encode_ack(packet.kind, packet.packet_id, version, packet.code, packet.properties)
    if isinstance(packet, Connect):
        return _encode_connect(packet)
    if isinstance(packet, ConnAck):
        return _encode_connack(packet, v5)
    if isinstance(packet, Subscribe):
        return _encode_subscribe(packet, v5)
    if isinstance(packet, SubAck):
        return _encode_suback(packet, v5)
    if isinstance(packet, Unsubscribe):
        return _encode_unsubscribe(packet, v5)
    if isinstance(packet, UnsubAck):
        return _encode_unsuback(packet, v5)
    if isinstance(packet, PingReq):
        return b"\xc0\x00"
    if isinstance(packet, PingResp):
        return b"\xd0\x00"
    if isinstance(packet, Disconnect):
        return _encode_coded(DISCONNECT, packet.code, packet.properties, v5)
    if isinstance(packet, Auth):
        return _encode_coded(AUTH, packet.code, packet.properties, v5)
    raise TypeError(f"not an MQTT packet: {type(packet).__name__}")
