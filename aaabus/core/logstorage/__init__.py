"""LogStorage: a ZODB storage shaped like the queue stores of industrial buses.

Each transaction is ONE block appended to a log of preallocated segment files with ONE write
and ONE ``fdatasync``; an in-memory index maps each object to its current record; a
background compactor copies the few live records out of old segments and recycles them, and
drops objects no longer reachable from the root. Disk use follows the live data, not the
history. This docstring is the reference for the format and the rules; the modules say how.

Modules: :mod:`.format` (bytes), :mod:`.segments` (files), :mod:`.recovery` (opening),
:mod:`.log` (shared state and locks), :mod:`.storage` (the ZODB API), :mod:`.compactor` and
:mod:`.garbage` (reclaiming space).

Files
=====
One directory holds ``lock`` (taken with zc.lockfile as FileStorage does: a second process is
refused with :class:`StoreInUse`), named segments ``<seq>.seg`` (seq: 8 hex digits; a new
segment's seq is above the seq of every file present, so the bytes a recycled file keeps from
its earlier lives never carry the seq of its current one), recycled files ``free-<seq>.seg``
waiting for reuse (content meaningless), and, after a crash, ``*.seg.tmp`` creations that never
completed (deleted at open).

A segment's size is fixed when it is created (``segment_size``, 4 MiB by default; a transaction
larger than that gets a segment of its own size) and never changes: new files are zero-filled
and synced under a ``.tmp`` name, a recycled file keeps its blocks. Its header is written and
synced, then the file is renamed to its name and the directory synced: a named segment always
has a whole header, and an ``fdatasync`` after a commit never has file metadata to write.
Zero-filled rather than fallocate'd: on ext4 the first write into an fallocate'd extent
converts it (metadata, hence a journal commit in the fdatasync); ``python -m perf commit``
measures both (``floor`` against ``floor_falloc``).

Bytes on disk (integers big-endian)
===================================
Segment header, bytes 0-63::

    0   8  magic b"AAALOGSG"
    8   2  format version (1)
    10  2  zero
    12  4  seq (equals the file name's)
    16  8  file size
    24  8  tid watermark: last committed tid when the segment was prepared
    32  8  oid watermark: next oid to allocate then
    40  20 zero
    60  4  crc32 of bytes 0-59

Blocks follow from byte 64, back to back. A block is what one write puts on disk::

    0   4  magic b"ABLK"
    4   4  seq of the segment (so bytes left by an earlier life of a recycled file never pass)
    8   1  kind: 1 commit, 2 copy, 3 seal, 4 abort
    9   3  zero
    12  4  body length L
    16  8  tid: commit: the transaction's; seal: the last committed; abort: the aborted one;
           copy: zero
    24  L  body
    24+L 4 crc32 of bytes 0 .. 24+L-1       } the commit mark: a block counts only
    28+L 4 b"DONE"                           } when these are whole and right

Commit and copy bodies are data records, back to back, tiling the body exactly::

    0   8  oid
    8   8  tid of this revision (a commit's own tid; a copy keeps the original's)
    16  8  position of the previous revision's record (0: none); a position is
           seq << 32 | byte offset of the record in its segment
    24  4  data length D
    28  D  the data (ZODB's pickles)

A seal body is the oid watermark (8 bytes); an abort body is empty. Every head keeps room for
a seal and an abort block after its last block.

zlib.crc32 checksums: in the standard library, C speed (well under a microsecond for a bus
hop's ~700 bytes, so the commit path does not feel it), it catches every burst error up to 32
bits and misses random damage with odds of 2**-32. What it must catch is a torn write or
damaged sectors, not an adversary: whoever can write the directory can forge any checksum.

Commit protocol (one transaction at a time: the commit lock, from tpc_begin to tpc_finish or
tpc_abort)
==============
* ``tpc_begin``: a tid above the last one (ZODB's newTid).
* ``store``: a serial other than the current revision's tid is a ConflictError (no conflict
  resolution: the bus has one writer, which never conflicts).
* ``tpc_vote``: the records and the commit mark are built into one buffer; if it does not fit
  in the commit head (with the reserve), the head is sealed (a seal block, synced later by the
  compactor: not on the commit path) and a spare segment the compactor prepared becomes the
  head. Then ONE ``os.pwritev`` and ONE ``os.fdatasync``. Here and not in tpc_finish: ZODB's
  two-phase commit lets a participant veto in tpc_vote and forbids failing after a successful
  vote, so a disk error must surface in tpc_vote, where the whole transaction aborts cleanly.
  After a write error nothing more is appended (the head's tail is unknown): further commits
  raise OSError until the store is reopened.
* ``tpc_finish``: no I/O, cannot fail: the index points at the new records, under the index
  lock, and ZODB's callback runs in the same critical section.
* ``tpc_abort`` after a successful vote (another participant vetoed): an abort block naming
  the tid, written and synced right after the voted block (its room was reserved).

Durability: when tpc_vote returns, the block is on disk; so when tpc_finish returns, the
transaction is. A crash between the two leaves a whole block and no abort: it is kept at
recovery (presumed committed: never acknowledged, like a crash just after tpc_finish).

Opening: recovery rules
=======================
Segments are read in seq order. A header that fails its magic, checksum, version, seq or size
refuses the open: :class:`LogStoreDamaged`, one line naming the file and byte offset.
A segment's blocks are read from byte 64 until a seal block, or until the first place where no
whole block of this segment starts (wrong magic or seq, a length past the file's end, a missing
tag, a wrong checksum).

Torn tail or damage: writes are sequential (a block is written only after the previous write
returned) and each write is one block. So if ANY whole block of this segment (magic, seq,
checksum) starts anywhere after the failing place, the failing bytes were written before an
acknowledged write and were damaged since: the open is refused, one line naming the file and
the failing block's offset, nothing changed on disk. Otherwise the failing bytes are the last
write, interrupted (never acknowledged, as its fdatasync had not returned), and are dropped
silently (logged at INFO). The limit of the rule: damage to the very last block of a segment
whose seal never reached the disk looks exactly like a torn write and drops that block. Heads
are sealed at every rotation, at every clean close and at every open, so after a clean close
no committed block is in that position; only a crash leaves one, and then a torn write is what
its damage most likely is.

Index: for each oid the record with the highest tid wins (a compaction copy keeps its tid, so
it never shadows a later commit, and equals its original). A commit block followed by an abort
block with its tid is skipped. The last tid and the next oid are the highest seen in blocks,
records and watermarks (oids are never reused, even once their objects were collected).
Segments left unsealed (a crash) are sealed at the end of their readable blocks, over any torn
bytes, and synced; empty ones are kept as spares.

Side records
============
Records that are not ZODB objects share the format: their oid is a key whose first byte is
``0xFF`` (:data:`.format.SIDE_PREFIX`; ZODB's oids count up from 1 and never reach it). The bus
keeps its queues and clocks there (:mod:`aaabus.core.journal`). ``write_side(txn, records,
forget)`` adds them to an open transaction, so they are written in the same block as ZODB's
records of that transaction, or alone in a transaction that the caller began itself; the keys in
``forget`` leave the index at ``tpc_finish`` and nothing is written for them (their last record
is dead from then on, reclaimed with its segment; until then a reopen indexes it again, which is
why the journal judges what it reads at boot). Side keys never count towards the next oid, are
never collected as garbage (nothing in ZODB refers to them) and are not listed by
``record_iternext``; ``side_records()`` reads them all (a boot), ``forget_side(keys)`` drops keys
outside a transaction.

Reads and history
=================
The index keeps, per object, only the current record's position, length and tid. ``load`` and
``loadBefore(oid, tid)`` for a tid past the current revision (every load the bus makes: one
connection, always up to date) read it with one ``pread``. An older revision (another
connection's snapshot, after a concurrent commit) is found by following the records' back
pointers while the segments holding them still exist; once compaction recycled the one needed,
``ReadConflictError``: the same answer ZODB's MVCC adapter gives when a concurrent pack removed
a revision, so that reader's transaction is retried. ``loadSerial`` and ``history`` walk the
same chain. There is no undo and no transaction iterator.

Compaction and GC (thread ``aaabus-logstore-compactor``)
========================================================
Dead records: a revision is dead once superseded, an object once unreachable from the root.
A sealed segment whose live bytes are at most ``live_ratio`` (0.5) of its size is compacted:
its live records are found from a copy of the index, appended verbatim as copy blocks to the
compactor's own head (one write, one fdatasync per block of at most 256 KiB), and only then do
the index entries still pointing at them switch, under the index lock, one block at a time;
the emptied segment goes to the free pool (two files kept, more deleted). Commits wait for
compaction only during those switches (a few microseconds per record).

GC pass: marks from the root through ZODB's ``referencesf`` on current records while commits go
on (objects committed during the pass are marked again from their new records; the last round
and the sweep share one critical section), then drops objects that this pass AND the previous
one found unreachable (an object unlinked in one transaction and linked again in a later one
survives if no pass ran in between; code that parks a persistent object outside the tree
across transactions must relink it before the next pass). A pass runs once the bytes committed
since the previous one reach twice the live bytes (at least two segments): it reads each live
record once (a ``pread`` and a ``referencesf``, a few microseconds), so its cost per committed
byte stays bounded, and it holds the index lock per record and for the last round.
``pack(t, referencesf)`` does all of it synchronously, without the grace pass: GC, then both
heads sealed, then every other segment compacted; ``t`` is ignored (there is no history to
pack to a time). ``stats()`` reports live and file bytes and the last compaction and GC pass.

Conformance
===========
ZODB's own storage suites (``ZODB.tests``) run against this storage in ``make test``:
``BasicStorage``, ``MTStorage``, ``Synchronization``, ``PersistentStorage``, ``ReadOnlyStorage``,
``ConflictResolution`` (conflicts detected, none resolved), ``PackableStorage`` and
``RevisionStorage`` (old revisions while their segments exist), on default and on 4 KiB
segments (compaction racing the suites' threads). Not the undo, iterator, recovery, history,
blob and FileStorage-index suites: no undo and no transaction history are kept, by design.
``tests/test_logstorage_zodb.py`` gives the reasons test by test.

Threads: the engine commits and loads; the compactor works beside it; any thread may load.
Locks: the commit lock (one transaction at a time), then the index lock (short sections, no
I/O but single-record preads); the compactor's own mutex is taken outside both.
"""

from aaabus.core.logstorage.recovery import LogStoreDamaged
from aaabus.core.logstorage.segments import StoreInUse
from aaabus.core.logstorage.storage import DEFAULT_SEGMENT_SIZE, LogStorage

__all__ = ["DEFAULT_SEGMENT_SIZE", "LogStorage", "LogStoreDamaged", "StoreInUse"]
