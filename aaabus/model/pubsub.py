"""The notifications of topics: what an agent sends to publish or subscribe, and what it receives.

Agents do not build these by hand: :meth:`aaabus.Agent.publish`, :meth:`~aaabus.Agent.subscribe`
and :meth:`~aaabus.Agent.unsubscribe` send them to the topic representative of the agent's own
server (``#s.s.2``, see :mod:`aaabus.topics`); a subscriber receives :class:`Publication`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification

__all__ = ["MessageProps", "MqttFields", "Publication", "Publish", "Subscribe", "Unsubscribe"]


@dataclass(frozen=True)
class MessageProps:
    """MQTT 5.0's properties of one application message, carried with it across the bus and
    handed to every 5.0 subscriber as published (a 3.1.1 device receives the message without
    them; agents see them on :class:`Publication`). Only a 5.0 device's publication has any:
    agents and clients publish without (``None`` on :class:`Publish`).

    ``payload_format``: 1 if the payload is UTF-8 text (the listener refuses one that is not).
    ``content_type``, ``response_topic``, ``correlation``: as published (request/response passes
    them through unchanged). ``user``: the User Properties, ordered, a name may repeat.
    ``expires_at``: the Message Expiry Interval made a wall-clock deadline (``time.time()``)
    when published; a device is not sent it after that, and is sent what remains of it.
    """

    payload_format: int = 0
    content_type: str | None = None
    response_topic: str | None = None
    correlation: bytes | None = None
    user: tuple[tuple[str, str], ...] = ()
    expires_at: float | None = None


@dataclass(kw_only=True)
class MqttFields:
    """What MQTT adds to a publication, in one place for every class that carries one
    (:class:`Publish`, :class:`Publication`, and the representatives'
    :class:`~aaabus.topics.messages.Carried`): keyword-only fields, after the class's own in
    its constructor.

    ``qos``: the MQTT quality of service it was published with, which caps the QoS an MQTT
    device receives it at (docs/mqtt.md); 2 for agents and clients, whose publications the bus
    delivers exactly once. The bus itself delivers every publication exactly once whatever it is.
    ``origin``: the client id of the MQTT device that published it through a listener (empty
    for agents and clients): what MQTT 5.0's no-local option and the order of a shared
    subscription's deliveries per publisher go by, since every device of a server publishes as
    that server's ``#s.s.0``. ``props``: the message's MQTT 5.0 properties (None: it has none).

    Not a notification itself (it has no tag): a base the classes' fields come from. The field
    names, types and defaults are those the classes always had: stored and wired copies read
    as before (both go by field name).
    """

    qos: int = 2
    origin: str = ""
    props: MessageProps | None = None


@dataclass
class Publish(Notification, MqttFields):
    """Publish ``payload`` on ``topic``; the publisher is the sender.

    ``retain``: the representatives keep it as the topic's retained publication, handed to every
    later subscription whose filter matches (``payload=None`` with ``retain`` clears it).
    ``qos``, ``origin``, ``props``: :class:`MqttFields` (keywords).
    """

    topic: str
    payload: Any
    retain: bool = False


@dataclass
class Subscribe(Notification):
    """Subscribe ``subscriber`` (default: the sender) to ``topic_filter``.

    The subscriber must live on the representative's server. Subscribing twice to one filter is
    one subscription; the retained publications matching the filter are sent again, unless
    ``send_retained`` is False (MQTT 5.0's retain handling 1 and 2).
    """

    topic_filter: str
    subscriber: AgentId | None = None
    send_retained: bool = True


@dataclass
class Unsubscribe(Notification):
    """End the subscription of ``subscriber`` (default: the sender) to ``topic_filter``."""

    topic_filter: str
    subscriber: AgentId | None = None


@dataclass
class Publication(Notification, MqttFields):
    """What a subscriber receives: ``payload`` published on ``topic`` by ``publisher``.

    ``filters``: the subscriber's filters that matched (one publication is delivered once per
    subscriber, even when several of its filters match). ``retained``: a copy of the topic's
    retained publication, sent when the subscription was made (it may be older than live
    publications already received, and is outside the causal contract; see docs/architecture.md).
    ``qos``, ``origin`` and ``props``: those of :class:`Publish` (:class:`MqttFields`,
    keywords); ``retain``: the RETAIN flag it was published with (what MQTT 5.0's
    retain-as-published hands on; True in a retained copy).
    """

    topic: str
    payload: Any
    publisher: AgentId
    filters: tuple[str, ...] = ()
    retained: bool = False
    retain: bool = False
