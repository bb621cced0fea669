"""A server's log shipped to its replicas, without sockets (issue 42).

What travels is each commit's records, not the log's bytes: the primary's vote hands its records
(ZODB objects and side records, with the side keys it forgets) to :meth:`Shipper.ship` before its
own write, the replica stores them in a commit of the same tid in its own log store, and the
primary's vote returns only once the replicas the sync setting asks for have acknowledged it
(:meth:`Shipper.wait`). The replica's store runs its own compactor: segments, recycling and
copies are each side's business, so nothing of the compactor has to travel. Why records and
not blocks: docs/architecture.md, "Replicas and failover".

Catch-up: a replica says the last tid it has (``HELLO``); the primary answers with every current
record committed after it and the list of its side keys (``CATCHUP``), read under its index lock
in one go (:meth:`aaabus.core.logstorage.LogStorage.snapshot_since`), and from then on the
replica follows every commit. An empty replica gets the whole store that way; a replica that
has a tid the primary never reached (another history) is told to start empty (``WIPE``). Objects
the primary's garbage collector dropped meanwhile stay unreachable on the replica, whose own
collector drops them; side keys the primary no longer holds are forgotten by the replica.

Messages (payloads of authenticated frames, :mod:`aaabus.io.replink`), integers big-endian::

    EPOCH    primary -> replica   b"E" epoch(8) member(1) 0   first: who ships, at which epoch
    NEWER    replica -> primary   b"N" epoch(8) member(1) voted(1)  refused: a newer epoch is
                                                              voted (1), or only claimed (0)
    HELLO    replica -> primary   b"H" index(1) epoch(8) tid(8)  its last commit and its epoch
    ACK      replica -> primary   b"A" tid(8)                 that commit is on its disk
    RECORDS  primary -> replica   b"R" (oid(8) len(4) data)*  records of the commit that follows
    COMMIT   primary -> replica   b"T" tid(8) key(8)*         store the records (tid), forget keys
    CATCHUP  primary -> replica   b"C" tid(8) key(8)*         store them at tid, keep only keys
    ABORT    primary -> replica   b"X" tid(8)                 the commit just shipped is aborted
    WIPE     primary -> replica   b"W"                        start again from an empty store
    BEAT     primary -> replica   b"P"                        heartbeat of an idle primary

and, as the first message of a connection of their own (failover, :mod:`aaabus.node.member`)::

    FENCE    candidate -> member  b"F" epoch(8) member(1) how(1)  how 0: claim (a candidacy:
                                                              refuse older epochs for a while),
                                                              1: voted, 2: released (lost),
                                                              3: ballot (a lone server's vote)
    POSITION member -> candidate  b"S" epoch(8) tid(8)        (or NEWER: a live primary, or
                                                              another candidate's claim)
    WHOIS    member -> member     b"W"                        which member is primary?
    IS       member -> member     b"I" epoch(8) member(1) role(1)  role 1: that member is
                                                              primary (itself); 0: not known

A ballot (FENCE, how 3) is the vote of a server that shares no domain with another: its members
are its electorate (:meth:`aaabus.node.replica.ReplicaServer.ballot`). The member answers a
FENCE: how 1 (granted: the epoch and member it granted) or how 2 (refused: the epoch and member
it knows), or NEWER when it serves (a live primary).

The primary's EPOCH comes first; a member that knows a newer epoch (it took over, or a candidate
fenced it) answers NEWER and closes; a primary that reads a NEWER of a voted epoch stops serving.
WIPE and WHOIS share a byte: WIPE follows an EPOCH on the primary's connection, WHOIS opens a
connection.

A replica votes (writes and syncs) a COMMIT, acknowledges it, and finishes it when the next
message comes or the connection ends (a vote ends committed unless an ABORT follows it, as on
the primary, where a crash between vote and finish keeps the block).

Threads: :class:`Shipper` is shared by the committing thread (``ship``, ``wait``, ``aborted``)
and one link thread per replica (``attach``, ``acked``, ``detach``), under one condition; a
waiting commit reads the replicas' acknowledgements itself (:class:`AckReader`, the condition's
lock let go meanwhile) and so calls ``acked`` too;
:class:`Follower` belongs to the replica's link thread.
"""

from __future__ import annotations

import logging
import select
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aaabus.core.epoch import EpochRecord, read_epoch
from aaabus.core.logstorage import LogStorage
from aaabus.core.logstorage.format import Z64
from aaabus.core.trace import CommitMarks
from aaabus.errors import ReplicationStopped, StoreError, WireError

log = logging.getLogger("aaabus.replication")

HELLO, ACK, RECORDS, COMMIT, CATCHUP, ABORT, WIPE = (bytes([c]) for c in b"HARTCXW")
EPOCH, NEWER, BEAT, FENCE, POSITION, WHOIS, IS = (bytes([c]) for c in b"ENPFSWI")
_TID = struct.Struct(">8s")
_HELLO = struct.Struct(">BQ8s")
_EPOCH = struct.Struct(">QBB")
#: The ``how`` of a FENCE, the last byte of an EPOCH-like message.
CLAIM, VOTED, RELEASED, BALLOT = 0, 1, 2, 3
_POSITION = struct.Struct(">Q8s")
_IS = struct.Struct(">QBB")
_REC = struct.Struct(">8sI")
#: Records per RECORDS message are cut at about this many bytes (a catch-up may be the store).
CHUNK_BYTES = 1 << 20
#: A commit waiting longer than this for its acknowledgements is logged (then every 10 s).
WAIT_WARN_S = 1.0
WAIT_REPEAT_S = 10.0
#: How long a commit waiting on its replicas' sockets goes without looking at whether the
#: shipper was closed or deposed meanwhile (both also shut the links, which ends the wait).
POLL_S = 0.05
#: What one replica's outgoing queue may hold before the replica is dropped (it comes back
#: and catches up): a replica that cannot keep up must not make its primary hold its log twice.
MAX_QUEUED_BYTES = 256 << 20


def hello(index: int, epoch: int, tid: bytes) -> bytes:
    return HELLO + _HELLO.pack(index, epoch, tid)


def decode_hello(payload: bytes) -> tuple[int, int, bytes]:
    """(index, epoch, tid) of a HELLO."""
    if payload[:1] != HELLO or len(payload) != 1 + _HELLO.size:
        raise WireError(f"replication: expected a HELLO, got {len(payload)} bytes")
    index, epoch, tid = _HELLO.unpack_from(payload, 1)
    return index, epoch, tid


def epoch_message(kind: bytes, epoch: int, member: int, how: int = 0) -> bytes:
    """An EPOCH, NEWER or FENCE message."""
    return kind + _EPOCH.pack(epoch, member, how)


def decode_epoch(payload: bytes) -> tuple[int, int, int]:
    """(epoch, member, how) of an EPOCH, NEWER or FENCE message."""
    if len(payload) != 1 + _EPOCH.size:
        raise WireError(f"replication: a {payload[:1]!r} message of {len(payload)} bytes")
    epoch, member, how = _EPOCH.unpack_from(payload, 1)
    if how > BALLOT:
        raise WireError(f"replication: a {payload[:1]!r} message with how={how}")
    return epoch, member, how


def position_message(epoch: int, tid: bytes) -> bytes:
    return POSITION + _POSITION.pack(epoch, tid)


def decode_position(payload: bytes) -> tuple[int, bytes]:
    """(epoch, tid) of a POSITION."""
    if payload[:1] != POSITION or len(payload) != 1 + _POSITION.size:
        raise WireError(f"replication: expected a POSITION, got {len(payload)} bytes")
    epoch, tid = _POSITION.unpack_from(payload, 1)
    return epoch, tid


def is_message(epoch: int, member: int, primary: bool) -> bytes:
    return IS + _IS.pack(epoch, member, int(primary))


def decode_is(payload: bytes) -> tuple[int, int, bool]:
    """(epoch, member, whether that member says it is primary) of an IS."""
    if payload[:1] != IS or len(payload) != 1 + _IS.size:
        raise WireError(f"replication: expected an IS, got {len(payload)} bytes")
    epoch, member, primary = _IS.unpack_from(payload, 1)
    return epoch, member, bool(primary)


def ack(tid: bytes) -> bytes:
    return ACK + tid


def encode_records(records: dict[bytes, bytes]) -> list[bytes]:
    """RECORDS messages for ``records``, each about :data:`CHUNK_BYTES` at most."""
    out: list[bytes] = []
    parts: list[bytes] = [RECORDS]
    size = 0
    for oid, data in records.items():
        parts.append(_REC.pack(oid, len(data)))
        parts.append(data)
        size += _REC.size + len(data)
        if size >= CHUNK_BYTES:
            out.append(b"".join(parts))
            parts, size = [RECORDS], 0
    if size:
        out.append(b"".join(parts))
    return out


def encode_end(kind: bytes, tid: bytes, keys: Iterable[bytes]) -> bytes:
    return b"".join([kind, tid, *keys])


def decode_records(payload: bytes, into: dict[bytes, bytes]) -> None:
    """Add the records of a RECORDS message to ``into``; WireError if it does not tile."""
    view = memoryview(payload)
    at, end = 1, len(payload)
    while at < end:
        if end - at < _REC.size:
            raise WireError("replication: a record header is cut short")
        oid, length = _REC.unpack_from(view, at)
        at += _REC.size
        if end - at < length:
            raise WireError("replication: a record is longer than its message")
        into[oid] = bytes(view[at : at + length])
        at += length


def decode_end(payload: bytes) -> tuple[bytes, list[bytes]]:
    """(tid, keys) of a COMMIT or CATCHUP message."""
    if len(payload) < 9 or (len(payload) - 9) % 8:
        raise WireError(f"replication: a {payload[:1]!r} message of {len(payload)} bytes")
    return payload[1:9], [payload[i : i + 8] for i in range(9, len(payload), 8)]


def decode_tid(payload: bytes, size: int) -> bytes:
    if len(payload) != size:
        raise WireError(f"replication: a {payload[:1]!r} message of {len(payload)} bytes")
    return payload[-8:]


# -- the primary's side --------------------------------------------------------------------------


class AckReader(Protocol):
    """How a committing thread that waits reads one replica's acknowledgements itself (the
    socket side, :mod:`aaabus.node.replication`): a thread that would only read them and wake
    the waiting one would put a second thread switch on every commit's path."""

    #: Set once the link failed: nothing more is read from it (its writer detaches it).
    dead: bool

    def fileno(self) -> int:
        """The socket to wait on (``select``)."""

    def drain(self) -> None:
        """Without blocking, read what has arrived and give each acknowledgement to
        :meth:`Shipper.acked`; any thread, never raises (a failed link is marked dead)."""


@dataclass
class _Replica:
    """What the primary knows of one replica (guarded by the Shipper's condition)."""

    index: int
    address: str
    send: Callable[[list[bytes], int], None] | None = None
    #: Set while attached by a socket link: the waiting commit reads acknowledgements itself.
    reader: AckReader | None = None
    #: Last tid acknowledged (zero: none since this process started).
    acked: bytes = Z64
    #: The primary's (commits, bytes) counters at the last acknowledged commit; None: unknown.
    acked_at: tuple[int, int] | None = None
    #: Commits sent and not acknowledged yet: (tid, commits, bytes) counters after each.
    inflight: deque[tuple[bytes, int, int]] = field(default_factory=deque)
    since: float = field(default_factory=time.monotonic)


class Shipper:
    """The primary's side: ships each commit to the attached replicas and waits for ``sync``
    of them to have it on disk.

    ``replicas``: index -> address (for the figures and the log lines). A replica is *attached*
    by its link thread once caught up (:meth:`attach`): only attached replicas count, so with no
    replica attached a commit waits, logging every :data:`WAIT_REPEAT_S`, until one is (or the
    shipper is closed, which fails the waiting vote: the commit is aborted, never acknowledged).
    """

    def __init__(self, server_id: int, replicas: dict[int, str], sync: int) -> None:
        self.server_id = server_id
        self.sync = sync
        # Reentrant (an in-process replica acknowledges from inside ``send``); wait() holds it
        # once, and lets go of it around its read of the replicas' sockets.
        self._cond = threading.Condition(threading.RLock())
        self._replicas = {i: _Replica(i, addr) for i, addr in replicas.items()}
        self._closed = False
        #: Commits and bytes shipped since the process started.
        self._commits = 0
        self._bytes = 0
        #: The commit voted last, until the next: (tid, messages, counters before and after).
        self._pending: tuple[bytes, list[bytes], tuple[int, int], tuple[int, int]] | None = None
        #: When the commit waiting now started to wait (None: none waits).
        self._waiting_since: float | None = None
        #: The commit whose wait :meth:`close` cut short, until its ABORT is shipped.
        self._abandoned: bytes | None = None
        #: Why this primary acknowledges nothing any more (a newer epoch exists), once known.
        self._deposed: str | None = None
        self.waits = 0
        #: Set (before any commit) when the server traces (``aaabus.trace``): the committing
        #: thread's marks of each commit, and the latest acknowledgement read (tid, when).
        self.marks: CommitMarks | None = None
        self._mark: dict[str, int] = {}
        self._read_at: tuple[bytes, int] = (Z64, 0)

    # -- the committing thread -------------------------------------------------------------

    def ship(self, tid: bytes, records: dict[bytes, bytes], forget: list[bytes]) -> None:
        if self.marks is not None:
            self._mark = {"ship": time.perf_counter_ns()}
        messages = [*encode_records(records), encode_end(COMMIT, tid, forget)]
        size = sum(len(m) for m in messages)
        if self.marks is not None:
            # Before the links' writes, not after: a replica on the other core may have read
            # the records before this thread runs again, and its mark must come later.
            self._mark["shipped"] = time.perf_counter_ns()
        with self._cond:
            before = (self._commits, self._bytes)
            self._commits += 1
            self._bytes += size
            after = (self._commits, self._bytes)
            self._pending = (tid, messages, before, after)
            for rep in self._replicas.values():
                if rep.send is not None:
                    rep.inflight.append((tid, *after))
                    rep.send(messages, size)

    def wait(self, tid: bytes) -> None:
        """Return once ``sync`` attached replicas acknowledged ``tid``; ReplicationStopped (a
        FatalError: the vote fails, the commit is aborted, the engine stops) once closed."""
        if self.marks is None:
            self._wait(tid)
            return
        waiting = time.perf_counter_ns()
        self._wait(tid)
        returned = time.perf_counter_ns()
        read_tid, read = self._read_at
        if read_tid == tid:
            marks = {**self._mark, "waiting": waiting, "read": read, "returned": returned}
            self.marks.write("primary", tid, marks)

    def _wait(self, tid: bytes) -> None:
        with self._cond:
            if self._deposed is not None:
                self._abandoned = tid
                raise ReplicationStopped(self._deposed)
            if self.sync == 0 or self._count(tid) >= self.sync:
                return
            start = time.monotonic()
            self._waiting_since = start
            self.waits += 1
            warn_at = start + WAIT_WARN_S
            try:
                while self._count(tid) < self.sync:
                    if self._deposed is not None:
                        self._abandoned = tid
                        raise ReplicationStopped(self._deposed)
                    if self._closed:
                        self._abandoned = tid
                        raise ReplicationStopped(
                            f"server {self.server_id} stopped while a commit waited for "
                            f"{self.sync} replica(s) to have it (aaabus.replication.sync); it was "
                            "not acknowledged: start its replicas, or set the setting to 0"
                        )
                    now = time.monotonic()
                    if now >= warn_at:
                        log.warning(
                            "server %s: a commit has waited %.1f s for %d replica(s) to have it "
                            "on disk (aaabus.replication.sync); nothing is acknowledged "
                            "meanwhile: %s",
                            self.server_id,
                            now - start,
                            self.sync,
                            self._describe(),
                        )
                        warn_at = now + WAIT_REPEAT_S
                    readers = [
                        rep.reader
                        for rep in self._replicas.values()
                        if rep.send is not None
                        and rep.reader is not None
                        and not rep.reader.dead
                        and rep.acked < tid
                    ]
                    if not readers:
                        self._cond.wait(max(0.0, warn_at - now))
                        continue
                    self._cond.release()
                    try:
                        _pump(readers, min(POLL_S, max(0.0, warn_at - now)))
                    finally:
                        self._cond.acquire()
            finally:
                self._waiting_since = None
            if time.monotonic() >= start + WAIT_WARN_S:
                log.warning(
                    "server %s: the commit that waited for its replicas is durable after %.1f s",
                    self.server_id,
                    time.monotonic() - start,
                )

    def aborted(self, tid: bytes) -> None:
        with self._cond:
            pending = self._pending
            if pending is None or pending[0] != tid:
                return
            self._pending = None
            if self._abandoned == tid:
                self._abandoned = None
                self._cond.notify_all()
            message = ABORT + tid
            for rep in self._replicas.values():
                if rep.send is not None:
                    while rep.inflight and rep.inflight[-1][0] == tid:
                        rep.inflight.pop()
                    rep.send([message], len(message))

    def _count(self, tid: bytes) -> int:
        return sum(
            1 for rep in self._replicas.values() if rep.send is not None and rep.acked >= tid
        )

    def _describe(self) -> str:
        now = time.monotonic()
        return "; ".join(
            f"replica {rep.index} ({rep.address}) "
            + (
                f"connected, last acknowledged {rep.acked.hex()}"
                if rep.send is not None
                else f"not connected for {now - rep.since:.0f} s"
            )
            for rep in self._replicas.values()
        )

    # -- the link threads -------------------------------------------------------------------

    def attach(
        self,
        index: int,
        since: bytes,
        storage: LogStorage,
        send: Callable[[list[bytes], int], None],
        reader: AckReader | None = None,
    ) -> bytes:
        """Catch replica ``index`` (which has every commit up to ``since``) up and follow the
        commits from then on: the catch-up and every later commit go to ``send(messages,
        size)``, in order (``send`` must not block: it queues). Returns the tid of the catch-up,
        which the replica acknowledges like a commit. With a ``reader``, a waiting commit reads
        the replica's acknowledgements itself; without, someone calls :meth:`acked`."""
        caught: list[bytes] = []

        def follow(last: bytes, records: dict[bytes, bytes], side: list[bytes]) -> None:
            # Under the store's index lock: no commit finishes between the snapshot and this.
            with self._cond:
                rep = self._replicas[index]
                pending = self._pending
                later = pending if pending is not None and pending[0] > last else None
                messages = [*encode_records(records), encode_end(CATCHUP, last, side)]
                rep.inflight.clear()
                rep.inflight.append((last, *(later[2] if later else self._counters())))
                rep.send = send
                rep.reader = reader
                rep.since = time.monotonic()
                send(messages, sum(len(m) for m in messages))
                if later is not None:
                    # Voted but not finished, so not in the snapshot; shipped before we attached.
                    rep.inflight.append((later[0], *later[3]))
                    send(later[1], sum(len(m) for m in later[1]))
                caught.append(last)
                # A commit waiting for replicas now has this one's socket to read.
                self._cond.notify_all()

        storage.snapshot_since(since, follow)
        return caught[0]

    def acked(self, index: int, tid: bytes) -> None:
        if self.marks is not None:
            self._read_at = (tid, time.perf_counter_ns())
        with self._cond:
            rep = self._replicas[index]
            if tid > rep.acked:
                rep.acked = tid
            while rep.inflight and rep.inflight[0][0] <= tid:
                done = rep.inflight.popleft()
                rep.acked_at = (done[1], done[2])
            self._cond.notify_all()

    def detach(self, index: int) -> None:
        with self._cond:
            rep = self._replicas[index]
            if rep.send is not None:
                rep.since = time.monotonic()
            rep.send = None
            rep.reader = None
            rep.inflight.clear()
            self._cond.notify_all()

    def depose(self, why: str) -> None:
        """A newer epoch exists (any thread): every vote from now on, and the one waiting,
        fails with ``why`` (ReplicationStopped): this primary acknowledges nothing more, even
        what a replica that is not fenced yet would acknowledge, or with ``sync`` 0."""
        with self._cond:
            if self._deposed is None:
                self._deposed = why
            self._cond.notify_all()

    def close(self) -> None:
        """Stop waiting: a vote waiting now fails (its commit is aborted, unacknowledged)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def quiesce(self, timeout: float) -> None:
        """After :meth:`close`: wait (at most ``timeout``) until the commit whose wait was cut
        short has shipped its ABORT, so that the replicas mark it aborted before the links
        close rather than keep it as a commit this server never made."""
        deadline = time.monotonic() + timeout
        with self._cond:
            # A waiting commit first wakes to find the shipper closed (then it is abandoned),
            # then its abort ships the ABORT (then it is not any more).
            while (self._waiting_since is not None or self._abandoned is not None) and (
                time.monotonic() < deadline
            ):
                self._cond.wait(max(0.0, min(0.05, deadline - time.monotonic())))

    # -- figures (any thread) ------------------------------------------------------------------

    def _counters(self) -> tuple[int, int]:
        return (self._commits, self._bytes)

    def figures(self) -> dict[str, Any]:
        """``sync``, whether a commit waits (and since how long), and per replica: connected,
        how far behind in commits and bytes (None before its first acknowledgement since this
        server started), the last tid it acknowledged."""
        with self._cond:
            now = time.monotonic()
            replicas = {}
            for rep in self._replicas.values():
                at = rep.acked_at
                replicas[str(rep.index)] = {
                    "address": rep.address,
                    "connected": rep.send is not None,
                    "for_s": round(now - rep.since, 3),
                    "behind_commits": None if at is None else self._commits - at[0],
                    "behind_bytes": None if at is None else self._bytes - at[1],
                    "acknowledged": rep.acked.hex(),
                }
            waiting = self._waiting_since
            return {
                "sync": self.sync,
                "waiting_s": None if waiting is None else round(now - waiting, 3),
                "waits": self.waits,
                "replicas": replicas,
            }


def _pump(readers: list[AckReader], timeout: float) -> None:
    """Wait at most ``timeout`` for one of ``readers`` to have something, and drain those that
    have (the committing thread, the shipper's lock not held)."""
    try:
        ready, _, _ = select.select(readers, [], [], timeout)
    except (OSError, ValueError):
        ready = readers  # a socket closed meanwhile: draining it marks it dead
    for reader in ready:
        reader.drain()


# -- the replica's side --------------------------------------------------------------------------


class Follower:
    """The replica's side: applies its primary's messages to its own log store.

    ``open_store()`` opens (creating) the replica's store; ``wipe()`` empties its directory (the
    store closed). One thread (the replica's link thread) calls everything.
    """

    def __init__(self, open_store: Callable[[], LogStorage], wipe: Callable[[], None]) -> None:
        self._open = open_store
        self._wipe = wipe
        self.storage = open_store()
        self._records: dict[bytes, bytes] = {}
        #: The transaction voted last, finished when the next message comes (or the link ends).
        self._voted: tuple[object, bytes] | None = None
        self.applied = 0

    def position(self) -> bytes:
        """The last tid on disk (a voted, unfinished commit included)."""
        if self._voted is not None:
            return self._voted[1]
        return self.storage.lastTransaction()

    def epoch(self) -> EpochRecord:
        """The epoch record of the store's last finished commit."""
        return read_epoch(self.storage)

    def receive(self, payload: bytes) -> bytes | None:
        """Apply one message; returns the acknowledgement to send, if any. WireError for a
        message that makes no sense (the link is then closed; the store is left consistent),
        StoreError when the store cannot be written (the replica must stop)."""
        kind = payload[:1]
        if kind == RECORDS:
            decode_records(payload, self._records)
            return None
        if kind == ABORT:
            tid = decode_tid(payload, 9)
            voted = self._voted
            if voted is not None and voted[1] == tid:
                self._voted = None
                self.storage.tpc_abort(voted[0])
            return None
        self.settle()
        if kind == COMMIT:
            tid, forget = decode_end(payload)
            self._vote(tid, forget)
            return ack(tid)
        if kind == CATCHUP:
            tid, keep = decode_end(payload)
            held = set(keep)
            mine = self.storage.side_records()
            stale = [key for key in mine if key not in held]
            if self._records or tid > self.storage.lastTransaction():
                self._vote(tid, stale)
                self.settle()
            else:
                self.storage.forget_side(stale)
            return ack(tid)
        if kind == WIPE:
            self._records.clear()
            self.storage.close()
            self._wipe()
            self.storage = self._open()
            return None
        raise WireError(f"replication: unknown message {kind!r}")

    def _vote(self, tid: bytes, forget: list[bytes]) -> None:
        records, self._records = self._records, {}
        txn = object()
        storage = self.storage
        try:
            storage.tpc_begin(txn, tid)
        except OSError as exc:
            raise _write_failed(storage, exc) from None
        try:
            storage.store_replicated(txn, records, forget)
            storage.tpc_vote(txn)
        except OSError as exc:
            storage.tpc_abort(txn)
            raise _write_failed(storage, exc) from None
        except BaseException:
            storage.tpc_abort(txn)
            raise
        self._voted = (txn, tid)

    def settle(self) -> None:
        """Finish the commit voted last: kept, as a primary keeps a voted block after a crash
        (tpc_finish does no I/O, the vote wrote and synced: it cannot fail)."""
        voted, self._voted = self._voted, None
        if voted is not None:
            self.storage.tpc_finish(voted[0])
            self.applied += 1

    def close(self) -> None:
        self.settle()
        self.storage.close()


def _write_failed(storage: LogStorage, exc: OSError) -> StoreError:
    """A replica whose disk fails stops (one line), as a server does: acknowledging nothing
    more is all it can do right, and retrying would acknowledge nothing either."""
    reason = exc.strerror or str(exc)
    return StoreError(
        f"replica store {storage.getName()} cannot be written ({reason}); nothing unwritten "
        "was acknowledged: free space or fix the disk, then restart the replica"
    )
