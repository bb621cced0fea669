"""The MQTT listener's store operations, gathered into one engine batch per turn of its loop.

The connections' operations queued during one turn of the loop (``mqtt-<id>``) go to the
engine as one batch (:meth:`~aaabus.mqtt.port.EnginePort.run_batch`), and the batches that
arrive while a commit runs go into the next one (group commit across connections); each
batch's outcomes come back to the loop once durable, in the order of the batches. Writes
nobody waits for (``lazy``) ride along with the next batch. Threads: :meth:`Batches.add` and
the flush on the loop; the completions on the engine thread or, when the loop ran the batch
itself, on the loop.

A batch the loop runs itself and that holds only steps of publications' QoS flows (PUBLISH,
PUBREL, PUBREC: ``flow``) sends its deliveries before its answers: the session mailboxes'
pushes are written as the commit's durable actions run, the batch's answers (PUBACK, PUBREC,
PUBCOMP, PUBREL) right after the commit returns. A subscriber's PUBLISH is the end of a
publication's way, a publisher's PUBACK only its flow control: the answer's encoding and system
call, ~30 µs, were on the way of every delivery (``perf mqtt --breakdown``, perf/RESULTS.md).
A device keeps its own order, though: a push to a device that has an answer of the batch to
come sends that answer first (:meth:`Batches.answer_before`), so that a device subscribed to
what it publishes still gets its PUBACK before the copy of its message. Any other operation in
the batch keeps the answers first: a CONNECT, whose CONNACK must precede the session's first
PUBLISH; a SUBSCRIBE, whose SUBACK comes before the retained messages it brings (MQTT allows
either order; devices expect this one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from aaabus.mqtt.batchtrace import BatchTrace, Marks
from aaabus.mqtt.port import EnginePort

__all__ = ["Batches", "Op", "Then"]

log = logging.getLogger("aaabus.mqtt")

Op = Callable[[], Any]
Then = Callable[[Any], None]


class Batches:
    """Server ``sid``'s listener's batches for ``engine`` from ``loop``; ``flush_writes()``
    sends the connections' queued bytes after a batch's answers, ``stopping()`` says the
    listener is closing (nothing more is queued); ``trace``: where each batch's time goes
    (``aaabus.trace`` only)."""

    def __init__(
        self,
        sid: int,
        engine: EnginePort,
        loop: asyncio.AbstractEventLoop,
        flush_writes: Callable[[], None],
        stopping: Callable[[], bool],
        trace: BatchTrace | None = None,
    ) -> None:
        self._sid = sid
        self._engine = engine
        self._run_batch = engine.run_batch
        self._trace = trace
        self._marks: Marks | None = None  # the pending batch's, when traced
        self._loop = loop
        self._flush_writes, self._stopping = flush_writes, stopping
        self._pending: list[tuple[Op, Then]] = []
        # Whether every pending operation is a step of a QoS flow (see the module docstring),
        # and whose (the devices' connections) they are.
        self._flows_only = True
        self._owners: set[object] = set()
        # The owners of the answers in _answers (a push to one of them sends them first).
        self._answering: set[object] = set()
        self._lazy: list[tuple[Op, Then]] = []
        self._scheduled = False
        # Whether the loop thread is running a batch itself (see to_loop).
        self._inline = False
        # The answers of the batch the loop runs itself, sent once its commit returned.
        self._answers: list[tuple[list[tuple[Op, Then]], list[Any], Marks | None]] = []
        # Completions queued to the loop by to_loop, and those handled: see there.
        self._queued = 0
        self._handed = 0
        self._loop_thread = 0

    def bind_thread(self) -> None:
        """The calling thread is the loop's (once, when it starts)."""
        self._loop_thread = threading.get_ident()

    def add(
        self, fn: Op, then: Then, lazy: bool = False, flow: bool = False, owner: object = None
    ) -> None:
        """Queue ``fn`` for the engine's next batch; ``then(outcome)`` on the loop once it is
        durable (``outcome``: its result, or the exception it raised). ``flow``: a step of a
        publication's QoS flow, whose answer may follow the batch's deliveries to others than
        its ``owner`` (the device's connection)."""
        if self._stopping():
            return
        if self._trace is not None and not lazy and not self._pending:
            self._marks = self._trace.opened()
        if lazy:
            self._lazy.append((fn, then))
        else:
            self._pending.append((fn, then))
            self._flows_only = self._flows_only and flow
            self._owners.add(owner)
        if not self._scheduled:
            # After every callback of this turn of the loop: one batch for all of them.
            self._scheduled = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._scheduled = False
        if self._stopping():
            return
        trace = self._trace
        if self._lazy:
            # Writes nobody waits for (acknowledgements of the devices' backlogs): they ride
            # along with the next batch instead of costing a commit of their own.
            lazy, self._lazy = self._lazy, []
            fns = [fn for fn, _then in lazy]
            if trace is not None:  # behind a mark, whose outcome is not theirs
                done = self._done_for(lazy, marked_head=True)
                self._run_batch(trace.before_acks(fns), done, lazy=True)
            else:
                self._run_batch(fns, self._done_for(lazy), lazy=True)
        ops, self._pending = self._pending, []
        flows_only, self._flows_only = self._flows_only, True
        owners, self._owners = self._owners, set()
        marks, self._marks = self._marks, None
        if ops:
            fns = [fn for fn, _then in ops]
            if marks is not None and trace is not None:
                marks["handed"] = time.perf_counter_ns()
                fns = trace.around(marks, fns, self._engine)
            # Run by this thread if the engine is idle: no hand-off to the engine thread and
            # back (two wake-ups per batch). The loop waits for the commit meanwhile; what
            # arrives then is read after it and goes into the next batch.
            self._inline = True
            self._answering = owners
            if self._trace is not None:
                self._trace.current = marks
            try:
                self._run_batch(fns, self._done_for(ops, marks, flows_only), run_here=True)
            finally:
                self._inline = False
                if self._trace is not None:
                    self._trace.current = None
                self._send_answers()

    def answer_before(self, owner: object) -> None:
        """A push to ``owner`` is about to be written (loop thread): if the batch being run
        holds an answer of its, the answers go first (a device keeps its own order)."""
        if self._answers and owner in self._answering:
            self._send_answers()

    def _send_answers(self) -> None:
        answers, self._answers = self._answers, []
        self._answering = set()
        for answer in answers:
            try:
                self._completed(*answer)
            except Exception:  # a bug here must end one connection, not the loop
                log.exception("server %s: MQTT completion failed", self._sid)

    def _done_for(
        self,
        ops: list[tuple[Op, Then]],
        marks: Marks | None = None,
        last: bool = False,
        marked_head: bool = False,
    ) -> Callable[[list[Any]], None]:
        """The batch's durable action; ``last``: its answers may follow its deliveries;
        ``marks``: the batch ran between two marking operations (:meth:`BatchTrace.around`),
        ``marked_head``: after one (:meth:`BatchTrace.before_acks`)."""

        def done(outcomes: list[Any]) -> None:  # engine thread (or this one), once durable
            if marks is not None:  # the marking operations' outcomes are not the batch's
                outcomes = outcomes[1:-1]
                BatchTrace.durable(marks, self._engine.store)
            elif marked_head:
                outcomes = outcomes[1:]
            if last and self._at_once():
                # The loop runs this batch: its answers after its pushes (module docstring).
                if marks is not None:
                    marks["inline"] = 1
                self._answers.append((ops, outcomes, marks))
            else:
                self.to_loop(self._completed, ops, outcomes, marks)

        return done

    def to_loop(self, handle: Callable[..., None], *args: Any) -> None:
        """Have the loop run ``handle(*args)``: at once when this is the loop thread running a
        batch itself (the batch is durable: what ZODB still does to finish its commit need not
        delay the answers), else through the loop's wake-up (from the engine thread).

        At once is safe: what a handler starts on the loop only queues (operations go to the
        next batch through ``call_soon``; sockets are written without blocking).

        In the order of the groups, always: an earlier group run by the engine thread may have
        queued its completions and pushes just before the loop thread ran this one; handled at
        once, this group's would overtake them (a PUBREL sent before an earlier one: the device
        delivers QoS 2 messages out of order). So "at once" only when nothing is queued; else
        behind what is. The counts change only under the engine's turn (both threads' callers
        hold it), and ``_handed`` on the loop thread alone."""
        if self._at_once():
            try:
                handle(*args)
            except Exception:  # a bug here must end one connection, not the commit
                log.exception("server %s: MQTT completion failed", self._sid)
            return
        self._queued += 1
        with contextlib.suppress(RuntimeError):  # the listener stopped meanwhile
            self._loop.call_soon_threadsafe(self._in_turn, handle, args)

    def _at_once(self) -> bool:
        """Whether a completion may be handled now, on this thread (see :meth:`to_loop`)."""
        return (
            self._inline
            and threading.get_ident() == self._loop_thread
            and self._handed == self._queued
        )

    def _in_turn(self, handle: Callable[..., None], args: tuple[Any, ...]) -> None:
        """Loop thread: a completion or push queued by :meth:`to_loop`, in its turn."""
        self._handed += 1
        handle(*args)

    def _completed(
        self, ops: list[tuple[Op, Then]], outcomes: list[Any], marks: Marks | None
    ) -> None:
        at_loop = time.perf_counter_ns() if marks is not None else 0
        for (_fn, then), outcome in zip(ops, outcomes, strict=True):
            try:
                then(outcome)
            except Exception:  # a bug here must end one connection, not the listener
                log.exception("server %s: MQTT completion failed", self._sid)
        self._flush_writes()
        if marks is not None and self._trace is not None:
            self._trace.answered(marks, at_loop)
