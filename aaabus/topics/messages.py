"""The notifications the topic representatives exchange among themselves and with their server.

Not part of the agent API (agents use :mod:`aaabus.model.pubsub`). They derive from
:class:`~aaabus.Notification` so that every server's trust policy loads them (they are aaabus's
own data classes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification
from aaabus.model.pubsub import MessageProps

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
class Carried(Notification):
    """One publication on its way between representatives (and a topic's retained copy);
    the fields of :class:`~aaabus.model.pubsub.Publish`, and its publisher."""

    topic: str
    payload: Any
    publisher: AgentId
    retain: bool = False
    qos: int = 2
    origin: str = ""
    props: MessageProps | None = None


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
    as one message, and costs the receiver one reaction): ``items[k]`` for ``targets[k]``,
    handled as that many :class:`Relay`. Two flat tuples rather than a tuple of :class:`Relay`:
    one level of nesting less to encode and decode per item."""

    targets: tuple[tuple[int, ...], ...]
    items: tuple[Carried | InterestChange, ...]

    def __post_init__(self) -> None:
        if len(self.targets) != len(self.items):
            raise ValueError(f"{len(self.targets)} target lists for {len(self.items)} items")


def one_message(relays: tuple[Relay, ...]) -> Relay | Relays:
    """What the relays of one event to one hop travel as: the relay itself when alone."""
    if len(relays) == 1:
        return relays[0]
    return Relays(tuple(r.targets for r in relays), tuple(r.item for r in relays))


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
    """

    name: str
    topic_filter: str | None
    first: tuple[AgentId, Notification] | None = None


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
