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
import os
from pathlib import Path
from typing import Any

import transaction
import zc.lockfile
import ZODB
import ZODB.FileStorage
from BTrees.LOBTree import LOBTree
from BTrees.OOBTree import OOBTree
from persistent import Persistent
from persistent.mapping import PersistentMapping

from aaabus.errors import StoreError

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
        self.tm.commit()

    def abort(self) -> None:
        self.tm.abort()

    def size_bytes(self) -> int:
        return int(self._db.storage.getSize())

    def close(self) -> None:
        try:
            self.tm.abort()
            self.conn.close()
        finally:
            self._db.close()


def open_store(kind: str, directory: str | os.PathLike[str] | None, server_id: int) -> Store:
    """Open (creating if needed) the store of ``server_id``; errors are one-line StoreErrors."""
    if kind == "memory":
        return Store(ZODB.DB(None), f"in-memory store of server {server_id}", server_id)
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
        db = ZODB.DB(storage, cache_size=CACHE_SIZE)
    except Exception as exc:
        storage.close()
        raise StoreError(f"storage {data} is damaged ({type(exc).__name__}: {exc})") from None
    return Store(db, f"storage {data}", server_id)
