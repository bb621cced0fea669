"""``LogStorage``: the ZODB storage API over a :class:`~aaabus.core.logstorage.log.Log`.

Threads: one transaction at a time commits (the commit lock, taken in ``tpc_begin`` and released
by ``tpc_finish`` or ``tpc_abort``, serialises committers; the bus has one, the engine). Loads
may come from any thread. The compactor runs on its own thread (:mod:`.compactor`).
"""

from __future__ import annotations

import bisect
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import zope.interface
from ZODB.interfaces import IMultiCommitStorage, IStorage, IStorageCurrentRecordIteration
from ZODB.POSException import (
    ConflictError,
    POSKeyError,
    ReadConflictError,
    ReadOnlyError,
    StorageTransactionError,
    Unsupported,
)
from ZODB.serialize import referencesf as zodb_referencesf
from ZODB.TimeStamp import TimeStamp
from ZODB.utils import newTid, oid_repr, p64, tid_repr

from aaabus.core.logstorage.compactor import Compactor
from aaabus.core.logstorage.format import (
    BLOCK_HEAD,
    BLOCK_OVERHEAD,
    KIND_COMMIT,
    MAX_SEGMENT_SIZE,
    RECORD_HEAD,
    Z64,
    block_parts,
    is_side,
    position,
)
from aaabus.core.logstorage.log import RESERVE, Log
from aaabus.core.logstorage.segments import LOCK_NAME, Segment
from aaabus.errors import StoreError

#: 4 MiB: a handful of segments is the floor of the disk use (heads, a spare, one being
#: compacted), while a segment still holds thousands of bus hops between two rotations.
DEFAULT_SEGMENT_SIZE = 4 << 20
MIN_SEGMENT_SIZE = 4096

logger = logging.getLogger("aaabus.logstorage")

_RH = RECORD_HEAD.size
_pack_record = RECORD_HEAD.pack
_BODY_AT = BLOCK_HEAD.size


class Shipper(Protocol):
    """Where a primary's commits go to its replicas (:class:`aaabus.core.replication.Shipper`).
    Called by the committing thread, commit lock held."""

    def ship(self, tid: bytes, records: dict[bytes, bytes], forget: list[bytes]) -> None: ...

    def wait(self, tid: bytes) -> None: ...

    def aborted(self, tid: bytes) -> None: ...


@zope.interface.implementer(IStorage, IStorageCurrentRecordIteration, IMultiCommitStorage)
class LogStorage:
    """A ZODB storage that appends each transaction to a log of preallocated segment files.

    ``create``: make the store when missing; when false (and when ``read_only``), a directory
    that was never a log store (no ``lock`` file) is refused with a StoreError, so that a
    mistyped path does not start an empty store.
    ``read_only``: no writes, no compactor (the directory is still locked: a running server
    recycles segments under a reader's feet). ``gc``: let the compactor also drop objects
    unreachable from the root (two passes in a row, see the package docstring); superseded
    revisions are reclaimed either way. ``compact``: run the compactor thread at all (off: only
    ``pack`` reclaims space). ``live_ratio``: a sealed segment is compacted when at most this
    fraction of it holds current records.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
        create: bool = True,
        read_only: bool = False,
        gc: bool = True,
        compact: bool = True,
        live_ratio: float = 0.5,
    ) -> None:
        path = Path(directory)
        if not MIN_SEGMENT_SIZE <= segment_size <= MAX_SEGMENT_SIZE:
            raise StoreError(
                f"log store segment size {segment_size} is out of range "
                f"({MIN_SEGMENT_SIZE} to {MAX_SEGMENT_SIZE} bytes)"
            )
        if (not create or read_only) and not (path / LOCK_NAME).exists():
            raise StoreError(f"{path} holds no log store; fix the path or create the store")
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._log = Log(path, segment_size, read_only)
        except OSError as exc:
            raise StoreError(
                f"cannot open log store {path}: {exc.strerror or exc}; free space or fix the "
                "directory's permissions"
            ) from None
        self._name = str(path)
        self._read_only = read_only
        self._commit_lock = threading.Lock()
        self._txn: Any = None
        self._tid = Z64
        self._tdata: dict[bytes, bytes] = {}
        #: Side records the open transaction drops from the index at tpc_finish.
        self._forget: list[bytes] = []
        self._placed: list[tuple[bytes, int, int]] | None = None
        self.last_vote_ns: tuple[int, int, int] | None = None
        self._voted_head: Segment | None = None
        #: The write error that left the commit head in an unknown state: no commit after it.
        self._failed: OSError | None = None
        self._closed = False
        #: Set on a primary with replicas (aaabus.core.replication): each vote ships its block's
        #: records before the local write and waits for the replicas' acknowledgements after.
        self.shipper: Shipper | None = None
        self._compactor = Compactor(self._log, live_ratio=live_ratio, gc=gc)
        if compact and not read_only:
            self._log.on_change = self._compactor.wake
            self._compactor.start()

    # -- identity and figures ----------------------------------------------------------------

    def getName(self) -> str:
        return self._name

    def sortKey(self) -> str:
        return self._name

    def getSize(self) -> int:
        """Bytes on disk (every segment file, spare and free ones included)."""
        return self._log.file_bytes()

    def __len__(self) -> int:
        """Current records: ZODB's objects and the side records."""
        return len(self._log.index)

    def isReadOnly(self) -> bool:
        return self._read_only

    def supportsUndo(self) -> bool:
        return False

    def undo(self, transaction_id: bytes, transaction: Any) -> None:
        """No undo: no history is kept (ReadOnlyError first when read-only, as ZODB expects)."""
        if self._read_only:
            raise ReadOnlyError()
        raise Unsupported("a log store keeps no history to undo")

    def registerDB(self, wrapper: object) -> None:
        """Nothing to register: no other process writes this store, so nothing to forward."""

    def lastTransaction(self) -> bytes:
        with self._log.lock:
            return self._log.last_tid

    def stats(self) -> dict[str, Any]:
        """Figures for operators: live bytes (current records), file bytes (what the directory
        holds), objects, segments, and the compactor's last compaction and GC pass."""
        log = self._log
        with log.lock:
            figures: dict[str, Any] = {
                "live_bytes": sum(log.live.values()),
                "objects": len(log.index),
                "segments": len(log.segments),
                "spare_segments": len(log.spares),
                "free_segments": len(log.free),
                "torn_tails_dropped_at_open": len(log.torn),
            }
        figures["file_bytes"] = log.file_bytes()
        figures.update(self._compactor.figures())
        return figures

    @property
    def compacting(self) -> bool:
        """True while the compactor (or pack) is at work: lets a benchmark tell the commits
        that ran beside it."""
        return self._compactor.busy()

    # -- reads -------------------------------------------------------------------------------

    def load(self, oid: bytes, version: str = "") -> tuple[bytes, bytes]:
        found = self._log.read_current(oid)
        if found is None:
            raise POSKeyError(oid)
        return found

    def loadBefore(self, oid: bytes, tid: bytes) -> tuple[bytes, bytes, bytes | None] | None:
        """The revision of ``oid`` current just before ``tid``: (data, its tid, the next tid or
        None). Older revisions are served by walking each record's back pointer while their
        segments still exist; once compaction recycled the one needed, ReadConflictError (the
        error ZODB's MVCC adapter itself raises when a concurrent pack removed a revision:
        the reader's transaction is retried). None when the object was created after ``tid``.
        """
        log = self._log
        with log.lock:
            entry = log.index.get(oid)
            if entry is None:
                raise POSKeyError(oid)
            pos, length, current = entry
            if current < tid:
                data = log.read(pos, length)
                if data is None:
                    raise AssertionError("an index entry points into a recycled segment")
                return data, current, None
            end = current
            prev = self._prev(pos)
            while prev:
                older = self._older(prev, oid, end)
                if older is None:
                    break
                rec_tid, rec_prev, rec_len = older
                if rec_tid < tid:
                    data = log.read(prev, rec_len)
                    if data is None:
                        break
                    return data, rec_tid, end
                end, prev = rec_tid, rec_prev
            else:
                return None  # created at or after tid
        raise ReadConflictError(
            f"load {oid_repr(oid)} before {tid_repr(tid)}: that revision was reclaimed by the "
            "log store's compaction",
            oid=oid,
        )

    def _prev(self, pos: int) -> int:
        """The back pointer of the record at ``pos`` (a current one: its segment exists)."""
        head = self._log.read(pos, _RH, 0)
        if head is None:
            raise AssertionError("an index entry points into a recycled segment")
        return int(RECORD_HEAD.unpack(head)[2])

    def _older(self, pos: int, oid: bytes, newer: bytes) -> tuple[bytes, int, int] | None:
        """(tid, back pointer, data length) of the revision a back pointer leads to, or None
        when the disk no longer holds it: its segment was recycled, or the seq was given to a
        new segment after a restart (the record found there is another object's, or not older
        than the revision pointing to it). Caller holds the index lock."""
        head = self._log.read(pos, _RH, 0)
        if head is None:
            return None
        rec_oid, rec_tid, rec_prev, rec_len = RECORD_HEAD.unpack(head)
        if rec_oid != oid or rec_tid >= newer:
            return None
        return rec_tid, rec_prev, rec_len

    def _revisions(self, oid: bytes, limit: int) -> list[tuple[bytes, int, int]]:
        """(tid, position, data length) of up to ``limit`` revisions, newest first, as far back
        as the disk still holds them; POSKeyError for an unknown oid."""
        log = self._log
        with log.lock:
            entry = log.index.get(oid)
            if entry is None:
                raise POSKeyError(oid)
            found = [(entry[2], entry[0], entry[1])]
            prev = self._prev(entry[0])
            while prev and len(found) < limit:
                older = self._older(prev, oid, found[-1][0])
                if older is None:
                    break
                found.append((older[0], prev, older[2]))
                prev = older[1]
            return found

    def loadSerial(self, oid: bytes, serial: bytes) -> bytes:
        """The revision ``serial`` of ``oid`` while it is on disk, else POSKeyError."""
        for tid, pos, length in self._revisions(oid, 1 << 62):
            if tid == serial:
                data = self._log.read(pos, length)
                if data is not None:
                    return data
            if tid <= serial:
                break
        raise POSKeyError(oid, serial)

    def history(self, oid: bytes, size: int = 1) -> list[dict[str, Any]]:
        """The revisions still on disk, newest first (no user or description: not stored)."""
        return [
            {
                "time": TimeStamp(tid).timeTime(),
                "tid": tid,
                "serial": tid,
                "user_name": b"",
                "description": b"",
                "size": length,
            }
            for tid, _pos, length in self._revisions(oid, max(size, 1))
        ]

    def record_iternext(
        self,
        next: bytes | None = None,  # the name ZODB's interface gives it
    ) -> tuple[bytes, bytes, bytes, bytes | None]:
        """(oid, tid, data, next oid or None) of the current record at or after ``next``: ZODB's
        objects only, not the side records."""
        log = self._log
        with log.lock:
            order = log.oid_order
            if order is None:
                order = log.oid_order = sorted(oid for oid in log.index if not is_side(oid))
            at = bisect.bisect_left(order, next or Z64)
            if at >= len(order):
                raise POSKeyError(next or Z64)
            oid = order[at]
            found = log.read_current(oid)
            if found is None:
                raise AssertionError("the oid order lists an object the index lacks")
            following = order[at + 1] if at + 1 < len(order) else None
            return oid, found[1], found[0], following

    # -- two-phase commit --------------------------------------------------------------------

    def new_oid(self) -> bytes:
        if self._read_only:
            raise ReadOnlyError()
        log = self._log
        with log.lock:
            oid = log.next_oid
            log.next_oid = oid + 1
        return p64(oid)

    def tpc_begin(self, transaction: Any, tid: bytes | None = None) -> None:
        if self._read_only:
            raise ReadOnlyError()
        if transaction is self._txn:
            raise StorageTransactionError("Duplicate tpc_begin calls for same transaction")
        self._commit_lock.acquire()
        failed = self._failed
        if failed is not None or self._closed:
            self._commit_lock.release()
            if failed is None:
                raise StoreError(f"log store {self._name} is closed")
            raise OSError(
                failed.errno,
                f"log store {self._name} failed an earlier write ({failed.strerror}); "
                "close and reopen it",
            )
        # last_tid changes only in tpc_finish, under the commit lock this thread now holds.
        self._tid = tid if tid is not None else newTid(self._log.last_tid)
        self._txn = transaction
        self._tdata = {}
        self._forget = []
        self._placed = None
        self._voted_head = None

    def tpc_transaction(self) -> Any:
        return self._txn

    def store(self, oid: bytes, serial: bytes, data: bytes, version: str, transaction: Any) -> None:
        if transaction is not self._txn:
            if self._read_only:
                raise ReadOnlyError()
            raise StorageTransactionError(self, transaction)
        # A dict lookup is atomic: only this thread (holding the commit lock) changes tids;
        # the compactor only moves records (same tid) or drops unreachable ones.
        entry = self._log.index.get(oid)
        if entry is not None and serial != entry[2]:
            raise ConflictError(oid=oid, serials=(entry[2], serial), data=data)
        self._tdata[oid] = data

    def write_side(
        self, transaction: Any, records: dict[bytes, bytes], forget: Iterable[bytes]
    ) -> None:
        """Add side records to the open ``transaction`` (begun with ``tpc_begin``, before its
        vote): ``records`` (key -> data; keys :func:`~.format.is_side`) are written in its block
        beside ZODB's, and the keys in ``forget`` leave the index when it finishes.

        Side records are what the bus keeps outside ZODB's objects (:mod:`aaabus.core.journal`):
        no serial, no conflict check (one writer), never collected as garbage. A forgotten key
        writes nothing: its last record stays on disk, dead, until its segment is compacted, so a
        store reopened before that finds it again (:meth:`side_records`); whoever forgets keys
        must tell such records from live ones by what the live records say."""
        if transaction is not self._txn:
            raise StorageTransactionError(self, transaction)
        if self._placed is not None:
            raise StorageTransactionError("side records added after the vote")
        for oid in records:
            if not is_side(oid):
                raise ValueError(f"side record key {oid.hex()} lacks the side prefix")
        self._tdata.update(records)
        self._forget.extend(forget)

    def side_records(self) -> dict[bytes, bytes]:
        """Every side record the index holds (key -> data), read once: a boot's load."""
        log = self._log
        with log.lock:
            keys = [oid for oid in log.index if is_side(oid)]
        found: dict[bytes, bytes] = {}
        for oid in keys:
            current = log.read_current(oid)
            if current is not None:
                found[oid] = current[0]
        return found

    def side_record(self, key: bytes) -> bytes | None:
        """The current data of side record ``key``, or None."""
        current = self._log.read_current(key)
        return None if current is None else current[0]

    def forget_side(self, keys: Iterable[bytes]) -> None:
        """Drop side records from the index now, outside any transaction (a boot that found them
        dead): nothing is written; compaction reclaims them."""
        self._log.delete([oid for oid in keys if is_side(oid)])

    def checkCurrentSerialInTransaction(self, oid: bytes, serial: bytes, transaction: Any) -> None:
        # Checked now, not at vote: the commit lock keeps other transactions out until then.
        if transaction is not self._txn:
            raise StorageTransactionError(self, transaction)
        entry = self._log.index.get(oid)
        committed = entry[2] if entry is not None else Z64
        if committed != serial:
            raise ReadConflictError(oid=oid, serials=(committed, serial))

    def tpc_vote(self, transaction: Any) -> None:
        """Write the transaction: ONE block (records and commit mark), ONE pwritev, ONE
        fdatasync. Here and not in tpc_finish: ZODB's two-phase commit lets any participant
        veto in tpc_vote, and forbids failing after a successful vote ("if this method returns
        without an error, then there must not be an error if tpc_finish or tpc_abort is called
        subsequently"). A disk error here aborts the whole transaction cleanly; the same error
        in tpc_finish would come after other participants committed. tpc_finish then only
        switches the index: it does no I/O, so it cannot fail."""
        if transaction is not self._txn:
            raise StorageTransactionError("tpc_vote called with wrong transaction")
        if self._placed is not None:
            return
        voted_ns = time.perf_counter_ns()
        log = self._log
        tid = self._tid
        index_get = log.index.get
        body: list[bytes] = []
        placed: list[tuple[bytes, int, int]] = []
        body_len = 0
        for oid, data in self._tdata.items():
            entry = index_get(oid)
            length = len(data)
            body.append(_pack_record(oid, tid, entry[0] if entry is not None else 0, length))
            body.append(data)
            placed.append((oid, body_len, length))
            body_len += _RH + length
        total = BLOCK_OVERHEAD + body_len
        shipper = self.shipper
        if shipper is not None:
            # Before the local write, so that the replicas' writes and syncs overlap ours.
            shipper.ship(tid, self._tdata, self._forget)
        head = log.commit_head
        if head is None or head.sealed or head.end + total + RESERVE > head.size:
            head = log.commit_head = log.head_for(head, total)  # errors here wrote nothing
        try:
            offset = log.write_block(
                head, block_parts(KIND_COMMIT, head.seq, tid, body, body_len), total
            )
        except OSError as exc:
            # The head's tail is now unknown (part of the block may be on disk): no further
            # commit may append after it. Reopening recovers from what the disk holds.
            self._failed = exc
            if shipper is not None:
                shipper.aborted(tid)  # the replicas must not keep what this disk may not have
            raise
        log.appended += total
        # When this vote began, its write ended and its sync ended (``perf_counter_ns``): the
        # commit's stages in a hop breakdown (aaabus.core.trace.STAGES).
        self.last_vote_ns = (voted_ns, *log.last_write_ns)
        base = position(head.seq, offset + _BODY_AT)
        self._placed = [(oid, base + rel, length) for oid, rel, length in placed]
        self._voted_head = head
        if shipper is not None:
            # Durable only once the replicas the sync setting asks for have it on disk too. If
            # the wait is cut short (the server stops), tpc_abort marks the block aborted here
            # and at the replicas.
            shipper.wait(tid)

    def voted(self, transaction: Any) -> bool:
        """Whether ``transaction`` (what ``tpc_begin`` got: a ZODB connection passes its
        ``TransactionMetaData``) is voted here, hence on disk: from then on a crash reboots
        with it, so it can only end committed unless another participant vetoes it."""
        return transaction is self._txn and self._placed is not None

    def tpc_finish(
        self, transaction: Any, func: Callable[[bytes], object] = lambda tid: None
    ) -> bytes:
        """Make the voted transaction current (it is on disk since tpc_vote) and return its
        tid. ``func(tid)`` runs under the index lock, so no load returns an older revision
        once ZODB has been told of the new one."""
        if transaction is not self._txn:
            raise StorageTransactionError("tpc_finish called with wrong transaction")
        try:
            if self._placed is None:
                self.tpc_vote(transaction)
            head = self._voted_head
            assert head is not None and self._placed is not None
            self._log.apply_commit(self._tid, head.seq, self._placed, func, self._forget)
            return self._tid
        finally:
            self._end_transaction()
            self._compactor.after_commit()

    def tpc_abort(self, transaction: Any) -> None:
        if transaction is not self._txn:
            return
        try:
            head = self._voted_head
            if head is not None and self._failed is None:
                try:
                    self._log.write_abort(head, self._tid)
                except OSError as exc:
                    # tpc_abort must not fail; but the voted block would count as committed at
                    # the next open: refuse further commits and say so.
                    self._failed = exc
                    logger.critical(
                        "log store %s: an aborted transaction could not be marked aborted (%s);"
                        " it may count as committed when the store is reopened",
                        self._name,
                        exc,
                    )
            if head is not None and self.shipper is not None:
                self.shipper.aborted(self._tid)
        finally:
            self._end_transaction()

    # -- replication (aaabus.core.replication) -------------------------------------------------

    def store_replicated(
        self, transaction: Any, records: dict[bytes, bytes], forget: Iterable[bytes]
    ) -> None:
        """A replica's copy of its primary's commit, in the open ``transaction`` (begun with the
        primary's tid): ``records`` (ZODB objects and side records alike) are stored as they
        are, without the serial check the primary made, and ``forget`` leaves the index."""
        if transaction is not self._txn:
            raise StorageTransactionError(self, transaction)
        self._tdata.update(records)
        self._forget.extend(forget)

    def snapshot_since(
        self, tid: bytes, then: Callable[[bytes, dict[bytes, bytes], list[bytes]], None]
    ) -> None:
        """Call ``then(last tid, records, side keys)`` with what a replica that has every commit
        up to ``tid`` lacks: the current records committed after ``tid`` and every side key
        held now. Read and called under the index lock, so it is one commit's state and the
        caller starts following the commits exactly after it. Commits finish after it (the
        records are read from the page cache, or the disk)."""
        log = self._log
        with log.lock:
            wanted = [(oid, pos, length) for oid, (pos, length, t) in log.index.items() if t > tid]
            records: dict[bytes, bytes] = {}
            for oid, pos, length in wanted:
                data = log.read(pos, length)
                if data is None:
                    raise AssertionError("an index entry points into a recycled segment")
                records[oid] = data
            then(log.last_tid, records, [oid for oid in log.index if is_side(oid)])

    def _end_transaction(self) -> None:
        self._txn = None
        self._tdata = {}
        self._forget = []
        self._placed = None
        self._voted_head = None
        self._commit_lock.release()

    # -- space -------------------------------------------------------------------------------

    def pack(
        self,
        t: float,
        referencesf: Callable[[bytes], list[bytes]] = zodb_referencesf,
        gc: bool = True,
    ) -> None:
        """Reclaim everything now, synchronously: drop unreachable objects (with ``gc``, no
        grace pass), seal the heads and copy every live record out of every older segment.
        ``t`` is ignored: the store keeps no history to pack to a time."""
        if self._read_only:
            raise ReadOnlyError()
        self._compactor.pack(referencesf if gc else None, self._commit_lock)

    def collect_garbage(self, *, grace: bool = True) -> None:
        """Run one GC pass now (the compactor runs them by itself when due). With ``grace``,
        only objects that the previous pass also found unreachable are dropped."""
        if self._read_only:
            raise ReadOnlyError()
        self._compactor.collect(zodb_referencesf, grace)

    def close(self) -> None:
        """Stop the compactor, seal the heads durably, release the directory. A transaction
        left open (begun, never finished) is aborted: it was never acknowledged."""
        if self._closed:
            return
        self._compactor.stop()
        if self._txn is not None:
            self.tpc_abort(self._txn)
        with self._commit_lock:
            self._closed = True
            self._log.close()
