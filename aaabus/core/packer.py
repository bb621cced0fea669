"""Background pack of a FileStorage, on the daemon thread ``aaabus-filestore-packer``.

FileStorage appends a new revision of every object a commit touches and never drops the old
ones by itself: a bus that writes and deletes queue entries all day grows its ``data.fs`` by
every message it ever carried. The packer bounds it: whenever the file has grown by
``every_bytes`` since the last pack (or since the store was opened), it packs to the present
(every superseded revision and every object unreachable from the root go), which leaves about
the live data. Policy: property ``aaabus.store.pack_mb`` (``docs/operations.md``).

Threads: the engine thread calls :meth:`committed` after each commit (one size comparison) and
reads :meth:`figures`; the packer's thread waits for that call to wake it and runs
``ZODB.DB.pack``, which FileStorage lets run beside commits (it copies the live records to
``data.fs.pack`` without the commit lock, then takes it to copy the transactions committed
meanwhile and swap the files). Woken by the commits rather than polling: the pack starts at
the growth step, so the file peaks at about the live data, plus the step, plus what is
committed during one pack.

A pack that fails (a full disk, say) is logged and retried at the next growth step; it never
stops the server: commits go on into the unpacked file, as they did before packs existed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import ZODB

log = logging.getLogger("aaabus.packer")

#: How long the idle thread waits before looking whether it was asked to stop.
IDLE_SECONDS = 5.0


class Packer:
    """Packs ``db`` (a FileStorage's) each time its file grows by ``every_bytes``."""

    def __init__(self, db: ZODB.DB, every_bytes: int) -> None:
        self._db = db
        self._every = every_bytes
        self._stopping = False
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards the figures (engine thread reads, packer writes)
        self._baseline = int(db.storage.getSize())
        self._figures: dict[str, Any] = {
            "packs": 0,
            "last_pack_at": None,
            "last_pack_seconds": None,
            "size_after_last_pack": None,
            "last_error": None,
        }
        self._thread = threading.Thread(
            target=self._run, name="aaabus-filestore-packer", daemon=True
        )
        self._thread.start()

    def committed(self) -> None:
        """Engine thread, after each commit: wake the packer once the file grew a step."""
        if int(self._db.storage.getSize()) - self._baseline >= self._every:
            self._wake.set()

    def figures(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._figures)

    def stop(self, timeout: float = 60.0) -> None:
        """Stop the thread; a pack under way finishes first (FileStorage cannot abandon one
        half-way without leaving ``data.fs.pack`` behind)."""
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("file store packer did not stop within %.0f s", timeout)

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(IDLE_SECONDS)
            self._wake.clear()
            if not self._stopping and self._db.storage.getSize() - self._baseline >= self._every:
                self._pack()

    def _pack(self) -> None:
        started = time.monotonic()
        try:
            self._db.pack(time.time())
        except Exception as exc:
            # Retried one growth step later: commits go on meanwhile, unpacked.
            self._baseline = int(self._db.storage.getSize())
            with self._lock:
                self._figures["last_error"] = f"{type(exc).__name__}: {exc}"
            log.warning("file store %s: pack failed: %s", self._db.storage.getName(), exc)
            return
        size = int(self._db.storage.getSize())
        self._baseline = size
        with self._lock:
            self._figures.update(
                packs=self._figures["packs"] + 1,
                last_pack_at=time.time(),
                last_pack_seconds=round(time.monotonic() - started, 3),
                size_after_last_pack=size,
            )
