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

from collections.abc import Collection
from typing import Protocol, cast

from BTrees.LOBTree import LOBTree

from aaabus.errors import StoreError
from aaabus.model.agent import BACKLOGS_ATTRIBUTE, Agent
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

__all__ = ["Backlog", "BacklogKeeper", "FlowMarks", "Mailbox"]


class Backlog(Protocol):
    """What a mailbox keeps: items numbered 1, 2, 3, ... until acknowledged.

    Two implementations answer it: the items in the mailbox's own attributes (a ``LOBTree``; file
    and memory stores, and a mailbox not stored yet) and the journal's records on a log store
    (:class:`aaabus.core.backlogs.JournalBacklog`). The same checks run against both
    (``tests/test_mailbox_backlogs.py``). Engine thread; every change is made in the open
    transaction and undone with it."""

    @property
    def next_seq(self) -> int: ...
    @property
    def dropped(self) -> int: ...
    @property
    def watched(self) -> bool: ...
    @property
    def count(self) -> int: ...
    def first(self) -> int: ...
    def set_watched(self, watched: bool) -> None: ...
    def take(self, after: int, most: int) -> list[tuple[int, Notification]]: ...
    def append(self, note: Notification, limit: int) -> int: ...
    def ack(self, upto: int) -> None: ...
    def withdraw(self, seq: int) -> Notification | None: ...
    def take_all(self) -> list[tuple[int, Notification]]: ...
    def restore(
        self, items: list[tuple[int, Notification]], next_seq: int, dropped: int, limit: int | None
    ) -> None: ...


class FlowMarks(Protocol):
    """An MQTT session's QoS 2 state kept beside its backlog, written in the same commits as
    its items (:class:`aaabus.core.backlogs.JournalBacklog`, log stores only; elsewhere the
    session record keeps it, :mod:`aaabus.mqtt.sessions`): the packet ids of the device's
    publications awaiting their PUBREL, and the items the device PUBREC'd. A move of the
    backlog (:meth:`Backlog.take_all`, :meth:`Backlog.restore`) clears it: the session's own
    state carries it. Engine thread; changes in the open transaction."""

    @property
    def released(self) -> Collection[int]: ...
    def inbound_ids(self) -> list[int]: ...
    def has_inbound(self, packet_id: int) -> bool: ...
    def add_inbound(self, packet_id: int) -> None: ...
    def remove_inbound(self, packet_id: int) -> bool: ...
    def release(self, seq: int) -> None: ...


class BacklogKeeper(Protocol):
    """What a store offers to keep backlogs outside the agents (found on the mailbox's
    ``_p_jar``, attribute :data:`~aaabus.model.agent.BACKLOGS_ATTRIBUTE`)."""

    def box(self, owner: AgentId) -> Backlog | None: ...
    def adopt(
        self, owner: AgentId, items: list[tuple[int, Notification]], next_seq: int, dropped: int
    ) -> Backlog: ...
    def drop(self, owner: AgentId) -> None: ...


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
    #: Whether the items are the store's journal's (True from the first change on a log store,
    #: :mod:`aaabus.core.backlogs`) rather than this object's own (the class default).
    journaled: bool = False

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
        # The in-agent backlog's fields (_Held), under the names stores have always had them.
        self.__dict__.update(next_seq=1, count=0, dropped=0, watched=True)

    def on_init(self, first_time: bool) -> None:
        # A subscription's filter was registered by the representative that created it.
        if first_time and self.first is not None:
            target, note = self.first
            self.first = None
            self.send_to(target, note)

    def on_delete(self) -> None:
        if self.topic_filter is not None:
            self.unsubscribe(self.topic_filter)
        if self.journaled:
            keeper = self._keeper()
            if keeper is not None:
                keeper.drop(self.id)

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
        backlog = self._writable()
        if self.push is not None:
            current_context("a mailbox's push").notify(
                self.push, (self.name, backlog.next_seq, note)
            )
        elif backlog.watched:
            # Wake the readers waiting on this mailbox: after the commit, through the server's
            # listeners. Only when a reader found nothing new at its last look: one that found
            # items takes them and looks again without waiting.
            backlog.set_watched(False)
            self.send_to(AgentId.server_of(self.id.server), MailboxGrew(self.name))
        backlog.append(note, self.limit)

    # -- where the items are ---------------------------------------------------------------------

    @property
    def backlog(self) -> Backlog:
        """The items, wherever they are kept (read only: changes go through the methods)."""
        if self.journaled:
            keeper = self._keeper()
            found = keeper.box(self.id) if keeper is not None else None
            if found is None:
                raise StoreError(
                    f"mailbox {self.name!r} ({self.id}) lost its journaled backlog; "
                    "restore the server's store from a backup"
                )
            return found
        return _Held(self)

    @property
    def next_seq(self) -> int:
        """The number the next item gets."""
        return self.backlog.next_seq

    @property
    def count(self) -> int:
        """How many items are kept."""
        return self.backlog.count

    @property
    def dropped(self) -> int:
        """How many items were dropped at the limit so far."""
        return self.backlog.dropped

    @property
    def watched(self) -> bool:
        """Whether a reader found nothing new at its last look (and may be waiting): the next
        item then wakes the readers."""
        return self.backlog.watched

    @watched.setter
    def watched(self, value: bool) -> None:
        self.backlog.set_watched(value)

    def oldest(self) -> int:
        """The oldest seq kept, or :attr:`next_seq` if none is."""
        return self.backlog.first()

    def _keeper(self) -> BacklogKeeper | None:
        jar = self._p_jar
        return getattr(jar, BACKLOGS_ATTRIBUTE, None) if jar is not None else None

    def _writable(self) -> Backlog:
        """The backlog to change: the journal's, moving the items there first if this mailbox
        is stored on a log store and still holds them itself (a mailbox made by an earlier
        version, or not yet stored at its last change)."""
        if self.journaled:
            return self.backlog
        keeper = self._keeper()
        if keeper is None:
            return _Held(self)
        held = _Held(self)
        backlog = keeper.adopt(self.id, held.take_all(), held.next_seq, held.dropped)
        for name in _Held.FIELDS:
            self.__dict__.pop(name, None)
        self.journaled = True  # marks the agent changed: its old fields leave the store too
        return backlog

    def marks(self, *, moving: bool) -> FlowMarks | None:
        """The QoS 2 state kept with the backlog, or None where the backlog cannot keep it
        (file and memory stores, a mailbox not stored yet). ``moving``: a mailbox of an
        earlier version moves its items to the journal first (a change is coming); without,
        nothing is written (a read, or a removal that finds nothing there)."""
        backlog = self._writable() if moving else self.backlog
        return cast(FlowMarks, backlog) if self.journaled else None

    # -- the admin side (engine thread, inside Engine.call) ----------------------------------------

    def take(self, after: int, most: int) -> list[tuple[int, Notification]]:
        """Up to ``most`` items numbered above ``after``, oldest first (nothing is removed).
        Finding none arms the wake-up of the next item (see :attr:`watched`)."""
        backlog = self.backlog
        out = backlog.take(after, most) if most > 0 and backlog.count else []
        if not out and not backlog.watched and self.push is None:
            backlog.set_watched(True)
        return out

    def ack(self, upto: int) -> None:
        """Forget every item numbered ``upto`` or below: the client consumed them."""
        backlog = self.backlog
        if backlog.count and backlog.first() <= upto:
            self._writable().ack(upto)

    def withdraw(self, seq: int) -> Notification | None:
        """Take item ``seq`` back (None if the mailbox no longer holds it): an MQTT shared
        subscription hands it to another member (:mod:`aaabus.mqtt.shared`). The reader
        skips the gap as it skips acknowledged items; numbering goes on."""
        return self._writable().withdraw(seq)

    # -- moves of a roaming MQTT session (engine thread, in the mover's reaction) ------------------

    def append(self, note: Notification) -> None:
        """Append ``note`` as if the mailbox had received it (pushed, numbered, bounded): an
        item forwarded from the session's anchor. In a reaction (the push needs one)."""
        self._append(note)

    def take_all(self) -> list[tuple[int, Notification]]:
        """Every item kept, with its number, oldest first; the mailbox is left empty (its
        numbering goes on from where it was)."""
        return self._writable().take_all()

    def restore(self, items: list[tuple[int, Notification]], next_seq: int, dropped: int) -> None:
        """Put back ``items`` with their own numbers (a device's packet ids are derived from
        them: a message resent after a move keeps its id) and go on numbering at
        ``next_seq``; ``dropped``: the count of items dropped at the limit so far."""
        self._writable().restore(items, next_seq, dropped, self.limit)


class _Held:
    """The backlog in the mailbox's own attributes: a ``LOBTree`` of items (seq -> item) and
    its counters, stored with the agent (file and memory stores; a mailbox not stored yet)."""

    FIELDS = ("items", "next_seq", "count", "dropped", "watched")

    def __init__(self, box: Mailbox) -> None:
        self._box = box
        box._p_activate()
        self._fields = box.__dict__

    @property
    def next_seq(self) -> int:
        return int(self._fields.get("next_seq", 1))

    @property
    def count(self) -> int:
        return int(self._fields.get("count", 0))

    @property
    def dropped(self) -> int:
        return int(self._fields.get("dropped", 0))

    @property
    def watched(self) -> bool:
        return bool(self._fields.get("watched", True))

    def _set(self, **values: object) -> None:
        self._fields.update(values)
        self._box._p_changed = True

    def _items(self) -> LOBTree:
        items = self._fields.get("items")
        if items is None:
            items = LOBTree()
            self._set(items=items)
        return items

    def first(self) -> int:
        items = self._fields.get("items")
        return int(items.minKey()) if self.count and items else self.next_seq

    def set_watched(self, watched: bool) -> None:
        self._set(watched=watched)

    def take(self, after: int, most: int) -> list[tuple[int, Notification]]:
        out: list[tuple[int, Notification]] = []
        items = self._fields.get("items")
        if items is None or most <= 0:
            return out
        for seq, item in items.items(min=after + 1):
            out.append((seq, _loaded(item)))
            if len(out) >= most:
                break
        return out

    def append(self, note: Notification, limit: int) -> int:
        seq = self.next_seq
        items = self._items()
        items[seq] = _stored(note) if self._box.push is not None else note
        self._set(next_seq=seq + 1, count=self.count + 1)
        self._bound(items, limit)
        return seq

    def _bound(self, items: LOBTree, limit: int) -> None:
        count, dropped = self.count, self.dropped
        while count > limit:
            del items[items.minKey()]
            count -= 1
            dropped += 1
        if dropped != self.dropped:
            self._set(count=count, dropped=dropped)

    def ack(self, upto: int) -> None:
        items, count = self._fields.get("items"), self.count
        while count and items is not None and items.minKey() <= upto:
            del items[items.minKey()]
            count -= 1
        if count != self.count:
            self._set(count=count)

    def withdraw(self, seq: int) -> Notification | None:
        items = self._fields.get("items")
        item = items.pop(seq, None) if items is not None else None
        if item is None:
            return None
        self._set(count=self.count - 1)
        return _loaded(item)

    def take_all(self) -> list[tuple[int, Notification]]:
        items = self._fields.get("items")
        if items is None:
            return []
        out = [(seq, _loaded(item)) for seq, item in items.items()]
        items.clear()
        self._set(count=0)
        return out

    def restore(
        self, items: list[tuple[int, Notification]], next_seq: int, dropped: int, limit: int | None
    ) -> None:
        tree = self._items()
        for seq, note in items:
            tree[seq] = _stored(note) if self._box.push is not None else note
        count = len(tree)
        self._set(
            count=count,
            next_seq=max(next_seq, tree.maxKey() + 1 if count else 1, self.next_seq),
            dropped=dropped,
        )
        if limit is not None:
            self._bound(tree, limit)


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
