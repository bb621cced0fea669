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

__all__ = ["Publication", "Publish", "Subscribe", "Unsubscribe"]


@dataclass
class Publish(Notification):
    """Publish ``payload`` on ``topic``; the publisher is the sender.

    ``retain``: the representatives keep it as the topic's retained publication, handed to every
    later subscription whose filter matches (``payload=None`` with ``retain`` clears it).
    ``qos``: the MQTT quality of service it was published with, which caps the QoS an MQTT
    device receives it at (docs/mqtt.md); 2 for agents and clients, whose publications the bus
    delivers exactly once. The bus itself delivers every publication exactly once whatever it is.
    ``origin``: the client id of the MQTT device that published it through a listener (empty
    for agents and clients): what MQTT 5.0's no-local option and the order of a shared
    subscription's deliveries per publisher go by, since every device of a server publishes as
    that server's ``#s.s.0``.
    """

    topic: str
    payload: Any
    retain: bool = False
    qos: int = 2
    origin: str = ""


@dataclass
class Subscribe(Notification):
    """Subscribe ``subscriber`` (default: the sender) to ``topic_filter``.

    The subscriber must live on the representative's server. Subscribing twice to one filter is
    one subscription; the retained publications matching the filter are sent again.
    """

    topic_filter: str
    subscriber: AgentId | None = None


@dataclass
class Unsubscribe(Notification):
    """End the subscription of ``subscriber`` (default: the sender) to ``topic_filter``."""

    topic_filter: str
    subscriber: AgentId | None = None


@dataclass
class Publication(Notification):
    """What a subscriber receives: ``payload`` published on ``topic`` by ``publisher``.

    ``filters``: the subscriber's filters that matched (one publication is delivered once per
    subscriber, even when several of its filters match). ``retained``: a copy of the topic's
    retained publication, sent when the subscription was made (it may be older than live
    publications already received, and is outside the causal contract; see docs/architecture.md).
    ``qos`` and ``origin``: those of :class:`Publish`.
    """

    topic: str
    payload: Any
    publisher: AgentId
    filters: tuple[str, ...] = ()
    retained: bool = False
    qos: int = 2
    origin: str = ""
