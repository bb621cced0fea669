"""The bytes of a log store on disk: segment headers, blocks, data records, and the scan that
tells a torn tail from damage (the layout is described byte by byte in the package docstring).

Pure functions over bytes: no file, no lock, no thread. What fails is reported with the byte
offset where it fails; the caller names the file.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from typing import NamedTuple

from aaabus.errors import FormatError

SEGMENT_MAGIC = b"AAALOGSG"
FORMAT_VERSION = 1
#: magic, version, reserved, seq, file size, tid watermark, oid watermark, 20 zero bytes, crc32.
SEGMENT_HEADER = struct.Struct(">8sHHIQ8s8s20xI")
#: Where the first block of a segment starts (the header, padded to 64 bytes).
DATA_START = 64

BLOCK_MAGIC = b"ABLK"
#: magic, segment seq, kind, 3 zero bytes, body length, tid.
BLOCK_HEAD = struct.Struct(">4sIB3xI8s")
#: The commit mark that closes every block: crc32 of head and body, then a fixed tag.
BLOCK_MARK = struct.Struct(">I4s")
MARK_TAG = b"DONE"
BLOCK_OVERHEAD = BLOCK_HEAD.size + BLOCK_MARK.size

#: oid, tid of this revision, position of the previous revision (0: none), data length.
RECORD_HEAD = struct.Struct(">8s8sQI")

KIND_COMMIT = 1  # one transaction: its data records; tid = the transaction's id
KIND_COPY = 2  # live records moved by compaction, each keeping its own tid; tid = zeros
KIND_SEAL = 3  # end of the segment's life as a head; tid = last committed tid; body = next oid
KIND_ABORT = 4  # the voted transaction just before was aborted; tid = its id; empty body
_KINDS = frozenset((KIND_COMMIT, KIND_COPY, KIND_SEAL, KIND_ABORT))

SEAL_BODY = struct.Struct(">Q")
SEAL_SIZE = BLOCK_OVERHEAD + SEAL_BODY.size
ABORT_SIZE = BLOCK_OVERHEAD

Z64 = b"\0" * 8

#: First byte of a side record's key (:meth:`LogStorage.write_side`): records that are not ZODB
#: objects (the bus's queue entries and clock pages, :mod:`aaabus.core.journal`). ZODB's oids
#: are allocated upwards from 1 and never come near it; recovery leaves such keys out of the
#: next oid, and garbage collection never drops them (nothing in ZODB refers to them).
SIDE_PREFIX = 0xFF


def is_side(oid: bytes) -> bool:
    """Whether ``oid`` is a side record's key rather than a ZODB object's."""
    return oid[0] == SIDE_PREFIX


#: Positions pack a segment's seq and a byte offset in it into one int: seq << 32 | offset.
OFFSET_BITS = 32
OFFSET_MASK = (1 << OFFSET_BITS) - 1
MAX_SEGMENT_SIZE = 1 << OFFSET_BITS


class SegmentHeader(NamedTuple):
    seq: int
    size: int
    tid_mark: bytes
    next_oid: int


class Block(NamedTuple):
    offset: int
    kind: int
    tid: bytes
    body_start: int
    body_len: int
    end: int


class Record(NamedTuple):
    offset: int  # of the record header, in the segment
    oid: bytes
    tid: bytes
    prev: int
    data_len: int


class SegmentScan(NamedTuple):
    blocks: list[Block]
    #: Where the readable blocks end: the next append offset.
    end: int
    sealed: bool
    #: True when the bytes at ``end`` began a block of this segment that did not complete.
    torn: bool


def position(seq: int, offset: int) -> int:
    return seq << OFFSET_BITS | offset


def encode_segment_header(header: SegmentHeader) -> bytes:
    fields = (
        SEGMENT_MAGIC,
        FORMAT_VERSION,
        0,
        header.seq,
        header.size,
        header.tid_mark,
        header.next_oid.to_bytes(8, "big"),
    )
    unsigned = SEGMENT_HEADER.pack(*fields, 0)
    crc = zlib.crc32(unsigned[: SEGMENT_HEADER.size - 4])
    return SEGMENT_HEADER.pack(*fields, crc).ljust(DATA_START, b"\0")


def decode_segment_header(raw: bytes) -> SegmentHeader:
    """The header at the start of a segment file; FormatError (offset 0) when it is not one."""
    if len(raw) < SEGMENT_HEADER.size:
        raise FormatError(0, f"segment header cut short ({len(raw)} bytes)")
    magic, version, _reserved, seq, size, tid_mark, next_oid, crc = SEGMENT_HEADER.unpack_from(raw)
    if magic != SEGMENT_MAGIC:
        raise FormatError(0, "not a log store segment (bad magic)")
    if zlib.crc32(raw[: SEGMENT_HEADER.size - 4]) != crc:
        raise FormatError(0, "segment header fails its checksum")
    if version != FORMAT_VERSION:
        raise FormatError(0, f"segment format version {version}, this code reads {FORMAT_VERSION}")
    return SegmentHeader(seq, size, tid_mark, int.from_bytes(next_oid, "big"))


def block_parts(kind: int, seq: int, tid: bytes, body: list[bytes], body_len: int) -> list[bytes]:
    """A block as buffers for one ``os.pwritev``: head and body joined, then the commit mark.

    ``body_len`` must be the total length of ``body`` (the caller knows it without a pass).
    """
    joined = b"".join([BLOCK_HEAD.pack(BLOCK_MAGIC, seq, kind, body_len, tid), *body])
    return [joined, BLOCK_MARK.pack(zlib.crc32(joined), MARK_TAG)]


def seal_block(seq: int, tid_mark: bytes, next_oid: int) -> bytes:
    return b"".join(block_parts(KIND_SEAL, seq, tid_mark, [SEAL_BODY.pack(next_oid)], 8))


def abort_block(seq: int, tid: bytes) -> bytes:
    return b"".join(block_parts(KIND_ABORT, seq, tid, [], 0))


def parse_block(buf: bytes, offset: int, seq: int) -> Block | None:
    """The block of segment ``seq`` at ``offset``, or None when there is no whole one there.

    Whole means: magic, this segment's seq (bytes left by an earlier life of a recycled file
    carry another), a known kind, a length inside the buffer, the tag and the checksum.
    """
    size = len(buf)
    if offset + BLOCK_OVERHEAD > size:
        return None
    magic, block_seq, kind, body_len, tid = BLOCK_HEAD.unpack_from(buf, offset)
    if magic != BLOCK_MAGIC or block_seq != seq or kind not in _KINDS:
        return None
    body_start = offset + BLOCK_HEAD.size
    mark = body_start + body_len
    if mark + BLOCK_MARK.size > size:
        return None
    crc, tag = BLOCK_MARK.unpack_from(buf, mark)
    if tag != MARK_TAG or crc != zlib.crc32(memoryview(buf)[offset:mark]):
        return None
    return Block(offset, kind, tid, body_start, body_len, mark + BLOCK_MARK.size)


def find_block(buf: bytes, start: int, seq: int) -> int | None:
    """Offset of the first whole block of segment ``seq`` at or after ``start``, if any."""
    pattern = BLOCK_MAGIC + seq.to_bytes(4, "big")
    at = buf.find(pattern, start)
    while at != -1:
        if parse_block(buf, at, seq) is not None:
            return at
        at = buf.find(pattern, at + 1)
    return None


def scan_segment(buf: bytes, seq: int) -> SegmentScan:
    """Read the blocks of segment ``seq`` (``buf`` is the whole file) up to its end.

    The end is a seal block, or the first place where no whole block starts. There, the rule
    that tells a torn tail from damage: every write is one block appended after the previous
    one, and the next write starts only after the previous one returned; so if any whole block
    of this segment exists beyond the failing place, the failing bytes were written before an
    acknowledged write and then damaged: FormatError. Otherwise the failing bytes are the last
    write, interrupted (or nothing was ever written there), and the scan ends there.
    """
    blocks: list[Block] = []
    offset = DATA_START
    while True:
        block = parse_block(buf, offset, seq)
        if block is None:
            break
        blocks.append(block)
        offset = block.end
        if block.kind == KIND_SEAL:
            return SegmentScan(blocks, offset, True, False)
    later = find_block(buf, offset + 1, seq)
    if later is not None:
        raise FormatError(
            offset, f"the block there is damaged while a whole block follows at byte {later}"
        )
    head = buf[offset : offset + 8]
    torn = head == BLOCK_MAGIC + seq.to_bytes(4, "big")
    return SegmentScan(blocks, offset, False, torn)


def iter_records(buf: bytes, block: Block) -> Iterator[Record]:
    """The data records of a commit or copy block; FormatError if they do not tile its body."""
    offset = block.body_start
    end = block.body_start + block.body_len
    while offset < end:
        if offset + RECORD_HEAD.size > end:
            raise FormatError(offset, "a data record header overruns its block")
        oid, tid, prev, data_len = RECORD_HEAD.unpack_from(buf, offset)
        if offset + RECORD_HEAD.size + data_len > end:
            raise FormatError(offset, "a data record overruns its block")
        yield Record(offset, oid, tid, prev, data_len)
        offset += RECORD_HEAD.size + data_len


def seal_next_oid(buf: bytes, block: Block) -> int:
    if block.body_len != SEAL_BODY.size:
        raise FormatError(block.offset, "a seal block of the wrong length")
    (next_oid,) = SEAL_BODY.unpack_from(buf, block.body_start)
    return int(next_oid)
