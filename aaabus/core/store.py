"""The server's store: one ZODB database holding agents, queues and counters.

Opening storages is this module's only job besides the root layout, so that another ZODB storage
(ZEO, RelStorage, ...) can be added in one place. Three kinds exist today (property
``aaabus.store``):

* ``log`` (the default): a :class:`~aaabus.core.logstorage.LogStorage` in ``<dir>/log/``, one
  write and one ``fdatasync`` per commit into preallocated segments, compacted in the
  background so that disk use follows the live data;
* ``file``: a ``FileStorage`` in ``<dir>/data.fs``, fsync'd at every commit;
* ``memory``: a ``MappingStorage``, non-durable, for tests and in-process simulation.

A directory holding one durable kind is refused when opened as the other (one line naming
both): switching the kind would otherwise boot an empty store beside the messages the old one
still holds.

A :class:`Store` and every persistent object reached through it belong to ONE thread, the
engine's: ZODB gives each connection its own object copies, and a single writer means commits
never conflict (no ``ConflictError`` to retry, no lost update between threads).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import struct
from pathlib import Path
from typing import Any

import transaction
import zc.lockfile
import ZODB
import ZODB.broken
import ZODB.FileStorage
import ZODB.utils
from BTrees.LOBTree import LOBTree
from BTrees.OOBTree import OOBTree
from persistent import Persistent
from persistent.mapping import PersistentMapping

from aaabus.config.trust import TrustPolicy
from aaabus.core import upgrades
from aaabus.core.cachesweep import CacheSweeper
from aaabus.core.clock import DomainClock
from aaabus.core.journal import Journal, JournalQueue
from aaabus.core.logstorage import DEFAULT_SEGMENT_SIZE, LogStorage
from aaabus.core.logstorage.segments import LOCK_NAME
from aaabus.core.packer import Packer
from aaabus.core.records import VettedDB, check_record
from aaabus.core.writers import FreeingDB
from aaabus.errors import MalformedPickle, StoreError, StoreWriteFailed, UntrustedClass
from aaabus.model.agent import BACKLOGS_ATTRIBUTE
from aaabus.model.renames import current_path
from aaabus.wire.frames import BODY_VERSION as WIRE_VERSION
from aaabus.wire.pickles import pickle_end

log = logging.getLogger("aaabus.store")

STORE_KINDS = ("log", "file", "memory")
DEFAULT_STORE_KIND = "log"

#: Where each durable kind keeps its files inside the server's storage directory.
LOG_DIR = "log"
FILE_NAME = "data.fs"

#: A file store is packed each time it grew by this much (property ``aaabus.store.pack_mb``).
DEFAULT_PACK_EVERY = 64 << 20

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
        if self and self.maxKey() <= seq:
            # Everything goes (the usual case: an acknowledgement covers all that was in
            # flight): one C-level clear instead of a Python loop over the keys.
            removed = len(self)
            self.clear()
            return removed
        removed = 0
        while self and self.minKey() <= seq:
            del self[self.minKey()]
            removed += 1
        return removed


class ZodbQueues:
    """The channel's clocks and queues as ZODB objects under the root's ``queues`` tree: the
    layout of the file and memory stores (the log store keeps them in its journal,
    :class:`~aaabus.core.journal.Journal`, which answers the same questions).

    Keys: ``("clock", domain)`` a :class:`DomainClock`, ``("wait", domain)`` an ``OOBTree``
    (peer, seq) -> held-back message, ``("out", peer, domain)`` a :class:`PersistentQueue`
    link seq -> frame."""

    def __init__(self, queues: OOBTree, qin: PersistentQueue) -> None:
        self._queues = queues
        self._qin = qin

    def clock(self, domain: str) -> DomainClock | None:
        clock: DomainClock | None = self._queues.get(("clock", domain))
        return clock

    def new_clock(self, domain: str, size: int, me: int, stamps: str, order: str) -> DomainClock:
        clock = self._queues["clock", domain] = DomainClock(size, me, stamps=stamps, order=order)
        return clock

    def waiting(self, domain: str) -> OOBTree:
        key = ("wait", domain)
        if key not in self._queues:
            self._queues[key] = OOBTree()
        wait: OOBTree = self._queues[key]
        return wait

    def outgoing(self, peer: int, domain: str) -> PersistentQueue:
        key = ("out", peer, domain)
        if key not in self._queues:
            self._queues[key] = PersistentQueue()
        out: PersistentQueue = self._queues[key]
        return out

    def domains(self) -> list[tuple[str, DomainClock]]:
        return [(key[1], clock) for key, clock in self._queues.items() if key[0] == "clock"]

    def _keys(self, domain: str | None = None) -> list[tuple[Any, ...]]:
        return [
            key
            for key in self._queues
            if key[0] in ("wait", "out") and (domain is None or key[-1] == domain)
        ]

    def pending(self, domain: str) -> int:
        """Messages held back or unacknowledged in ``domain``."""
        return sum(len(self._queues[key]) for key in self._keys(domain))

    def pending_messages(self) -> int:
        """Every message queued: input, held back, unacknowledged."""
        return len(self._qin) + sum(len(self._queues[key]) for key in self._keys())

    def drop(self, domain: str) -> None:
        """Forget the clock and queues of ``domain`` (the caller checked they are empty)."""
        for key in [("clock", domain), *self._keys(domain)]:
            self._queues.pop(key, None)


class ServerRecord(Persistent):
    """Counters of one server: which server owns the store, boots, and id allocation."""

    def __init__(self, server_id: int) -> None:
        self.server_id = server_id
        self.boots = 0
        self.next_stamp = 0
        #: Which bus this store belongs to: an HMAC of the bus key
        #: (aaabus.config.secret.bus_identity).
        self.bus_identity: bytes | None = None
        #: The wire version of the bodies its queues hold (aaabus.wire.frames.BODY_VERSION).
        self.wire_version: int | None = WIRE_VERSION
        #: Boot services already started once (their class paths): ``first_time`` is per service,
        #: so that a service added to the config later still sees its first time.
        self.services_started: PersistentMapping = PersistentMapping()


class Store:
    """One open database and the single connection the engine thread uses."""

    def __init__(
        self,
        db: ZODB.DB,
        description: str,
        server_id: int,
        identity: bytes | None = None,
        *,
        pack_every: int = 0,
    ) -> None:
        """``identity``: of the bus (refused if the store records another); ``pack_every``: pack
        in the background each time the storage grew by this many bytes (a FileStorage; 0:
        never). A log store keeps the queues and clocks as side records of its journal
        (:mod:`aaabus.core.journal`). A store written by an earlier version is upgraded, one
        written by a newer one refused (:mod:`aaabus.core.upgrades`)."""
        self.description = description
        self._db = db
        self._packer: Packer | None = None
        self.tm = transaction.TransactionManager()
        self.conn = db.open(transaction_manager=self.tm)
        # The cache's count bound alone lets objects that left the graph (emptied queue buckets)
        # pile up until they fill it: see aaabus.core.cachesweep. ZODB offers the cache only as
        # Connection._cache.
        self._sweeper = CacheSweeper(self.conn._cache)
        self.tm.registerSynch(self._sweeper)
        root = self.conn.root()
        if "aaabus" not in root:
            root["aaabus"] = ServerRecord(server_id)
            root["agents"] = OOBTree()
            root["qin"] = PersistentQueue()
            root["queues"] = OOBTree()
            upgrades.mark_new(self)
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
        #: The ZODB tree of the channel's structures (clocks, held-back messages, outgoing
        #: queues) in a file or memory store; empty in a log store, whose journal holds them.
        self.queues: OOBTree = root["queues"]
        self.journal: Journal | None = None
        #: Deliverable notifications for local agents, in delivery order.
        self.qin: PersistentQueue | JournalQueue = root["qin"]
        #: The channel's clocks and queues, wherever this kind of store keeps them.
        self.links: ZodbQueues | Journal = ZodbQueues(self.queues, root["qin"])
        try:
            # Nothing is written to a store of a newer version, not even the bus identity.
            upgrades.refuse_newer(self)
            storage = db.storage
            if isinstance(storage, LogStorage):
                self.journal = Journal(storage, self.tm, description)
                self.links = self.journal
                self.qin = self.journal.qin
                # The mailboxes find their journaled backlogs through their _p_jar (the agents
                # layer does not import the core): see aaabus.topics.mailbox.
                backlogs = self.journal.backlogs
                agents = self.agents
                backlogs.sweep(lambda owner: owner in agents)
                setattr(self.conn, BACKLOGS_ATTRIBUTE, backlogs)
            #: The upgrade steps this boot ran (their schema versions; empty: none was due).
            self.upgraded: list[int] = upgrades.upgrade(self)
        except StoreError:
            self.close()
            raise
        if identity is not None:
            if self.record.bus_identity is None:
                self.record.bus_identity = identity  # a new store, or one older than identities
                self.tm.commit()
            elif self.record.bus_identity != identity:
                self.close()
                raise StoreError(
                    f"{description} belongs to another bus (it was made under another bus key); "
                    "start it with that bus's key, or pass another --storage"
                )
        if pack_every:
            self._packer = Packer(db, pack_every)

    def commit(self) -> None:
        try:
            self.tm.commit()
            if self._packer is not None:
                self._packer.committed()
        except OSError as exc:
            # The transaction is aborted (ZODB rolled it back): nothing it holds was stored.
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise StoreWriteFailed(
                f"{self.description} cannot be written ({reason}); nothing unstored was "
                "acknowledged: free space or fix the disk, then restart the server"
            ) from None

    def abort(self) -> None:
        self.tm.abort()

    @property
    def storage(self) -> Any:
        """The ZODB storage under the database (a LogStorage, a FileStorage...)."""
        return self._db.storage

    def durable_at_vote(self, txn: Any) -> bool:
        """Whether ``txn`` is durable once the storage voted it (the log store writes and syncs
        in its vote: see aaabus.core.effects); False for stores that finish later."""
        storage = self._db.storage
        if not isinstance(storage, LogStorage):
            return False
        if self.journal is not None and self.journal.voted():
            return True  # no ZODB object took part: the journal's own commit voted
        try:
            # What the connection handed the storage for ``txn`` (ZODB passes its metadata).
            meta = txn.data(self.conn)
        except KeyError:
            return False  # the connection has not taken part: nothing of this group voted
        return storage.voted(meta)

    def vote_marks(self) -> tuple[int, int, int] | None:
        """``perf_counter_ns`` at the start of the last commit's vote, after its write and after
        its sync; None when the storage does not report them (only the log store does)."""
        storage = self._db.storage
        return storage.last_vote_ns if isinstance(storage, LogStorage) else None

    def disk(self) -> dict[str, Any]:
        """What the store holds: ``file_bytes`` on disk, ``live_bytes`` (the current records;
        None when the storage cannot tell) and ``compacted_at`` (epoch seconds of the last
        compaction or pack since the process started; None if none). Engine thread."""
        storage = self._db.storage
        if isinstance(storage, LogStorage):
            stats = storage.stats()
            return {
                "file_bytes": stats["file_bytes"],
                "live_bytes": stats["live_bytes"],
                "compacted_at": stats["last_compaction_at"],
            }
        size = int(storage.getSize())
        if self._packer is None:
            return {"file_bytes": size, "live_bytes": None, "compacted_at": None}
        # A pack leaves about the live data: its size then is the best figure there is without
        # reading the whole file.
        packed = self._packer.figures()
        return {
            "file_bytes": size,
            "live_bytes": packed["size_after_last_pack"],
            "compacted_at": packed["last_pack_at"],
        }

    def close(self) -> None:
        if self._packer is not None:
            self._packer.stop()
        try:
            self.tm.abort()
            self.conn.close()
        finally:
            storage = self._db.storage
            try:
                self._db.close()
            except OSError as exc:
                # After a failed write (disk full) FileStorage still holds the unwritten bytes
                # of the aborted transaction and fails again flushing them: nothing committed
                # is at stake, and the reason was already reported by the failed commit.
                log.warning("closing %s: %s", self.description, exc)
            if isinstance(storage, ZODB.FileStorage.FileStorage):
                # FileStorage writes its index file at close, under the process umask.
                _private_files(Path(storage.getName()).parent)


def open_store(
    kind: str,
    directory: str | os.PathLike[str] | None,
    server_id: int,
    trust: TrustPolicy | None = None,
    identity: bytes | None = None,
    *,
    segment_size: int = DEFAULT_SEGMENT_SIZE,
    pack_every: int = DEFAULT_PACK_EVERY,
) -> Store:
    """Open (creating if needed) the store of ``server_id``; errors are one-line StoreErrors.

    With ``trust``, every record is vetted by that policy before it is unpickled
    (:mod:`aaabus.core.records`): a store planted with a record the server did not write (a
    global it does not trust, a BUILD on a class...) is refused at boot when the record is the
    root or read by the boot, and otherwise fails whatever touches it; nothing of it runs.
    With ``identity`` (:func:`aaabus.config.secret.bus_identity`), a store recorded under another
    bus is refused. ``segment_size``: of the log store's new segment files (existing ones keep
    theirs). ``pack_every``: a file store is packed in the background each time it grew by this
    many bytes (0: never).

    A durable store's directory is created mode 0700 and its files 0600; a directory that
    another user owns or that its group or others may write is refused (they could swap the
    files).
    """
    if kind == "memory":
        description = f"in-memory store of server {server_id}"
        db = _database(None, trust, description)
        return _open_root(db, description, server_id, identity)
    if kind not in STORE_KINDS:
        raise StoreError(
            f"unknown store kind {kind!r}; "
            f"property aaabus.store takes one of {', '.join(STORE_KINDS)}"
        )
    if directory is None:
        raise StoreError(f"a {kind} store needs a directory; pass --storage DIR")
    path = Path(directory)
    _prepare_directory(path)
    _refuse_other_kind(path, kind)
    if kind == "log":
        db, description = _open_log(path / LOG_DIR, server_id, segment_size, trust)
        return _open_root(db, description, server_id, identity)
    db = _open_file(path / FILE_NAME, server_id, trust)
    return _open_root(db, f"storage {path / FILE_NAME}", server_id, identity, pack_every)


def _refuse_other_kind(path: Path, kind: str) -> None:
    """A directory already holding the other durable kind is refused: opening it as ``kind``
    would boot an empty store and leave the messages of the old one undelivered."""
    holds_file = (path / FILE_NAME).exists()
    holds_log = (path / LOG_DIR / LOCK_NAME).exists()
    if kind == "log" and holds_file and not holds_log:
        found, other = f"a file store ({path / FILE_NAME})", "file"
    elif kind == "file" and holds_log and not holds_file:
        found, other = f"a log store ({path / LOG_DIR})", "log"
    else:
        return
    raise StoreError(
        f"storage directory {path} holds {found}, not a {kind} store; set property "
        f"aaabus.store={other} to keep using it, or pass another --storage"
    )


def _open_log(
    path: Path, server_id: int, segment_size: int, trust: TrustPolicy | None
) -> tuple[ZODB.DB, str]:
    # LogStorage's own errors (damage, in use, disk) are already one-line StoreErrors.
    storage = LogStorage(path, segment_size=segment_size)
    try:
        db = _database(storage, trust, f"log store {path}")
    except StoreError:
        storage.close()
        raise
    except Exception as exc:
        storage.close()
        raise StoreError(f"log store {path} is damaged ({type(exc).__name__}: {exc})") from None
    return db, f"log store {path}"


def _open_file(data: Path, server_id: int, trust: TrustPolicy | None) -> ZODB.DB:
    _refuse_cut_commits(data)
    try:
        # pack_keep_old=False: a pack must shrink the disk use, not keep the old file beside.
        storage = ZODB.FileStorage.FileStorage(str(data), pack_keep_old=False)
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
        _private_files(data.parent)
        db = _database(storage, trust, f"storage {data}")
    except StoreError:
        storage.close()
        raise
    except Exception as exc:
        storage.close()
        raise StoreError(f"storage {data} is damaged ({type(exc).__name__}: {exc})") from None
    return db


def _database(storage: Any, trust: TrustPolicy | None, description: str) -> ZODB.DB:
    """ZODB over ``storage`` (None: in memory); with ``trust``, every record it loads is vetted
    (:class:`~aaabus.core.records.VettedDB`), the root first, before ZODB reads any of it.

    The root is also loaded once as a check, its references unfollowed: what only unpickling
    can refuse (a plain type's wrapper refusing its arguments) is then one line naming it too.
    """
    # The same object cache for every kind: ZODB's default (400 objects) is smaller than what
    # one group touches on a busy router, and an evicted agent loses its volatile (_v_)
    # attributes and is unpickled again at its next notification.
    if trust is None:
        return FreeingDB(storage, cache_size=CACHE_SIZE, class_factory=_moved_classes)
    if storage is not None and len(storage):
        try:
            check_record(trust, storage.load(ZODB.utils.z64)[0])
        except (UntrustedClass, MalformedPickle) as exc:
            root = ZODB.utils.oid_repr(ZODB.utils.z64)
            raise _refused(description, f"record {root}: {exc}") from None
    return VettedDB(storage, trust, cache_size=CACHE_SIZE)


def _moved_classes(_connection: Any, module: str, name: str) -> Any:
    """ZODB's own class factory, but a class that moved found where it is now
    (:mod:`aaabus.model.renames`): the trust policy does the same for a vetted store."""
    return ZODB.broken.find_global(*current_path(module, name))


def _open_root(
    db: ZODB.DB,
    description: str,
    server_id: int,
    identity: bytes | None,
    pack_every: int = 0,
) -> Store:
    try:
        return Store(db, description, server_id, identity, pack_every=pack_every)
    except (UntrustedClass, MalformedPickle) as exc:  # a record the boot reads (names its oid)
        db.close()
        raise _refused(description, str(exc)) from None


def _refused(description: str, reason: str) -> StoreError:
    """One line for a store holding a record this server refuses to load."""
    return StoreError(
        f"{description} holds a record this server refuses to load ({reason}); "
        "if the store is not yours, move it away"
    )


def _prepare_directory(path: Path) -> None:
    """Create ``path`` (0700), refuse it if others could change it, and prove it writable.

    The write probe is created exclusively and never follows a symlink: a link planted at its
    name cannot make the server truncate or create the file it points to.
    """
    where = "pass --storage DIR pointing to a private, writable directory"
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.stat()
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise StoreError(f"storage directory {path} is not writable ({reason}); {where}") from None
    if info.st_uid != os.geteuid():
        raise StoreError(
            f"storage directory {path} belongs to user {info.st_uid}, not to this server's user "
            f"{os.geteuid()}: its owner could swap the store; {where}"
        )
    if info.st_mode & 0o022:
        raise StoreError(
            f"storage directory {path} is writable by group or others (mode "
            f"{stat.S_IMODE(info.st_mode):o}): they could swap the store; run `chmod 700 {path}`"
        )
    probe = path / ".aaabus-write-probe"
    try:
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()  # a leftover of a crash, or a planted link: unlink never follows
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        probe.unlink()
    except OSError as exc:
        reason = os.strerror(exc.errno) if exc.errno else str(exc)
        raise StoreError(f"storage directory {path} is not writable ({reason}); {where}") from None


def _private_files(path: Path) -> None:
    """Make the files FileStorage created (under the process umask) readable by us alone."""
    for name in ("data.fs", "data.fs.index", "data.fs.lock", "data.fs.tmp"):
        with contextlib.suppress(OSError):
            os.chmod(path / name, 0o600, follow_symlinks=False)


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
