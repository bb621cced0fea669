"""The notifications the topic representatives exchange among themselves and with their server.

Not part of the agent API (agents use :mod:`aaabus.model.pubsub`). They derive from
:class:`~aaabus.Notification` so that every server's trust policy loads them (they are aaabus's
own data classes).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification
from aaabus.model.pubsub import MessageProps, MqttFields

__all__ = [
    "Carried",
    "CloseMailbox",
    "Forwarded",
    "InterestChange",
    "MailboxGrew",
    "OpenMailbox",
    "Relay",
    "Relays",
    "TopicRoutes",
]


@dataclass
class Carried(Notification, MqttFields):
    """One publication on its way between representatives (and a topic's retained copy);
    the fields of :class:`~aaabus.model.pubsub.Publish`, and its publisher (the MQTT ones,
    :class:`~aaabus.model.pubsub.MqttFields`, keywords)."""

    topic: str
    payload: Any
    publisher: AgentId
    retain: bool = False


@dataclass
class InterestChange(Notification):
    """Server ``origin`` gained (``add``) or lost its last local subscription to ``filters``."""

    origin: int
    filters: tuple[str, ...]
    add: bool


@dataclass
class Relay(Notification):
    """``item`` for the representatives of ``targets``, all reached through the receiver.

    The receiver handles ``item`` itself if it is a target, and relays it to the others, one
    :class:`Relay` per next hop: a relayed item crosses each link between servers at most once.
    """

    targets: tuple[int, ...]
    item: Carried | InterestChange


@dataclass
class Relays(Notification):
    """The relays of one event to one next hop, in order (a burst of publications crosses a link
    as one message, and costs the receiver one reaction), handled as that many :class:`Relay`.

    Kept as columns: relay ``k`` goes to ``targets[k]`` and carries the interest change
    ``changes[k]`` if there is one, else the publication made of ``topics[k]``,
    ``payloads[k]``, ``publishers[k]``, ``flags[k]`` (RETAIN in bit 0, the QoS above it),
    ``origins[k]`` and ``props[k]`` (an interest change's row holds placeholders there). Why
    not a tuple of :class:`Carried`: each publication would travel with its class's tag and
    its field names, and decode through a nested body of its own; as columns, only payloads
    are walked, the rest is decoded and checked by msgspec in C. Use :meth:`of` and
    :meth:`relays`.
    """

    targets: tuple[tuple[int, ...], ...]
    topics: tuple[str, ...]
    payloads: tuple[Any, ...]
    publishers: tuple[AgentId, ...]
    flags: tuple[int, ...]
    origins: tuple[str, ...]
    props: tuple[MessageProps | None, ...]
    changes: tuple[InterestChange | None, ...]

    def __post_init__(self) -> None:
        n = len(self.targets)
        if any(len(column) != n for column in self._columns()):
            raise ValueError(f"columns of unequal lengths for {n} relays")

    def _columns(self) -> tuple[tuple[Any, ...], ...]:
        """Every column, in the order of the fields."""
        return (
            self.targets,
            self.topics,
            self.payloads,
            self.publishers,
            self.flags,
            self.origins,
            self.props,
            self.changes,
        )

    @classmethod
    def of(cls, relays: Sequence[tuple[tuple[int, ...], Carried | InterestChange]]) -> Relays:
        """The columns of ``relays``, ``(targets, item)`` each, in order."""
        targets: list[tuple[int, ...]] = []
        topics: list[str] = []
        payloads: list[Any] = []
        publishers: list[AgentId] = []
        flags: list[int] = []
        origins: list[str] = []
        props: list[MessageProps | None] = []
        changes: list[InterestChange | None] = []
        for where, item in relays:
            targets.append(where)
            if isinstance(item, InterestChange):
                topics.append("")
                payloads.append(None)
                publishers.append(_NOBODY)
                flags.append(0)
                origins.append("")
                props.append(None)
                changes.append(item)
            else:
                topics.append(item.topic)
                payloads.append(item.payload)
                publishers.append(item.publisher)
                flags.append(item.retain | item.qos << 1)
                origins.append(item.origin)
                props.append(item.props)
                changes.append(None)
        return cls(
            tuple(targets),
            tuple(topics),
            tuple(payloads),
            tuple(publishers),
            tuple(flags),
            tuple(origins),
            tuple(props),
            tuple(changes),
        )

    def relays(self) -> Iterator[tuple[tuple[int, ...], Carried | InterestChange]]:
        """Each relay, ``(targets, item)``, in order."""
        rows = zip(*self._columns(), strict=True)
        for targets, topic, payload, publisher, flags, origin, props, change in rows:
            if change is not None:
                yield targets, change
            else:
                yield (
                    targets,
                    Carried(
                        topic,
                        payload,
                        publisher,
                        bool(flags & 1),
                        qos=flags >> 1,
                        origin=origin,
                        props=props,
                    ),
                )


#: The publisher column of an interest change's row in :class:`Relays` (a placeholder).
_NOBODY = AgentId(0, 0, 0)


def one_message(
    relays: tuple[tuple[tuple[int, ...], Carried | InterestChange], ...],
) -> Relay | Relays:
    """What the relays of one event to one hop, ``(targets, item)`` each, travel as: one
    :class:`Relay` when alone, else :class:`Relays`."""
    if len(relays) == 1:
        return Relay(*relays[0])
    return Relays.of(relays)


@dataclass
class TopicRoutes(Notification):
    """From the server at boot, when its routes changed: ``routes`` maps every other server to
    the next hop towards it (the configuration's route table)."""

    routes: dict[int, int]


@dataclass
class OpenMailbox(Notification):
    """Create mailbox ``name`` on the representative's server, unless it exists.

    ``topic_filter``: the mailbox subscribes to it (a client subscription); ``None`` for a reply
    mailbox. ``first``: a notification the mailbox sends, as its sender, when it is created (the
    request of :meth:`aaabus.Client.request`, whose reply then lands in the mailbox).
    ``owner``: the scope (:class:`aaabus.config.scopes.Scope`, as its number) of the admin key
    that opened it: only sessions whose scope covers it may resume, read or acknowledge it
    (:mod:`aaabus.node.mailboxes`). A mailbox that the config declares is ``operate``'s (2).
    ``durable``: a named subscription (``False``: an unnamed one, or a request's reply).
    """

    name: str
    topic_filter: str | None
    first: tuple[AgentId, Notification] | None = None
    owner: int = 2
    durable: bool = True


@dataclass
class CloseMailbox(Notification):
    """Delete mailbox ``name`` (its backlog with it)."""

    name: str


@dataclass
class MailboxGrew(Notification):
    """From a mailbox to its server (``#s.s.0``): an item arrived after a reader found nothing
    new; wakes the connections waiting on it."""

    name: str


@dataclass
class Forwarded(Notification):
    """From mailbox ``name`` whose :attr:`~aaabus.topics.mailbox.Mailbox.forward` is set, to
    that agent: ``item``, which the mailbox received and did not keep."""

    name: str
    item: Notification
