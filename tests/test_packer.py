"""The background pack of a file store: disk use follows the live data, commits go on."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from persistent.mapping import PersistentMapping

from aaabus.store import FILE_NAME, open_store


def test_a_file_store_packed_in_the_background_stays_bounded(tmp_path: Path) -> None:
    every = 256 << 10
    store = open_store("file", tmp_path, 0, pack_every=every)
    data = tmp_path / FILE_NAME
    try:
        assert store.disk()["compacted_at"] is None
        root = store.conn.root()
        root["item"] = item = PersistentMapping()
        written = peak = 0
        for n in range(2000):  # 2,000 revisions of a 2 KB object: 4 MB of history
            item["pad"] = bytes([n % 256]) * 2048
            item["n"] = n
            store.commit()
            written += 2048
            peak = max(peak, data.stat().st_size)
        deadline = time.monotonic() + 30
        pause = threading.Event()
        while store.disk()["compacted_at"] is None:
            assert time.monotonic() < deadline, "no pack within 30 s"
            pause.wait(0.05)  # the packer's figures change on its own thread: poll them
        disk = store.disk()
        # Superseded revisions went: what is left is one revision of everything (2 KB) plus the
        # commits made while the pack ran (it copies those too: how many depends on the
        # machine's load), far below the growth step that started the pack.
        assert disk["live_bytes"] is not None and disk["live_bytes"] < every // 2
        # The file peaks at a growth step, plus what the commits wrote during one pack (how
        # much depends on the machine's load): well below the history it would otherwise hold.
        assert peak < written / 2, (peak, written)
        assert not data.with_suffix(".fs.old").exists(), "pack kept the old file"
    finally:
        store.close()
    store = open_store("file", tmp_path, 0, pack_every=0)
    try:
        assert store.conn.root()["item"]["n"] == 1999
    finally:
        store.close()
