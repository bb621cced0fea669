"""Background compaction of a log store, on the daemon thread ``aaabus-logstore-compactor``.

Each round (after a segment is sealed, or every ``IDLE_SECONDS``): make the seals written on the
commit path durable, keep one spare segment prepared (so that a commit that fills its head
never waits for a file to be zero-filled), run a GC pass when one is due, then compact every
sealed segment whose live bytes are at most ``live_ratio`` of its size, emptiest first.

Compacting a segment: read its live records (found by reading its blocks back), append them
verbatim (each keeps its tid and back pointer) as copy blocks to the compactor's own head with
one write and one fdatasync per block, and only then switch the index entries that still point
at the old places, under the index lock, one block (at most ``COPY_BLOCK_BYTES``) at a time.
When none is left, the segment is recycled into the free pool. Commits wait for the compactor
only during those switches; the compactor pauses between blocks so that the committing
thread gets the GIL back at once after its fdatasync.

``pack`` (any thread) does the same work synchronously, on every sealed segment, after sealing
both heads and running a GC pass without grace.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ZODB.serialize import referencesf as zodb_referencesf

from aaabus.core.logstorage.format import (
    BLOCK_HEAD,
    BLOCK_OVERHEAD,
    DATA_START,
    KIND_COMMIT,
    KIND_COPY,
    Z64,
    block_parts,
    iter_records,
    parse_block,
    position,
)
from aaabus.core.logstorage.garbage import (
    BREATHE_SECONDS,
    PassStopped,
    References,
    UnreadableRecord,
    breathe,
    collect,
)
from aaabus.core.logstorage.log import RH, Log
from aaabus.core.logstorage.recovery import damaged
from aaabus.core.logstorage.segments import Segment

log = logging.getLogger("aaabus.logstorage")

IDLE_SECONDS = 1.0
#: After an error, the compactor waits this long before trying again.
RETRY_SECONDS = 5.0
COPY_BLOCK_BYTES = 256 << 10
#: Spare segments kept prepared.
SPARES = 1
#: A GC pass is due once this many times the live bytes (and at least this many segments) have
#: been appended since the last one: a pass reads every live record once, so its cost per
#: committed byte stays bounded (at most 1/GC_EVERY of a read per byte written).
GC_EVERY = 2


class Compactor:
    """Compaction and GC of one :class:`Log`; ``start`` runs them on a background thread."""

    def __init__(self, log_: Log, *, live_ratio: float, gc: bool) -> None:
        self._log = log_
        self._live_ratio = live_ratio
        self._gc = gc
        #: One compaction at a time: the thread's rounds, or pack().
        self._mutex = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        #: Objects the last GC pass found unreachable and spared (dropped if the next agrees).
        self._grace: set[bytes] = set()
        self._gc_at = GC_EVERY * 2 * log_.segment_size
        self._figures: dict[str, Any] = {
            "compactions": 0,
            "last_compaction_at": None,
            "last_compaction_segments": 0,
            "last_compaction_copied_bytes": 0,
            "last_compaction_reclaimed_bytes": 0,
            "gc_passes": 0,
            "last_gc_at": None,
            "last_gc_collected": 0,
            "last_gc_seconds": 0.0,
            "last_error": None,
        }

    # -- thread ------------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(
            target=self._run, name="aaabus-logstore-compactor", daemon=True
        )
        self._thread.start()

    def busy(self) -> bool:
        """A compaction round, GC pass or pack is under way (any thread may ask)."""
        return self._mutex.locked()

    def wake(self) -> None:
        self._wake.set()

    def after_commit(self) -> None:
        """Committing thread, after each commit: wake the thread when a GC pass is due."""
        if self._log.appended >= self._gc_at and self._thread is not None:
            self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the thread after its current step (a copy block, a few traced records)."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("log store compactor did not stop within %.0f s", timeout)

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(IDLE_SECONDS)
            self._wake.clear()
            if self._stopping:
                return
            try:
                with self._mutex:
                    self._round()
            except Exception as exc:
                self._figures["last_error"] = f"{type(exc).__name__}: {exc}"
                log.exception("log store %s: compaction failed", self._log.directory)
                deadline = time.monotonic() + RETRY_SECONDS
                while not self._stopping and time.monotonic() < deadline:
                    self._wake.wait(deadline - time.monotonic())
                    self._wake.clear()

    def _round(self) -> None:
        log_ = self._log
        log_.sync_sealed()
        while len(log_.spares) < SPARES and not self._stopping:
            log_.add_spare()
        if self._gc and log_.appended >= self._gc_at:
            self._collect(zodb_referencesf, grace=True)
        self._compact_all(log_.candidates(self._live_ratio))
        self._gc_at = GC_EVERY * max(log_.live_bytes(), 2 * log_.segment_size)

    # -- work --------------------------------------------------------------------------------

    def collect(self, refs: References, grace: bool) -> None:
        """One GC pass, now, in the calling thread."""
        with self._mutex:
            self._collect(refs, grace)

    def _collect(self, refs: References, grace: bool) -> None:
        started = time.monotonic()
        self._log.appended = 0
        try:
            dropped, spared = collect(
                self._log, refs, self._grace if grace else None, lambda: self._stopping
            )
        except PassStopped:
            return
        except UnreadableRecord as exc:
            if not grace:
                raise
            # Not a ZODB database (raw records): nothing can be known reachable. Say so once
            # per pass; compaction of superseded records goes on.
            log.warning("log store %s: GC pass skipped: %s", self._log.directory, exc)
            return
        self._grace = spared
        self._figures.update(
            gc_passes=self._figures["gc_passes"] + 1,
            last_gc_at=time.time(),
            last_gc_collected=dropped,
            last_gc_seconds=round(time.monotonic() - started, 6),
        )

    def _compact_all(self, segments: list[Segment]) -> None:
        copied = reclaimed = done = 0
        for segment in segments:
            if self._stopping:
                break
            moved = self._compact(segment, self._live_in(segment))
            copied += moved
            reclaimed += segment.end - DATA_START - moved
            done += 1
        if done:
            self._figures.update(
                compactions=self._figures["compactions"] + done,
                last_compaction_at=time.time(),
                last_compaction_segments=done,
                last_compaction_copied_bytes=copied,
                last_compaction_reclaimed_bytes=reclaimed,
            )

    def _live_in(self, segment: Segment) -> list[tuple[bytes, int, int]]:
        """(oid, position, data length) of the current records of a sealed segment: its blocks
        are read back (a sealed segment no longer changes; their checksums are checked again)
        and the index is asked about each record (one dict lookup, atomic: no lock). The cost
        follows the segment's size, not the store's."""
        log_ = self._log
        seq = segment.seq
        buf = os.pread(segment.fd, segment.end, 0)
        index_get = log_.index.get
        found = []
        offset = DATA_START
        seen = 0
        while offset < segment.end:
            block = parse_block(buf, offset, seq)
            if block is None:
                raise damaged(
                    segment.path, offset, "a block fails its checks since the store opened"
                )
            if block.kind in (KIND_COMMIT, KIND_COPY):
                for record in iter_records(buf, block):
                    pos = position(seq, record.offset)
                    entry = index_get(record.oid)
                    if entry is not None and entry[0] == pos:
                        found.append((record.oid, pos, record.data_len))
                    seen += 1
                    breathe(seen)
            offset = block.end
        return found

    def _compact(self, segment: Segment, records: list[tuple[bytes, int, int]]) -> int:
        """Copy the live records of a sealed ``segment`` forward, then recycle it; returns the
        bytes switched to the copies."""
        log_ = self._log
        moved = 0
        start = 0
        while start < len(records):
            end = start
            size = 0
            while end < len(records) and (end == start or size < COPY_BLOCK_BYTES):
                size += RH + records[end][2]
                end += 1
            moved += self._copy(records[start:end], size)
            start = end
            time.sleep(BREATHE_SECONDS)
        log_.retire(segment)
        return moved

    def _copy(self, records: list[tuple[bytes, int, int]], body_len: int) -> int:
        """One copy block: written and synced, then switched."""
        log_ = self._log
        body: list[bytes] = []
        for _oid, pos, length in records:
            raw = log_.read(pos, RH + length, 0)
            if raw is None:
                raise AssertionError("a sealed segment vanished while being compacted")
            body.append(raw)
        total = BLOCK_OVERHEAD + body_len
        head = log_.copy_head = log_.head_for(log_.copy_head, total)
        offset = log_.write_block(
            head, block_parts(KIND_COPY, head.seq, Z64, body, body_len), total
        )
        base = offset + BLOCK_HEAD.size
        moves = []
        for (oid, pos, length), raw in zip(records, body, strict=True):
            moves.append((oid, pos, position(head.seq, base), length))
            base += len(raw)
        return log_.switch(moves, head.seq)

    def pack(self, refs: References | None, commit_lock: threading.Lock) -> None:
        """Synchronous full GC (no grace) and compaction of every segment but the new heads."""
        log_ = self._log
        with self._mutex:
            if refs is not None:
                self._collect(refs, grace=False)
            with commit_lock:
                head = log_.commit_head
                if head is not None:
                    log_.seal(head)
                    log_.sync(head)
                    log_.commit_head = None
            head = log_.copy_head
            if head is not None:
                log_.seal(head)
                log_.sync(head)
                log_.copy_head = None
            log_.sync_sealed()
            self._compact_all(log_.candidates(1.0))

    def figures(self) -> dict[str, Any]:
        return dict(self._figures)
