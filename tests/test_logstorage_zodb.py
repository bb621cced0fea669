"""ZODB's own storage conformance suites (``ZODB.tests``), run against LogStorage.

They are assembled as ``ZODB/tests/testFileStorage.py`` and ``testMappingStorage.py`` assemble
them. What applies, and what does not:

Apply, in full:
  * ``BasicStorage`` (with ``RaceTests``: load/commit races, several connections at once);
  * ``MTStorage`` (storage-level and ZODB-level client threads committing together);
  * ``SynchronizedStorage`` (calls outside or across transactions are refused);
  * ``PersistentStorage`` (everything is there after close and reopen);
  * ``ReadOnlyStorage`` (``read_only=True`` refuses every write);
  * ``ConflictResolvingStorage``: conflicts are detected and raised; LogStorage resolves none
    (``_p_resolveConflict`` needs the committed old state, and the bus has one writer, which
    never conflicts), so only its ``test*`` methods, which expect ConflictError, run.

Apply in part:
  * ``PackableStorage``: packing (to any time) while writing, packing an empty store, and
    multi-database references apply. The tests that load superseded revisions with
    ``loadSerial`` before packing (``testPackAllRevisions``, ``testPackJustOldRevisions``,
    ``testPackOnlyOneObject``, ``testPackAllRevisionsNoGC``) also pass: revisions are served
    while their segments exist, and pack recycles them all. ``PackableUndoStorage`` needs undo.
  * ``RevisionStorage``: loadSerial/loadBefore of older revisions pass because a store this small
    is never compacted; LogStorage keeps no history on purpose (it serves an old revision only
    while the segment holding it has not been recycled, else ReadConflictError), so these run
    as a check of the back-pointer walk, not as a promise. ``testLoadBeforeUndo`` needs undo.

The racing tests that need a second storage client (``_new_storage_client``: ZEO and the
like) are left out: a log store has one process.

A test that does not apply is removed from the class (the attribute set to ``None``, which
unittest's loader does not collect), not skipped: the suite's report lists only what ran.

Do not apply:
  * ``HistoryStorage``: history() returns the revisions still on disk, but transaction user
    names and descriptions are not stored (the bus sets none; storing them costs every commit).
  * ``TransactionalUndoStorage``, ``PackableUndoStorage``, ``ConflictResolvingTransUndoStorage``:
    no undo (no history is kept).
  * ``IteratorStorage``, ``ExtendedIteratorStorage``, ``RecoveryStorage``: they iterate over
    past transactions (``iterator()``, ``restore``); compaction rewrites the log, so there is no
    transaction history to iterate.
  * ``Corruption`` (FileStorage's index file) and the blob suites: no index file, no blobs.
"""

from __future__ import annotations

from typing import Any

from ZODB.tests import (
    BasicStorage,
    ConflictResolution,
    MTStorage,
    PackableStorage,
    PersistentStorage,
    ReadOnlyStorage,
    RevisionStorage,
    StorageTestBase,
    Synchronization,
)

from aaabus.core.logstorage import LogStorage


class LogStorageConformance(
    StorageTestBase.StorageTestBase,
    BasicStorage.BasicStorage,
    MTStorage.MTStorage,
    Synchronization.SynchronizedStorage,
    PersistentStorage.PersistentStorage,
    ReadOnlyStorage.ReadOnlyStorage,
    ConflictResolution.ConflictResolvingStorage,
    PackableStorage.PackableStorageWithOptionalGC,
    RevisionStorage.RevisionStorage,
):
    """ZODB's suites; each test runs in its own temporary directory (StorageTestBase's setUp
    changes into one), the store in ``./logstore``."""

    def setUp(self) -> None:
        StorageTestBase.StorageTestBase.setUp(self)
        self.open()

    def open(self, **kwargs: Any) -> None:
        self._storage = LogStorage("logstore", **kwargs)

    # RevisionStorage's undo case: no undo.
    testLoadBeforeUndo = None
    # They need a second storage client (another process's view of the same store).
    test_race_load_vs_external_invalidate = None
    test_race_external_invalidate_vs_disconnect = None


class LogStorageConformanceSmallSegments(LogStorageConformance):
    """The same suites on 4 KiB segments: a few commits fill a segment, so heads rotate and the
    compactor copies and recycles segments while the suites' threads commit and load. GC is
    off (these suites store objects no root references and load them later), and the tests that
    read superseded revisions are left out: compaction may have recycled them, by design."""

    def open(self, **kwargs: Any) -> None:
        self._storage = LogStorage("logstore", segment_size=4096, gc=False, **kwargs)

    # They read superseded revisions, which compaction may have recycled, by design.
    testPackAllRevisions = None
    testPackJustOldRevisions = None
    testPackOnlyOneObject = None
    testPackAllRevisionsNoGC = None
    testLoadSerial = None
    testLoadBefore = None
    testLoadBeforeEdges = None
    testLoadBeforeOld = None
    testLoadBeforeConsecutiveTids = None
    testLoadBeforeCreation = None
    test_race_loadopen_vs_local_invalidate = None
