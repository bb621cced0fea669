"""The background pack of a file store: disk use follows the live data, commits go on."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from persistent.mapping import PersistentMapping

from aaabus.core.store import FILE_NAME, open_store


def test_a_file_store_packed_in_the_background_stays_bounded(tmp_path: Path) -> None:
    # Each cycle grows the file by one step of history (revisions of one 2 KB object), then
    # stops committing, at the step or as soon as a pack has happened: what the pack leaves is
    # then the live data, plus at most the one commit that may have raced it (the packer's own
    # reading of the file size can cross the step a commit before ours does).
    every = 256 << 10
    one_commit = 4 << 10  # a 2 KB revision and its transaction record, with room to spare
    store = open_store("file", tmp_path, 0, pack_every=every)
    data = tmp_path / FILE_NAME
    try:
        assert store.disk()["compacted_at"] is None
        start = data.stat().st_size
        root = store.conn.root()
        root["item"] = item = PersistentMapping()
        store.commit()
        n = written = peak = 0
        pause = threading.Event()
        for _cycle in range(4):  # four steps of history: 1 MB written for 2 KB live
            before = store.disk()["compacted_at"]
            while data.stat().st_size - start < every and store.disk()["compacted_at"] == before:
                n += 1
                item["pad"] = bytes([n % 256]) * 2048
                item["n"] = n
                store.commit()
                written += 2048
                peak = max(peak, data.stat().st_size)
            deadline = time.monotonic() + 30
            while store.disk()["compacted_at"] == before:
                assert time.monotonic() < deadline, "no pack within 30 s of a growth step"
                pause.wait(0.02)  # the packer's figures change on its own thread: poll them
            disk = store.disk()
            # Superseded revisions went: one revision of everything is left, a few KB.
            assert disk["live_bytes"] is not None and disk["live_bytes"] < 16 << 10, disk
            assert disk["file_bytes"] == data.stat().st_size, disk
            assert disk["live_bytes"] <= disk["file_bytes"] <= disk["live_bytes"] + one_commit
            start = data.stat().st_size
        # Four steps of history were written (each cycle grew the file by one), yet the file
        # peaked at the live data plus one step and the commit that crossed it.
        assert peak < every + (32 << 10), (peak, written)
        assert not data.with_suffix(".fs.old").exists(), "pack kept the old file"
    finally:
        store.close()
    store = open_store("file", tmp_path, 0, pack_every=0)
    try:
        assert store.conn.root()["item"]["n"] == n
    finally:
        store.close()
