"""MQTT 5.0's message-level semantics for the listener: the properties of a device's PUBLISH
made the bus's :class:`~aaabus.model.pubsub.MessageProps`, and back into a PUBLISH for a 5.0
subscriber, with the subscription options that act on each delivery (no-local,
retain-as-published, subscription identifiers) and message expiry.

Pure functions over values, called on the listener's loop thread by
:class:`~aaabus.mqtt.connection.MqttConnection` (and the option constants by
:class:`~aaabus.mqtt.sessions.MqttSessions` on the engine thread). A message without
properties to a device without options takes none of this: the connection tests for both first.
Nothing here raises on a device's input: what the protocol refuses, the codec has refused.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from aaabus.model.pubsub import MessageProps
from aaabus.mqtt import codes as mq

__all__ = [
    "KEPT",
    "NO_LOCAL",
    "RETAIN_AS_PUBLISHED",
    "RETAIN_HANDLING",
    "RETAIN_IF_NEW",
    "RETAIN_NEVER",
    "Item",
    "bad_payload",
    "kept",
    "message_props",
    "outgoing",
    "subscription_options",
]

#: SUBSCRIBE option bits of 5.0 (§3.8.3.1) beside the QoS.
NO_LOCAL = 0x04
RETAIN_AS_PUBLISHED = 0x08
RETAIN_HANDLING = 0x30
RETAIN_IF_NEW = 0x10  # retain handling 1: retained copies only for a new subscription
RETAIN_NEVER = 0x20  # retain handling 2: none
#: The option bits a subscription keeps for its deliveries (retain handling acts when it is made).
KEPT = NO_LOCAL | RETAIN_AS_PUBLISHED

#: A filter's kept options when it has none: (option bits, subscription identifier).
_NONE = (0, 0)

#: The PUBLISH properties that belong to the message (a topic alias belongs to the connection).
_MESSAGE = frozenset(
    {
        mq.PAYLOAD_FORMAT,
        mq.MESSAGE_EXPIRY,
        mq.CONTENT_TYPE,
        mq.RESPONSE_TOPIC,
        mq.CORRELATION_DATA,
        mq.USER_PROPERTY,
    }
)


class Item(Protocol):
    """What :func:`outgoing` reads of a backlog item (a
    :class:`~aaabus.mqtt.sessions.Delivery`, which imports this module's constants)."""

    @property
    def filters(self) -> tuple[str, ...]: ...
    @property
    def retained(self) -> bool: ...
    @property
    def retain(self) -> bool: ...
    @property
    def origin(self) -> str: ...
    @property
    def props(self) -> MessageProps | None: ...


def message_props(properties: dict[int, Any], now: float) -> MessageProps | None:
    """The message properties of a device's PUBLISH (the codec's ``properties``), its expiry
    interval made a deadline from ``now`` (``time.time()``); None when it has none."""
    if not _MESSAGE.intersection(properties):
        return None
    expiry = properties.get(mq.MESSAGE_EXPIRY)
    return MessageProps(
        properties.get(mq.PAYLOAD_FORMAT, 0),
        properties.get(mq.CONTENT_TYPE),
        properties.get(mq.RESPONSE_TOPIC),
        properties.get(mq.CORRELATION_DATA),
        tuple(properties.get(mq.USER_PROPERTY, ())),
        None if expiry is None else now + expiry,
    )


def bad_payload(props: MessageProps | None, payload: bytes) -> bool:
    """Whether ``payload`` claims to be UTF-8 text (Payload Format Indicator 1) and is not
    (5.0 §3.3.2.3.2: the server may refuse it, reason 0x99)."""
    if props is None or props.payload_format != 1:
        return False
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def subscription_options(
    topics: list[tuple[str, int]], properties: dict[int, Any]
) -> dict[str, tuple[int, int]] | None:
    """What a 5.0 SUBSCRIBE asks of its filters beside the QoS: filter -> (options byte,
    subscription identifier or 0), for the filters that ask anything; None if none does."""
    ids = properties.get(mq.SUBSCRIPTION_ID) if properties else None
    sub_id = ids[0] if ids else 0
    out = {f: (o & ~0x03, sub_id) for f, o in topics if o & ~0x03 or sub_id}
    return out or None


def kept(options: dict[str, tuple[int, int]] | None, topic_filter: str) -> tuple[int, int]:
    """What a subscription to ``topic_filter`` keeps of a SUBSCRIBE's ``options`` (from
    :func:`subscription_options`): (no-local and retain-as-published bits, identifier or 0)."""
    flags, sub_id = options.get(topic_filter, _NONE) if options else _NONE
    return flags & KEPT, sub_id


def outgoing(
    item: Item,
    options: dict[str, tuple[int, int]],
    client_id: str,
    v5: bool,
    now: float,
) -> tuple[tuple[str, ...], bool, dict[int, Any] | None] | None:
    """How backlog ``item`` leaves for the device ``client_id`` whose subscriptions have the
    kept ``options`` (filter -> (bits, identifier)): the filters it goes by, its RETAIN flag
    and, to a 5.0 device (``v5``), its PUBLISH properties; None if it does not go (it expired
    by ``now``, or every filter that matched it has no-local and the device published it).

    No-local removes the filters that have it (5.0 §3.8.3.1: for them the message does not
    match); retain-as-published on one of the remaining filters keeps the RETAIN flag it was
    published with (a retained copy sent at subscribe always has it); the identifiers are those
    of the remaining filters. The expiry interval sent is what remains, in whole seconds rounded
    down (never more than remains) and at least 1 (it has not expired).
    """
    filters = item.filters
    retain = item.retained
    ids: list[int] = []
    if options:
        if item.origin and item.origin == client_id:
            filters = tuple(f for f in filters if not options.get(f, _NONE)[0] & NO_LOCAL)
            if not filters:
                return None
        if item.retain and not retain:
            retain = any(options.get(f, _NONE)[0] & RETAIN_AS_PUBLISHED for f in filters)
        if v5:
            ids = sorted({options.get(f, _NONE)[1] for f in filters} - {0})
    props = item.props
    out: dict[int, Any] | None = None
    if props is not None:
        expiry = None
        if props.expires_at is not None:
            left = props.expires_at - now
            if left <= 0:
                return None
            expiry = max(1, math.floor(left))
        if v5:
            out = {}
            if props.payload_format:
                out[mq.PAYLOAD_FORMAT] = props.payload_format
            if expiry is not None:
                out[mq.MESSAGE_EXPIRY] = expiry
            if props.content_type is not None:
                out[mq.CONTENT_TYPE] = props.content_type
            if props.response_topic is not None:
                out[mq.RESPONSE_TOPIC] = props.response_topic
            if props.correlation is not None:
                out[mq.CORRELATION_DATA] = props.correlation
            if props.user:
                out[mq.USER_PROPERTY] = list(props.user)
    if ids:
        if out is None:
            out = {}
        out[mq.SUBSCRIPTION_ID] = ids
    return filters, retain, out
