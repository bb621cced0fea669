"""The journal: the channel's queues and clocks as side records of the log store, not ZODB objects.

Why. A ZODB commit costs some 30 µs per object it writes (pickling, the connection's bookkeeping,
the storage's store) on top of its fixed cost, and a bus hop used to write two or three: the
outgoing queue's bucket, the clock page, and the agent when it changed. A relay or a reply whose
agent keeps no state (a router, a ``Pong``) then committed objects that are only bytes: a frame
and a page of counters. Here those bytes are written as they are, as records of the log store's
own commit block (:meth:`~aaabus.core.logstorage.LogStorage.write_side`): the same block and the
same ``fdatasync`` as the agents' ZODB records when an agent changed, and no ZODB at all when
none did. ZODB keeps agents and their state; :mod:`aaabus.core.store` keeps today's ZODB layout
for the file and memory stores (:class:`~aaabus.core.store.ZodbQueues`), behind the same
interface.

What is stored, one record per key (8 bytes: ``0xFF``, a kind, six bytes):

=================  =========================  ==============================================
kind               key's six bytes            data
=================  =========================  ==============================================
catalog            0                          the domains (number, size, me, stamps, order)
                                              and the links (peer, domain) -> number, JSON
qin entry          the entry's seq            the message as a data frame (:mod:`.linkframes`)
qin head           0                          the seq of the oldest entry not consumed
out run            link, first seq mod 2**32  the frames one transaction queued on the link,
                                              each after its length (4 bytes), as sent
out acknowledged   link, 0                    the seq of the last frame acknowledged
wait entry         link, seq mod 2**32        the clock index of the peer (2 bytes), the frame
clock page         domain, page               the page's uint64 cells (:class:`.clock._Page`);
                                              page ``0xFFFFFFFF``: a full-stamp clock's matrix
=================  =========================  ==============================================

The mailboxes' backlogs are side records too, kept by :mod:`aaabus.core.backlogs`
(:attr:`Journal.backlogs`) with their own rules of liveness.

Removing an entry writes nothing: its key leaves the log store's index when the commit finishes
(``forget``), and its record stays on disk, dead, until compaction drops its segment. A store
reopened before then finds such records again; each kind tells them from live ones by what the
live records say, so a crash never brings a consumed entry back:

* a qin entry below the head is consumed (the head is rewritten by every commit that pops);
* a wait entry whose seq the clock already counts as delivered from its peer was delivered
  (the clock and the held-back set are written by the same commits);
* a frame at or below its link's acknowledged seq was acknowledged (an acknowledgement
  rewrites that 8-byte record, and forgets the runs whose last frame it covers).

Dead records found at boot are forgotten there, so that compaction reclaims them.

Transactions. The :class:`Journal` is a data manager of the ``transaction`` package and the
``_p_jar`` of the clocks and pages it holds (the ``persistent`` machinery tells it when one
changes, as it tells a ZODB connection). Queue entries are staged as they change; a clock's
pages are serialised at the commit. It sorts after the ZODB connection and before the engine's
effects (:mod:`aaabus.core.effects`): when the connection takes part (an agent changed), the
journal's records ride in the storage transaction the connection began; otherwise the journal
drives the storage's two-phase commit itself, so a commit that changed no agent never enters
ZODB. Savepoints and aborts restore the queues (an undo log, as the effects keep) and the pages
(their bytes at the savepoint, or as last committed).

Engine thread only, like the store.
"""

from __future__ import annotations

import json
import struct
from array import array
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from persistent import Persistent
from transaction.interfaces import IDataManagerSavepoint, ISavepointDataManager
from zope.interface import implementer

from aaabus.core.backlogs import JournalBacklogs
from aaabus.core.clock import DomainClock
from aaabus.core.commitorder import sort_key
from aaabus.core.epoch import EPOCH_KEY
from aaabus.errors import StoreError
from aaabus.wire.linkframes import decode_data, encode_data
from aaabus.wire.message import Message

if TYPE_CHECKING:
    from aaabus.core.logstorage import LogStorage

_SIDE = 0xFF
K_CATALOG = 1
K_QIN = 2
K_QIN_HEAD = 3
K_OUT = 4
K_WAIT = 5
K_PAGE = 6
K_ACKED = 7
#: Kind 8 is the server's epoch (aaabus.core.epoch.EPOCH_KEY), not the journal's own; kinds 9
#: to 11 are the mailboxes' backlogs (aaabus.core.backlogs).
#: The page number of a full-stamp clock's matrix (kept in the clock object itself).
MATRIX = 0xFFFFFFFF
_LOW32 = 0xFFFFFFFF
_LOW48 = (1 << 48) - 1
_CATALOG_KEY = bytes((_SIDE, K_CATALOG)) + bytes(6)
_HEAD_KEY = bytes((_SIDE, K_QIN_HEAD)) + bytes(6)
#: A link or domain number is two bytes of a key.
MAX_NUMBER = 0xFFFF
_ABSENT: Any = object()
#: The length before each frame of an outgoing run record.
_RUN_LEN = struct.Struct(">I")
#: Serial given to the journal's objects, so that DomainClock.dirty_bytes sees them as stored.
_STORED = b"\0" * 7 + b"\1"

Undo = Callable[..., object]


class Flushes(Protocol):
    """What holds writes back until the commit (:meth:`Journal.flush_at_commit`)."""

    def flush(self) -> None: ...


_SORT_KEY = sort_key("journal")


def _key(kind: int, number: int, low: int) -> bytes:
    return bytes((_SIDE, kind)) + number.to_bytes(2, "big") + (low & _LOW32).to_bytes(4, "big")


def qin_key(seq: int) -> bytes:
    return bytes((_SIDE, K_QIN)) + (seq & _LOW48).to_bytes(6, "big")


def _frame_seq(frame: bytes) -> int:
    """The link sequence number in a data frame's header (bytes 1-8)."""
    return int.from_bytes(frame[1:9], "big")


@implementer(ISavepointDataManager)
class Journal:
    """The queues and clocks of one server, as side records of its log store.

    ``storage``: the store's LogStorage (not the connection's MVCC wrapper); ``tm``: the store's
    transaction manager. Reads every side record at once (the boot), forgets the dead ones.
    """

    def __init__(self, storage: LogStorage, tm: Any, description: str) -> None:
        self.transaction_manager = tm
        self._storage = storage
        self._description = description
        self._writes: dict[bytes, bytes] = {}
        self._forgets: set[bytes] = set()
        self._dirty: dict[bytes, Persistent] = {}
        #: Outgoing queues with frames queued by the open transaction (written at its commit).
        self._flushing: list[Flushes] = []
        self._undo: list[tuple[Undo, tuple[Any, ...]]] = []
        self._joined = False
        #: Our own storage transaction (a commit no ZODB object took part in), else None.
        self._own: object | None = None
        #: Last committed bytes of each clock page (what an abort restores).
        self._committed: dict[bytes, bytes] = {}
        self._clocks: dict[str, DomainClock] = {}
        self._waits: dict[str, JournalWait] = {}
        self._outs: dict[tuple[int, str], JournalOut] = {}
        records = storage.side_records()
        try:
            self._catalog = self._read_catalog(records)
            self.qin = self._load_qin(records)
            self._load_links(records)
            #: The mailboxes' backlogs (:mod:`aaabus.core.backlogs`).
            self.backlogs = JournalBacklogs(self, records, self._live)
        except (ValueError, KeyError, TypeError, IndexError, struct.error) as exc:
            raise StoreError(
                f"{description} holds damaged queue records ({type(exc).__name__}: {exc}); "
                "restore the store from a backup"
            ) from None
        # The server's epoch (aaabus.core.epoch) is a side record the journal keeps alive.
        dead = [key for key in records if key not in self._live and key != EPOCH_KEY]
        if dead:
            storage.forget_side(dead)
        del self._live

    # -- boot ----------------------------------------------------------------------------------

    def _read_catalog(self, records: dict[bytes, bytes]) -> dict[str, Any]:
        self._live: set[bytes] = set()
        raw = records.get(_CATALOG_KEY)
        if raw is None:
            return {"domains": {}, "links": [], "next_domain": 0}
        self._live.add(_CATALOG_KEY)
        catalog: dict[str, Any] = json.loads(raw)
        return catalog

    def _load_qin(self, records: dict[bytes, bytes]) -> JournalQueue:
        head_raw = records.get(_HEAD_KEY)
        head = int.from_bytes(head_raw, "big") if head_raw is not None else 0
        if head_raw is not None:
            self._live.add(_HEAD_KEY)
        found: dict[int, tuple[bytes, Message]] = {}
        for key, data in records.items():
            if key[1] != K_QIN:
                continue
            seq, _domain, _stamp, message = decode_data(data)
            if seq >= head:
                found[seq] = (key, message)
        items: deque[Message] = deque()
        for expected, seq in enumerate(sorted(found), head):
            if seq != expected:
                raise ValueError(f"input queue entry {expected} is missing before {seq}")
            key, message = found[seq]
            items.append(message)
            self._live.add(key)
        return JournalQueue(self, items, head)

    def _load_links(self, records: dict[bytes, bytes]) -> None:
        """Clocks first (the held-back entries are judged by them), then the queues."""
        for domain, (number, size, me, stamps, order) in self._catalog["domains"].items():
            self._clocks[domain] = self._load_clock(records, number, size, me, stamps, order)
        # A link of a domain dropped and made again has a new number (the last one listed):
        # records under the old one are dead.
        current: dict[tuple[int, str], int] = {}
        for number, (peer, domain) in enumerate(self._catalog["links"]):
            if domain in self._clocks:
                current[peer, domain] = number
        for (peer, domain), number in current.items():
            self._outs[peer, domain] = JournalOut(self, number)
        for domain in self._clocks:
            self._waits.setdefault(domain, JournalWait(self, domain, {}))
        links = self._catalog["links"]
        outs: dict[int, list[tuple[int, bytes, bytes]]] = {}  # link -> (first seq, key, run)
        for key, data in records.items():
            kind = key[1]
            if kind not in (K_OUT, K_WAIT):
                continue
            number = int.from_bytes(key[2:4], "big")
            peer, domain = links[number]
            if current.get((peer, domain)) != number:
                continue  # a dead record of a domain since dropped
            if kind == K_OUT:
                outs.setdefault(number, []).append((_frame_seq(data[_RUN_LEN.size :]), key, data))
                continue
            src = int.from_bytes(data[:2], "big")
            seq, frame_domain, stamp, message = decode_data(data[2:])
            if frame_domain != domain:
                raise ValueError(f"a held-back entry of domain {frame_domain!r} under {domain!r}")
            if seq <= self._clocks[domain].received_from(src):
                continue  # delivered since it was held back: dead
            self._waits[domain]._items[peer, seq] = (src, stamp, message)
            self._live.add(key)
        for number, found in outs.items():
            peer, domain = links[number]
            ack_key = _key(K_ACKED, number, 0)
            raw = records.get(ack_key)
            acked = int.from_bytes(raw, "big") if raw is not None else 0
            queue = self._outs[peer, domain]
            for _first, key, run in sorted(found):
                if queue._load(key, run, acked):
                    self._live.add(key)
        for number in current.values():
            ack_key = _key(K_ACKED, number, 0)
            if ack_key in records:
                self._live.add(ack_key)

    def _load_clock(
        self, records: dict[bytes, bytes], number: int, size: int, me: int, stamps: str, order: str
    ) -> DomainClock:
        clock = DomainClock(size, me, stamps=stamps, order=order)
        for page_number, piece in _pieces(clock):
            key = _key(K_PAGE, number, page_number)
            data = records.get(key)
            if data is not None:
                _restore(piece, data)
                self._live.add(key)
            self._attach(piece, key)
        return clock

    def _attach(self, piece: Persistent, key: bytes) -> None:
        piece._p_jar = self
        piece._p_oid = key
        piece._p_serial = _STORED
        piece._p_changed = False
        self._committed[key] = _state(piece)

    # -- what the channel asks (the same as ZodbQueues) ------------------------------------------

    def clock(self, domain: str) -> DomainClock | None:
        """The clock of ``domain``, or None if this store has none."""
        return self._clocks.get(domain)

    def new_clock(self, domain: str, size: int, me: int, stamps: str, order: str) -> DomainClock:
        """Create the clock of ``domain`` (in the open transaction)."""
        # Numbers are never reused: a dropped domain's pages may still be on disk, dead.
        number = self._catalog.get("next_domain", len(self._catalog["domains"]))
        if number > MAX_NUMBER:
            raise StoreError(
                f"{self._description}: more than {MAX_NUMBER + 1} domains made over its life"
            )
        clock = DomainClock(size, me, stamps=stamps, order=order)
        for page_number, piece in _pieces(clock):
            self._attach(piece, _key(K_PAGE, number, page_number))
        self._set_catalog("next_domain", number + 1)
        domains = self._catalog["domains"]
        self._set_catalog("domains", {**domains, domain: [number, size, me, stamps, order]})
        self._clocks[domain] = clock
        self.undo(self._clocks.pop, domain)
        return clock

    def waiting(self, domain: str) -> JournalWait:
        wait = self._waits.get(domain)
        if wait is None:
            wait = self._waits[domain] = JournalWait(self, domain, {})
            self.undo(self._waits.pop, domain)
        return wait

    def outgoing(self, peer: int, domain: str) -> JournalOut:
        queue = self._outs.get((peer, domain))
        if queue is None:
            links = self._catalog["links"]
            if len(links) > MAX_NUMBER:
                raise StoreError(f"{self._description}: more than {MAX_NUMBER + 1} links")
            queue = self._outs[peer, domain] = JournalOut(self, len(links))
            self.undo(self._outs.pop, (peer, domain))
            self._set_catalog("links", [*links, [peer, domain]])
        return queue

    def domains(self) -> list[tuple[str, DomainClock]]:
        return list(self._clocks.items())

    def pending(self, domain: str) -> int:
        """Messages held back or unacknowledged in ``domain``."""
        held = len(self._waits[domain]) if domain in self._waits else 0
        return held + sum(len(q) for (_peer, d), q in self._outs.items() if d == domain)

    def pending_messages(self) -> int:
        """Every message queued: input, held back, unacknowledged."""
        return len(self.qin) + sum(self.pending(domain) for domain in self._clocks)

    def drop(self, domain: str) -> None:
        """Forget the clock and queues of ``domain`` (a rebuild: the caller checked they are
        empty). Its link numbers are kept (their records are gone), so keys never change owner
        while a dead record of the old owner may still be on disk."""
        clock = self._clocks.pop(domain)
        self.undo(self._clocks.__setitem__, domain, clock)
        for _number, piece in _pieces(clock):
            key = piece._p_oid
            assert key is not None
            self.forget(key)
        for link in [link for link in self._outs if link[1] == domain]:
            out = self._outs.pop(link)
            self.undo(self._outs.__setitem__, link, out)
            self.forget(_key(K_ACKED, out._number, 0))
        wait = self._waits.pop(domain, None)
        if wait is not None:
            self.undo(self._waits.__setitem__, domain, wait)
        domains = dict(self._catalog["domains"])
        del domains[domain]
        self._set_catalog("domains", domains)

    def adopt_clock(self, domain: str, was: DomainClock) -> None:
        """Make the clock of ``domain`` a copy of ``was``, a clock kept as a ZODB object by a
        log store written before the journal (:mod:`aaabus.core.upgrades`), in the open
        transaction."""
        clock = self.new_clock(domain, was.size, was.me, was.stamps, was.order)
        for (_n, piece), (_m, before) in zip(_pieces(clock), _pieces(was), strict=True):
            _restore(piece, _state(before))

    def _set_catalog(self, part: str, value: Any) -> None:
        old = self._catalog
        self._catalog = {**old, part: value}
        self.undo(setattr, self, "_catalog", old)
        self.write(_CATALOG_KEY, json.dumps(self._catalog, sort_keys=True).encode())

    # -- staging (engine thread, in a transaction) -----------------------------------------------

    def write(self, key: bytes, data: bytes) -> None:
        """Write ``data`` under ``key`` at the commit of the open transaction."""
        if not self._joined:
            self._join()
        writes = self._writes
        self._undo.append((self._unstage, (key, writes.get(key, _ABSENT), key in self._forgets)))
        writes[key] = data
        self._forgets.discard(key)

    def forget(self, key: bytes) -> None:
        """Drop ``key`` at the commit of the open transaction (nothing is written)."""
        if not self._joined:
            self._join()
        writes = self._writes
        self._undo.append((self._unstage, (key, writes.pop(key, _ABSENT), key in self._forgets)))
        self._forgets.add(key)

    def read(self, key: bytes) -> bytes | None:
        """The data under ``key`` as the open transaction sees it (its own writes first)."""
        data = self._writes.get(key)
        if data is not None:
            return data
        if key in self._forgets:
            return None
        return self._storage.side_record(key)

    def forget_now(self, keys: list[bytes]) -> None:
        """Forget ``keys`` outside any transaction: dead records a boot found."""
        self._storage.forget_side(keys)

    def _unstage(self, key: bytes, data: bytes, forgotten: bool) -> None:
        if data is _ABSENT:
            self._writes.pop(key, None)
        else:
            self._writes[key] = data
        if forgotten:
            self._forgets.add(key)
        else:
            self._forgets.discard(key)

    def flush_at_commit(self, out: Flushes) -> None:
        """Have ``out`` write what it holds back (an outgoing queue's open run, a backlog's
        marks) when the transaction commits."""
        self._flushing.append(out)
        self.undo(self._flushing.pop)

    def undo(self, fn: Undo, *args: Any) -> None:
        """Record how to take back a change just made in memory (as the effects' undo log)."""
        if not self._joined:
            self._join()
        self._undo.append((fn, args))

    def _join(self) -> None:
        self.transaction_manager.get().join(self)
        self._joined = True

    # -- IPersistentDataManager, for the clocks and pages ----------------------------------------

    def register(self, obj: Persistent) -> None:
        """A clock page changed (the ``persistent`` machinery calls this)."""
        if not self._joined:
            self._join()
        key = obj._p_oid
        assert key is not None
        self._dirty[key] = obj

    def setstate(self, obj: Persistent) -> None:
        raise AssertionError("the journal's objects are never ghosts")

    # -- IDataManager --------------------------------------------------------------------------

    def abort(self, txn: Any) -> None:
        self._rollback(0, {})
        self._writes.clear()
        self._forgets.clear()
        self._joined = False
        own, self._own = self._own, None
        if own is not None:  # our own storage transaction had begun: end it too
            self._storage.tpc_abort(own)

    def tpc_begin(self, txn: Any) -> None:
        # The connection sorts before us: if an agent changed, it has begun the storage's
        # transaction and our records ride in it; otherwise we begin one of our own.
        if self._storage.tpc_transaction() is None:
            self._own = own = _OwnCommit()
            self._storage.tpc_begin(own)

    def commit(self, txn: Any) -> None:
        for out in self._flushing:
            out.flush()
        writes = self._writes
        for key, obj in self._dirty.items():
            writes[key] = _state(obj)
        storage = self._storage
        storage.write_side(storage.tpc_transaction(), writes, self._forgets)

    def tpc_vote(self, txn: Any) -> None:
        if self._own is not None:
            self._storage.tpc_vote(self._own)

    def tpc_finish(self, txn: Any) -> None:
        if self._own is not None:
            own, self._own = self._own, None
            self._storage.tpc_finish(own)
        committed = self._committed
        writes = self._writes
        for key, obj in self._dirty.items():
            committed[key] = writes[key]
            obj._p_changed = False
        self._dirty.clear()
        self._flushing = []
        self._writes = {}
        self._forgets = set()
        self._undo.clear()
        self._joined = False

    def tpc_abort(self, txn: Any) -> None:
        self.abort(txn)

    def sortKey(self) -> str:
        # After the ZODB connection and before the effects, whose vote must come after the
        # store's write (aaabus.core.commitorder).
        return _SORT_KEY

    def voted(self) -> bool:
        """Whether the open commit is our own storage transaction and the storage voted it."""
        return self._own is not None and self._storage.voted(self._own)

    # -- ISavepointDataManager -----------------------------------------------------------------

    def savepoint(self) -> _Savepoint:
        pages = {key: _state(obj) for key, obj in self._dirty.items()}
        return _Savepoint(self, len(self._undo), pages)

    def _rollback(self, mark: int, pages: dict[bytes, bytes]) -> None:
        entries = self._undo
        while len(entries) > mark:
            fn, args = entries.pop()
            fn(*args)
        for key, obj in list(self._dirty.items()):
            kept = pages.get(key)
            if kept is not None:
                _restore(obj, kept)
            else:
                _restore(obj, self._committed[key])
                obj._p_changed = False
                del self._dirty[key]


class _OwnCommit:
    """What the journal hands the storage as its transaction when ZODB takes no part."""

    user = description = b""
    extension: dict[str, Any] = {}


@implementer(IDataManagerSavepoint)
class _Savepoint:
    __slots__ = ("_journal", "_mark", "_pages")

    def __init__(self, journal: Journal, mark: int, pages: dict[bytes, bytes]) -> None:
        self._journal = journal
        self._mark = mark
        self._pages = pages

    def rollback(self) -> None:
        self._journal._rollback(self._mark, self._pages)


def _pieces(clock: DomainClock) -> list[tuple[int, Persistent]]:
    """The journal's objects of ``clock``, with their page numbers: its pages, or itself."""
    pages = getattr(clock, "_pages", None)
    if pages is not None and clock.stamps == "delta":
        return list(enumerate(pages))
    return [(MATRIX, clock)]


def _state(piece: Persistent) -> bytes:
    if isinstance(piece, DomainClock):
        return piece._m.tobytes()
    data: bytes = piece.d.tobytes()
    return data


def _restore(piece: Persistent, data: bytes) -> None:
    if isinstance(piece, DomainClock):
        if len(data) != len(piece._m) * 8:
            raise ValueError(f"a clock matrix of {len(data)} bytes for {len(piece._m)} cells")
        piece._m = array("q", data)
        return
    cells = len(piece.d)
    if len(data) != cells * 8:
        raise ValueError(f"a clock page of {len(data)} bytes for {cells} cells")
    piece.d = array("Q", data)


class JournalQueue:
    """The input queue (qin): a FIFO whose entries are journal records, popped by a head."""

    def __init__(self, journal: Journal, items: deque[Message], head: int) -> None:
        self._journal = journal
        self._items = items
        self._head = head  # seq of items[0]

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def put(self, item: Message) -> int:
        seq = self._head + len(self._items)
        self._items.append(item)
        journal = self._journal
        journal.undo(self._items.pop)
        journal.write(qin_key(seq), encode_data(seq, "", b"", item))
        return seq

    def peek(self) -> Message:
        return self._items[0]

    def pop(self) -> Message:
        """Remove and return the oldest item; IndexError when empty."""
        if not self._items:
            raise IndexError("queue is empty")
        item = self._items.popleft()
        seq = self._head
        self._head = seq + 1
        journal = self._journal
        journal.undo(self._unpop, item)
        journal.forget(qin_key(seq))
        journal.write(_HEAD_KEY, (seq + 1).to_bytes(8, "big"))
        return item

    def _unpop(self, item: Message) -> None:
        self._items.appendleft(item)
        self._head -= 1

    def values(self) -> list[Message]:
        """The items, oldest first (as PersistentQueue.values())."""
        return list(self._items)


class JournalOut:
    """One link's outgoing queue: link seq -> frame, in seq order.

    The frames one transaction queues on a link are ONE record (a *run*, keyed by its first
    seq): a burst of 200 sends is one record, not 200, and an acknowledgement forgets the runs
    it covers whole. A run partly acknowledged stays on disk until its last frame is; the
    acknowledged seq tells a boot which of its frames are still owed."""

    def __init__(self, journal: Journal, number: int) -> None:
        self._journal = journal
        self._number = number
        self._items: deque[tuple[int, bytes]] = deque()
        #: Committed runs, oldest first: (seq of its last frame, its key).
        self._runs: deque[tuple[int, bytes]] = deque()
        #: Frames queued by the open transaction: its run, written at the commit.
        self._fresh: list[tuple[int, bytes]] = []

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __setitem__(self, seq: int, frame: bytes) -> None:
        items = self._items
        if items and seq <= items[-1][0]:
            raise ValueError(f"link seq {seq} after {items[-1][0]}: out of order")
        entry = (seq, frame)
        items.append(entry)
        fresh = self._fresh
        if not fresh:
            self._journal.flush_at_commit(self)
        fresh.append(entry)
        self._journal.undo(self._unput)

    def _unput(self) -> None:
        self._items.pop()
        self._fresh.pop()

    def flush(self) -> None:
        """Commit (journal): write the open transaction's frames as one run."""
        fresh = self._fresh
        if not fresh:
            return
        journal = self._journal
        key = _key(K_OUT, self._number, fresh[0][0])
        journal.write(key, b"".join(_RUN_LEN.pack(len(frame)) + frame for _seq, frame in fresh))
        self._runs.append((fresh[-1][0], key))
        self._fresh = []
        journal.undo(self._unflush, fresh)

    def _unflush(self, fresh: list[tuple[int, bytes]]) -> None:
        self._runs.pop()
        self._fresh = fresh

    def pop_through(self, seq: int) -> int:
        """Forget every frame whose seq is ``<= seq``; return how many."""
        items = self._items
        removed: list[tuple[int, bytes]] = []
        while items and items[0][0] <= seq:
            removed.append(items.popleft())
        if not removed:
            return 0
        journal = self._journal
        journal.undo(items.extendleft, removed[::-1])
        fresh = self._fresh
        if fresh and fresh[0][0] <= seq:  # queued and acknowledged in one transaction
            self._fresh = [entry for entry in fresh if entry[0] > seq]
            journal.undo(setattr, self, "_fresh", fresh)
        runs = self._runs
        done: list[tuple[int, bytes]] = []
        while runs and runs[0][0] <= seq:
            done.append(runs.popleft())
            journal.forget(done[-1][1])
        if done:
            journal.undo(runs.extendleft, done[::-1])
        journal.write(_key(K_ACKED, self._number, 0), removed[-1][0].to_bytes(8, "big"))
        return len(removed)

    def _load(self, key: bytes, data: bytes, acked: int) -> bool:
        """Boot: take a run record's frames still owed; whether there was any."""
        frames = []
        offset = 0
        while offset < len(data):
            (length,) = _RUN_LEN.unpack_from(data, offset)
            offset += _RUN_LEN.size
            frame = data[offset : offset + length]
            if len(frame) != length:
                raise ValueError(f"a queued frame cut short ({len(frame)} of {length} bytes)")
            offset += length
            frames.append((_frame_seq(frame), frame))
        owed = [entry for entry in frames if entry[0] > acked]
        if not owed:
            return False
        self._items.extend(owed)
        self._runs.append((frames[-1][0], key))
        return True

    def items(self) -> Iterator[tuple[int, bytes]]:
        return iter(list(self._items))


class JournalWait:
    """The held-back messages of one domain: (peer, seq) -> (clock index of the peer, stamp,
    message)."""

    def __init__(
        self,
        journal: Journal,
        domain: str,
        items: dict[tuple[int, int], tuple[int, bytes, Message]],
    ) -> None:
        self._journal = journal
        self._domain = domain
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __getitem__(self, key: tuple[int, int]) -> tuple[int, bytes, Message]:
        return self._items[key]

    def get(self, key: tuple[int, int], default: Any = None) -> Any:
        return self._items.get(key, default)

    def _record_key(self, key: tuple[int, int]) -> bytes:
        link = self._journal.outgoing(key[0], self._domain)
        return _key(K_WAIT, link._number, key[1])

    def __setitem__(self, key: tuple[int, int], value: tuple[int, bytes, Message]) -> None:
        items = self._items
        old = items.get(key, _ABSENT)
        items[key] = value
        journal = self._journal
        journal.undo(self._put_back, key, old)
        src, stamp, message = value
        frame = encode_data(key[1], self._domain, stamp, message)
        journal.write(self._record_key(key), src.to_bytes(2, "big") + frame)

    def __delitem__(self, key: tuple[int, int]) -> None:
        value = self._items.pop(key)
        journal = self._journal
        journal.undo(self._put_back, key, value)
        journal.forget(self._record_key(key))

    def pop(self, key: tuple[int, int], default: Any = _ABSENT) -> Any:
        if key not in self._items:
            if default is _ABSENT:
                raise KeyError(key)
            return default
        value = self._items[key]
        del self[key]
        return value

    def _put_back(self, key: tuple[int, int], value: Any) -> None:
        if value is _ABSENT:
            self._items.pop(key, None)
        else:
            self._items[key] = value

    def items(self) -> list[tuple[tuple[int, int], tuple[int, bytes, Message]]]:
        return list(self._items.items())

    def keys(self) -> list[tuple[int, int]]:
        return list(self._items)
