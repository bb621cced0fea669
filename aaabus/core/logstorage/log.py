"""The state of one open log store, shared by the committing thread and the compactor.

``Log.lock`` (one re-entrant lock) guards the index, the per-segment live byte counts, the
segment table and the pools of spare and free files. It is held only for dictionary updates and
single-record ``pread``s, never across a write or an ``fdatasync``: the committing thread writes
its block with no lock held (it owns the commit head), and so does the compactor (it owns the
copy head). Lock order, outermost first: the storage's commit lock, ``Log.lock``.

Threads: the engine (commits and loads), the compactor (copies, GC, spare segments), and any
thread ZODB loads from; every method says which may call it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from aaabus.core.logstorage.format import (
    ABORT_SIZE,
    DATA_START,
    MAX_SEGMENT_SIZE,
    OFFSET_BITS,
    OFFSET_MASK,
    RECORD_HEAD,
    SEAL_SIZE,
    SegmentHeader,
    abort_block,
    seal_block,
)
from aaabus.core.logstorage.recovery import Entry, recover
from aaabus.core.logstorage.segments import (
    Segment,
    create_file,
    install,
    lock_directory,
    retire,
)

log = logging.getLogger("aaabus.logstorage")

#: Room every head keeps free after its last block: a seal, and an abort block for the
#: transaction just voted (both must fit in the same segment, see the package docstring).
RESERVE = SEAL_SIZE + ABORT_SIZE
RH = RECORD_HEAD.size
#: Recycled files kept for reuse; more are deleted, so that the disk follows the live data
#: once a burst of history has been compacted away.
MAX_FREE = 2


class Log:
    """Index, segments and heads of one store directory (opened and recovered in __init__)."""

    def __init__(self, directory: Path, segment_size: int, read_only: bool) -> None:
        self.directory = directory
        self.segment_size = segment_size
        self.read_only = read_only
        self.lock = threading.RLock()
        self._lockfile = lock_directory(directory)
        try:
            found = recover(directory, read_only, segment_size)
        except BaseException:
            self._lockfile.close()
            raise
        self.index: dict[bytes, Entry] = found.index
        self.segments: dict[int, Segment] = found.segments
        self.free: list[Path] = found.free
        self.spares: list[Segment] = []
        self.last_tid = found.last_tid
        self.next_oid = found.next_oid
        self.next_seq = found.next_seq
        #: Segments whose interrupted last write this open dropped (seq -> byte offset).
        self.torn = found.torn
        #: Live bytes (record headers and data of current revisions) per segment seq.
        self.live: dict[int, int] = dict.fromkeys(self.segments, 0)
        for pos, data_len, _tid in self.index.values():
            self.live[pos >> OFFSET_BITS] += RH + data_len
        self.commit_head: Segment | None = None
        self.copy_head: Segment | None = None
        #: Bytes committed since the last GC pass began (decides when the next one is due). The
        #: committing thread adds, the compactor resets: a lost update only shifts a pass.
        self.appended = 0
        #: ``perf_counter_ns`` after the last commit's write and after its sync.
        self.last_write_ns = (0, 0)
        #: While a GC pass marks: the oids committed meanwhile (they and what they reference
        #: are live whatever the marking saw). None when no pass is marking.
        self.marking: set[bytes] | None = None
        #: Sorted oids for record_iternext, rebuilt when an oid appears or disappears.
        self.oid_order: list[bytes] | None = None
        #: Called (no lock held) when a segment is sealed or a spare is taken.
        self.on_change: Callable[[], None] = lambda: None
        if not read_only:
            try:
                self._seal_left_open(found.unsealed, found.torn)
            except BaseException:
                self.close()
                raise

    def _seal_left_open(self, unsealed: list[Segment], torn: dict[int, int]) -> None:
        """Opening: seal, durably, the segments a crash left open (over their torn tails, if
        any), so that no later write follows bytes of unknown content; empty ones are spares."""
        for segment in unsealed:
            if segment.end == DATA_START and segment.seq not in torn:
                del self.segments[segment.seq]
                del self.live[segment.seq]
                self.spares.append(segment)
            else:
                self.seal(segment)
                self.sync(segment)

    # -- reads (any thread) ------------------------------------------------------------------

    def read(self, pos: int, length: int, skip: int = RH) -> bytes | None:
        """``length`` bytes at ``skip`` past the record at ``pos``; None if its segment is gone
        (recycled). Under the lock, so that the segment cannot be recycled mid-read."""
        with self.lock:
            segment = self.segments.get(pos >> OFFSET_BITS)
            if segment is None:
                return None
            return os.pread(segment.fd, length, (pos & OFFSET_MASK) + skip)

    def read_current(self, oid: bytes) -> tuple[bytes, bytes] | None:
        """(data, tid) of the current revision of ``oid``, or None if there is none."""
        with self.lock:
            entry = self.index.get(oid)
            if entry is None:
                return None
            pos, length, tid = entry
            segment = self.segments[pos >> OFFSET_BITS]
            return os.pread(segment.fd, length, (pos & OFFSET_MASK) + RH), tid

    # -- segments (the head's owner; the compactor for spares) ---------------------------------

    def head_for(self, head: Segment | None, nbytes: int) -> Segment:
        """``head`` if a block of ``nbytes`` fits in it with the reserve to spare, else a new
        head (the old one sealed). Called by the head's owner, no lock held."""
        if head is not None and not head.sealed and head.end + nbytes + RESERVE <= head.size:
            return head
        if head is not None and not head.sealed:
            self.seal(head)
        segment = self.take_spare(DATA_START + nbytes + RESERVE)
        self.on_change()
        return segment

    def take_spare(self, min_size: int) -> Segment:
        """A prepared empty segment of at least ``min_size`` bytes, now registered; prepared
        here (zero-filled: slow) when the compactor has none ready."""
        with self.lock:
            for i, spare in enumerate(self.spares):
                if spare.size >= min_size:
                    segment = self.spares.pop(i)
                    break
            else:
                segment = None
        if segment is None:
            size = max(self.segment_size, min_size)
            if size > MAX_SEGMENT_SIZE:
                raise OSError(f"a transaction of {min_size} bytes exceeds the 4 GiB log limit")
            segment = self.prepare(size)
        with self.lock:
            self.segments[segment.seq] = segment
            self.live[segment.seq] = 0
        return segment

    def prepare(self, size: int) -> Segment:
        """A new named, empty segment of ``size`` bytes, from the free pool when one fits."""
        with self.lock:
            seq = self.next_seq
            self.next_seq += 1
            source = self.free.pop() if size == self.segment_size and self.free else None
            header = SegmentHeader(seq, size, self.last_tid, self.next_oid)
        if source is None:
            source = create_file(self.directory, seq, size)
        return install(self.directory, source, header)

    def add_spare(self) -> None:
        """Compactor: prepare one standard segment ahead of need."""
        segment = self.prepare(self.segment_size)
        with self.lock:
            self.spares.append(segment)

    def seal(self, segment: Segment) -> None:
        """Write a seal block at the end of ``segment`` (no sync: see ``sync``). Caller holds
        the lock or owns the segment."""
        if segment.end + SEAL_SIZE <= segment.size:
            os.pwrite(
                segment.fd, seal_block(segment.seq, self.last_tid, self.next_oid), segment.end
            )
            segment.end += SEAL_SIZE
            segment.unsynced = True
        segment.sealed = True

    def sync(self, segment: Segment) -> None:
        os.fdatasync(segment.fd)
        segment.unsynced = False

    def sync_sealed(self) -> None:
        """Compactor: make the seals written on the commit path durable."""
        with self.lock:
            pending = [s for s in self.segments.values() if s.unsynced]
        for segment in pending:
            self.sync(segment)

    # -- writes (the head's owner, no lock held) ---------------------------------------------

    def write_block(self, head: Segment, parts: list[bytes], total: int) -> int:
        """Append one block (ONE pwritev, ONE fdatasync) and return its offset."""
        offset = head.end
        try:
            self._write(head, parts, total, offset)
        except OSError:
            # Part of the block may be on disk: nothing may be appended after it any more.
            # Left unsealed on disk, the next open drops that tail as a torn write.
            head.sealed = True
            raise
        head.end = offset + total
        return offset

    def _write(self, head: Segment, parts: list[bytes], total: int, offset: int) -> None:
        written = os.pwritev(head.fd, parts, offset)
        if written < total:  # a short write (rare): finish it, still before the one sync
            rest = b"".join(parts)[written:]
            while rest:
                n = os.pwrite(head.fd, rest, offset + total - len(rest))
                rest = rest[n:]
        written_ns = time.perf_counter_ns()
        os.fdatasync(head.fd)
        # Two clock reads per commit (~0.1 µs) so that a hop's breakdown can tell the write
        # from the sync (aaabus.core.trace.STAGES); read by the committing thread only.
        self.last_write_ns = (written_ns, time.perf_counter_ns())

    def write_abort(self, head: Segment, tid: bytes) -> None:
        """Cancel the transaction voted just before in ``head`` (its room was reserved)."""
        block = abort_block(head.seq, tid)
        os.pwrite(head.fd, block, head.end)
        os.fdatasync(head.fd)
        head.end += len(block)

    # -- index updates -------------------------------------------------------------------------

    def apply_commit(
        self,
        tid: bytes,
        seq: int,
        placed: list[tuple[bytes, int, int]],
        func: Callable[[bytes], object],
        forget: Iterable[bytes] = (),
    ) -> None:
        """Committing thread, in tpc_finish: make the voted records current, drop the side
        records in ``forget`` from the index, then call ``func`` (ZODB's invalidation callback)
        still under the lock, so that no load returns an old revision once ZODB has been told
        of the new one."""
        with self.lock:
            index = self.index
            live = self.live
            added = 0
            new_oid = False
            for oid, pos, length in placed:
                old = index.get(oid)
                if old is None:
                    new_oid = True
                else:
                    live[old[0] >> OFFSET_BITS] -= RH + old[1]
                index[oid] = (pos, length, tid)
                added += RH + length
            live[seq] += added
            for oid in forget:
                entry = index.pop(oid, None)
                if entry is not None:
                    live[entry[0] >> OFFSET_BITS] -= RH + entry[1]
                    new_oid = True
            self.last_tid = tid
            if new_oid:
                self.oid_order = None
            if self.marking is not None:
                self.marking.update(oid for oid, _pos, _len in placed)
            func(tid)

    def switch(self, moves: Iterable[tuple[bytes, int, int, int]], seq: int) -> int:
        """Compactor: point the index at copies (oid, old pos, new pos, data length) written to
        segment ``seq``, for those still current at the old place; returns bytes switched."""
        moved = 0
        with self.lock:
            index = self.index
            live = self.live
            for oid, old_pos, new_pos, length in moves:
                entry = index.get(oid)
                if entry is None or entry[0] != old_pos:
                    continue  # superseded or collected meanwhile: the copy is dead already
                index[oid] = (new_pos, length, entry[2])
                live[old_pos >> OFFSET_BITS] -= RH + length
                moved += RH + length
            live[seq] += moved
        return moved

    def delete(self, oids: Iterable[bytes]) -> int:
        """GC: drop unreachable objects from the index; returns how many were dropped."""
        count = 0
        with self.lock:
            for oid in oids:
                entry = self.index.pop(oid, None)
                if entry is not None:
                    self.live[entry[0] >> OFFSET_BITS] -= RH + entry[1]
                    count += 1
            if count:
                self.oid_order = None
        return count

    def retire(self, segment: Segment) -> None:
        """Compactor: recycle a sealed segment that holds no live record any more."""
        with self.lock:
            if self.live[segment.seq] != 0:
                raise AssertionError(f"segment {segment.seq} still holds live records")
            del self.segments[segment.seq]
            del self.live[segment.seq]
            reuse = segment.size == self.segment_size and len(self.free) < MAX_FREE
        free = retire(self.directory, segment, reuse)
        if free is not None:
            with self.lock:
                self.free.append(free)

    def candidates(self, max_live_ratio: float) -> list[Segment]:
        """Sealed segments whose live bytes are at most ``max_live_ratio`` of their size,
        emptiest first."""
        with self.lock:
            chosen = [
                s
                for s in self.segments.values()
                if s.sealed and self.live[s.seq] <= max_live_ratio * s.size
            ]
            chosen.sort(key=lambda s: self.live[s.seq])
            return chosen

    # -- figures and closing -------------------------------------------------------------------

    def file_bytes(self) -> int:
        with self.lock:
            named = sum(s.size for s in self.segments.values())
            spares = sum(s.size for s in self.spares)
            return named + spares + len(self.free) * self.segment_size

    def live_bytes(self) -> int:
        with self.lock:
            return sum(self.live.values())

    def close(self) -> None:
        """Seal the heads durably (a clean close leaves no segment whose last block could be
        mistaken for a torn write), close every file, release the directory."""
        try:
            if not self.read_only:
                for head in (self.commit_head, self.copy_head):
                    if head is not None and not head.sealed:
                        self.seal(head)
                        self.sync(head)
                self.sync_sealed()
        finally:
            self.commit_head = self.copy_head = None
            for segment in [*self.segments.values(), *self.spares]:
                os.close(segment.fd)
            self.segments.clear()
            self.spares.clear()
            self._lockfile.close()
