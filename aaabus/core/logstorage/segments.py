"""Segment files: naming, preallocation, recycling, and the directory's lock.

A segment is named ``<seq as 8 hex digits>.seg`` only once its header is on disk, so a named
segment always has a whole header. Files named ``free-*.seg`` are recycled segments waiting
to be reused (their content means nothing); ``*.tmp`` files are creations that a crash
interrupted. Whichever thread calls these functions does the I/O; callers hold no lock
across them (see :mod:`aaabus.core.logstorage.log`).

New segments are zero-filled, not ``fallocate``'d: on ext4 an fallocate'd range is "unwritten"
and the first write into each extent converts it, a metadata change that makes the commit's
``fdatasync`` commit the journal too. ``python -m perf commit`` measures both side by side
(``floor`` and ``floor_falloc``, 600-byte appends): over six runs on the development VM (ext4
on virtio) the medians were within 8 % of each other, while the p90 of the zero-filled file
was always lower (98-173 µs against 178-290 µs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zc.lockfile

from aaabus.core.logstorage.format import DATA_START, SegmentHeader, encode_segment_header
from aaabus.errors import StoreInUse

SUFFIX = ".seg"
FREE_PREFIX = "free-"
LOCK_NAME = "lock"
#: Zero-filling goes by chunks of this size, each synced before the next.
_ZEROS = b"\0" * (256 << 10)


@dataclass(eq=False)
class Segment:
    """One open segment file. ``end`` is where the next block goes; only the thread that owns
    the segment as its head moves it (the committing thread, or the compactor)."""

    seq: int
    path: Path
    fd: int
    size: int
    end: int
    #: No block may be appended any more (a seal block is written, or it will be at boot).
    sealed: bool = False
    #: The seal (or last block) still needs an fdatasync (done off the commit path).
    unsynced: bool = False

    def room(self) -> int:
        return self.size - self.end


def segment_name(seq: int) -> str:
    return f"{seq:08x}{SUFFIX}"


def parse_name(name: str) -> int | None:
    """The seq of a segment file name, or None for any other name."""
    stem = name[: -len(SUFFIX)] if name.endswith(SUFFIX) else None
    if stem is None or len(stem) != 8:
        return None
    try:
        return int(stem, 16)
    except ValueError:
        return None


def lock_directory(directory: Path) -> zc.lockfile.LockFile:
    try:
        lock = zc.lockfile.LockFile(str(directory / LOCK_NAME))
    except zc.lockfile.LockError:
        raise StoreInUse(
            f"log store {directory} is in use by another process; stop that process or open "
            "another directory"
        ) from None
    # zc.lockfile creates it under the process umask; every file of a store is private.
    os.chmod(directory / LOCK_NAME, 0o600, follow_symlinks=False)
    return lock


def fsync_directory(directory: Path) -> None:
    """Make renames and creations in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def zero_fill(fd: int, size: int) -> None:
    """Write zeros over ``size`` bytes and sync: every extent is then allocated AND written.

    Synced chunk by chunk: a commit's fdatasync on another file waits behind whatever the
    disk is flushing, so one large flush here would stall it for tens of milliseconds."""
    offset = 0
    while offset < size:
        offset += os.pwrite(fd, memoryview(_ZEROS)[: min(len(_ZEROS), size - offset)], offset)
        os.fdatasync(fd)
    os.fsync(fd)


def create_file(directory: Path, seq: int, size: int) -> Path:
    """A new zero-filled file of ``size`` bytes, still under a temporary name (returned)."""
    path = directory / f"{segment_name(seq)}.tmp"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)  # the store is private
    try:
        zero_fill(fd, size)
    except OSError:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    os.close(fd)
    return path


def install(directory: Path, source: Path, header: SegmentHeader) -> Segment:
    """Turn ``source`` (a fresh or recycled file of ``header.size`` bytes) into named segment
    ``header.seq``: header written and synced, then renamed, then the rename made durable."""
    fd = os.open(source, os.O_RDWR)
    try:
        os.pwrite(fd, encode_segment_header(header), 0)
        os.fdatasync(fd)
        path = directory / segment_name(header.seq)
        os.rename(source, path)
        fsync_directory(directory)
    except OSError:
        os.close(fd)
        raise
    return Segment(header.seq, path, fd, header.size, DATA_START)


def retire(directory: Path, segment: Segment, reuse: bool) -> Path | None:
    """Close a segment no index entry points into; rename it into the free pool (returned) or,
    when ``reuse`` is false (an odd size), delete it. No fsync: if the rename is lost in a crash
    the segment comes back at boot and its records are found superseded or copied."""
    os.close(segment.fd)
    if not reuse:
        segment.path.unlink(missing_ok=True)
        return None
    free = directory / f"{FREE_PREFIX}{segment.path.name}"
    os.rename(segment.path, free)
    return free
