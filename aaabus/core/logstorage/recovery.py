"""Opening a store directory: read every segment, check it, and rebuild the in-memory index.

Runs once, in the thread that opens the storage, before any other thread exists. Damage is one
:class:`LogStoreDamaged` line naming the file and the byte offset; an interrupted last write of
a segment that was never sealed is dropped (it was never acknowledged) and logged at INFO.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from aaabus.core.logstorage.format import (
    DATA_START,
    KIND_ABORT,
    KIND_COMMIT,
    KIND_COPY,
    KIND_SEAL,
    Z64,
    FormatError,
    decode_segment_header,
    is_side,
    iter_records,
    position,
    scan_segment,
    seal_next_oid,
)
from aaabus.core.logstorage.segments import FREE_PREFIX, SUFFIX, Segment, parse_name
from aaabus.errors import LogStoreDamaged

log = logging.getLogger("aaabus.logstorage")

#: oid -> (position of the record, length of its data, tid). Positions: see format.position.
Entry = tuple[int, int, bytes]


@dataclass
class Recovered:
    index: dict[bytes, Entry] = field(default_factory=dict)
    #: Named segments by seq (open; sealed ones flagged).
    segments: dict[int, Segment] = field(default_factory=dict)
    #: Segments left unsealed by the last run (crash): the caller seals them, or reuses them as
    #: heads when they hold no block at all.
    unsealed: list[Segment] = field(default_factory=list)
    free: list[Path] = field(default_factory=list)
    last_tid: bytes = Z64
    next_oid: int = 1
    next_seq: int = 1
    #: Segments whose interrupted last write was dropped: seq -> byte offset.
    torn: dict[int, int] = field(default_factory=dict)


def damaged(path: Path, offset: int, what: str) -> LogStoreDamaged:
    return LogStoreDamaged(
        f"log store segment {path} is damaged at byte {offset}: {what}; restore the store "
        "directory from a backup (nothing was changed)"
    )


def recover(directory: Path, read_only: bool, segment_size: int) -> Recovered:
    """Read the directory's segments in seq order and rebuild the index (see the package
    docstring for the rules). Unknown files are left alone; interrupted creations are removed."""
    out = Recovered()
    named: list[tuple[int, Path]] = []
    max_seq = 0
    for entry in os.scandir(directory):
        name = entry.name
        if name.endswith(SUFFIX + ".tmp"):
            if not read_only:
                os.unlink(entry.path)
            continue
        if name.startswith(FREE_PREFIX) and name.endswith(SUFFIX):
            seq = parse_name(name[len(FREE_PREFIX) :])
            if seq is not None:
                max_seq = max(max_seq, seq)
                if entry.stat().st_size == segment_size:
                    out.free.append(Path(entry.path))
                elif not read_only:
                    os.unlink(entry.path)
            continue
        seq = parse_name(name)
        if seq is not None:
            named.append((seq, Path(entry.path)))
            max_seq = max(max_seq, seq)
    out.next_seq = max_seq + 1
    flags = os.O_RDONLY if read_only else os.O_RDWR
    try:
        for seq, path in sorted(named):
            _read_segment(out, seq, path, flags)
    except BaseException:
        for segment in out.segments.values():
            os.close(segment.fd)
        raise
    return out


def _read_segment(out: Recovered, seq: int, path: Path, flags: int) -> None:
    fd = os.open(path, flags)
    try:
        size = os.fstat(fd).st_size
        buf = os.pread(fd, size, 0)
        try:
            header = decode_segment_header(buf[:DATA_START])
        except FormatError as exc:
            raise damaged(path, exc.offset, exc.what) from None
        if header.seq != seq:
            raise damaged(path, 0, f"its header names segment {header.seq}")
        if header.size != size:
            # Segments never change size once named (zero-filled and synced before): only
            # something other than a crash (a copy, a truncation) makes them shorter or longer.
            raise damaged(
                path,
                min(size, header.size),
                f"the file has {size} bytes, its header says "
                f"{header.size} (cut or extended after it was written)",
            )
        try:
            scan = scan_segment(buf, seq)
            _apply_blocks(out, seq, buf, scan.blocks)
        except FormatError as exc:
            raise damaged(path, exc.offset, exc.what) from None
    except BaseException:
        os.close(fd)
        raise
    out.last_tid = max(out.last_tid, header.tid_mark)
    out.next_oid = max(out.next_oid, header.next_oid)
    segment = Segment(seq, path, fd, size, scan.end, sealed=scan.sealed)
    out.segments[seq] = segment
    if not scan.sealed:
        out.unsealed.append(segment)
    if scan.torn:
        out.torn[seq] = scan.end
        log.info("log store: dropped the interrupted last write of %s at byte %d", path, scan.end)


def _apply_blocks(out: Recovered, seq: int, buf: bytes, blocks: list) -> None:
    """Index the records of ``blocks``: for each oid the revision with the highest tid wins
    (a compaction copy keeps its tid, so it never shadows a later commit)."""
    index = out.index
    for i, block in enumerate(blocks):
        kind = block.kind
        if kind == KIND_SEAL:
            out.last_tid = max(out.last_tid, block.tid)
            out.next_oid = max(out.next_oid, seal_next_oid(buf, block))
            continue
        if kind == KIND_ABORT:
            continue
        if kind == KIND_COMMIT:
            following = blocks[i + 1] if i + 1 < len(blocks) else None
            # An abort block right after a voted transaction cancels it (tpc_abort after a
            # successful tpc_vote; the commit lock keeps them adjacent).
            if following is not None and (following.kind, following.tid) == (KIND_ABORT, block.tid):
                continue
            out.last_tid = max(out.last_tid, block.tid)
        elif kind != KIND_COPY:
            continue
        for record in iter_records(buf, block):
            if kind == KIND_COMMIT and record.tid != block.tid:
                raise FormatError(record.offset, "a record's tid differs from its transaction's")
            oid_int = int.from_bytes(record.oid, "big")
            if oid_int >= out.next_oid and not is_side(record.oid):
                out.next_oid = oid_int + 1
            if record.tid > out.last_tid:
                out.last_tid = record.tid
            current = index.get(record.oid)
            if current is None or record.tid > current[2]:
                index[record.oid] = (
                    position(seq, record.offset),
                    record.data_len,
                    record.tid,
                )
