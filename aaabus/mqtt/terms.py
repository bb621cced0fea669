"""MQTT 5.0's connection-level rules, sans-IO: what a CONNECT and its CONNACK agree on, a
connection's inbound topic aliases, and the bound on the QoS 1/2 publications a device may leave
unacknowledged (our Receive Maximum).

Pure values over decoded packets (:mod:`aaabus.mqtt.codec`): no sockets, threads, clocks or
store. The connection (:mod:`aaabus.mqtt.connection`, on the listener's loop thread) asks
:func:`negotiate` once per CONNECT and keeps the :class:`Terms`; its QoS flows
(:mod:`aaabus.mqtt.flows`) keep a :class:`TopicAliases` and an :class:`InboundWindow`. A 3.1.1
CONNECT gets :class:`Terms` too (3.1.1's fixed rules in the same shape), so the connection has
one code path.

What 5.0 changes of a session's life (5.0 §3.1.2.4, §3.1.2.11.2): Clean Start says whether a stored
session is dropped at CONNECT, the Session Expiry Interval how long it outlives its connection (0,
the default: it ends with the connection, even when one stored was resumed). 3.1.1's Clean
Session is both at once: clean start and expiry 0, or no clean start and the server's expiry.

Every refusal raises :class:`~aaabus.errors.MqttProtocolError` whose ``code`` is the 5.0 reason to
answer (a CONNACK's while connecting, a DISCONNECT's after).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

from aaabus.errors import MqttProtocolError
from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq

__all__ = [
    "InboundWindow",
    "Limits",
    "OutboundAliases",
    "Terms",
    "TopicAliases",
    "disconnect_expiry",
    "negotiate",
]

#: 5.0 §3.1.2.11.2: this Session Expiry Interval means "never expires" (capped like any other).
NEVER = 0xFFFFFFFF


class Limits(Protocol):
    """The server's side of the bargain (the listener's properties, ``aaabus.mqtt.*``)."""

    inflight: int
    max_packet: int
    topic_aliases: int
    max_keepalive: int
    keepalive_0: bool
    session_expiry_s: float


@dataclass(slots=True)
class Terms:
    """What one connection's CONNECT settled.

    ``clean_start``: a stored session is dropped first. ``expiry``: seconds the session outlives
    the connection (0: it ends with it), None for a 3.1.1 persistent session (the server's
    ``session_expiry_s``, applied when it expires, so a changed property applies to it).
    ``keep_alive``: the interval the server enforces (5.0 may impose its own). ``window``: QoS 1/2
    deliveries the device may have unacknowledged (ours and its Receive Maximum, the lower).
    ``max_out``: largest packet the device accepts (0: no bound but MQTT's). ``connack``: the 5.0
    CONNACK's properties ({} for 3.1.1). ``aliases_out``: topic aliases the server may set
    towards the device (its Topic Alias Maximum, capped by ours; 0: none)."""

    clean_start: bool
    expiry: int | None
    keep_alive: int
    window: int
    max_out: int = 0
    connack: dict[int, Any] = field(default_factory=dict)
    aliases_out: int = 0

    @property
    def ends(self) -> bool:
        """The session ends with the connection (3.1.1 clean session; 5.0 expiry 0)."""
        return self.expiry == 0


def _expiry(requested: int, cap: float) -> int:
    return min(requested, int(cap))


def negotiate(packet: mc.Connect, limits: Limits, assigned: str | None) -> Terms:
    """The terms of ``packet`` under ``limits``; ``assigned``: the client id the server chose for
    a CONNECT without one (5.0 tells the client, Assigned Client Identifier). Raises
    :class:`MqttProtocolError` with the CONNACK reason for a CONNECT refused."""
    keep_alive = packet.keep_alive
    too_long = keep_alive > limits.max_keepalive
    if packet.version != mq.V5:
        if too_long or (keep_alive == 0 and not limits.keepalive_0):
            # 3.1.1 cannot impose another keep-alive: it refuses (0x02, identifier rejected, is
            # the closest of its five codes).
            what = "0 (aaabus.mqtt.keepalive_0 is off)" if keep_alive == 0 else f"{keep_alive} s"
            raise MqttProtocolError(
                f"keep-alive {what} refused (aaabus.mqtt.max_keepalive is "
                f"{limits.max_keepalive} s)",
                mq.CLIENT_ID_NOT_VALID,
            )
        return Terms(packet.clean, 0 if packet.clean else None, keep_alive, limits.inflight)
    props = packet.properties
    if mq.AUTH_METHOD in props:
        # Enhanced authentication (5.0 §4.12) is not built: the method is refused as unknown.
        raise MqttProtocolError(
            f"authentication method {str(props[mq.AUTH_METHOD])[:40]!r} is not supported",
            mq.BAD_AUTH_METHOD,
        )
    connack: dict[int, Any] = {}
    requested = props.get(mq.SESSION_EXPIRY, 0)
    expiry = _expiry(requested, limits.session_expiry_s)
    if expiry != requested:
        connack[mq.SESSION_EXPIRY] = expiry
    if too_long or keep_alive == 0:
        # 5.0 §3.2.2.3.14: the server may impose its own keep-alive instead of refusing. For 0
        # too: a device that can be told to ping is told (a 3.1.1 one cannot: the listener's
        # max_idle_s is then its only deadline).
        keep_alive = limits.max_keepalive
        connack[mq.SERVER_KEEP_ALIVE] = keep_alive
    connack[mq.RECEIVE_MAXIMUM] = limits.inflight
    connack[mq.MAXIMUM_PACKET_SIZE] = limits.max_packet
    if limits.topic_aliases:  # absent: 0, the client may send none
        connack[mq.TOPIC_ALIAS_MAXIMUM] = limits.topic_aliases
    connack[mq.RETAIN_AVAILABLE] = 1
    connack[mq.WILDCARD_SUB_AVAILABLE] = 1
    connack[mq.SUBSCRIPTION_ID_AVAILABLE] = 1
    connack[mq.SHARED_SUB_AVAILABLE] = 1
    if assigned is not None:
        connack[mq.ASSIGNED_CLIENT_ID] = assigned
    # The codec refuses a Receive Maximum or a Maximum Packet Size of 0 (a protocol error).
    window = min(limits.inflight, props.get(mq.RECEIVE_MAXIMUM, limits.inflight))
    return Terms(
        packet.clean,  # bit 1 of the flags: Clean Session in 3.1.1, Clean Start in 5.0
        expiry,
        keep_alive,
        window,
        props.get(mq.MAXIMUM_PACKET_SIZE, 0),
        connack,
        # Ours bounds what the server keeps per connection for them, whatever the device allows.
        min(props.get(mq.TOPIC_ALIAS_MAXIMUM, 0), limits.topic_aliases),
    )


def disconnect_expiry(terms: Terms, packet: mc.Disconnect, limits: Limits) -> int | None:
    """The session expiry after the device's DISCONNECT (5.0 §3.14.2.2.2: it may change it), or
    None if it did not. Raises :class:`MqttProtocolError` (0x82) for a change from 0, which
    the specification forbids (the DISCONNECT is then not a valid one: the will is published)."""
    requested = packet.properties.get(mq.SESSION_EXPIRY)
    if requested is None or terms.expiry is None:
        return None
    if terms.expiry == 0 and requested:
        raise MqttProtocolError(
            "DISCONNECT sets a session expiry interval after a CONNECT without one",
            mq.PROTOCOL_ERROR,
        )
    return _expiry(requested, limits.session_expiry_s)


class TopicAliases:
    """A connection's inbound topic aliases (5.0 §3.3.2.3.4): a PUBLISH with a topic and an
    alias sets the alias, one with an empty topic uses it. Bounded by ``maximum`` entries (our
    Topic Alias Maximum); the map lives and dies with the connection, as the spec says."""

    __slots__ = ("_names", "maximum")

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self._names: dict[int, str] = {}

    def resolve(self, packet: mc.Publish) -> str:
        """The topic name of ``packet``. Raises :class:`MqttProtocolError` (0x94) for an alias
        out of 1..maximum or an empty topic whose alias was never set."""
        topic = packet.topic
        alias = packet.properties.get(mq.TOPIC_ALIAS)
        if alias is None:
            if not topic:
                raise MqttProtocolError(
                    "PUBLISH with an empty topic and no alias", mq.PROTOCOL_ERROR
                )
            return topic
        if not 0 < alias <= self.maximum:
            raise MqttProtocolError(
                f"topic alias {alias} out of 1..{self.maximum} (aaabus.mqtt.topic_aliases)",
                mq.TOPIC_ALIAS_INVALID,
            )
        if topic:
            self._names[alias] = topic
            return topic
        name = self._names.get(alias)
        if name is None:
            raise MqttProtocolError(
                f"PUBLISH with an empty topic and alias {alias}, which was never set",
                mq.TOPIC_ALIAS_INVALID,
            )
        return name


class OutboundAliases:
    """The topic aliases the server sets towards a 5.0 device that allows them (5.0 §3.3.2.3.4:
    its CONNECT's Topic Alias Maximum, capped by ours). The ``maximum`` topics sent most
    recently hold an alias each, so a topic sent often keeps its own; the first PUBLISH of a
    topic carries its name and sets the alias, the next ones an empty name and the alias. A
    topic beyond the maximum takes the alias of the one sent least recently (the device's map
    is overwritten by that first PUBLISH). Lives and dies with the connection, as the device's
    map does.

    Invariant: every alias held here was set by a PUBLISH the device was sent; one that is
    not sent after all (:meth:`unsent`) is forgotten."""

    __slots__ = ("_by_topic", "_free", "_issued", "maximum")

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self._by_topic: OrderedDict[str, int] = OrderedDict()  # least recently sent first
        self._issued = 0  # aliases 1.._issued have been given out
        self._free: list[int] = []  # given out, then forgotten

    def apply(self, topic: str, props: dict[int, Any] | None) -> tuple[str, dict[int, Any]]:
        """The topic name and properties of a PUBLISH on ``topic`` whose other properties are
        ``props`` (the caller's own dict, which is extended, or None)."""
        by_topic = self._by_topic
        alias = by_topic.get(topic)
        name = ""
        if alias is not None:
            by_topic.move_to_end(topic)
        else:
            name = topic
            if self._free:
                alias = self._free.pop()
            elif self._issued < self.maximum:
                self._issued += 1
                alias = self._issued
            else:
                alias = by_topic.popitem(last=False)[1]
            by_topic[topic] = alias
        if props is None:
            return name, {mq.TOPIC_ALIAS: alias}
        props[mq.TOPIC_ALIAS] = alias
        return name, props

    def unsent(self, topic: str, name: str) -> None:
        """The PUBLISH :meth:`apply` named ``name`` for ``topic`` was not sent: an alias it
        was to set is forgotten (the device never learnt it)."""
        if name:
            alias = self._by_topic.pop(topic, None)
            if alias is not None:
                self._free.append(alias)


class InboundWindow:
    """The device's QoS 1/2 publications the server has not finished acknowledging: a QoS 1
    one until its PUBACK is sent, a QoS 2 one until its PUBCOMP (or a PUBREC with an error
    reason, which ends the flow). 5.0 §4.9: a device may have at most our Receive Maximum of
    them; one more is a protocol violation (0x93).

    The count drops when the answer is produced, possibly before it is on the wire: never more
    than the device's own count, so a device that keeps the rule is never refused."""

    __slots__ = ("_qos1", "_qos2", "maximum")

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self._qos1 = 0
        self._qos2: set[int] = set()  # packet ids: a retransmitted PUBLISH is not a new one

    def received(self, qos: int, packet_id: int | None) -> None:
        """A PUBLISH at ``qos`` arrived; raises :class:`MqttProtocolError` (0x93) beyond the
        maximum."""
        if qos == 0 or (qos == 2 and packet_id in self._qos2):
            return
        if self._qos1 + len(self._qos2) >= self.maximum:
            raise MqttProtocolError(
                f"more than {self.maximum} QoS 1/2 publications unacknowledged (our Receive "
                "Maximum, aaabus.mqtt.inflight)",
                mq.RECEIVE_MAXIMUM_EXCEEDED,
            )
        if qos == 1:
            self._qos1 += 1
        else:
            self._qos2.add(packet_id or 0)

    def finished(self, qos: int, packet_id: int) -> None:
        """The flow of the PUBLISH ``packet_id`` at ``qos`` is over on the server's side."""
        if qos == 1:
            self._qos1 = max(0, self._qos1 - 1)
        else:
            self._qos2.discard(packet_id)
