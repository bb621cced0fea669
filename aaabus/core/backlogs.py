"""Mailbox backlogs as side records of the journal: a delivery to a device changes no ZODB object.

Why. A mailbox (:mod:`aaabus.topics.mailbox`: an MQTT session's backlog, a ``Client``
subscription's) used to keep its items in a ``LOBTree`` of the agent: every publication it
received rewrote a bucket of that tree and the agent itself (its counters), two ZODB objects of
some 30 µs each plus the connection's fixed cost, in the commit that comes before the PUBACK. On
a log store the items are now records of the journal's commit block, written as they are, and a
publication that reaches a mailbox changes no ZODB object (issue 43; the same cure as issue 34's
for the channel's queues). File and memory stores keep the items in the agent, as before.

Records (keys as the journal's, :mod:`aaabus.core.journal`: ``0xFF``, a kind, six bytes):

===========  ===========================  ==================================================
kind         key's six bytes              data
===========  ===========================  ==================================================
box head     a number (see below)         the mailbox's id (origin, stamp), its incarnation,
                                          next seq, count dropped at the limit, and floor:
                                          every seq at or below it is gone
box item     a number                     its head's number, the incarnation, the item's
                                          seq, a flag (1: withdrawn), the body (the codec's)
box marks    a number                     its head's number, the incarnation, an MQTT
                                          session's QoS 2 state: the packet ids of inbound
                                          publications awaiting their PUBREL, the seqs of
                                          items the device PUBREC'd
===========  ===========================  ==================================================

Numbers come from one counter (48 bits) for heads and items alike, so a key is written once and
never reused while a record under it may be on disk: at boot the counter starts above every
number found, dead records included.

What is live, at boot (a forgotten key's last record may still be on disk, see the journal):
an item is live if its head is (the item names its head's number), its incarnation is the
head's, and its seq is above the head's floor; a withdrawn item (an MQTT shared subscription
handed it to another member) is a rewritten record flagged withdrawn, kept until the floor
passes it, so that the withdrawn item never comes back. A box's marks are one record, rewritten
whole at the commit of each transaction that changed them, under one key for the incarnation
(never forgotten while it lives: a packet id found again after its PUBREL would make the
device's next publication with that id pass for a retransmission, and be lost); live if its
head is and its incarnation is the head's. Emptying the mailbox or putting items back with
their own numbers (a roaming session's move) starts a new incarnation: every older
record is dead at once, whatever its seq. A head is live if its mailbox still exists in the
store; the store checks that after the journal's boot (:meth:`JournalBacklogs.sweep`), since
the journal opens before the agents are read. Two heads naming one mailbox (ids are never
reused, so only a damaged store could hold them): the newer is kept.

Bodies stay on disk: a backlog holds only (seq, key) pairs in memory, and an item's body is read
back (from the open transaction's writes, else from the storage) when a reader takes it. A device
that is connected gets its items pushed as they are committed, never read back.

Engine thread only, like the journal; every change is made in the open transaction and undone
with it (the journal's undo log).
"""

from __future__ import annotations

import struct
from bisect import bisect_right, insort
from collections import deque
from collections.abc import Callable, Collection, Iterable
from itertools import islice
from typing import TYPE_CHECKING, Any, Protocol

from aaabus.model.ids import AgentId
from aaabus.wire.codec import Codec

if TYPE_CHECKING:
    from aaabus.model.notifications import Notification

__all__ = ["K_BOX_HEAD", "K_BOX_ITEM", "K_BOX_MARKS", "JournalBacklog", "JournalBacklogs"]

_SIDE = 0xFF
K_BOX_HEAD = 9
K_BOX_ITEM = 10
K_BOX_MARKS = 11
_NUMBERS = 1 << 48
#: origin, stamp, incarnation, next seq, dropped, floor.
_HEAD = struct.Struct(">IQIQQQ")
#: the head's number, incarnation, seq, flag; the body follows.
_ITEM = struct.Struct(">QIQB")
_WITHDRAWN = 1
#: the head's number, incarnation, how many inbound packet ids (two bytes each) follow; then
#: the released seqs (eight bytes each) to the end.
_MARKS = struct.Struct(">QIH")
_INCARNATIONS = 1 << 32

Owner = tuple[int, int]  # a mailbox's (origin, stamp): its key in the store's agents table


class Journal(Protocol):
    """What the backlogs use of :class:`aaabus.core.journal.Journal` (which holds them)."""

    def write(self, key: bytes, data: bytes) -> None: ...
    def forget(self, key: bytes) -> None: ...
    def undo(self, fn: Callable[..., object], *args: Any) -> None: ...
    def read(self, key: bytes) -> bytes | None: ...
    def forget_now(self, keys: list[bytes]) -> None: ...
    def flush_at_commit(self, out: Any) -> None: ...


def _number(key: bytes) -> int:
    return int.from_bytes(key[2:], "big")


class JournalBacklogs:
    """Every journaled mailbox backlog of one store (the ``backlogs`` of its journal).

    ``records``: every side record read at the boot; the keys of the live ones are added to
    ``live`` (what the journal keeps; it forgets the rest). ``codec`` encodes and decodes the
    items' bodies; the server gives its own (:attr:`codec`), which may import the modules its
    operator trusts, as it does for the notifications that reach it.
    """

    def __init__(self, journal: Journal, records: dict[bytes, bytes], live: set[bytes]) -> None:
        self._journal = journal
        #: How bodies are encoded and decoded (set by the server to its own codec).
        self.codec = Codec()
        self._boxes: dict[Owner, JournalBacklog] = {}
        top = -1
        for key, data in records.items():
            if key[1] != K_BOX_HEAD:
                continue
            top = max(top, _number(key))
            origin, stamp, inc, next_seq, dropped, floor = _HEAD.unpack(data)
            was = self._boxes.get((origin, stamp))
            if was is not None and _number(was._head) > _number(key):
                continue  # a mailbox's ids are never reused: the newer head is its own
            self._boxes[origin, stamp] = JournalBacklog(
                self, (origin, stamp), key, inc, next_seq, dropped, floor
            )
        live.update(box._head for box in self._boxes.values())
        heads = {_number(box._head): box for box in self._boxes.values()}
        found: dict[JournalBacklog, list[tuple[int, bytes]]] = {}
        for key, data in records.items():
            if key[1] != K_BOX_ITEM:
                continue
            top = max(top, _number(key))
            head, inc, seq, flag = _ITEM.unpack_from(data)
            box = heads.get(head)
            if box is None or inc != box._inc or not box._floor < seq < box.next_seq:
                continue  # acknowledged, dropped, of an older incarnation or a deleted mailbox
            live.add(key)
            if flag & _WITHDRAWN:
                box._withdrawn[seq] = key
            else:
                found.setdefault(box, []).append((seq, key))
        for box, items in found.items():
            items.sort()
            box._seqs.extend(seq for seq, _key in items)
            box._keys.update(items)
        for key, data in records.items():
            if key[1] != K_BOX_MARKS:
                continue
            top = max(top, _number(key))
            head, inc, count = _MARKS.unpack_from(data)
            box = heads.get(head)
            if box is None or inc != box._inc:
                continue  # of a deleted mailbox or an older incarnation
            live.add(key)
            box._marks = key
            ids = struct.unpack_from(f">{count}H", data, _MARKS.size)
            rest = memoryview(data)[_MARKS.size + 2 * count :]
            box._inbound.update(ids)
            box._released.update(struct.unpack(f">{len(rest) // 8}Q", rest))
        self._next = top + 1

    # -- what a mailbox asks (aaabus.topics.mailbox.BacklogKeeper) -------------------------------

    def box(self, owner: AgentId) -> JournalBacklog | None:
        """The backlog of mailbox ``owner``, or None if it has none here."""
        return self._boxes.get((owner.origin, owner.stamp))

    def adopt(
        self,
        owner: AgentId,
        items: Iterable[tuple[int, Notification]],
        next_seq: int,
        dropped: int,
    ) -> JournalBacklog:
        """Give mailbox ``owner`` a backlog here holding ``items`` (its own, kept in the agent
        until now), numbered on from ``next_seq``; in the open transaction."""
        key = self.new_key(K_BOX_HEAD)
        box = JournalBacklog(self, (owner.origin, owner.stamp), key, 0, next_seq, dropped, 0)
        self._boxes[box.owner] = box
        self._journal.undo(self._boxes.pop, box.owner)
        box.restore(list(items), next_seq, dropped, None)
        box._write_head()
        return box

    def drop(self, owner: AgentId) -> None:
        """Forget mailbox ``owner``'s backlog and every record of it (the mailbox is deleted)."""
        box = self._boxes.pop((owner.origin, owner.stamp), None)
        if box is None:
            return
        self._journal.undo(self._boxes.__setitem__, box.owner, box)
        forget = self._journal.forget
        for key in box._all_keys():
            forget(key)

    def sweep(self, exists: Callable[[Owner], bool]) -> int:
        """At boot, outside any transaction: forget the backlogs whose mailbox no longer exists
        (deleted, their records found again on disk). Returns how many."""
        gone = [box for owner, box in self._boxes.items() if not exists(owner)]
        keys: list[bytes] = []
        for box in gone:
            del self._boxes[box.owner]
            keys.extend(box._all_keys())
        if keys:
            self._journal.forget_now(keys)
        return len(gone)

    # -- for the backlogs ------------------------------------------------------------------------

    def new_key(self, kind: int) -> bytes:
        number = self._next
        if number >= _NUMBERS:  # 2**48 items: centuries at a million a second
            raise OverflowError("the journal's backlog record numbers are spent")
        self._next = number + 1
        self._journal.undo(setattr, self, "_next", number)
        return bytes((_SIDE, kind)) + number.to_bytes(6, "big")

    def count(self) -> int:
        """Items kept in every backlog."""
        return sum(len(box) for box in self._boxes.values())


class JournalBacklog:
    """One mailbox's backlog in the journal: the same questions as the in-agent one
    (:class:`aaabus.topics.mailbox.Backlog`). Engine thread; changes in the open transaction."""

    def __init__(
        self,
        keeper: JournalBacklogs,
        owner: Owner,
        head: bytes,
        inc: int,
        next_seq: int,
        dropped: int,
        floor: int,
    ) -> None:
        self._keeper = keeper
        self._journal = keeper._journal
        self.owner = owner
        self._head = head
        self._number = _number(head)
        self._inc = inc
        self.next_seq = next_seq
        self.dropped = dropped
        self._floor = floor
        self._seqs: deque[int] = deque()  # the live items' seqs, ascending
        self._keys: dict[int, bytes] = {}
        self._withdrawn: dict[int, bytes] = {}
        #: The marks' record (None: none written in this incarnation) and what it holds.
        self._marks: bytes | None = None
        #: The marks changed in the open transaction: written once, at its commit (a batch
        #: of a hundred publications of one device rewrites them once, not a hundred times).
        self._marks_dirty = False
        self._inbound: set[int] = set()
        self._released: set[int] = set()
        #: Not stored: after a boot, the next item wakes the readers (one wake-up too many at
        #: worst); undone with the transaction like the rest.
        self.watched = True

    def __len__(self) -> int:
        return len(self._seqs)

    @property
    def count(self) -> int:
        return len(self._seqs)

    def first(self) -> int:
        """The oldest seq kept, or :attr:`next_seq` if none is."""
        return self._seqs[0] if self._seqs else self.next_seq

    def set_watched(self, watched: bool) -> None:
        # Only disarming is undone with its transaction (the wake-up it sent is undone too);
        # arming costs no undo, so a reader's look that finds nothing joins no transaction,
        # and a wake-up too many is harmless.
        if not watched:
            self._journal.undo(setattr, self, "watched", self.watched)
        self.watched = watched

    # -- reads -----------------------------------------------------------------------------------

    def take(self, after: int, most: int) -> list[tuple[int, Notification]]:
        """Up to ``most`` items numbered above ``after``, oldest first (nothing removed)."""
        seqs = self._seqs
        start = bisect_right(seqs, after)
        return [(seq, self._load(seq)) for seq in islice(seqs, start, start + most)]

    def _load(self, seq: int) -> Notification:
        data = self._journal.read(self._keys[seq])
        assert data is not None, "a live item's record is in the store"
        return self._keeper.codec.decode(memoryview(data)[_ITEM.size :])

    # -- an MQTT session's QoS 2 state (aaabus.topics.mailbox.FlowMarks) ------------------------

    @property
    def released(self) -> Collection[int]:
        """The seqs of the items the device PUBREC'd (read only)."""
        return self._released

    def inbound_ids(self) -> list[int]:
        """The packet ids of inbound QoS 2 publications awaiting their PUBREL."""
        return sorted(self._inbound)

    def has_inbound(self, packet_id: int) -> bool:
        return packet_id in self._inbound

    def add_inbound(self, packet_id: int) -> None:
        """Keep ``packet_id`` until :meth:`remove_inbound` (its PUBREL)."""
        if packet_id not in self._inbound:
            self._inbound.add(packet_id)
            self._journal.undo(self._inbound.discard, packet_id)
            self._write_marks()

    def remove_inbound(self, packet_id: int) -> bool:
        """Forget ``packet_id``; whether it was kept."""
        if packet_id not in self._inbound:
            return False
        self._inbound.discard(packet_id)
        self._journal.undo(self._inbound.add, packet_id)
        self._write_marks()
        return True

    def release(self, seq: int) -> None:
        """Item ``seq`` was PUBREC'd: resent as PUBREL from now on, until acknowledged."""
        if seq > self._floor and seq not in self._released:
            self._released.add(seq)
            self._journal.undo(self._released.discard, seq)
            self._write_marks()

    # -- changes (in the open transaction) -------------------------------------------------------

    def append(self, note: Notification, limit: int) -> int:
        """Add ``note`` as the next item; beyond ``limit`` items drop the oldest. Its seq."""
        seq = self.next_seq
        self._put(seq, note)
        self._set(next_seq=seq + 1)
        self._bound(limit)
        self._write_head()
        return seq

    def ack(self, upto: int) -> None:
        """Forget every item numbered ``upto`` or below."""
        upto = min(upto, self.next_seq - 1)
        if upto <= self._floor:
            return
        seqs, forget = self._seqs, self._journal.forget
        while seqs and seqs[0] <= upto:
            forget(self._pop_first())
        for seq in [seq for seq in self._withdrawn if seq <= upto]:
            forget(self._unwithdraw(seq))
        self._set(floor=upto)
        self._trim_released()
        self._write_head()

    def withdraw(self, seq: int) -> Notification | None:
        """Take item ``seq`` back (None if not kept); its record is rewritten flagged
        withdrawn until the floor passes it, so that it never comes back."""
        key = self._keys.get(seq)
        if key is None:
            return None
        note = self._load(seq)
        self._seqs.remove(seq)
        del self._keys[seq]
        self._withdrawn[seq] = key
        self._journal.undo(self._unwithdraw_back, seq, key)
        self._journal.write(key, _ITEM.pack(self._number, self._inc, seq, _WITHDRAWN))
        return note

    def take_all(self) -> list[tuple[int, Notification]]:
        """Every item, oldest first; the backlog is left empty, numbering going on."""
        out = [(seq, self._load(seq)) for seq in self._seqs]
        self._new_incarnation()
        self._write_head()
        return out

    def restore(
        self,
        items: list[tuple[int, Notification]],
        next_seq: int,
        dropped: int,
        limit: int | None,
    ) -> None:
        """Put ``items`` back with their own numbers beside what is kept, number on from
        ``next_seq`` at least, ``dropped`` so far; beyond ``limit`` drop the oldest."""
        kept = dict(self.take(0, len(self._seqs)))
        kept.update(items)
        self._new_incarnation()
        for seq in sorted(kept):
            self._put(seq, kept[seq])
        last = max(kept) + 1 if kept else 1
        self._set(next_seq=max(next_seq, last, self.next_seq), dropped=dropped)
        if limit is not None:
            self._bound(limit)
        self._write_head()

    # -- helpers ---------------------------------------------------------------------------------

    def _put(self, seq: int, note: Notification) -> None:
        key = self._keeper.new_key(K_BOX_ITEM)
        body = self._keeper.codec.encode(note)
        self._journal.write(key, _ITEM.pack(self._number, self._inc, seq, 0) + body)
        seqs = self._seqs
        if not seqs or seqs[-1] < seq:
            seqs.append(seq)
        else:
            insort(seqs, seq)
        self._keys[seq] = key
        self._journal.undo(self._unput, seq)

    def _unput(self, seq: int) -> None:
        self._seqs.remove(seq)
        del self._keys[seq]

    def _pop_first(self) -> bytes:
        seq = self._seqs.popleft()
        key = self._keys.pop(seq)
        self._journal.undo(self._put_back, seq, key)
        return key

    def _put_back(self, seq: int, key: bytes) -> None:
        insort(self._seqs, seq)
        self._keys[seq] = key

    def _unwithdraw(self, seq: int) -> bytes:
        key = self._withdrawn.pop(seq)
        self._journal.undo(self._withdrawn.__setitem__, seq, key)
        return key

    def _unwithdraw_back(self, seq: int, key: bytes) -> None:
        del self._withdrawn[seq]
        self._put_back(seq, key)

    def _bound(self, limit: int) -> None:
        forget, dropped = self._journal.forget, 0
        while len(self._seqs) > limit:
            seq = self._seqs[0]
            forget(self._pop_first())
            self._set(floor=seq)
            dropped += 1
        if dropped:
            self._set(dropped=self.dropped + dropped)
            for seq in [seq for seq in self._withdrawn if seq <= self._floor]:
                forget(self._unwithdraw(seq))
            self._trim_released()

    def _trim_released(self) -> None:
        """Forget the marks of the items at or below the floor (acknowledged or dropped)."""
        gone = [seq for seq in self._released if seq <= self._floor]
        if gone:
            self._released.difference_update(gone)
            self._journal.undo(self._released.update, gone)
            self._write_marks()

    def _write_marks(self) -> None:
        """The marks changed: their record is written when the transaction commits."""
        if self._marks is None:
            self._marks = self._keeper.new_key(K_BOX_MARKS)
            self._journal.undo(setattr, self, "_marks", None)
        if not self._marks_dirty:
            self._marks_dirty = True
            self._journal.undo(setattr, self, "_marks_dirty", False)
            self._journal.flush_at_commit(self)

    def flush(self) -> None:
        """At the commit (the journal calls it): write the marks as they are now, unless a
        new incarnation cleared them since (their old record is forgotten then)."""
        self._marks_dirty = False
        if self._marks is not None:
            ids, released = self._inbound, self._released
            data = _MARKS.pack(self._number, self._inc, len(ids)) + struct.pack(
                f">{len(ids)}H{len(released)}Q", *ids, *released
            )
            self._journal.write(self._marks, data)

    def _all_keys(self) -> list[bytes]:
        """Every record of this backlog (the mailbox is gone)."""
        keys = [*self._keys.values(), *self._withdrawn.values(), self._head]
        return keys if self._marks is None else [*keys, self._marks]

    def _new_incarnation(self) -> None:
        """Every record written so far dead at once: a fresh start under the same head."""
        forget = self._journal.forget
        while self._seqs:
            forget(self._pop_first())
        for seq in list(self._withdrawn):
            forget(self._unwithdraw(seq))
        # The session's QoS 2 state goes too: a move carries it in the session's own state
        # (aaabus.mqtt.roaming), and an old packet id kept here would swallow a publication.
        if self._marks is not None:
            forget(self._marks)
            inbound, released = set(self._inbound), set(self._released)
            self._journal.undo(self._unmark, self._marks, inbound, released)
            self._marks = None
            self._inbound.clear()
            self._released.clear()
        self._set(inc=(self._inc + 1) % _INCARNATIONS, floor=0)

    def _unmark(self, key: bytes, inbound: set[int], released: set[int]) -> None:
        self._marks = key
        self._inbound.update(inbound)
        self._released.update(released)

    def _set(self, **values: int) -> None:
        names = {"inc": "_inc", "floor": "_floor", "next_seq": "next_seq", "dropped": "dropped"}
        for name, value in values.items():
            attr = names[name]
            self._journal.undo(setattr, self, attr, getattr(self, attr))
            setattr(self, attr, value)

    def _write_head(self) -> None:
        origin, stamp = self.owner
        data = _HEAD.pack(origin, stamp, self._inc, self.next_seq, self.dropped, self._floor)
        self._journal.write(self._head, data)

    def state(self) -> dict[str, Any]:
        """What the tests and ``aaabus status`` may look at (no bodies)."""
        return {
            "next_seq": self.next_seq,
            "dropped": self.dropped,
            "seqs": list(self._seqs),
            "withdrawn": sorted(self._withdrawn),
            "incarnation": self._inc,
            "floor": self._floor,
            "inbound": sorted(self._inbound),
            "released": sorted(self._released),
        }
