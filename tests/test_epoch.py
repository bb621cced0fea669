"""The epoch record of a store (issue 42): written as a commit of its own, read back after a
reopen (the journal keeps it alive), copied by replication like any side record, and the history
that tells a follower whose last commit is not in its primary's history."""

from __future__ import annotations

from pathlib import Path

import pytest

from aaabus.core.epoch import NO_EPOCH, EpochRecord, read_epoch, write_epoch
from aaabus.core.logstorage import LogStorage
from aaabus.core.logstorage.format import Z64
from aaabus.core.store import LOG_DIR, open_store
from aaabus.errors import StoreError


def tid(n: int) -> bytes:
    return n.to_bytes(8, "big")


def test_a_store_without_a_record_is_at_epoch_zero(tmp_path: Path) -> None:
    storage = LogStorage(tmp_path / LOG_DIR)
    try:
        assert read_epoch(storage) == NO_EPOCH
    finally:
        storage.close()


def test_the_record_survives_a_reopen_as_a_server_store(tmp_path: Path) -> None:
    store = open_store("log", tmp_path, 0)  # a server store, with its journal's side records
    storage = store.storage
    assert isinstance(storage, LogStorage)
    record = NO_EPOCH.next(1, 0, storage.lastTransaction())
    written = write_epoch(storage, record)
    assert storage.lastTransaction() == written
    store.close()
    # The journal forgets side records it does not know at boot: not this one.
    store = open_store("log", tmp_path, 0)
    try:
        assert isinstance(store.storage, LogStorage)
        assert read_epoch(store.storage) == record
    finally:
        store.close()
    store = open_store("log", tmp_path, 0)
    try:
        assert isinstance(store.storage, LogStorage)
        assert read_epoch(store.storage).epoch == 1
    finally:
        store.close()


def test_the_history_holds_only_the_commits_the_takeover_kept() -> None:
    # Epoch 1 from tid 5, epoch 2 taken over by member 1 when it had tid 20.
    record = NO_EPOCH.next(1, 0, tid(5)).next(2, 1, tid(20))
    last = tid(40)
    assert record.holds(0, Z64, last)  # an empty store
    assert record.holds(0, tid(5), last) and not record.holds(0, tid(6), last)
    assert record.holds(1, tid(20), last)
    # A commit of epoch 1 made after the new primary's last one: another history.
    assert not record.holds(1, tid(21), last)
    assert record.holds(2, tid(40), last) and not record.holds(2, tid(41), last)
    assert not record.holds(3, tid(10), last)  # a newer epoch is no part of this history


def test_a_damaged_record_is_one_line() -> None:
    with pytest.raises(StoreError, match="epoch record is damaged") as err:
        EpochRecord.decode(b"{not json")
    assert "\n" not in str(err.value)
