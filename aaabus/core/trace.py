"""Per-message tracing of clock costs, off by default and free when off.

When the property ``aaabus.trace`` names a directory, every server writes there one JSON line per
message hop: the stamp's size, the CPU time spent in clock operations, and, filled in at the
group's commit, the commit time, the clock bytes that commit persisted, and how many hops shared
it. The perf suites turn these lines into their Parquet traces.

The first receive record of a group also gets ``stages``: the nanoseconds between the marks that
one remote hop passes on this server, in order (:data:`STAGES`), from the read that brought
the frame to the socket send of what its reaction produced. Stages whose marks were not passed
(an input that was not a frame, a group without reaction or send) are left out. Meaningful
when one message is in flight at a time (``perf pingpong --breakdown``); in a busy group the
marks are those of its first input and first reaction.

Runs on the engine thread only; the file is written in blocks and closed at stop. The records of
the open group are in-memory effects of its transaction: a rolled-back reaction or an aborted
group takes its records back with it (see :mod:`aaabus.core.effects`).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from aaabus.core.effects import TransactionEffects

#: Written in every record so that readers can refuse what they do not understand.
TRACE_VERSION = 1

#: The marks one hop passes on a server, in order, and the stage that ENDS at each mark:
#: ``read`` (the I/O thread's socket read returned), ``handed`` (the frame was decoded and its
#: MAC checked, then handed to the engine's inbox: stage ``decode_mac``), ``applied`` (its group
#: took it up: ``handoff``, the engine thread's wake-up, or with an inline group the group's start
#: and the inputs before it), ``tested`` (frame decoded, stamp tested against the clock,
#: message queued for delivery: ``clock_test``), ``react_start`` (other inputs of the group:
#: ``to_reaction``), ``reacted`` (body decoded and ``react`` run: ``reaction``), ``sealed`` (the
#: reaction's sends stamped, encoded and queued: ``stamp``), ``commit`` (``to_commit``),
#: [``notified`` (the durability notices of the tentative frames the group applied came:
#: ``notice_wait``), ``sent_early`` (early frames, aaabus.core.early: the group's frames left,
#: tentative: ``send_early``), ``prepared`` (ZODB's preparation, ending at the first vote:
#: ``commit_prepare``)], ``vote`` (the store's vote starts: ``to_vote``; without the bracketed
#: marks, ZODB pickled the changed objects and handed them to the storage: ``commit_prepare``),
#: ``written`` (one ``pwritev``: ``write``), ``synced`` (one ``fdatasync``: ``sync``), ``flush``
#: (the frames start to leave: ``commit_finish``, the rest of the vote with the log store,
#: which sends once its sync returned; ZODB's ``tpc_finish`` too
#: with other stores),
#: ``sent`` (frames MAC'd and written to the sockets: ``send``; with early frames, the
#: durability notices and acknowledgements). ``vote``/``written``/``synced``
#: come from the log store; other stores give one ``commit_io`` stage from ``commit`` to
#: ``flush``.
STAGES: tuple[tuple[str, str], ...] = (
    ("handed", "decode_mac"),
    ("applied", "handoff"),
    ("tested", "clock_test"),
    ("react_start", "to_reaction"),
    ("reacted", "reaction"),
    ("sealed", "stamp"),
    ("commit", "to_commit"),
    ("notified", "notice_wait"),
    ("sent_early", "send_early"),
    ("prepared", "commit_prepare"),
    ("vote", "commit_prepare"),
    ("written", "write"),
    ("synced", "sync"),
    ("flush", "commit_finish"),
    ("sent", "send"),
)


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
        #: Marks of the open group (see :data:`STAGES`); None until its first frame arrives.
        self._marks: dict[str, int] | None = None

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

    def arrived(self, read_ns: int, handed_ns: int) -> None:
        """A frame read at ``read_ns`` and handed over at ``handed_ns`` (I/O thread's
        ``perf_counter_ns``) is being applied: the group's first such frame opens its marks."""
        if self._marks is None:
            self._marks = {"read": read_ns, "handed": handed_ns, "applied": time.perf_counter_ns()}
            self._effects.undo(setattr, self, "_marks", None)

    def mark(self, name: str, at_ns: int | None = None) -> None:
        """Pass mark ``name`` (now, or at ``at_ns``) in the open group, once: the first wins."""
        marks = self._marks
        if marks is not None and name not in marks:
            marks[name] = time.perf_counter_ns() if at_ns is None else at_ns

    def before_commit(self) -> int:
        return self._clock_bytes() if self._group else 0

    def committed(self, commit_ns: int, clock_bytes: int) -> None:
        """The group committed: complete its records and buffer them."""
        marks, self._marks = self._marks, None
        if not self._group:
            return
        if marks is not None:
            # A hop is a delivered message: a group that only met a duplicate (a resend when a
            # link comes up) wrote nothing and sent an acknowledgement, which is no hop's time.
            for rec in self._group:
                if rec["event"] == "receive" and rec["verdict"] == "deliver":
                    rec["stages"] = _stages(marks)
                    break
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


def _stages(marks: dict[str, int]) -> dict[str, int]:
    """Durations in ns between consecutive marks that were passed (see :data:`STAGES`)."""
    stages: dict[str, int] = {}
    previous = marks["read"]
    for mark, stage in STAGES:
        at = marks.get(mark)
        if at is None:
            continue
        if mark == "flush" and "vote" not in marks:
            stage = "commit_io"  # a store that does not report its write and sync apart
        elif mark == "vote" and "prepared" in marks:
            stage = "to_vote"  # early frames: ZODB's preparation ended at "prepared"
        stages[stage] = at - previous
        previous = at
    return stages


def read_hops(directory: str | Path) -> Iterable[dict[str, Any]]:
    """Every hop record written under ``directory`` (all servers)."""
    for path in sorted(Path(directory).glob("hops-s*.jsonl")):
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


#: A replicated commit's marks, in order, and the stage that ENDS at each (``perf pingpong
#: --breakdown --replicas N``): the primary has encoded the records (``ship``), the replica has
#: the COMMIT message (``to_replica``: the hand-off to the link's thread, the MAC, the write, the
#: replica's wake-up and read), starts its vote (``replica_prepare``: the records decoded, the
#: previous commit finished, the transaction begun), writes (``replica_write``) and syncs
#: (``replica_sync``), is about to write its acknowledgement (``replica_ack``), the primary has
#: read it (``ack_back``: the write, the wake-up, the read) and the commit's wait returns
#: (``wait_return``). Every mark that ends at a socket is taken before the write, never after:
#: the other side may read it before the writer runs again (2 cores, a loaded machine), and a
#: stage must never come out negative. ``waited`` is apart: from the primary's own sync to the
#: wait's return, what the replica costs the commit beyond the primary's disk.
REPLICA_STAGES: tuple[tuple[str, str], ...] = (
    ("shipped", "ship"),
    ("received", "to_replica"),
    ("voting", "replica_prepare"),
    ("written", "replica_write"),
    ("synced", "replica_sync"),
    ("acked", "replica_ack"),
    ("read", "ack_back"),
    ("returned", "wait_return"),
)


class CommitMarks:
    """One process's marks of its replicated commits, one JSON line per commit and side
    (``replication-*.jsonl`` under the ``aaabus.trace`` directory), ``perf_counter_ns`` times:
    one clock for every process of the machine, so the two sides' marks join by tid. Off
    unless ``aaabus.trace`` is set; each side's writer is the one thread that makes its marks
    (the committing thread, the replica's link thread). Meaningful one commit at a time."""

    def __init__(self, directory: Path, name: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self._file: TextIO | None = (directory / f"replication-{name}.jsonl").open(
            "a", encoding="utf-8"
        )
        self._buffer: list[str] = []
        # The writer and a stop (another thread) may meet.
        self._lock = threading.Lock()

    def write(self, side: str, tid: bytes, marks: dict[str, int]) -> None:
        line = json.dumps({"v": TRACE_VERSION, "side": side, "tid": tid.hex(), **marks})
        with self._lock:
            self._buffer.append(line)
            if len(self._buffer) >= 256:
                self._flush()

    def _flush(self) -> None:
        if self._file is not None and self._buffer:
            self._file.write("\n".join(self._buffer) + "\n")
            self._file.flush()
        self._buffer = []

    def close(self) -> None:
        with self._lock:
            self._flush()
            if self._file is not None:
                self._file.close()
                self._file = None


def replica_stages(directory: str | Path) -> dict[str, list[int]]:
    """Each :data:`REPLICA_STAGES` stage (and ``waited``) in ns, one value per commit whose
    two sides both left their marks under ``directory``."""
    sides: dict[str, dict[str, int]] = {}
    for path in sorted(Path(directory).glob("replication-*.jsonl")):
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    sides.setdefault(rec["tid"], {}).update(
                        {k: v for k, v in rec.items() if k not in ("v", "side", "tid")}
                    )
    stages: dict[str, list[int]] = {stage: [] for _mark, stage in REPLICA_STAGES}
    stages["waited"] = []
    for marks in sides.values():
        if not all(mark in marks for mark, _stage in REPLICA_STAGES) or "ship" not in marks:
            continue
        previous = marks["ship"]
        for mark, stage in REPLICA_STAGES:
            stages[stage].append(marks[mark] - previous)
            previous = marks[mark]
        stages["waited"].append(marks["returned"] - marks["waiting"])
    return stages
