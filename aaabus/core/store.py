"""The server's store: one ZODB database holding agents, queues and counters.

Opening storages is this module's only job besides the root layout, so that another ZODB storage
(ZEO, RelStorage, ...) can be added in one place. Two kinds exist today:

* ``file`` (the default): a ``FileStorage`` in ``<dir>/data.fs``, fsync'd at every commit;
* ``memory``: a ``MappingStorage``, non-durable, for tests and in-process simulation.

A :class:`Store` and every persistent object reached through it belong to ONE thread, the
engine's: ZODB gives each connection its own object copies, and a single writer means commits
never conflict (no ``ConflictError`` to retry, no lost update between threads).
"""

from __future__ import annotations

import errno
import logging
import os
import struct
from pathlib import Path
from typing import Any

import transaction
import zc.lockfile
import ZODB
import ZODB.FileStorage
import ZODB.utils
from BTrees.LOBTree import LOBTree
from BTrees.OOBTree import OOBTree
from persistent import Persistent
from persistent.mapping import PersistentMapping

from aaabus.errors import MalformedPickle, StoreError, StoreWriteFailed
from aaabus.wire.pickles import pickle_end

log = logging.getLogger("aaabus.store")

STORE_KINDS = ("file", "memory")

#: Objects kept in each connection's cache: large enough that a server's agents and queue
#: buckets stay in memory, so that a reaction never waits on the disk to load its agent.
CACHE_SIZE = 100_000


class PersistentQueue(LOBTree):
    """A FIFO queue whose every put and pop is part of the current transaction.

    It is a BTree keyed by sequence numbers, with nothing else stored: a queue that fits one
    bucket is ONE small record, rewritten by a commit that puts or pops. Every record a commit
    writes costs tens of microseconds in ZODB, so a separate header with head and tail counters
    would make every hop slower. The next number is the largest key plus one (0 when empty: the
    numbers of a queue that emptied may be reused, so they must not name anything outside it).
    """

    def put(self, item: Any) -> int:
        seq = self.maxKey() + 1 if self else 0
        self[seq] = item
        return seq

    def peek(self) -> Any:
        return self[self.minKey()]

    def pop(self) -> Any:
        """Remove and return the oldest item; IndexError when empty."""
        if not self:
            raise IndexError("queue is empty")
        return super().pop(self.minKey())

    def pop_through(self, seq: int) -> int:
        """Remove every item whose sequence number is ``<= seq``; return how many."""
        removed = 0
        while self and self.minKey() <= seq:
            del self[self.minKey()]
            removed += 1
        return removed


class ServerRecord(Persistent):
    """Counters of one server: which server owns the store, boots, and id allocation."""

    def __init__(self, server_id: int) -> None:
        self.server_id = server_id
        self.boots = 0
        self.next_stamp = 0
        #: Boot services already started once (their class paths): ``first_time`` is per service,
        #: so that a service added to the config later still sees its first time.
        self.services_started: PersistentMapping = PersistentMapping()


class Store:
    """One open database and the single connection the engine thread uses."""

    def __init__(self, db: ZODB.DB, description: str, server_id: int) -> None:
        self.description = description
        self._db = db
        self.tm = transaction.TransactionManager()
        self.conn = db.open(transaction_manager=self.tm)
        root = self.conn.root()
        if "aaabus" not in root:
            root["aaabus"] = ServerRecord(server_id)
            root["agents"] = OOBTree()
            root["qin"] = PersistentQueue()
            root["queues"] = OOBTree()
            self.tm.commit()
        self.record: ServerRecord = root["aaabus"]
        if self.record.server_id != server_id:
            self.close()
            raise StoreError(
                f"{description} belongs to server {self.record.server_id}, not {server_id}; "
                "pass the right --id or another --storage"
            )
        #: Agents by (origin, stamp): the hosting server is this one by definition.
        self.agents: OOBTree = root["agents"]
        #: Deliverable notifications for local agents, in delivery order.
        self.qin: PersistentQueue = root["qin"]
        #: Named structures of the channel side (outgoing queues, held-back messages, clocks).
        self.queues: OOBTree = root["queues"]

    def commit(self) -> None:
        try:
            self.tm.commit()
        except OSError as exc:
            # The transaction is aborted (ZODB rolled it back): nothing it holds was stored.
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise StoreWriteFailed(
                f"{self.description} cannot be written ({reason}); nothing unstored was "
                "acknowledged: free space or fix the disk, then restart the server"
            ) from None

    def abort(self) -> None:
        self.tm.abort()

    def size_bytes(self) -> int:
        return int(self._db.storage.getSize())

    def close(self) -> None:
        try:
            self.tm.abort()
            self.conn.close()
        finally:
            try:
                self._db.close()
            except OSError as exc:
                # After a failed write (disk full) FileStorage still holds the unwritten bytes
                # of the aborted transaction and fails again flushing them: nothing committed
                # is at stake, and the reason was already reported by the failed commit.
                log.warning("closing %s: %s", self.description, exc)


def open_store(kind: str, directory: str | os.PathLike[str] | None, server_id: int) -> Store:
    """Open (creating if needed) the store of ``server_id``; errors are one-line StoreErrors."""
    if kind == "memory":
        # The same object cache as a file store: ZODB's default (400 objects) is smaller than
        # what one group touches on a busy router, and an evicted agent loses its volatile
        # (_v_) attributes and is unpickled again at its next notification.
        db = ZODB.DB(None, cache_size=CACHE_SIZE)
        return Store(db, f"in-memory store of server {server_id}", server_id)
    if kind != "file":
        raise StoreError(
            f"unknown store kind {kind!r}; "
            f"property aaabus.store takes one of {', '.join(STORE_KINDS)}"
        )
    if directory is None:
        raise StoreError("a file store needs a directory; pass --storage DIR")
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".aaabus-write-probe"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise StoreError(
            f"storage directory {path} is not writable ({reason}); "
            "pass --storage DIR pointing to a writable directory"
        ) from None
    data = path / "data.fs"
    _refuse_cut_commits(data)
    try:
        storage = ZODB.FileStorage.FileStorage(str(data))
    except zc.lockfile.LockError:
        raise StoreError(
            f"storage {data} is in use by another process (is server {server_id} already "
            "running?); stop that process or pass another --storage"
        ) from None
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EROFS, errno.EACCES):
            raise StoreError(f"cannot open storage {data}: {os.strerror(exc.errno)}") from None
        raise StoreError(f"cannot open storage {data}: {exc}") from None
    except Exception as exc:  # FileStorage's format and corruption errors have no common base
        raise StoreError(
            f"storage {data} is damaged ({type(exc).__name__}: {exc}); restore it from a backup "
            "or move it away to start empty"
        ) from None
    try:
        _verify_current_records(storage, data)
        db = ZODB.DB(storage, cache_size=CACHE_SIZE)
    except StoreError:
        storage.close()
        raise
    except Exception as exc:
        storage.close()
        raise StoreError(f"storage {data} is damaged ({type(exc).__name__}: {exc})") from None
    return Store(db, f"storage {data}", server_id)


# -- fault detection at boot -----------------------------------------------------------------
#
# FileStorage commits a transaction by writing it with status "c" (in progress), then flipping
# that byte to " " and fsyncing: only then does ZODB's commit return, and only then does the
# server acknowledge anything. At open, FileStorage truncates a tail it cannot read to the last
# complete transaction, with a mere log warning. For a tail left by a crash (status "c") that is
# right: nothing in it was acknowledged. A tail whose header says " " (committed) but whose body
# is missing was cut by something else (a copy, the disk) and held acknowledged messages that no
# peer will resend: the server must refuse to boot rather than silently forget them.

_TXN_HEAD = struct.Struct(">8sQcHHH")  # tid, length, status, user/desc/ext lengths (23 bytes)


def _refuse_cut_commits(data: Path) -> None:
    try:
        size = data.stat().st_size
        if size <= 4:
            return
        with data.open("rb") as f:
            # Fast path: the last 8 bytes repeat the last transaction's length; if they lead to a
            # committed header that spans exactly to the end, the tail is whole.
            f.seek(size - 8)
            tl = int.from_bytes(f.read(8), "big")
            start = size - 8 - tl
            if 4 <= start < size:
                f.seek(start)
                head = f.read(_TXN_HEAD.size)
                if len(head) == _TXN_HEAD.size:
                    _tid, length, status, *_ = _TXN_HEAD.unpack(head)
                    if length == tl and status != b"c":
                        return
            # Slow path: walk the transaction headers to the damaged one and judge it.
            pos = 4
            while pos < size:
                f.seek(pos)
                head = f.read(_TXN_HEAD.size)
                if len(head) < _TXN_HEAD.size:
                    return  # a torn header: only an uncommitted write leaves one
                _tid, length, status, *_ = _TXN_HEAD.unpack(head)
                if pos + length + 8 > size:
                    if status == b"c":
                        return  # an interrupted commit: FileStorage drops it, nothing was acked
                    raise StoreError(
                        f"storage {data} is truncated: the committed transaction at byte {pos} "
                        f"needs {pos + length + 8 - size} more bytes; committed (and possibly "
                        "acknowledged) data is missing: restore the file from a backup"
                    )
                if status == b"c":
                    return
                pos += length + 8
    except OSError:
        return  # unreadable: FileStorage's own open reports it


def _verify_current_records(storage: ZODB.FileStorage.FileStorage, data: Path) -> None:
    """Read the current revision of every object and check that it is two well-formed pickles
    (ZODB's class record and state): garbage written over a live record is found now, as a
    one-line error, rather than when an agent or a queue is next touched. Garbage inside an old
    revision is never read again and goes unnoticed: it is harmless.

    The walk (:func:`aaabus.wire.pickles.pickle_end`) builds nothing: a few microseconds per live
    object (reading it costs more than checking it), once per boot.
    """
    if not len(storage):
        return
    current: bytes | None = ZODB.utils.z64  # the root, the lowest oid
    while current is not None:
        try:
            _oid, _tid, record, following = storage.record_iternext(current)
            if pickle_end(record, pickle_end(record)) != len(record):
                raise MalformedPickle("bytes after the state")
        except Exception as exc:
            raise StoreError(
                f"storage {data} is damaged: object 0x{int.from_bytes(current, 'big'):x} cannot "
                f"be read ({type(exc).__name__}: {exc}); restore the file from a backup"
            ) from None
        current = following
