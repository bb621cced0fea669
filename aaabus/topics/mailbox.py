"""A mailbox: the persistent backlog of one consumer outside the bus.

A client subscription (:meth:`aaabus.Client.subscribe`) is a mailbox agent on the server the
client goes through, subscribed to the client's filter by the representative that created it; a
request (:meth:`aaabus.Client.request`) is a mailbox that sends the request as its own sender
and keeps the reply. The mailbox numbers
what it receives 1, 2, 3, ... and keeps it in the server's store until the client acknowledges
it, so a consumer that is slow, gone or reconnecting after a server restart never holds the bus
back and loses nothing: the bus delivers to the mailbox at the bus's pace, the client reads from
it at its own.

The limit: at most ``limit`` items wait (property ``aaabus.topics.backlog``, read when the
mailbox is created). Beyond it, the **oldest** item is dropped and counted in ``dropped``: the
backlog then reads as if the subscription had started later, with no hole in its middle, and
the client sees the count grow (``Subscription.dropped``, a warning from ``aaabus subscribe``).

Threads: :meth:`Mailbox.react` runs on the engine thread in a reaction; :meth:`take` and
:meth:`ack` are called by the server's admin side (``aaabus.node.mailboxes``), on the engine
thread too, inside ``Engine.call``, so the backlog has one writer.
"""

from __future__ import annotations

from BTrees.LOBTree import LOBTree

from aaabus.model.agent import Agent
from aaabus.model.context import current_context
from aaabus.model.ids import AgentId
from aaabus.model.notifications import (
    AgentCreateReply,
    AgentDeleteAck,
    AgentDeleteRequest,
    Notification,
)
from aaabus.model.pubsub import Publication
from aaabus.topics.messages import Forwarded, MailboxGrew
from aaabus.wire.codec import Codec, encode_note

__all__ = ["Mailbox"]


class Mailbox(Agent):
    """The backlog of one outside consumer (see the module docstring)."""

    #: The observer key (:meth:`~aaabus.model.context.ReactionContext.notify`) of a live reader
    #: fed by push: each item, once durable, goes to it as ``(name, seq, item)`` and no
    #: :class:`MailboxGrew` is sent. Set on an MQTT session's mailbox; ``None`` (class default)
    #: for client subscriptions, which fetch.
    push: str | None = None
    #: An agent to which everything received goes, as :class:`Forwarded`, instead of being
    #: kept (``None``, the class default: kept). Set on the mailbox of a roaming MQTT session
    #: at its anchor server while another server holds the session (:mod:`aaabus.mqtt.roaming`).
    forward: AgentId | None = None

    def __init__(
        self,
        label: str,
        topic_filter: str | None,
        limit: int,
        first: tuple[AgentId, Notification] | None = None,
    ) -> None:
        super().__init__(label)
        self.topic_filter = topic_filter
        self.limit = limit
        self.first = first
        self.items: LOBTree = LOBTree()
        self.next_seq = 1
        self.count = 0  # len() of a BTree walks it: keep the size
        self.dropped = 0
        #: Whether a reader found nothing new at its last look (and may be waiting): the next
        #: item then wakes the readers.
        self.watched = True

    def on_init(self, first_time: bool) -> None:
        # A subscription's filter was registered by the representative that created it.
        if first_time and self.first is not None:
            target, note = self.first
            self.first = None
            self.send_to(target, note)

    def on_delete(self) -> None:
        if self.topic_filter is not None:
            self.unsubscribe(self.topic_filter)

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, AgentDeleteRequest):
            super().react(sender, note)
        elif not isinstance(note, AgentCreateReply | AgentDeleteAck):
            # Publications, replies, and error reports (the reply to a failed request).
            self._append(note)

    def _append(self, note: Notification) -> None:
        if self.forward is not None:
            self.send_to(self.forward, Forwarded(self.name, note))
            return
        if self.push is not None:
            current_context("a mailbox's push").notify(self.push, (self.name, self.next_seq, note))
        elif self.watched:
            # Wake the readers waiting on this mailbox: after the commit, through the server's
            # listeners. Only when a reader found nothing new at its last look: one that found
            # items takes them and looks again without waiting.
            self.watched = False
            self.send_to(AgentId.server_of(self.id.server), MailboxGrew(self.name))
        self.items[self.next_seq] = _stored(note) if self.push is not None else note
        self.next_seq += 1
        self.count += 1
        while self.count > self.limit:
            del self.items[self.items.minKey()]
            self.count -= 1
            self.dropped += 1

    # -- the admin side (engine thread, inside Engine.call) ----------------------------------------

    def take(self, after: int, most: int) -> list[tuple[int, Notification]]:
        """Up to ``most`` items numbered above ``after``, oldest first (nothing is removed).
        Finding none arms the wake-up of the next item (see :attr:`watched`)."""
        out: list[tuple[int, Notification]] = []
        if most > 0 and self.count:
            for seq, item in self.items.items(min=after + 1):
                out.append((seq, _loaded(item)))
                if len(out) >= most:
                    break
        if not out and not self.watched and self.push is None:
            self.watched = True
        return out

    def ack(self, upto: int) -> None:
        """Forget every item numbered ``upto`` or below: the client consumed them."""
        while self.count and self.items.minKey() <= upto:
            del self.items[self.items.minKey()]
            self.count -= 1

    def withdraw(self, seq: int) -> Notification | None:
        """Take item ``seq`` back (None if the mailbox no longer holds it): an MQTT shared
        subscription hands it to another member (:mod:`aaabus.mqtt.shared`). The reader
        skips the gap as it skips acknowledged items; numbering goes on."""
        item = self.items.pop(seq, None)
        if item is None:
            return None
        self.count -= 1
        return _loaded(item)

    # -- moves of a roaming MQTT session (engine thread, in the mover's reaction) ------------------

    def append(self, note: Notification) -> None:
        """Append ``note`` as if the mailbox had received it (pushed, numbered, bounded): an
        item forwarded from the session's anchor. In a reaction (the push needs one)."""
        self._append(note)

    def take_all(self) -> list[tuple[int, Notification]]:
        """Every item kept, with its number, oldest first; the mailbox is left empty (its
        numbering goes on from where it was)."""
        out = [(seq, _loaded(item)) for seq, item in self.items.items()]
        self.items.clear()
        self.count = 0
        return out

    def restore(self, items: list[tuple[int, Notification]], next_seq: int, dropped: int) -> None:
        """Put back ``items`` with their own numbers (a device's packet ids are derived from
        them: a message resent after a move keeps its id) and go on numbering at
        ``next_seq``; ``dropped``: the count of items dropped at the limit so far."""
        for seq, note in items:
            self.items[seq] = _stored(note) if self.push is not None else note
        self.count = len(self.items)
        self.next_seq = max(next_seq, self.items.maxKey() + 1 if self.count else 1)
        self.dropped = dropped
        while self.count > self.limit:
            del self.items[self.items.minKey()]
            self.count -= 1
            self.dropped += 1


# A device's backlog holds publications by the hundred, and every commit that appends one
# rewrites the bucket it lands in: stored as an object, each item costs the pickler a dozen
# objects (topic, payload, publisher id, filters...); stored as its data body, one. Only for
# what needs nothing but aaabus's own classes to load again (a publication of bytes, text or
# nothing, which is all a device sends or reads), so that a reboot can always read it back.
_AS_BODY = (bytes, str, type(None))


def _stored(note: Notification) -> Notification | bytes:
    if isinstance(note, Publication) and isinstance(note.payload, _AS_BODY):
        return encode_note(note)
    return note


def _loaded(item: Notification | bytes) -> Notification:
    return _BODIES.decode(item) if isinstance(item, bytes) else item


_BODIES = Codec()  # imports nothing: the bodies stored here name aaabus's classes only
