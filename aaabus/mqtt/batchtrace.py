"""Where an MQTT batch's time goes, with ``aaabus.trace`` only (``perf mqtt --breakdown``).

One JSON line per batch of operations (not the lazy ones), in ``mqtt-s<id>.jsonl`` of the
trace directory: the ``perf_counter_ns`` marks it passed, in order (:data:`MARKS`). Each
stage ends at a mark: ``parse`` (from the socket read that brought the packet to its operation
queued), ``batch_wait`` (the rest of that turn of the loop, until the batch is handed to the
engine), ``handoff`` (until the group starts on the batch: the engine thread's wake-up, or
the group's own start when the loop runs it), ``acks`` (the devices' acknowledgements that
ride along with the batch, applied at the head of its group: a PUBACK read before the next
publication; near nothing when none did; a record without the ``acked`` mark, written before
the stage existed, counts that time in ``handoff``), ``ops`` (the batch's operations: a
publication handed to the representative, its deliveries queued), ``reaction`` (the group's
other work before its commit: the session mailbox's reaction), ``commit_prepare`` (ZODB's
preparation, until the store's vote), ``write`` and ``sync`` (the log store's ``pwritev`` and
``fdatasync``), ``commit_finish`` (the rest of the vote, until the batch's durable completion),
``delivery`` (until the loop wrote the session mailbox's push: the subscriber's PUBLISH),
``loop_delay`` (until the loop handles the batch's completion) and ``answer`` (the completions:
PUBACK, PUBREC written). That is the order when the loop ran the batch itself (``inline`` in the
record), which writes its pushes before its answers (:mod:`aaabus.mqtt.batches`); a batch the
engine thread ran is answered first and delivered after: each stage is the time from the mark
before it in time, whichever order they came in. A store that does not report its write and
sync gives no ``vote``/``written``/``synced``: ``commit_prepare`` then ends at ``durable``.

Meaningful when one publication is in flight at a time (``delivery`` is the batch's push, or
the next push after its completion); in busy batches the marks are those of the batch's first
operation.
Owned by the loop thread: the engine thread writes a batch's marks while the batch runs and
hands them to the loop with its completion (:meth:`Batches.to_loop`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from aaabus.mqtt.port import EnginePort, StoreView

__all__ = ["MARKS", "BatchTrace", "stages"]

#: The marks of a batch, in order, each with the stage that ends there (see the module docstring).
MARKS: tuple[tuple[str, str], ...] = (
    ("queued", "parse"),
    ("handed", "batch_wait"),
    ("acked", "handoff"),
    ("applied", "acks"),
    ("ops_done", "ops"),
    ("commit", "reaction"),
    ("vote", "commit_prepare"),
    ("written", "write"),
    ("synced", "sync"),
    ("durable", "commit_finish"),
    ("delivered", "delivery"),
    ("loop", "loop_delay"),
    ("answered", "answer"),
)

Marks = dict[str, int]


def stages(marks: Marks) -> dict[str, int]:
    """The nanoseconds of each stage whose end mark was passed, from ``read`` on."""
    out: dict[str, int] = {}
    previous = marks["read"]
    passed = sorted((marks[mark], n) for n, (mark, _stage) in enumerate(MARKS) if mark in marks)
    for at, n in passed:
        mark, stage = MARKS[n]
        if mark == "durable" and "vote" not in marks:
            stage = "commit_prepare"  # a store that does not report its vote
        elif mark == "applied" and "acked" not in marks:
            stage = "handoff"  # no acknowledgement rode along
        out[stage] = out.get(stage, 0) + at - previous
        previous = at
    return out


class BatchTrace:
    """The batch records of server ``sid``'s listener, written under ``directory``."""

    def __init__(self, directory: Path, sid: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"mqtt-s{sid}.jsonl"
        self._file: TextIO | None = self.path.open("a", encoding="utf-8")
        self._read = 0
        self._last: Marks | None = None  # completed, waiting for the push that follows it
        # When the last batch was handed (loop thread, :meth:`around`) and when the first lazy
        # batch after it started (the group's thread, :meth:`before_acks`): read by that
        # batch's first operation, in the same group, after both.
        self._handed = 0
        self._acks_start = -1
        #: The marks of the batch the loop is running itself (set by its Batches): its pushes
        #: come before its answers.
        self.current: Marks | None = None

    def reading(self) -> None:
        """A socket read starts (loop thread): the ``read`` mark of what it queues."""
        self._read = time.perf_counter_ns()

    def opened(self) -> Marks:
        """A batch's first operation was queued (loop thread): its marks."""
        return {"read": self._read or time.perf_counter_ns(), "queued": time.perf_counter_ns()}

    def around(
        self, marks: Marks, ops: list[Callable[[], Any]], engine: EnginePort
    ) -> list[Callable[[], Any]]:
        """``ops`` between two marking operations (run by the group, engine thread), for the
        batch of ``marks`` handed now: the first marks ``applied``, and ``acked`` when
        acknowledgements were applied at the group's head (:meth:`before_acks`), and has the
        transaction mark ``commit`` as it starts to commit; the last marks ``ops_done``."""
        self._handed = marks["handed"]

        def first() -> None:
            marks["applied"] = time.perf_counter_ns()
            if self._acks_start >= marks["handed"]:
                marks["acked"] = self._acks_start
            engine.store.tm.get().addBeforeCommitHook(lambda: marks.setdefault("commit", _now()))

        def last() -> None:
            marks["ops_done"] = time.perf_counter_ns()

        return [first, *ops, last]

    def before_acks(self, acks: list[Callable[[], Any]]) -> list[Callable[[], Any]]:
        """``acks`` (a lazy batch: acknowledgements riding along with the next group) behind a
        marking operation, run by that group at its head (engine thread): the first such mark
        since the last batch was handed ends that batch's ``handoff`` and starts its ``acks``
        (several lazy batches may ride along; one that ran earlier, in a group of its own,
        belongs to no batch)."""

        def mark() -> None:
            if self._acks_start < self._handed:
                self._acks_start = time.perf_counter_ns()

        return [mark, *acks]

    @staticmethod
    def durable(marks: Marks, store: StoreView) -> None:
        """The batch is durable (engine thread, in the store's vote with the log store): its
        vote's marks, if the store gives this commit's."""
        marks["durable"] = time.perf_counter_ns()
        voted = store.vote_marks()
        if voted is not None and voted[0] >= marks.get("commit", marks["applied"]):
            marks.update(zip(("vote", "written", "synced"), voted, strict=True))

    def answered(self, marks: Marks, at_loop: int) -> None:
        """The loop handled the batch's completion (``at_loop``) and wrote its answers."""
        marks["loop"] = at_loop
        marks["answered"] = time.perf_counter_ns()
        self._write_last()
        self._last = marks
        if "delivered" in marks:  # pushed before its answers: complete
            self._write_last()

    def pushed(self) -> None:
        """The loop wrote a session mailbox's push: the delivery of the batch it runs, else of
        the last batch answered, once."""
        if self.current is not None:
            self.current.setdefault("delivered", time.perf_counter_ns())
        elif self._last is not None:
            self._last.setdefault("delivered", time.perf_counter_ns())
            self._write_last()

    def _write_last(self) -> None:
        last, self._last = self._last, None
        if last is not None and self._file is not None:
            self._file.write(json.dumps(last, separators=(",", ":")) + "\n")

    def close(self) -> None:
        """Write what is left and close the file (loop thread, at the listener's stop)."""
        self._write_last()
        if self._file is not None:
            self._file.close()
            self._file = None


def _now() -> int:
    return time.perf_counter_ns()
