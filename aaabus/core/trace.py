"""Per-message tracing of clock costs, off by default and free when off.

When the property ``aaabus.trace`` names a directory, every server writes there one JSON line per
message hop: the stamp's size, the CPU time spent in clock operations, and, filled in at the
group's commit, the commit time, the clock bytes that commit persisted, and how many hops shared
it. The perf suites turn these lines into their Parquet traces.

Runs on the engine thread only; the file is written in blocks and closed at stop. The records of
the open group are in-memory effects of its transaction: a rolled-back reaction or an aborted
group takes its records back with it (see :mod:`aaabus.core.effects`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from aaabus.core.effects import TransactionEffects

#: Written in every record so that readers can refuse what they do not understand.
TRACE_VERSION = 1


class Tracer:
    """Collects hop records of one server; see the module docstring for the fields."""

    def __init__(self, directory: str | Path, server_id: int, effects: TransactionEffects) -> None:
        self.server_id = server_id
        self._effects = effects
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"hops-s{server_id}.jsonl"
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        self._group: list[dict[str, Any]] = []
        self._buffer: list[str] = []
        self._clock_bytes: Callable[[], int] = lambda: 0

    def watch_clocks(self, dirty_bytes: Callable[[], int]) -> None:
        """Give the function that estimates what the next commit writes for the clocks."""
        self._clock_bytes = dirty_bytes

    def _add(self, record: dict[str, Any]) -> None:
        self._group.append(record)
        self._effects.undo(self._group.pop)

    def stamped(self, domain: str, peer: int, stamp_bytes: int, clock_ns: int) -> None:
        self._add(
            {
                "event": "send",
                "domain": domain,
                "peer": peer,
                "stamp_bytes": stamp_bytes,
                "clock_ns": clock_ns,
                "t_ns": time.time_ns(),
            }
        )

    def tested(self, domain: str, peer: int, verdict: str, clock_ns: int) -> None:
        self._add(
            {
                "event": "receive",
                "domain": domain,
                "peer": peer,
                "verdict": verdict,
                "clock_ns": clock_ns,
                "t_ns": time.time_ns(),
            }
        )

    def before_commit(self) -> int:
        return self._clock_bytes() if self._group else 0

    def committed(self, commit_ns: int, clock_bytes: int) -> None:
        """The group committed: complete its records and buffer them."""
        if not self._group:
            return
        shared = len(self._group)
        for rec in self._group:
            rec["v"] = TRACE_VERSION
            rec["server"] = self.server_id
            rec["commit_ns"] = commit_ns
            rec["clock_bytes"] = clock_bytes
            rec["group_hops"] = shared
            self._buffer.append(json.dumps(rec, separators=(",", ":")))
        self._group.clear()
        if len(self._buffer) >= 1024:
            self.flush()

    def flush(self) -> None:
        if self._file is not None and self._buffer:
            self._file.write("\n".join(self._buffer) + "\n")
            self._file.flush()
        self._buffer = []

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def read_hops(directory: str | Path) -> Iterable[dict[str, Any]]:
    """Every hop record written under ``directory`` (all servers)."""
    for path in sorted(Path(directory).glob("hops-s*.jsonl")):
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)
