"""A store remembers the wire version of the bodies it queues: one written by another version
boots only if it holds no queued message (docs/operations.md, Upgrading a running bus)."""

from __future__ import annotations

from pathlib import Path

import pytest

from aaabus import AgentId, StoreError
from aaabus.core.store import open_store
from aaabus.wire.frames import VERSION
from aaabus.wire.message import Message

ME = AgentId(0, 0, 16)


def _as_written_by(path: Path, version: int | None, queued: int, kind: str = "file") -> None:
    """Make the store at ``path`` look written by wire ``version`` (None: before versions were
    recorded), holding ``queued`` messages in its input queue (a log store: as ZODB objects,
    the layout of the versions before the journal)."""
    store = open_store(kind, path, 0, journal=False)
    try:
        if version is None:
            del store.record.wire_version  # the class default: what older stores read as
        else:
            store.record.wire_version = version
        for i in range(queued):
            store.qin.put(Message(ME, ME, bytes([i])))
        store.commit()
    finally:
        store.close()


def test_a_new_store_records_this_wire_version(tmp_path: Path) -> None:
    store = open_store("file", tmp_path / "s0", 0)
    try:
        assert store.record.wire_version == VERSION
    finally:
        store.close()


@pytest.mark.parametrize("version", [None, VERSION - 1])
def test_an_older_store_with_queued_messages_is_refused_and_keeps_them(
    tmp_path: Path, version: int | None
) -> None:
    _as_written_by(tmp_path / "s0", version, queued=2)
    with pytest.raises(StoreError) as refused:
        open_store("file", tmp_path / "s0", 0)
    line = str(refused.value)
    assert "\n" not in line and "still holds 2 queued messages" in line and "drained" in line
    with pytest.raises(StoreError, match="still holds 2 queued"):  # refused again: kept
        open_store("file", tmp_path / "s0", 0)


def test_an_older_log_store_refused_keeps_its_queue_where_its_version_reads_it(
    tmp_path: Path,
) -> None:
    # The journal would move the queue out of ZODB at the first boot: a refused store must not
    # have it moved, or the version that wrote it would boot with an empty queue.
    _as_written_by(tmp_path / "s0", VERSION - 1, queued=2, kind="log")
    with pytest.raises(StoreError, match="still holds 2 queued"):
        open_store("log", tmp_path / "s0", 0)
    with pytest.raises(StoreError, match="still holds 2 queued"):
        open_store("log", tmp_path / "s0", 0, journal=False)


def test_a_drained_older_store_boots_and_records_the_new_version(tmp_path: Path) -> None:
    _as_written_by(tmp_path / "s0", None, queued=0)
    store = open_store("file", tmp_path / "s0", 0)
    store.close()
    store = open_store("file", tmp_path / "s0", 0)
    try:
        assert store.record.wire_version == VERSION and store.record.__dict__.get("wire_version")
    finally:
        store.close()


def test_a_store_of_a_newer_version_is_refused(tmp_path: Path) -> None:
    _as_written_by(tmp_path / "s0", VERSION + 1, queued=0)
    with pytest.raises(StoreError, match=f"newer than this server's {VERSION}"):
        open_store("file", tmp_path / "s0", 0)
