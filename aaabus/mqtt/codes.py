"""MQTT's numbers, sans-IO: packet types, protocol levels, 5.0 properties, reason codes.

The tables of the OASIS specifications the codec (:mod:`aaabus.mqtt.codec`) checks packets
against and the rest of the package answers with: the packet types and protocol levels (3.1.1
§2.2.1, 5.0 §2.1.2); every 5.0 property, its data type and the packets (and wills) it may
appear in (5.0 §2.2.2.2); the 5.0 reason codes each packet type may carry (5.0 §2.4 and the
tables of §3) and 3.1.1's CONNACK return codes (3.1.1 §3.2.2.3). Values only: no function here
reads or writes bytes. Read as ``mq.NAME`` (``from aaabus.mqtt import codes as mq``).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "ADMINISTRATIVE_ACTION",
    "ALLOWED",
    "ASSIGNED_CLIENT_ID",
    "AUTH",
    "AUTH_DATA",
    "AUTH_METHOD",
    "BAD_AUTH_METHOD",
    "BAD_CREDENTIALS",
    "BAD_CREDENTIALS_311",
    "BANNED",
    "BINARY",
    "BYTE",
    "CLIENT_ID_NOT_VALID",
    "CONNACK",
    "CONNECT",
    "CONNECTION_RATE_EXCEEDED",
    "CONTENT_TYPE",
    "CONTINUE_AUTHENTICATION",
    "CORRELATION_DATA",
    "DISCONNECT",
    "DISCONNECT_WITH_WILL",
    "GRANTED_QOS_1",
    "GRANTED_QOS_2",
    "IDENTIFIER_REJECTED",
    "IMPLEMENTATION_SPECIFIC",
    "KEEP_ALIVE_TIMEOUT",
    "MALFORMED",
    "MAXIMUM_CONNECT_TIME",
    "MAXIMUM_PACKET_SIZE",
    "MAXIMUM_QOS",
    "MAX_VARINT",
    "MESSAGE_EXPIRY",
    "MESSAGE_RATE_TOO_HIGH",
    "NAMES",
    "NOT_AUTHORIZED",
    "NOT_AUTHORIZED_311",
    "NO_MATCHING_SUBSCRIBERS",
    "NO_SUBSCRIPTION_EXISTED",
    "PACKET_ID_IN_USE",
    "PACKET_ID_NOT_FOUND",
    "PACKET_TOO_LARGE",
    "PAIR",
    "PAYLOAD_FORMAT",
    "PAYLOAD_FORMAT_INVALID",
    "PINGREQ",
    "PINGRESP",
    "PROPERTIES",
    "PROTOCOL_ERROR",
    "PUBACK",
    "PUBCOMP",
    "PUBLISH",
    "PUBREC",
    "PUBREL",
    "QOS_NOT_SUPPORTED",
    "QUOTA_EXCEEDED",
    "REASON_CODES",
    "REASON_STRING",
    "REAUTHENTICATE",
    "RECEIVE_MAXIMUM",
    "RECEIVE_MAXIMUM_EXCEEDED",
    "REQUEST_PROBLEM_INFO",
    "REQUEST_RESPONSE_INFO",
    "RESPONSE_INFO",
    "RESPONSE_TOPIC",
    "RETAIN_AVAILABLE",
    "RETAIN_NOT_SUPPORTED",
    "SERVER_BUSY",
    "SERVER_KEEP_ALIVE",
    "SERVER_MOVED",
    "SERVER_REFERENCE",
    "SERVER_SHUTTING_DOWN",
    "SERVER_UNAVAILABLE",
    "SERVER_UNAVAILABLE_311",
    "SESSION_EXPIRY",
    "SESSION_TAKEN_OVER",
    "SHARED_SUB_AVAILABLE",
    "SHARED_SUB_NOT_SUPPORTED",
    "SUBACK",
    "SUBSCRIBE",
    "SUBSCRIPTION_ID",
    "SUBSCRIPTION_IDS_NOT_SUPPORTED",
    "SUBSCRIPTION_ID_AVAILABLE",
    "SUCCESS",
    "TOPIC_ALIAS",
    "TOPIC_ALIAS_INVALID",
    "TOPIC_ALIAS_MAXIMUM",
    "TOPIC_FILTER_INVALID",
    "TOPIC_NAME_INVALID",
    "U16",
    "U32",
    "UNACCEPTABLE_PROTOCOL",
    "UNBOUNDED",
    "UNSPECIFIED",
    "UNSUBACK",
    "UNSUBSCRIBE",
    "UNSUPPORTED_VERSION",
    "USER_PROPERTY",
    "USE_ANOTHER_SERVER",
    "UTF8",
    "V5",
    "V311",
    "VARINT",
    "WILDCARD_SUBS_NOT_SUPPORTED",
    "WILDCARD_SUB_AVAILABLE",
    "WILL_DELAY",
    "WILL_KEY",
    "PropertyInfo",
    "UserBound",
]

# -- packet types and protocol levels (3.1.1 §2.2.1, 5.0 §2.1.2) ---------------------------------

CONNECT = 1
CONNACK = 2
PUBLISH = 3
PUBACK = 4
PUBREC = 5
PUBREL = 6
PUBCOMP = 7
SUBSCRIBE = 8
SUBACK = 9
UNSUBSCRIBE = 10
UNSUBACK = 11
PINGREQ = 12
PINGRESP = 13
DISCONNECT = 14
AUTH = 15

#: The protocol levels of CONNECT: MQTT 3.1.1 and MQTT 5.0.
V311 = 4
V5 = 5

NAMES = {
    CONNECT: "CONNECT",
    CONNACK: "CONNACK",
    PUBLISH: "PUBLISH",
    PUBACK: "PUBACK",
    PUBREC: "PUBREC",
    PUBREL: "PUBREL",
    PUBCOMP: "PUBCOMP",
    SUBSCRIBE: "SUBSCRIBE",
    SUBACK: "SUBACK",
    UNSUBSCRIBE: "UNSUBSCRIBE",
    UNSUBACK: "UNSUBACK",
    PINGREQ: "PINGREQ",
    PINGRESP: "PINGRESP",
    DISCONNECT: "DISCONNECT",
    AUTH: "AUTH",
}

# -- 5.0 properties (5.0 §2.2.2.2) ----------------------------------------------------------------

PAYLOAD_FORMAT = 0x01
MESSAGE_EXPIRY = 0x02
CONTENT_TYPE = 0x03
RESPONSE_TOPIC = 0x08
CORRELATION_DATA = 0x09
SUBSCRIPTION_ID = 0x0B
SESSION_EXPIRY = 0x11
ASSIGNED_CLIENT_ID = 0x12
SERVER_KEEP_ALIVE = 0x13
AUTH_METHOD = 0x15
AUTH_DATA = 0x16
REQUEST_PROBLEM_INFO = 0x17
WILL_DELAY = 0x18
REQUEST_RESPONSE_INFO = 0x19
RESPONSE_INFO = 0x1A
SERVER_REFERENCE = 0x1C
REASON_STRING = 0x1F
RECEIVE_MAXIMUM = 0x21
TOPIC_ALIAS_MAXIMUM = 0x22
TOPIC_ALIAS = 0x23
MAXIMUM_QOS = 0x24
RETAIN_AVAILABLE = 0x25
USER_PROPERTY = 0x26
MAXIMUM_PACKET_SIZE = 0x27
WILDCARD_SUB_AVAILABLE = 0x28
SUBSCRIPTION_ID_AVAILABLE = 0x29
SHARED_SUB_AVAILABLE = 0x2A

#: Data types of property values (5.0 §1.5), and the Python type each decodes to.
BYTE = "byte"  # int 0..255 (every byte property of 5.0 is a 0/1 flag)
U16 = "two-byte integer"  # int
U32 = "four-byte integer"  # int
VARINT = "variable byte integer"  # int; SUBSCRIPTION_ID is kept as a list[int]
UTF8 = "UTF-8 string"  # str
BINARY = "binary data"  # bytes
PAIR = "UTF-8 string pair"  # USER_PROPERTY: list[tuple[str, str]], order kept

#: Largest variable byte integer (four 7-bit groups): remaining lengths, subscription ids.
MAX_VARINT = 268_435_455

#: The user properties one property section may carry: (how many, bytes they take in the
#: packet: identifier, names and values with their lengths). Over it, the packet is refused
#: with 0x95 (Packet too large: what it carries is more than the server takes).
UserBound = tuple[int, int]
UNBOUNDED: UserBound = (MAX_VARINT, MAX_VARINT)


class PropertyInfo(NamedTuple):
    """Where a property may appear: ``packets`` (packet types), ``will`` (a CONNECT's will)."""

    name: str
    kind: str
    packets: frozenset[int]
    will: bool = False


_ACKS = (PUBACK, PUBREC, PUBREL, PUBCOMP)
# Every packet type that has a property section: all but PINGREQ and PINGRESP.
_WITH_PROPERTIES = (CONNECT, CONNACK, PUBLISH, *_ACKS, SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK,
                    DISCONNECT, AUTH)  # fmt: skip


def _info(name: str, kind: str, *packets: int, will: bool = False) -> PropertyInfo:
    return PropertyInfo(name, kind, frozenset(packets), will)


#: Every 5.0 property: its name, data type, and where it may appear (5.0 §2.2.2.2, table 2-4).
PROPERTIES: dict[int, PropertyInfo] = {
    PAYLOAD_FORMAT: _info("Payload Format Indicator", BYTE, PUBLISH, will=True),
    MESSAGE_EXPIRY: _info("Message Expiry Interval", U32, PUBLISH, will=True),
    CONTENT_TYPE: _info("Content Type", UTF8, PUBLISH, will=True),
    RESPONSE_TOPIC: _info("Response Topic", UTF8, PUBLISH, will=True),
    CORRELATION_DATA: _info("Correlation Data", BINARY, PUBLISH, will=True),
    SUBSCRIPTION_ID: _info("Subscription Identifier", VARINT, PUBLISH, SUBSCRIBE),
    SESSION_EXPIRY: _info("Session Expiry Interval", U32, CONNECT, CONNACK, DISCONNECT),
    ASSIGNED_CLIENT_ID: _info("Assigned Client Identifier", UTF8, CONNACK),
    SERVER_KEEP_ALIVE: _info("Server Keep Alive", U16, CONNACK),
    AUTH_METHOD: _info("Authentication Method", UTF8, CONNECT, CONNACK, AUTH),
    AUTH_DATA: _info("Authentication Data", BINARY, CONNECT, CONNACK, AUTH),
    REQUEST_PROBLEM_INFO: _info("Request Problem Information", BYTE, CONNECT),
    WILL_DELAY: _info("Will Delay Interval", U32, will=True),
    REQUEST_RESPONSE_INFO: _info("Request Response Information", BYTE, CONNECT),
    RESPONSE_INFO: _info("Response Information", UTF8, CONNACK),
    SERVER_REFERENCE: _info("Server Reference", UTF8, CONNACK, DISCONNECT),
    REASON_STRING: _info(
        "Reason String", UTF8, CONNACK, *_ACKS, SUBACK, UNSUBACK, DISCONNECT, AUTH
    ),
    RECEIVE_MAXIMUM: _info("Receive Maximum", U16, CONNECT, CONNACK),
    TOPIC_ALIAS_MAXIMUM: _info("Topic Alias Maximum", U16, CONNECT, CONNACK),
    TOPIC_ALIAS: _info("Topic Alias", U16, PUBLISH),
    MAXIMUM_QOS: _info("Maximum QoS", BYTE, CONNACK),
    RETAIN_AVAILABLE: _info("Retain Available", BYTE, CONNACK),
    USER_PROPERTY: _info("User Property", PAIR, *_WITH_PROPERTIES, will=True),
    MAXIMUM_PACKET_SIZE: _info("Maximum Packet Size", U32, CONNECT, CONNACK),
    WILDCARD_SUB_AVAILABLE: _info("Wildcard Subscription Available", BYTE, CONNACK),
    SUBSCRIPTION_ID_AVAILABLE: _info("Subscription Identifier Available", BYTE, CONNACK),
    SHARED_SUB_AVAILABLE: _info("Shared Subscription Available", BYTE, CONNACK),
}

#: The property identifiers each packet type (and, under key 0, a will) may carry.
ALLOWED: dict[int, frozenset[int]] = {
    kind: frozenset(pid for pid, info in PROPERTIES.items() if kind in info.packets)
    for kind in NAMES
}
WILL_KEY = 0
ALLOWED[WILL_KEY] = frozenset(pid for pid, info in PROPERTIES.items() if info.will)

# -- reason codes (5.0 §2.4) and 3.1.1 CONNACK return codes (3.1.1 §3.2.2.3) ---------------------

SUCCESS = 0x00  # also Normal disconnection, Granted QoS 0
GRANTED_QOS_1 = 0x01
GRANTED_QOS_2 = 0x02
DISCONNECT_WITH_WILL = 0x04
NO_MATCHING_SUBSCRIBERS = 0x10
NO_SUBSCRIPTION_EXISTED = 0x11
CONTINUE_AUTHENTICATION = 0x18
REAUTHENTICATE = 0x19
UNSPECIFIED = 0x80
MALFORMED = 0x81
PROTOCOL_ERROR = 0x82
IMPLEMENTATION_SPECIFIC = 0x83
UNSUPPORTED_VERSION = 0x84
CLIENT_ID_NOT_VALID = 0x85
BAD_CREDENTIALS = 0x86
NOT_AUTHORIZED = 0x87
SERVER_UNAVAILABLE = 0x88
SERVER_BUSY = 0x89
BANNED = 0x8A
SERVER_SHUTTING_DOWN = 0x8B
BAD_AUTH_METHOD = 0x8C
KEEP_ALIVE_TIMEOUT = 0x8D
SESSION_TAKEN_OVER = 0x8E
TOPIC_FILTER_INVALID = 0x8F
TOPIC_NAME_INVALID = 0x90
PACKET_ID_IN_USE = 0x91
PACKET_ID_NOT_FOUND = 0x92
RECEIVE_MAXIMUM_EXCEEDED = 0x93
TOPIC_ALIAS_INVALID = 0x94
PACKET_TOO_LARGE = 0x95
MESSAGE_RATE_TOO_HIGH = 0x96
QUOTA_EXCEEDED = 0x97
ADMINISTRATIVE_ACTION = 0x98
PAYLOAD_FORMAT_INVALID = 0x99
RETAIN_NOT_SUPPORTED = 0x9A
QOS_NOT_SUPPORTED = 0x9B
USE_ANOTHER_SERVER = 0x9C
SERVER_MOVED = 0x9D
SHARED_SUB_NOT_SUPPORTED = 0x9E
CONNECTION_RATE_EXCEEDED = 0x9F
MAXIMUM_CONNECT_TIME = 0xA0
SUBSCRIPTION_IDS_NOT_SUPPORTED = 0xA1
WILDCARD_SUBS_NOT_SUPPORTED = 0xA2

UNACCEPTABLE_PROTOCOL = 0x01
IDENTIFIER_REJECTED = 0x02
SERVER_UNAVAILABLE_311 = 0x03
BAD_CREDENTIALS_311 = 0x04
NOT_AUTHORIZED_311 = 0x05

# The tables below keep several codes a line, in the specification's order.
# fmt: off
_PUB_CODES = frozenset({
    SUCCESS, NO_MATCHING_SUBSCRIBERS, UNSPECIFIED, IMPLEMENTATION_SPECIFIC, NOT_AUTHORIZED,
    TOPIC_NAME_INVALID, PACKET_ID_IN_USE, QUOTA_EXCEEDED, PAYLOAD_FORMAT_INVALID,
})

#: The 5.0 reason codes each packet type may carry (the tables of 5.0 §3.x.2.1 and §3.9.3).
REASON_CODES: dict[int, frozenset[int]] = {
    CONNACK: frozenset({
        SUCCESS, UNSPECIFIED, MALFORMED, PROTOCOL_ERROR, IMPLEMENTATION_SPECIFIC,
        UNSUPPORTED_VERSION, CLIENT_ID_NOT_VALID, BAD_CREDENTIALS, NOT_AUTHORIZED,
        SERVER_UNAVAILABLE, SERVER_BUSY, BANNED, BAD_AUTH_METHOD, TOPIC_NAME_INVALID,
        PACKET_TOO_LARGE, QUOTA_EXCEEDED, PAYLOAD_FORMAT_INVALID, RETAIN_NOT_SUPPORTED,
        QOS_NOT_SUPPORTED, USE_ANOTHER_SERVER, SERVER_MOVED, CONNECTION_RATE_EXCEEDED,
    }),
    PUBACK: _PUB_CODES,
    PUBREC: _PUB_CODES,
    PUBREL: frozenset({SUCCESS, PACKET_ID_NOT_FOUND}),
    PUBCOMP: frozenset({SUCCESS, PACKET_ID_NOT_FOUND}),
    SUBACK: frozenset({
        SUCCESS, GRANTED_QOS_1, GRANTED_QOS_2, UNSPECIFIED, IMPLEMENTATION_SPECIFIC,
        NOT_AUTHORIZED, TOPIC_FILTER_INVALID, PACKET_ID_IN_USE, QUOTA_EXCEEDED,
        SHARED_SUB_NOT_SUPPORTED, SUBSCRIPTION_IDS_NOT_SUPPORTED, WILDCARD_SUBS_NOT_SUPPORTED,
    }),
    UNSUBACK: frozenset({
        SUCCESS, NO_SUBSCRIPTION_EXISTED, UNSPECIFIED, IMPLEMENTATION_SPECIFIC, NOT_AUTHORIZED,
        TOPIC_FILTER_INVALID, PACKET_ID_IN_USE,
    }),
    # Some are the server's only (e.g. SESSION_TAKEN_OVER), 0x04 the client's only: a receiver
    # is not held to that here, since either way the connection ends.
    DISCONNECT: frozenset({
        SUCCESS, DISCONNECT_WITH_WILL, UNSPECIFIED, MALFORMED, PROTOCOL_ERROR,
        IMPLEMENTATION_SPECIFIC, NOT_AUTHORIZED, SERVER_BUSY, SERVER_SHUTTING_DOWN,
        KEEP_ALIVE_TIMEOUT, SESSION_TAKEN_OVER, TOPIC_FILTER_INVALID, TOPIC_NAME_INVALID,
        RECEIVE_MAXIMUM_EXCEEDED, TOPIC_ALIAS_INVALID, PACKET_TOO_LARGE, MESSAGE_RATE_TOO_HIGH,
        QUOTA_EXCEEDED, ADMINISTRATIVE_ACTION, PAYLOAD_FORMAT_INVALID, RETAIN_NOT_SUPPORTED,
        QOS_NOT_SUPPORTED, USE_ANOTHER_SERVER, SERVER_MOVED, SHARED_SUB_NOT_SUPPORTED,
        CONNECTION_RATE_EXCEEDED, MAXIMUM_CONNECT_TIME, SUBSCRIPTION_IDS_NOT_SUPPORTED,
        WILDCARD_SUBS_NOT_SUPPORTED,
    }),
    AUTH: frozenset({SUCCESS, CONTINUE_AUTHENTICATION, REAUTHENTICATE}),
}
# fmt: on
