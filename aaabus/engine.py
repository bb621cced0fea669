"""The engine: the one thread that runs reactions and owns the store.

Every change to the store happens on this thread, inside *groups*: one ZODB transaction that
applies the inputs handed over by other threads (received messages, acknowledgements, injected
notifications) and then runs reactions while deliverable notifications are waiting, up to a bound
(``max_batch`` reactions or ``max_group_s`` seconds). Each reaction is atomic on its own — its
state changes, the consumption of its input and its sends all land together or not at all — and
the group commit makes many of them durable with one fsync. Nothing a group produced leaves the
server (network frames, acknowledgements) before its commit: that is the durability point.

When a reaction raises, the group is aborted and replayed in *careful mode*, one reaction per
transaction, so that the failing reaction is rolled back alone. The replay re-runs the reactions
that preceded it, which is exactly what a crash followed by a restart would do, so it adds no new
behaviour: reactions must already tolerate being re-run when their transaction did not commit.
"""

from __future__ import annotations

import collections
import importlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import cloudpickle
from persistent import Persistent

from aaabus.agent import Agent
from aaabus.context import running
from aaabus.ids import FACTORY_STAMP, FIRST_USER_STAMP, SERVER_STAMP, AgentId
from aaabus.message import Message, decode_note, encode_note
from aaabus.notifications import (
    AgentCreateReply,
    AgentCreateRequest,
    ExceptionNotification,
    Notification,
    UnknownAgent,
)
from aaabus.store import StoreWriteFailed

if TYPE_CHECKING:
    from aaabus.store import Store
    from aaabus.trace import Tracer

log = logging.getLogger("aaabus.engine")

#: Notifications that report an error: never answered with another error report, so that two
#: parties can never bounce errors at each other forever.
_ERROR_REPORTS = (ExceptionNotification, UnknownAgent)

Input = Callable[["Engine"], None]
T = TypeVar("T")


class Channel(Protocol):
    """What the engine needs from the channel side for messages to other servers.

    Every method runs on the engine thread, inside the current group's transaction.
    """

    def knows(self, server: int) -> bool:
        """Whether ``server`` is part of the bus."""
        ...

    def send(self, message: Message) -> None:
        """Stamp ``message`` and queue it persistently for its next hop (same transaction)."""
        ...

    def mark(self) -> Any:
        """A position in what the channel has staged in memory for after the commit."""
        ...

    def rollback(self, mark: Any) -> None:
        """Forget what was staged since ``mark`` (``None``: everything): the store rolled back."""
        ...


class AgentBox(Persistent):
    """Storage of an agent whose class cannot be imported here (it came by value).

    ZODB records classes by reference, which would not load after a restart; the box keeps the
    agent cloudpickled instead and is refreshed after every reaction of the agent.
    """

    def __init__(self, agent: Agent) -> None:
        self.blob = cloudpickle.dumps(agent)


def _importable(cls: type) -> bool:
    module = sys.modules.get(cls.__module__)
    if module is None:
        try:
            module = importlib.import_module(cls.__module__)
        except Exception:
            return False
    obj: Any = module
    for part in cls.__qualname__.split("."):
        obj = getattr(obj, part, None)
    return obj is cls


class ReactionFailed(Exception):
    """Internal: a reaction raised inside a group; the group must be replayed carefully."""


class EngineStats:
    """Counters of the engine thread; read by other threads without locking (ints are atomic)."""

    def __init__(self) -> None:
        self.reactions = 0
        self.commits = 0
        self.aborts = 0
        self.errors = 0
        self.commit_ns = 0
        self.commit_total_ns = 0
        self.started = time.time()


class Engine:
    """Runs reactions, one at a time, in committed groups. See the module docstring.

    Other threads talk to it only through :meth:`submit` (hand an input over) and :meth:`stop`.
    """

    def __init__(
        self,
        store: Store,
        server_id: int,
        *,
        channel: Channel | None = None,
        max_batch: int = 64,
        max_group_s: float = 0.005,
        name: str | None = None,
        on_exit: Callable[[], None] | None = None,
    ) -> None:
        self.store = store
        self.server_id = server_id
        self.channel = channel
        self.max_batch = max_batch
        self.max_group_s = max_group_s
        self.stats = EngineStats()
        #: Optional per-hop tracing (see aaabus.trace); set before start.
        self.tracer: Tracer | None = None
        self._me = AgentId.server_of(server_id)
        self._factory = AgentId.factory(server_id)
        self._inbox: collections.deque[Input] = collections.deque()
        self._lazy: list[Input] = []
        self.lazy_delay_s = 0.05
        self._cond = threading.Condition()
        self._stopping = False
        self._after_commit: list[Callable[[], None]] = []
        self._current = self._me
        # Agents whose on_init already ran during this boot, and those added by the open group
        # (forgotten on abort, because the abort rolled their on_init back).
        self._initialised: set[AgentId] = set()
        self._group_initialised: list[AgentId] = []
        # Agents that came by value: unpickled once per boot, dropped when a group aborts.
        self._boxed: dict[AgentId, Agent] = {}
        self._group_boxed: set[AgentId] = set()
        self._deleted: list[AgentId] = []
        self._careful = 0
        self._careful_inputs = False
        self._ready: collections.deque[Message] = collections.deque()
        self._ready_ok = False
        self._listeners: list[Callable[[AgentId, Notification], None]] = []
        self._thread = threading.Thread(
            target=self._run, name=name or f"engine-{server_id}", daemon=True
        )
        self._failure: BaseException | None = None
        self._on_exit = on_exit
        self._context = _EngineContext(self)

    # -- other threads ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, item: Input) -> None:
        """Hand ``item`` to the engine thread; it runs inside the next group's transaction.

        ``item(engine)`` must only touch the store and queue follow-up work with
        :meth:`after_commit`. If it raises, the group is aborted, the error logged, and the item
        dropped (an input that fails once would fail forever).
        """
        with self._cond:
            self._inbox.append(item)
            self._cond.notify()

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread, as ``#s.s.0``, inside the next group.

        The future resolves with ``fn``'s result once the group has committed; if ``fn`` raises,
        its own changes are rolled back (the rest of the group goes on) and the future fails.
        """
        future: Future[T] = Future()

        def apply(engine: Engine) -> None:
            savepoint = engine.store.tm.savepoint(optimistic=True)
            marks = engine._marks()
            engine._current = engine._me
            try:
                with running(engine._context):
                    result = fn()
            except Exception as exc:
                savepoint.rollback()
                engine._forget(marks)
                future.set_exception(exc)
                return
            engine.after_commit(lambda: future.set_result(result))

        self.submit(apply)
        return future

    def submit_lazy(self, item: Input) -> None:
        """Like :meth:`submit`, for work that may wait: it rides along with the next group.

        Used for acknowledgements: applying one costs a commit of its own if done at once, while
        delaying it only keeps a message in an outgoing queue a little longer (a crash meanwhile
        means one more resend, absorbed as a duplicate). If nothing else happens, lazy work is
        done after ``lazy_delay_s``.
        """
        with self._cond:
            self._lazy.append(item)
            if len(self._lazy) == 1:
                self._cond.notify()  # let the waiting engine arm its timer

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the group in flight (commit or abort) and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"engine of server {self.server_id} did not stop in {timeout}s")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def failure(self) -> BaseException | None:
        """The error that stopped the engine thread, if any (e.g. the disk is full)."""
        return self._failure

    def add_listener(self, listener: Callable[[AgentId, Notification], None]) -> None:
        """Call ``listener(sender, note)`` after commit for notifications to ``#s.s.0``.

        Runs on the engine thread: it must not block.
        """
        self._listeners.append(listener)

    # -- engine thread --------------------------------------------------------------------------

    def after_commit(self, action: Callable[[], None]) -> None:
        """Run ``action`` once the current group has committed (dropped if it aborts)."""
        self._after_commit.append(action)

    def run_in_transaction(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` as a boot-time operation with ``#s.s.0`` as sender, and commit it."""
        self._current = self._me
        try:
            with running(self._context):
                fn()
            self._commit()
        except BaseException:
            self._abort()
            raise

    def _run(self) -> None:
        try:
            while True:
                inputs = self._wait_for_work()
                if inputs is None:
                    return
                self._group(inputs)
        except BaseException as exc:  # the store failed: stop rather than acknowledge anything
            self._failure = exc
            # A failed write explains itself in one line; anything else is a bug: full trace.
            expected = isinstance(exc, StoreWriteFailed)
            log.critical(
                "engine of server %s stopped: %s", self.server_id, exc, exc_info=not expected
            )
            try:
                self._abort()
            except Exception:
                log.debug("abort after failure failed", exc_info=True)
        finally:
            if self._on_exit is not None:
                self._on_exit()

    def _wait_for_work(self) -> list[Input] | None:
        with self._cond:
            lazy_deadline: float | None = None
            while not self._inbox and not self.store.qin:
                if self._stopping:
                    return None
                if self._lazy:
                    now = time.monotonic()
                    if lazy_deadline is None:
                        lazy_deadline = now + self.lazy_delay_s
                    if now >= lazy_deadline:
                        break
                    self._cond.wait(lazy_deadline - now)
                else:
                    self._cond.wait()
            if self._stopping:
                return None
            inputs = self._lazy + list(self._inbox)
            self._lazy = []
            self._inbox.clear()
            return inputs

    def _group(self, inputs: list[Input]) -> None:
        done_inputs = 0
        reactions = 0
        self._ready_ok = not self._careful
        try:
            if self._careful_inputs:
                self._careful_inputs = False
                self._apply_carefully(inputs)
            else:
                for item in inputs:
                    item(self)
                    done_inputs += 1
            self._ready_ok = False
            # Messages that arrived deliverable while the input queue was empty are run at once,
            # without ever being written to it: two records less in this commit.
            ready = self._ready
            while ready:
                self._react_one(ready.popleft(), careful=False)
                reactions += 1
            limit = 1 if self._careful else self.max_batch
            deadline = time.perf_counter() + self.max_group_s
            qin = self.store.qin
            while qin and reactions < limit:
                self._react_one(qin.peek(), careful=bool(self._careful), from_qin=True)
                reactions += 1
                if time.perf_counter() > deadline:
                    break
            if self._careful:
                self._careful = max(0, self._careful - reactions)
            self._commit()
        except ReactionFailed:
            self._abort()
            # Replay one reaction per transaction; the failing one is then alone in its own.
            self._careful = reactions + 1
            self._requeue(inputs)
        except Exception:
            self._abort()
            self._drop_input()
            # Keep the others, and give the next group's inputs a savepoint each: dropping one
            # bad input per aborted group would cost a full replay of the rest each time, which
            # is quadratic under a stream of garbage (a fuzzing peer once starved the network
            # thread that way).
            self._careful_inputs = True
            self._requeue(inputs[:done_inputs] + inputs[done_inputs + 1 :])

    def _apply_carefully(self, inputs: list[Input]) -> None:
        """Apply inputs one savepoint each: a failing one is rolled back and dropped alone."""
        for item in inputs:
            savepoint = self.store.tm.savepoint(optimistic=True)
            marks = self._marks()
            try:
                item(self)
            except Exception:
                savepoint.rollback()
                self._forget(marks)
                self._drop_input()

    def _drop_input(self) -> None:
        """Log the input that just raised (a bug or garbage): it is not retried."""
        self.stats.errors += 1
        log.error(
            "server %s: dropping an input that failed: %s",
            self.server_id,
            traceback.format_exc(limit=4).strip().splitlines()[-1],
            exc_info=log.isEnabledFor(logging.DEBUG),
        )

    def _requeue(self, inputs: Iterable[Input]) -> None:
        with self._cond:
            self._inbox.extendleft(reversed(list(inputs)))

    def _commit(self) -> None:
        tracer = self.tracer
        clock_bytes = tracer.before_commit() if tracer is not None else 0
        t0 = time.perf_counter_ns()
        self.store.commit()
        self.stats.commit_ns = time.perf_counter_ns() - t0
        self.stats.commit_total_ns += self.stats.commit_ns
        self.stats.commits += 1
        if tracer is not None:
            tracer.committed(self.stats.commit_ns, clock_bytes)
        self._group_initialised.clear()
        self._group_boxed.clear()
        actions, self._after_commit = self._after_commit, []
        for action in actions:
            action()

    def _abort(self) -> None:
        self.store.abort()
        self.stats.aborts += 1
        if self.tracer is not None:
            self.tracer.aborted()
        self._forget(None)

    # -- one reaction ---------------------------------------------------------------------------

    def _react_one(self, msg: Message, careful: bool, from_qin: bool = False) -> None:
        # In careful mode the reaction gets a savepoint of its own, so that it can be rolled
        # back alone without losing the inputs applied earlier in the same group.
        savepoint = self.store.tm.savepoint(optimistic=True) if careful else None
        marks = self._marks() if careful else None
        if from_qin:
            self.store.qin.pop()
        self.stats.reactions += 1
        target = msg.target
        note: Any = None
        self._current = target
        try:
            # Decoded inside the try: a body this server cannot unpickle (a class it cannot
            # import, or garbage from a peer) fails this reaction alone, like a raising react.
            note = decode_note(msg.body)
            with running(self._context):
                if target.stamp == FACTORY_STAMP:
                    self._factory_react(msg.sender, note)
                elif target.stamp == SERVER_STAMP:
                    for listener in self._listeners:
                        self.after_commit(lambda ln=listener: ln(msg.sender, note))  # type: ignore[misc]
                else:
                    agent = self._load(target)
                    if agent is None:
                        self._unknown_agent(msg.sender, target, note)
                    else:
                        agent.react(msg.sender, note)
                        self._finish(target, agent)
        except Exception as exc:
            if savepoint is None:
                raise ReactionFailed() from exc
            savepoint.rollback()
            self._forget(marks)
            self._report_failure(msg, note, exc)

    def _marks(self) -> tuple[int, int, Any]:
        """Where the in-memory side of the group stands, to undo one reaction alone."""
        channel_mark = self.channel.mark() if self.channel is not None else None
        return len(self._after_commit), len(self._group_initialised), channel_mark

    def _forget(self, marks: tuple[int, int, Any] | None) -> None:
        """Drop the in-memory effects of work whose store changes were rolled back.

        ``marks`` from :meth:`_marks` undoes one reaction; ``None`` undoes the whole group.
        """
        after_commit_mark, initialised_mark, channel_mark = marks or (0, 0, None)
        if marks is None:
            self._ready.clear()
        if self.channel is not None:
            self.channel.rollback(channel_mark)
        del self._after_commit[after_commit_mark:]
        self._deleted.clear()
        for agent_id in self._group_initialised[initialised_mark:]:
            self._initialised.discard(agent_id)
        del self._group_initialised[initialised_mark:]
        # Boxed agents are reloaded from their blob, which the rollback left as it was.
        for agent_id in self._group_boxed:
            self._boxed.pop(agent_id, None)
        self._group_boxed.clear()

    def _report_failure(self, msg: Message, note: Any, exc: Exception) -> None:
        """Consume the input of a failed reaction and tell its sender (careful mode)."""
        self.store.qin.pop()
        self.stats.errors += 1
        log.warning(
            "server %s: reaction of %s to %s from %s raised %s: %s",
            self.server_id,
            msg.target,
            type(note).__name__ if note is not None else "an undecodable notification",
            msg.sender,
            type(exc).__name__,
            exc,
        )
        if isinstance(note, _ERROR_REPORTS) or msg.sender.stamp == SERVER_STAMP:
            return
        report = ExceptionNotification(msg.target, note, type(exc).__name__, str(exc))
        self._send_from(msg.target, msg.sender, report)

    def _unknown_agent(self, sender: AgentId, target: AgentId, note: Any) -> None:
        if isinstance(note, _ERROR_REPORTS) or sender.stamp == SERVER_STAMP:
            log.warning("server %s: %s for unknown agent %s dropped", self.server_id, note, target)
            return
        self._send_from(self._me, sender, UnknownAgent(target, note))

    def _load(self, agent_id: AgentId) -> Agent | None:
        entry = self.store.agents.get((agent_id.origin, agent_id.stamp))
        if entry is None:
            return None
        if isinstance(entry, AgentBox):
            agent = self._boxed.get(agent_id)
            if agent is None:
                agent = self._boxed[agent_id] = cloudpickle.loads(entry.blob)
            self._group_boxed.add(agent_id)
        else:
            agent = entry
        if agent_id not in self._initialised:
            self._initialised.add(agent_id)
            self._group_initialised.append(agent_id)
            agent.on_init(False)
        return agent

    def _finish(self, agent_id: AgentId, agent: Agent) -> None:
        agents = self.store.agents
        key = (agent_id.origin, agent_id.stamp)
        if self._deleted:
            for dead in self._deleted:
                agents.pop((dead.origin, dead.stamp), None)
                self._boxed.pop(dead, None)
                self._initialised.discard(dead)
            self._deleted.clear()
            if key not in agents:
                return
        if agent_id in self._group_boxed:
            agents[key].blob = cloudpickle.dumps(agent)

    # -- the factory (#s.s.1) --------------------------------------------------------------------

    def _factory_react(self, sender: AgentId, note: Any) -> None:
        if not isinstance(note, AgentCreateRequest):
            if isinstance(note, AgentCreateReply | _ERROR_REPORTS):
                log.info("factory of server %s got %r from %s", self.server_id, note, sender)
                return
            raise TypeError(f"the agent factory does not handle {type(note).__name__}")
        agent_id = note.agent_id
        key = (agent_id.origin, agent_id.stamp)
        error = ""
        if agent_id.server != self.server_id:
            error = f"{agent_id} does not belong to server {self.server_id}"
        elif key in self.store.agents:
            error = f"agent {agent_id} already exists"
        if not error:
            savepoint = self.store.tm.savepoint(optimistic=True)
            pending = len(self._after_commit)
            try:
                agent = cloudpickle.loads(note.agent)
                if not isinstance(agent, Agent):
                    raise TypeError(f"{type(agent).__name__} is not an aaabus.Agent")
                agent._aaabus_id = agent_id
                by_value = not _importable(type(agent))
                self.store.agents[key] = AgentBox(agent) if by_value else agent
                self._current = agent_id
                self._initialised.add(agent_id)
                self._group_initialised.append(agent_id)
                agent.on_init(True)
                if by_value:
                    self._boxed[agent_id] = agent
                    self._group_boxed.add(agent_id)
                    self.store.agents[key].blob = cloudpickle.dumps(agent)
            except Exception as exc:
                savepoint.rollback()
                del self._after_commit[pending:]
                self._initialised.discard(agent_id)
                error = f"{type(exc).__name__}: {exc}"
            finally:
                self._current = self._factory
        if error:
            log.warning("server %s: cannot create %s: %s", self.server_id, agent_id, error)
        if note.reply and sender.stamp != SERVER_STAMP:
            self._send_from(self._factory, sender, AgentCreateReply(agent_id, not error, error))

    # -- sending (the ReactionContext the agents see) ----------------------------------------------

    def _send_from(self, sender: AgentId, to: AgentId, note: Notification) -> None:
        self.route(Message(sender, to, encode_note(note)))

    def send(self, to: AgentId, note: Notification) -> None:
        """Send ``note`` to ``to`` in the current group, as ``send_to`` does in a reaction.

        Engine thread only (a boot service, or a function passed to :meth:`call`). The sender
        is the agent reacting now, or the server itself (``#s.s.0``) outside a reaction.
        Raises ``TypeError`` for a target that is not an :class:`AgentId`.
        """
        self._context.send(to, note)

    def deliver(self, msg: Message) -> None:
        """Queue a message that became deliverable here (engine thread, in the group)."""
        if self._ready_ok and not self.store.qin:
            self._ready.append(msg)
        else:
            self.store.qin.put(msg)

    def route(self, msg: Message) -> None:
        """Queue ``msg`` in this group: locally into qin, else through the channel.

        Engine thread only. A target on a server that is not part of the bus cannot exist: the
        sender gets its ``UnknownAgent`` at once.
        """
        to = msg.target
        if to.server == self.server_id:
            self.store.qin.put(msg)
        elif self.channel is not None and self.channel.knows(to.server):
            self.channel.send(msg)
        else:
            self._unknown_agent(msg.sender, to, decode_note(msg.body))


class _EngineContext:
    """The :class:`~aaabus.context.ReactionContext` the engine installs around a reaction."""

    __slots__ = ("_engine",)

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    @property
    def server_id(self) -> int:
        return self._engine.server_id

    @property
    def current(self) -> AgentId:
        return self._engine._current

    def send(self, to: AgentId, note: Notification) -> None:
        if not isinstance(to, AgentId):
            raise TypeError(f"send_to() needs an AgentId, got {type(to).__name__}")
        self._engine._send_from(self._engine._current, to, note)

    def deploy(self, agent: Agent, server: int, reply: bool) -> AgentId:
        engine = self._engine
        record = engine.store.record
        stamp = max(record.next_stamp, FIRST_USER_STAMP)
        record.next_stamp = stamp + 1
        agent_id = AgentId(engine.server_id, server, stamp)
        agent._aaabus_id = agent_id
        try:
            payload = cloudpickle.dumps(agent)
        except Exception:
            agent._aaabus_id = None
            raise
        engine._send_from(
            engine._current, AgentId.factory(server), AgentCreateRequest(agent_id, payload, reply)
        )
        return agent_id

    def delete(self, agent_id: AgentId) -> None:
        engine = self._engine
        if agent_id != engine._current or agent_id.server != engine.server_id:
            raise RuntimeError("an agent can only delete itself, from its own reaction")
        engine._deleted.append(agent_id)
