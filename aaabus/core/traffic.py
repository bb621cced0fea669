"""Who talks to whom: per-window counts of the notifications a server sends to other servers.

A :class:`TrafficRecorder` keeps, for the current time window, one counter pair (notifications,
bytes) per destination server, and hands each finished window to a background thread that
writes Parquet files of the ``traffic`` schema (:func:`traffic_schema`, re-exported by
``aaabus.analysis.schema``): one row per (window, src, dst). ``aaabus plan`` reads them to plan
causality domains. A server runs one when property ``aaabus.traffic`` names a directory; its
:class:`~aaabus.core.channel.Channel` notes each notification that one of its agents sends to
another server when the event that sent it is sealed (the frame's size is known then), and
calls ``record`` for the notes of a group once that group is durable.

Threads:

* :meth:`~TrafficRecorder.record` and :meth:`~TrafficRecorder.close` run on ONE thread at a
  time: ``record`` on whichever thread holds the engine's turn as a group becomes durable (the
  engine thread, or the network thread running a group inline), and ``close`` once the engine
  has stopped (they share the current window's dict without a lock: that is what keeps
  ``record`` to a time read and a dict update). A window is handed over by the first
  ``record`` after its end, or by ``close``.
* The writer thread ``traffic-s<id>`` receives finished windows through a queue, gathers them
  into batches and writes one file per batch; it never touches the current window.

What is recorded: call ``record(dst, nbytes)`` once per notification, on the server where its
sender runs, with ``dst`` the server of the addressee, whatever route the message then takes
(routers do not record what they forward). The counts are then end to end and do not depend on
the layout of domains in place when they were recorded, which is what a planner needs.

The counts are statistics, not data, but they count what was sent: a notification whose
sending reaction or group is rolled back is never recorded (the channel's notes are undone with
it), and one whose group is replayed is recorded once, when the replay is durable. What has not
been handed to the writer (the current window, or batches not yet written) is lost if the
process dies. A file being written is named ``.<name>.tmp`` (hidden from Spark and ``aaabus
plan``) and renamed when complete. A write that fails (disk full...) is logged once per
failure on ``aaabus.traffic`` and its rows counted in :attr:`TrafficRecorder.dropped_rows`; the
engine is never disturbed.

pyarrow is an optional dependency (the ``traffic`` extra): a recorder cannot be created without
it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aaabus.errors import TrafficError
from aaabus.extras import require

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["TRAFFIC_SCHEMA_VERSION", "TrafficError", "TrafficRecorder", "traffic_schema"]

log = logging.getLogger("aaabus.traffic")

# One finished window handed to the writer: (window_start_ms, {dst: [notes, bytes]}).
_Window = tuple[int, dict[int, list[int]]]
_STOP = None  # what close() puts in the queue after the last window


#: Changes whenever a column of the traffic schema changes meaning; readers refuse others.
TRAFFIC_SCHEMA_VERSION = 1


def traffic_schema() -> pa.Schema:
    """The Parquet schema of traffic rows (a function: pyarrow is imported only when used)."""
    import pyarrow as pa

    return pa.schema(
        [
            pa.field("window_start", pa.int64(), nullable=False),  # epoch ms, multiple of window
            pa.field("window_ms", pa.int32(), nullable=False),
            pa.field("src", pa.int32(), nullable=False),  # the server where the sender runs
            pa.field("dst", pa.int32(), nullable=False),  # the addressee's server, not next hop
            pa.field("notes", pa.int64(), nullable=False),  # notifications sent in the window
            pa.field("bytes", pa.int64(), nullable=False),  # their bytes on the wire
        ],
        metadata={
            "aaabus.trace": "traffic",
            "aaabus.schema_version": str(TRAFFIC_SCHEMA_VERSION),
        },
    )


class TrafficRecorder:
    """Counts the notifications a server sends, per destination server and time window.

    Files go to ``directory/traffic/`` (so that ``directory`` is a traces directory that
    ``aaabus plan`` reads as is; several servers may share it). Windows are ``window_ms`` long,
    aligned on multiples of ``window_ms`` since the epoch so that the windows of all servers
    line up. A file is written once ``batch_windows`` finished windows are pending, and at
    :meth:`close`. ``clock`` gives the time in seconds since the epoch (tests pass their own).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        server_id: int,
        *,
        window_ms: int = 10_000,
        batch_windows: int = 6,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if window_ms < 1 or batch_windows < 1:
            raise TrafficError(
                f"traffic windows of {window_ms} ms in batches of {batch_windows}: both must be "
                ">= 1"
            )
        # Only found here, imported by the writer at its first file: importing pyarrow doubles
        # the objects of a server process, which every full garbage collection on the engine
        # thread would then walk (our suspect for the 11 % the stream lost with it imported).
        require("traffic recording", "traffic", "pyarrow")
        self.server_id = server_id
        self.window_ms = window_ms
        self.batch_windows = batch_windows
        self.directory = Path(directory) / "traffic"
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TrafficError(
                f"cannot create the traffic directory {self.directory}: "
                f"{exc.strerror or exc}; choose a writable directory"
            ) from None
        #: Rows lost to failed writes (read from any thread; written by the writer only).
        self.dropped_rows = 0
        #: Files written so far (same).
        self.files_written = 0
        self._clock = clock
        self._counts: dict[int, list[int]] = {}
        self._window_start = 0
        self._window_end = 0.0  # seconds: the first record() opens a window
        self._closed = False
        self._queue: queue.SimpleQueue[_Window | None] = queue.SimpleQueue()
        self._writer = threading.Thread(
            target=self._write_loop, name=f"traffic-s{server_id}", daemon=True
        )
        self._writer.start()

    # ---------------------------------------------------------------------------------------
    # Engine thread.

    def record(self, dst: int, nbytes: int) -> None:
        """Count one notification of ``nbytes`` bytes sent to server ``dst``."""
        now = self._clock()
        if now >= self._window_end:
            self._open_window(now)
        counts = self._counts.get(dst)
        if counts is None:
            self._counts[dst] = [1, nbytes]
        else:
            counts[0] += 1
            counts[1] += nbytes

    def close(self, timeout: float = 10.0) -> None:
        """Hand over the current window, write everything pending and stop the writer thread.

        Waits up to ``timeout`` seconds for the last file; idempotent.
        """
        if self._closed:
            return
        self._closed = True
        self._window_end = 0.0  # a record() after close() now fails instead of counting for nobody
        if self._counts:
            self._hand_over()
        self._queue.put(_STOP)
        self._writer.join(timeout)
        if self._writer.is_alive():
            log.warning(
                "traffic recorder of server %d: the last file was not written within %.0f s",
                self.server_id,
                timeout,
            )

    def _open_window(self, now: float) -> None:
        if self._closed:
            raise TrafficError(f"traffic recorder of server {self.server_id} is closed")
        if self._counts:
            self._hand_over()
        start = int(now * 1000) // self.window_ms * self.window_ms
        self._window_start = start
        self._window_end = (start + self.window_ms) / 1000

    def _hand_over(self) -> None:
        self._queue.put((self._window_start, self._counts))
        self._counts = {}

    # ---------------------------------------------------------------------------------------
    # Writer thread.

    def _write_loop(self) -> None:
        pending: list[_Window] = []
        while True:
            item = self._queue.get()  # no deadline needed: close() always puts _STOP
            if item is not None:
                pending.append(item)
                if len(pending) < self.batch_windows:
                    continue
            if pending:
                self._write(pending)
                pending = []
            if item is None:
                return

    def _write(self, windows: list[_Window]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        starts: list[int] = []
        dsts: list[int] = []
        notes: list[int] = []
        nbytes: list[int] = []
        for start, counts in windows:
            for dst, (n, b) in counts.items():
                starts.append(start)
                dsts.append(dst)
                notes.append(n)
                nbytes.append(b)
        rows = len(starts)
        columns: list[Any] = [
            pa.array(starts, pa.int64()),
            pa.repeat(pa.scalar(self.window_ms, pa.int32()), rows),
            pa.repeat(pa.scalar(self.server_id, pa.int32()), rows),
            pa.array(dsts, pa.int32()),
            pa.array(notes, pa.int64()),
            pa.array(nbytes, pa.int64()),
        ]
        name = f"traffic-s{self.server_id}-{windows[0][0]}-{uuid.uuid4().hex[:8]}.parquet"
        final = self.directory / name
        partial = self.directory / f".{name}.tmp"
        try:
            table = pa.Table.from_arrays(columns, schema=traffic_schema())
            pq.write_table(table, partial)
            os.replace(partial, final)
        except (OSError, pa.ArrowException) as exc:
            self.dropped_rows += rows
            log.error(
                "traffic recorder of server %d: cannot write %s (%s); %d rows dropped",
                self.server_id,
                final,
                exc,
                rows,
            )
            with contextlib.suppress(OSError):  # the writer thread must live on
                partial.unlink(missing_ok=True)
            return
        self.files_written += 1
