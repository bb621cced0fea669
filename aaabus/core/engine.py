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

One exception to "this thread": when the engine is idle and the network's I/O thread hands over
the frames of one socket read, that thread runs their group itself (:meth:`Engine.submit_many`
with ``run_here``; property ``aaabus.engine.inline``) rather than waking the engine thread and
waiting for it: a thread wake-up costs tens of microseconds on a hop that takes a few hundred.
Groups still never overlap (whoever runs one holds the engine's *turn*), so the store keeps one
user at a time, and everything said here holds whichever thread runs the group: in this package,
"on the engine thread" means "holding the engine's turn" (reactions, inputs, ``call``'s
functions, listeners and after-commit actions alike). The price: while a reaction runs there,
that I/O thread reads no other socket, which is also back-pressure. A group run there that
must wait for a durability notice before its commit does not wait on that thread, the one that
reads the notice: it is set aside, transaction open and turn held, and that thread resumes it
(:meth:`Engine.resume`) from its loop; a group is a generator of its steps for that reason.

In-memory effects of a group (frames staged, agents initialised or unpickled, actions for after
the commit, counters) are recorded in :class:`~aaabus.core.effects.TransactionEffects` with the way
to undo them, so that the transaction itself -- abort or savepoint rollback -- takes them back
together with the store. No code path undoes anything by hand.
"""

from __future__ import annotations

import collections
import importlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

import cloudpickle
from persistent import Persistent

from aaabus.config.trust import TrustPolicy
from aaabus.core.effects import TransactionEffects
from aaabus.core.failpoints import Failpoints
from aaabus.errors import BadBody, DependencyLost, EngineStopped, ReactionFailed, StoreWriteFailed
from aaabus.model.agent import Agent
from aaabus.model.context import running
from aaabus.model.ids import FACTORY_STAMP, FIRST_USER_STAMP, SERVER_STAMP, AgentId
from aaabus.model.notifications import (
    AgentCreateReply,
    AgentCreateRequest,
    ExceptionNotification,
    Notification,
    UnknownAgent,
)
from aaabus.wire.codec import Codec, is_pickle, travels_by_name
from aaabus.wire.message import Message

if TYPE_CHECKING:
    from aaabus.core.store import Store
    from aaabus.core.trace import Tracer

log = logging.getLogger("aaabus.engine")

#: Notifications that report an error: never answered with another error report, so that two
#: parties can never bounce errors at each other forever.
_ERROR_REPORTS = (ExceptionNotification, UnknownAgent)

Input = Callable[["Engine"], None]
#: Makes the one notification of the items gathered for a target (see Engine.gather).
Build = Callable[[tuple[Any, ...]], Any]
T = TypeVar("T")


class Channel(Protocol):
    """What the engine needs from the channel side for messages to other servers.

    Every method runs on the engine thread, inside the current group's transaction.
    """

    def knows(self, server: int) -> bool:
        """Whether ``server`` is part of the bus."""
        ...

    def send(self, message: Message) -> None:
        """Hold ``message`` for the next :meth:`seal` (same transaction)."""
        ...

    def seal(self) -> None:
        """End of an event: stamp all its held sends as one clock event and queue them
        persistently for their next hops (same transaction)."""
        ...

    def before_commit(self) -> Iterator[object]:
        """The group is about to commit: wait for what it depends on, send what may leave
        early (see :mod:`aaabus.core.early`); ``DependencyLost`` replays the group.

        A generator: what it yields sets the group aside until :meth:`Engine.resume` (a
        thread that runs groups inline and can come back to them: see
        :meth:`Engine.submit_many`); it yields nothing on any other thread."""
        ...


#: The steps of a group: what it yields while it is set aside (see Channel.before_commit).
Steps = Generator[object, None, None]


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


#: Consecutive failures of one group (outside agent code) before the engine gives up.
MAX_GROUP_FAILURES = 3


class EngineStats:
    """Counters of the engine thread; read by other threads without locking (ints are atomic).

    ``reactions``, ``sent`` and ``errors`` count committed work only: a group that aborts takes
    its counts back with its other effects (``reactions`` are added when the group commits), so
    that once a bus is idle the notifications sent by all servers equal those delivered by all
    servers. ``commits`` and ``aborts`` count attempts.
    """

    def __init__(self) -> None:
        self.reactions = 0
        self.sent = 0
        self.commits = 0
        self.aborts = 0
        self.errors = 0
        #: Inputs consumed without a reaction because their body did not decode (garbage from
        #: a peer, a type not registered here, a field of the wrong type): each is logged with
        #: its reason, the last one kept here, and its sender told (ExceptionNotification).
        self.dead_letters = 0
        self.last_dead_letter = ""
        self.commit_ns = 0
        self.commit_total_ns = 0
        self.started = time.time()


#: Volatile attribute marking an agent object whose on_init ran (see Engine._initialised).
_INITIALISED = "_v_aaabus_initialised"


def _forget_initialised(agent: Agent) -> None:
    agent.__dict__.pop(_INITIALISED, None)


def _decrement(obj: object, name: str) -> None:
    setattr(obj, name, getattr(obj, name) - 1)


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
        trust: TrustPolicy | None = None,
        codec: Codec | None = None,
    ) -> None:
        self.store = store
        #: What bodies and deployed agents may construct (aaabus.trust); the default trusts
        #: everything, which suits only an engine fed by its own process (tests, simulation).
        self.trust = trust or TrustPolicy(by_value=True)
        #: How bodies are decoded and encoded (aaabus.wire.codec); the default imports nothing
        #: and pickles what has no data form, which again suits only an engine fed by its own
        #: process.
        self.codec = codec or Codec(pickles=True)
        self.server_id = server_id
        self.channel = channel
        self.max_batch = max_batch
        self.max_group_s = max_group_s
        self.stats = EngineStats()
        #: In-memory effects of the open transaction, undone with it (see aaabus.core.effects).
        self.effects = TransactionEffects(store.tm, store.durable_at_vote)
        #: Failpoints of this engine and of its channel (see aaabus.core.failpoints).
        self.failpoints = Failpoints()
        #: Optional per-hop tracing (see aaabus.trace); set before start.
        self.tracer: Tracer | None = None
        self._me = AgentId.server_of(server_id)
        self._factory = AgentId.factory(server_id)
        self._inbox: collections.deque[Input] = collections.deque()
        self._lazy: list[Input] = []
        self.lazy_delay_s = 0.05
        # When the lazy work waiting now must be done at the latest (set as the first of it
        # arrives, cleared when a group takes it; guarded by _cond).
        self._lazy_deadline: float | None = None
        self._cond = threading.Condition()
        self._stopping = False
        self._current = self._me
        # Agents that came by value: unpickled once per boot (their box holds the durable copy).
        self._boxed: dict[AgentId, Agent] = {}
        # How the next groups run after a failure: `_careful` reactions one per transaction,
        # inputs one savepoint each.
        self._careful = 0
        self._careful_inputs = False
        self._failures = 0
        self._ready: collections.deque[Message] = collections.deque()
        self._ready_ok = False
        # While a group runs its reactions (not in careful mode): the messages to run next in
        # this group, ahead of qin, never written to it (see _group_steps). None otherwise.
        self._chain: collections.deque[Message | _Handed] | None = None
        # How many arrivals, then near sends, are left at the chain's head, and whether the
        # running reaction's local sends are near ones (see _group_steps).
        self._arrivals_left = 0
        self._near_left = 0
        self._near_sends = False
        # Folded targets (see fold): stamp -> the notification types a send hands over at once.
        self._folds: dict[int, tuple[type, ...]] = {}
        # Sends gathered in the open event (see gather): (sender, target) -> (build, items).
        self._gathered: dict[tuple[AgentId, AgentId], tuple[Build, list[Any]]] = {}
        self._listeners: list[Callable[[AgentId, Notification], None]] = []
        # System handlers (see handle): reserved stamp -> fn(sender, note), run as reactions.
        self._handlers: dict[int, Callable[[AgentId, Any], None]] = {}
        # In-memory observers (ReactionContext.notify): key -> observer, the values notified
        # in the open group, and one flusher per key (registered once per group).
        self._observers: dict[str, Callable[[list[object]], None]] = {}
        self._notified: dict[str, list[object]] = {}
        self._flushers: dict[str, Callable[[], None]] = {}
        self._thread = threading.Thread(
            target=self._run, name=name or f"engine-{server_id}", daemon=True
        )
        self._failure: BaseException | None = None
        #: Whether a thread that hands inputs over with ``run_here`` (the network's, for
        #: received frames) runs their group itself when the engine is idle, instead of waking
        #: the engine thread (property ``aaabus.engine.inline``): one thread wake-up less per
        #: hop. Set before start.
        self.run_inline = True
        # The turn: True while some thread runs a group (guarded by _cond). Groups never
        # overlap, so the store and everything reached from it still have one user at a time.
        self._busy = False
        # The engine thread sleeps with no deadline (idle with no lazy work, or waiting for
        # another thread's group with no lazy work due later): the first lazy work, or the
        # end of that group with lazy work due, must wake it (guarded by _cond).
        self._asleep_untimed = False
        self._started = False
        # What stopped a group run by another thread: the engine thread stops on it.
        self._inline_failure: BaseException | None = None
        # The group another thread runs inline, while it runs or is set aside (that thread's).
        self._aside: Steps | None = None
        self._on_exit = on_exit
        self._context = _EngineContext(self)

    # -- other threads ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._started = True

    def submit(self, item: Input) -> None:
        """Hand ``item`` to the engine thread; it runs inside the next group's transaction.

        ``item(engine)`` must only touch the store, and record any in-memory effect in
        :attr:`effects` (follow-up work goes to ``effects.after_commit``). If it raises, the
        group is aborted and its inputs are applied again, one savepoint each: an item that
        raises a second time is logged and dropped (an input that fails twice would fail
        forever), one that raised by accident (a transient fault) is applied once, as if the
        first attempt never happened.
        """
        with self._cond:
            self._inbox.append(item)
            self._wake_for_work()

    def submit_many(
        self, items: Iterable[Input], lazy: Iterable[Input] = (), *, run_here: bool = False
    ) -> object | None:
        """:meth:`submit` each of ``items`` and :meth:`submit_lazy` each of ``lazy``, in order,
        with one lock and one wake-up.

        ``run_here``: if the engine is idle (no group running, the engine thread waiting), the
        calling thread runs the group itself, with the same rules and the same store, and
        returns once it has committed; otherwise, or with :attr:`run_inline` off, the engine
        thread is woken as by :meth:`submit`. Whatever the group leaves (reactions beyond
        ``max_batch``, a replay after a failure) goes to the engine thread.

        Returns what the channel yielded if the group was set aside before its commit (the
        network's I/O thread waiting for a durability notice: see
        :meth:`Channel.before_commit`): the group keeps its transaction and the turn until the
        caller :meth:`resume`-s it or :meth:`cancel`-s it, on this same thread.
        """
        with self._cond:
            # Only a group of these very items runs here: older ones may have to wait for
            # something this thread itself must deliver (aaabus.core.early's notices).
            run_here = run_here and not self._inbox
            self._inbox.extend(items)
            armed = self._add_lazy(lazy) if lazy else False
            if not self._inbox:
                if armed:
                    self._wake_for_deadline()
                return None
            if not (run_here and self._may_take_turn()):
                self._wake_for_work()
                return None
            self._busy = True
            inputs = self._take_inputs()
        self._aside = self._group_steps(inputs)
        return self.resume()

    def resume(self) -> object | None:
        """Go on with the group set aside (the thread that set it aside): what it yields if it
        must wait again, else None once it committed or was replayed, the turn given back."""
        return self._step(None)

    def cancel(self, reason: str) -> None:
        """Give up the group set aside (the thread that set it aside): it is aborted and
        replayed, as when what it waited for is lost (``DependencyLost``)."""
        if self._step(DependencyLost(reason)) is not None:
            raise RuntimeError("a cancelled group asked to wait again")

    def _step(self, throw: DependencyLost | None) -> object | None:
        steps = self._aside
        assert steps is not None, "no group is set aside"
        failure: BaseException | None = None
        try:
            waiting = next(steps) if throw is None else steps.throw(throw)
            return waiting
        except StopIteration:
            pass
        except BaseException as exc:
            # The store failed under this thread (the group replays everything else itself):
            # the engine thread stops on it, exactly as if it had run the group.
            failure = exc
        self._aside = None
        with self._cond:
            self._busy = False
            self._inline_failure = failure
            if failure is not None or self._inbox or self._stopping or self.store.qin:
                self._cond.notify()
            elif self._lazy:
                self._wake_for_deadline()
        return None

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread, as ``#s.s.0``, inside the next group.

        The future resolves with ``fn``'s result once the group has committed; if ``fn`` raises,
        its own changes are rolled back (the rest of the group goes on) and the future fails.
        """
        future: Future[T] = Future()

        def apply(engine: Engine) -> None:
            if future.done():
                return  # the group was replayed after fn had already failed: it failed
            savepoint = engine.store.tm.savepoint()
            engine._current = engine._me
            try:
                with running(engine._context):
                    result = fn()
            except Exception as exc:
                savepoint.rollback()
                future.set_exception(exc)
                return
            engine.effects.after_commit(lambda: future.set_result(result))

        self.submit(apply)
        return future

    def run_batch(
        self,
        ops: Sequence[Callable[[], object]],
        done: Callable[[list[object]], None],
        *,
        run_here: bool = False,
        lazy: bool = False,
    ) -> None:
        """Run each of ``ops`` on the engine thread, as ``#s.s.0``, in the next group; then call
        ``done(outcomes)`` once that group is durable (engine thread: it must not block).

        An outcome is what its op returned, or the exception it raised, its changes rolled back
        alone. Cheaper than one :meth:`call` per op for a front end that gathers many small
        operations (the MQTT listener): one input, one after-commit action, and no savepoint
        unless an op raises -- then the group is aborted and replayed, this batch with one
        savepoint per op, so an op that raises is expected to be rare (a bug, not a refusal:
        refusals are outcomes). ``run_here``: as for :meth:`submit_many` (the calling thread
        runs the group if the engine is idle, and ``done`` then runs on it). ``lazy``: as for
        :meth:`submit_lazy`, the batch rides along with the next group (or waits
        ``lazy_delay_s``): for writes nobody waits for, such as a device's acknowledgements.
        """
        attempts = 0

        def apply(engine: Engine) -> None:
            nonlocal attempts
            attempts += 1
            careful = attempts > 1
            outcomes: list[object] = []
            engine._current = engine._me
            with running(engine._context):
                for op in ops:
                    if not careful:
                        outcomes.append(op())
                        continue
                    savepoint = engine.store.tm.savepoint()
                    try:
                        outcomes.append(op())
                    except Exception as exc:
                        savepoint.rollback()
                        outcomes.append(exc)
            engine.effects.when_durable(lambda: done(outcomes))

        if lazy:
            self.submit_lazy(apply)
        else:
            self.submit_many((apply,), run_here=run_here)

    def observe(self, key: str, observer: Callable[[list[object]], None]) -> None:
        """Call ``observer(values)`` once per durable group with the values that its reactions
        handed over with :meth:`ReactionContext.notify` under ``key``, in order (engine thread:
        it must not block). Engine thread, or before start."""
        self._observers[key] = observer

        def flush() -> None:
            values = self._notified.pop(key, None)
            if values:
                observer(values)

        self._flushers[key] = flush

    def unobserve(self, key: str) -> None:
        """Stop :meth:`observe`-ing ``key`` (engine thread)."""
        self._observers.pop(key, None)
        self._flushers.pop(key, None)

    def _notify(self, key: str, value: object) -> None:
        flusher = self._flushers.get(key)
        if flusher is None:
            return
        values = self._notified.get(key)
        if values is None:
            values = self._notified[key] = []
            self.effects.undo(self._notified.pop, key, None)
        values.append(value)
        self.effects.undo(values.pop)
        self.effects.when_durable_once(flusher)

    def submit_lazy(self, item: Input) -> None:
        """Like :meth:`submit`, for work that may wait: it rides along with the next group.

        Used for acknowledgements: applying one costs a commit of its own if done at once, while
        delaying it only keeps a message in an outgoing queue a little longer (a crash meanwhile
        means one more resend, absorbed as a duplicate). If nothing else happens, lazy work is
        done after ``lazy_delay_s``.
        """
        with self._cond:
            if self._add_lazy((item,)):
                self._wake_for_deadline()

    def _may_take_turn(self) -> bool:
        """Whether a thread other than the engine's may run a group now (holding _cond): inline
        groups on, the engine started, idle, not stopping and not failed."""
        return (
            self.run_inline
            and self._started
            and not self._busy
            and not self._stopping
            and self._inline_failure is None
            and self._failure is None
        )

    def _add_lazy(self, items: Iterable[Input]) -> bool:
        """Queue lazy work (holding _cond); True if it is the first, which arms the deadline
        (the caller then wakes the engine thread if it must learn of it)."""
        first = not self._lazy
        self._lazy.extend(items)
        if first and self._lazy:
            self._lazy_deadline = time.monotonic() + self.lazy_delay_s
            return True
        return False

    # Waking the engine thread costs the waker a futex call and, on a VM, an interrupt to the
    # other CPU: tens of µs, measured on the I/O thread of a remote hop, on the critical path.
    # So it is woken only when nobody else will act on the work: not while a group runs (its
    # end looks for more work: the engine thread's loop, or the inline runner's release), and
    # for a lazy deadline only when it sleeps without one (waiting for another's group, it
    # comes back by itself at the deadline of lazy work queued before).

    def _wake_for_work(self) -> None:
        """New inputs are queued (holding _cond)."""
        if not self._busy:
            self._cond.notify()

    def _wake_for_deadline(self) -> None:
        """The first lazy work is queued (holding _cond)."""
        if self._asleep_untimed:
            self._cond.notify()

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

    def handle(self, stamp: int, fn: Callable[[AgentId, Any], None]) -> None:
        """Run ``fn(sender, note)`` for every notification to ``#s.s.<stamp>`` of this server,
        *inside* the reaction, in its transaction (set before start).

        For the server's own system handlers that are not stored agents (the moves of MQTT
        sessions, ``#s.s.3``): ``fn`` runs as a reaction of that id -- its sends have it as
        sender, it may deploy and notify observers, and if it raises the reaction is rolled back
        and its sender told, as for any agent. ``stamp`` must be a reserved one other than the
        server's and the factory's.
        """
        if stamp in (SERVER_STAMP, FACTORY_STAMP) or not 0 <= stamp < FIRST_USER_STAMP:
            raise ValueError(f"stamp {stamp} cannot have a system handler")
        self._handlers[stamp] = fn

    def fold(self, stamp: int, kinds: tuple[type, ...]) -> None:
        """Hand the notifications of ``kinds`` sent to this server's system agent
        ``#s.s.<stamp>`` to that agent's ``react`` at once, inside the sending reaction, instead
        of queueing them (set before start).

        For the topic representative (``#s.s.2``): an agent's publication is then delivered to
        this server's subscribers and relayed to the others' within the publishing reaction,
        one reaction and two queued records less per publication. The agent reacts as if the
        notification arrived now, with itself as the current agent (its sends have it as
        sender); its changes and sends belong to the sending reaction, committed or rolled back
        with it, and what it raises fails that reaction.

        Why the order is kept: the engine runs one thing at a time, so the agent sees the
        notification at a point of this server's sequential history. It may overtake messages
        queued for the agent, but none of those is causally before the sending reaction:
        everything that is, and was sent to this server, was queued ahead of the sender's own
        input and handled before it ran (qin is one FIFO, filled in causal order). Fold every
        kind whose relative order matters (for topics: publications *and* subscriptions, so
        that an agent's subscription never trails its later publication).
        """
        if not 0 <= stamp < FIRST_USER_STAMP or stamp in (SERVER_STAMP, FACTORY_STAMP):
            raise ValueError(f"stamp {stamp} cannot be folded")
        self._folds[stamp] = kinds

    def add_listener(self, listener: Callable[[AgentId, Notification], None]) -> None:
        """Call ``listener(sender, note)`` after commit for notifications to ``#s.s.0``.

        Runs on the engine thread: it must not block.
        """
        self._listeners.append(listener)

    # -- engine thread --------------------------------------------------------------------------

    def after_commit(self, action: Callable[[], object]) -> None:
        """Run ``action`` once the current group has committed (dropped if it aborts)."""
        self.effects.after_commit(action)

    def run_in_transaction(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` as a boot-time operation with ``#s.s.0`` as sender, and commit it."""
        self._current = self._me
        try:
            with running(self._context):
                fn()
            _to_the_end(self._commit_steps())
        except BaseException:
            self._abort()
            raise

    def _run(self) -> None:
        try:
            while True:
                inputs = self._wait_for_work()
                if inputs is None:
                    return
                # A group that raises keeps the turn (below): no other thread may start one
                # on a store that failed, nor between the failure and the abort.
                _to_the_end(self._group_steps(inputs))
                with self._cond:
                    self._busy = False
        except BaseException as exc:  # the store failed: stop rather than acknowledge anything
            with self._cond:
                self._busy = True  # the turn is the engine's for good (an inline group's too)
                self._failure = exc
            # A failed write explains itself in one line; anything else is a bug: full trace.
            expected = isinstance(exc, StoreWriteFailed | EngineStopped)
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
        """The inputs of the next group, once this thread has the turn; None to stop."""
        with self._cond:
            while True:
                if self._inline_failure is not None:
                    raise self._inline_failure
                if self._busy:
                    # Another thread runs a group (see submit_many): the store is not ours to
                    # read, not even qin. Its end wakes us for work it leaves (inbox, qin,
                    # failure, stop) and for lazy work if we sleep without a deadline; lazy
                    # work not yet due we come back for by ourselves, at its deadline (the
                    # group may end first and take it: the wait is then a stale one).
                    deadline = self._lazy_deadline
                    remaining = 0.0 if deadline is None else deadline - time.monotonic()
                    if remaining > 0:
                        self._cond.wait(remaining)
                    else:
                        self._sleep_untimed()
                    continue
                if self._stopping:
                    return None
                if self._inbox or self.store.qin:
                    break
                if self._lazy:
                    deadline = self._lazy_deadline
                    assert deadline is not None  # armed with the first lazy work (_add_lazy)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                else:
                    self._sleep_untimed()
            self._busy = True
            return self._take_inputs()

    def _sleep_untimed(self) -> None:
        """Wait without a deadline (holding _cond): lazy work must wake us (_wake_for_deadline)."""
        self._asleep_untimed = True
        try:
            self._cond.wait()
        finally:
            self._asleep_untimed = False

    def _take_inputs(self) -> list[Input]:
        inputs = self._lazy + list(self._inbox)
        self._lazy = []
        self._lazy_deadline = None
        self._inbox.clear()
        return inputs

    def _group_steps(self, inputs: list[Input]) -> Steps:
        """One transaction: apply ``inputs``, run reactions, commit; recover from any failure.
        Yields while it waits, set aside, before its commit (see :meth:`submit_many`).

        Three kinds of failure, each ending in an abort (which takes back every effect of the
        group, in the store and in memory) and a replay of the same inputs:

        * an input raised: the inputs are applied again one savepoint each, so that one failing
          twice is dropped alone (garbage from a peer) and one that failed once by accident is
          simply applied;
        * a reaction raised: the reactions are replayed one per transaction, each under a
          savepoint, so that the failing one is rolled back alone (see :meth:`_react_one`);
        * anything else (the commit, the engine's own steps): the group is replayed the same
          careful way; after :data:`MAX_GROUP_FAILURES` failures in a row the engine stops.
        """
        reactions = 0
        self._ready_ok = not self._careful
        try:
            if self._careful_inputs:
                self._careful_inputs = False
                self._apply_carefully(inputs)
            else:
                self._apply(inputs)
        except Exception:
            self._abort()
            self._drop_input(dropped=False)
            self._careful_inputs = True
            self._requeue(inputs)
            return
        try:
            self._ready_ok = False
            # Messages that arrived deliverable while the input queue was empty are run at once,
            # without ever being written to it: two records less in this commit.
            # The reactions' context is set once for all of them (it is the same object), not
            # around the commit: after-commit actions are not reactions.
            with running(self._context):
                careful = bool(self._careful)
                ready = self._ready
                chain: collections.deque[Message | _Handed] = collections.deque(ready)
                if ready:
                    # Taken all at once (nothing is added while reactions run: _ready_ok is
                    # off), with one undo entry rather than one per message.
                    self.effects.undo(ready.extend, list(chain))  # before the clear it undoes
                    ready.clear()
                # The chain: messages this group runs ahead of qin without writing them to it
                # (two records less each), first those that arrived deliverable, then the local
                # sends of its reactions made while qin is empty (route). Its order is qin's: a
                # message joins it only while qin is empty, so it precedes everything in qin,
                # and it runs first. In careful mode everything goes through qin, one reaction
                # per transaction.
                self._chain = None if careful else chain
                # What the chain holds, from its head: arrivals, then the sends of arrivals and
                # of qin's reactions (a publication's deliveries to local subscribers), then
                # deeper sends (an agent's message to itself, again and again). The first two
                # always run in this group: they are bounded by what came in. The rest counts
                # against max_batch and max_group_ms as qin's reactions do, and what is left at
                # the bound goes to qin.
                self._arrivals_left = len(chain)
                self._near_left = 0
                limit = 1 if careful else self.max_batch
                deadline = time.perf_counter() + self.max_group_s
                qin = self.store.qin
                try:
                    while True:
                        if chain:
                            if self._arrivals_left:
                                self._arrivals_left -= 1
                                self._near_sends = True
                            elif self._near_left:
                                self._near_left -= 1
                                self._near_sends = False
                            elif reactions >= limit and not qin:
                                # The group's bound (max_batch, or its time is up): the deeper
                                # sends left go to qin, in order (qin is empty here: a message
                                # joins the chain only then, and nothing joins qin while the
                                # chain holds one).
                                for msg in chain:
                                    qin.put(self._as_message(msg))
                                chain.clear()
                                break
                            else:
                                self._near_sends = False
                            self._react_one(chain.popleft(), careful=False)
                        elif qin and reactions < limit:
                            self._near_sends = True
                            self._react_one(qin.peek(), careful=careful, from_qin=True)
                        else:
                            break
                        reactions += 1
                        if time.perf_counter() > deadline:
                            limit = min(limit, reactions)
                finally:
                    self._chain = None
            yield from self._commit_steps()
            # Counted once committed, all at once: an aborted group counts nothing.
            self.stats.reactions += reactions
        except ReactionFailed:
            self._abort()
            # Replay one reaction per transaction; the failing one is then alone in its own.
            self._careful = reactions + 1
            self._requeue(inputs)
            return
        except DependencyLost as exc:
            # Not a failure of the group: a frame it applied will never be vouched for. The
            # replay drops that frame (its sender resends it if it was durable after all).
            self._abort()
            log.info("server %s: group replayed: %s", self.server_id, exc)
            self._requeue(inputs)
            return
        except Exception as exc:
            self._abort()
            self._failures += 1
            if self._failures >= MAX_GROUP_FAILURES:
                raise EngineStopped(
                    f"server {self.server_id} failed {self._failures} times in a row to run and "
                    f"commit the same group ({type(exc).__name__}: {exc}); see the log"
                ) from exc
            log.error(
                "server %s: group failed (%s: %s); replaying it carefully",
                self.server_id,
                type(exc).__name__,
                exc,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            self._careful = reactions + 1
            self._careful_inputs = True
            self._requeue(inputs)
            return
        self._failures = 0
        if self._careful:
            self._careful = max(0, self._careful - reactions)

    def _apply(self, inputs: list[Input]) -> None:
        failpoints = self.failpoints
        for item in inputs:
            if failpoints.armed:
                failpoints.hit("engine.input")
            item(self)
            self._seal()

    def _apply_carefully(self, inputs: list[Input]) -> None:
        """Apply inputs one savepoint each: a failing one is rolled back and dropped alone."""
        failpoints = self.failpoints
        for item in inputs:
            savepoint = self.store.tm.savepoint()
            try:
                if failpoints.armed:
                    failpoints.hit("engine.input")
                item(self)
                self._seal()
            except Exception:
                savepoint.rollback()
                self._drop_input(dropped=True)

    def _drop_input(self, dropped: bool) -> None:
        """Log the input that just raised (a bug, garbage or a transient fault)."""
        if dropped:
            self.stats.errors += 1
        log.log(
            logging.ERROR if dropped else logging.INFO,
            "server %s: %s an input that failed: %s",
            self.server_id,
            "dropping" if dropped else "will retry",
            traceback.format_exc(limit=4).strip().splitlines()[-1],
            exc_info=log.isEnabledFor(logging.DEBUG),
        )

    def _requeue(self, inputs: Iterable[Input]) -> None:
        with self._cond:
            self._inbox.extendleft(reversed(list(inputs)))

    def _seal(self) -> None:
        """End of an event (a reaction or an input): send what it gathered, then stamp its
        remote sends as one clock event."""
        if self._gathered:
            self._send_gathered()
        if self.channel is not None:
            self.channel.seal()

    def gather(self, to: AgentId, item: object, build: Build) -> None:
        """Send ``build(items)`` to ``to`` at the end of this event, ``items`` being every item
        gathered for ``to`` by the current agent in the event, in order (see
        :meth:`ReactionContext.gather`)."""
        key = (self._current, to)
        entry = self._gathered.get(key)
        if entry is None:
            entry = self._gathered[key] = (build, [])
            self.effects.undo(self._gathered.pop, key, None)
        items = entry[1]
        items.append(item)
        self.effects.undo(items.pop)

    def _send_gathered(self) -> None:
        gathered = self._gathered
        self._gathered = {}
        self.effects.undo(setattr, self, "_gathered", gathered)
        for (sender, to), (build, items) in gathered.items():
            self._send_from(sender, to, build(tuple(items)))

    def _commit_steps(self) -> Steps:
        # Sends made outside any reaction or input (boot-time operations) are one last event.
        self._seal()
        failpoints = self.failpoints
        if failpoints.armed:
            failpoints.hit("engine.commit")
        tracer = self.tracer
        clock_bytes = 0
        if tracer is not None:
            clock_bytes = tracer.before_commit()
            tracer.mark("commit")
        if self.channel is not None:
            yield from self.channel.before_commit()
        t0 = time.perf_counter_ns()
        # The effects' after-commit actions run inside this call, once the store is durable.
        self.store.commit()
        self.stats.commit_ns = time.perf_counter_ns() - t0
        self.stats.commit_total_ns += self.stats.commit_ns
        self.stats.commits += 1
        if tracer is not None:
            voted = self.store.vote_marks()
            if voted is not None and voted[0] >= t0:  # else this commit voted nothing
                for name, at in zip(("vote", "written", "synced"), voted, strict=True):
                    tracer.mark(name, at)
            tracer.committed(self.stats.commit_ns, clock_bytes)

    def _abort(self) -> None:
        self.store.abort()  # the effects of the group are undone with it
        self.stats.aborts += 1

    # -- one reaction ---------------------------------------------------------------------------

    def deliver(self, msg: Message) -> None:
        """Queue a message that became deliverable here (engine thread, in the group)."""
        if self._ready_ok and not self.store.qin:
            self._ready.append(msg)
            self.effects.undo(self._ready.pop)
        else:
            self.store.qin.put(msg)

    def _as_message(self, msg: Message | _Handed) -> Message:
        """A chain's entry as qin holds it: a handed-over note encoded."""
        if isinstance(msg, _Handed):
            return Message(msg.sender, msg.target, self.codec.encode(msg.note))
        return msg

    def _react_one(self, msg: Message | _Handed, careful: bool, from_qin: bool = False) -> None:
        # In careful mode the reaction gets a savepoint of its own, so that it can be rolled
        # back alone without losing the inputs applied earlier in the same group.
        savepoint = self.store.tm.savepoint() if careful else None
        if from_qin:
            self.store.qin.pop()
        # (Counted in stats.reactions by the caller, once the group has committed.)
        failpoints = self.failpoints
        tracer = self.tracer
        if tracer is not None:
            tracer.mark("react_start")
        target = msg.target
        note: Any = None
        self._current = target
        try:
            # Decoded inside the try: a body this server cannot decode (a type not registered
            # here, a field of the wrong type, garbage from a peer) fails this reaction alone,
            # like a raising react: consumed, its sender told, counted as a dead letter.
            note = msg.note if isinstance(msg, _Handed) else self.codec.decode(msg.body)
            # (The reaction's context is set by the caller, for the group's reactions.)
            if target.stamp == FACTORY_STAMP:
                self._factory_react(msg.sender, note, careful)
            elif target.stamp < FIRST_USER_STAMP and target.stamp in self._handlers:
                self._handlers[target.stamp](msg.sender, note)
            elif target.stamp == SERVER_STAMP:
                for listener in self._listeners:
                    self.after_commit(lambda ln=listener: ln(msg.sender, note))  # type: ignore[misc]
            else:
                agent = self._load(target)
                if agent is None:
                    self._unknown_agent(msg.sender, target, note)
                else:
                    if failpoints.armed:
                        failpoints.hit("engine.react")
                    agent.react(msg.sender, note)
                    if failpoints.armed:
                        failpoints.hit("engine.reacted")
                    self._finish(target, agent)
            if tracer is not None:
                tracer.mark("reacted")
            # A reaction is one event: its remote sends are counted and stamped together.
            self._seal()
            if tracer is not None:
                tracer.mark("sealed")
        except Exception as exc:
            if savepoint is None:
                raise ReactionFailed() from exc
            savepoint.rollback()
            self._report_failure(self._as_message(msg), note, exc)

    def _count(self, name: str) -> None:
        """Count one committed event in :attr:`stats` (taken back if the group aborts)."""
        stats = self.stats
        setattr(stats, name, getattr(stats, name) + 1)
        self.effects.undo(_decrement, stats, name)

    def _report_failure(self, msg: Message, note: Any, exc: Exception) -> None:
        """Consume the input of a failed reaction and tell its sender (careful mode)."""
        self.store.qin.pop()
        self._count("errors")
        if isinstance(exc, BadBody):
            self._count("dead_letters")
            self.stats.last_dead_letter = f"from {msg.sender} to {msg.target}: {exc}"
            log.warning(
                "server %s: dead letter from %s to %s: %s",
                self.server_id,
                msg.sender,
                msg.target,
                exc,
            )
        else:
            log.warning(
                "server %s: reaction of %s to %s from %s raised %s: %s",
                self.server_id,
                msg.target,
                type(note).__name__,
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
                agent = self._boxed[agent_id] = self.trust.loads(entry.blob)
            # The reaction may change the unpickled agent in memory: if it is rolled back, the
            # next reaction must start again from the box, which the rollback left as it was.
            self.effects.undo(self._boxed.pop, agent_id, None)
        else:
            agent = entry
        return self._ready_to_react(agent)

    def _ready_to_react(self, agent: Agent) -> Agent:
        """``agent``, its ``on_init(False)`` run if it has not run on this object yet."""
        if not getattr(agent, _INITIALISED, False):
            agent.on_init(False)
            self._initialised(agent)
        return agent

    def _initialised(self, agent: Agent) -> None:
        """Mark ``agent``'s in-memory state as initialised (its ``on_init`` ran on it).

        The mark is a volatile attribute of the agent itself: ZODB drops it whenever it resets
        the object (a rollback of a transaction that changed the agent, an eviction from the
        cache), which is exactly when what ``on_init`` rebuilt in memory is gone too. It is also
        taken back with the transaction in which ``on_init`` ran, so that a rolled-back
        ``on_init`` (and whatever it sent) runs again on the replay.
        """
        setattr(agent, _INITIALISED, True)
        self.effects.undo(_forget_initialised, agent)

    def _finish(self, agent_id: AgentId, agent: Agent) -> None:
        """After a reaction: refresh the box of an agent that came by value (unless deleted)."""
        if agent_id in self._boxed:
            self.store.agents[(agent_id.origin, agent_id.stamp)].blob = cloudpickle.dumps(agent)

    def _delete(self, agent_id: AgentId) -> None:
        """Remove the reacting agent now: the store and memory get it back if the group aborts."""
        self.store.agents.pop((agent_id.origin, agent_id.stamp), None)
        boxed = self._boxed.pop(agent_id, None)
        if boxed is not None:
            self.effects.undo(self._boxed.__setitem__, agent_id, boxed)
        if self.failpoints.armed:
            self.failpoints.hit("engine.delete")

    def _fold(self, target: AgentId, note: Any) -> bool:
        """Run ``target``'s reaction to ``note`` now, inside the current one (see :meth:`fold`);
        False if it is not stored here (yet), to send ``note`` as a message instead."""
        entry = self.store.agents.get((target.origin, target.stamp))
        if entry is None or isinstance(entry, AgentBox):
            return False
        sender = self._current
        self._current = target
        try:
            self._ready_to_react(entry).react(sender, note)
        finally:
            self._current = sender
        return True

    # -- the factory (#s.s.1) --------------------------------------------------------------------

    def _factory_react(self, sender: AgentId, note: Any, careful: bool) -> None:
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
            # The creation and on_init(True) share a savepoint: if either fails, everything
            # they did (the stored agent, what on_init sent, its in-memory marks) is undone.
            # A failure is final only when the creation ran alone (careful mode), like the
            # failure of any reaction: in a group it may be a fault of the moment, so the group
            # is replayed first.
            savepoint = self.store.tm.savepoint()
            try:
                self._create(agent_id, note.agent)
            except Exception as exc:
                if not careful:
                    raise
                savepoint.rollback()
                error = f"{type(exc).__name__}: {exc}"
            finally:
                self._current = self._factory
        if error:
            log.warning("server %s: cannot create %s: %s", self.server_id, agent_id, error)
        if note.reply and sender.stamp != SERVER_STAMP:
            self._send_from(self._factory, sender, AgentCreateReply(agent_id, not error, error))

    def _create(self, agent_id: AgentId, payload: bytes) -> None:
        failpoints = self.failpoints
        key = (agent_id.origin, agent_id.stamp)
        if is_pickle(payload):
            # By value: code, loaded only where the operator allowed it (trust.by_value).
            if not self.trust.by_value:
                raise BadBody(
                    f"agent {agent_id} came by value (code) and server {self.server_id} does not "
                    "load code: deploy a class of a module the servers import, or set property "
                    "aaabus.trust.by_value (docs/security.md)"
                )
            agent = self.trust.loads(payload)
        else:
            agent = self.codec.decode_agent(payload)
        if not isinstance(agent, Agent):
            raise TypeError(f"{type(agent).__name__} is not an aaabus.Agent")
        agent._aaabus_id = agent_id
        by_value = not _importable(type(agent))
        self.store.agents[key] = AgentBox(agent) if by_value else agent
        if failpoints.armed:
            failpoints.hit("factory.create")
        self._current = agent_id
        agent.on_init(True)
        self._initialised(agent)
        if failpoints.armed:
            failpoints.hit("factory.on_init")
        if by_value:
            self._boxed[agent_id] = agent
            self.effects.undo(self._boxed.pop, agent_id, None)
            self._finish(agent_id, agent)

    def install(self, agent_id: AgentId, agent: Agent) -> Agent:
        """Store ``agent`` under the reserved ``agent_id`` unless an agent is there already;
        return the stored one. Engine thread, in a transaction (the boot's).

        For the system agents every server has (the topic representative ``#s.s.2``): created
        by the server itself at boot, not deployed, so no reaction runs and nothing is sent;
        ``on_init(False)`` runs before its first reaction as for any agent.
        """
        if not agent_id.is_system or agent_id.server != self.server_id:
            raise ValueError(f"{agent_id} is not a system agent id of server {self.server_id}")
        key = (agent_id.origin, agent_id.stamp)
        stored: Agent | None = self.store.agents.get(key)
        if stored is None:
            agent._aaabus_id = agent_id
            self.store.agents[key] = stored = agent
        return stored

    # -- sending (the ReactionContext the agents see) ----------------------------------------------

    def _send_from(self, sender: AgentId, to: AgentId, note: Notification) -> None:
        self.route(Message(sender, to, self.codec.encode(note)))

    def send(self, to: AgentId, note: Notification) -> None:
        """Send ``note`` to ``to`` in the current group, as ``send_to`` does in a reaction.

        Engine thread only (a boot service, or a function passed to :meth:`call`). The sender
        is the agent reacting now, or the server itself (``#s.s.0``) outside a reaction.
        Raises ``TypeError`` for a target that is not an :class:`AgentId`.
        """
        self._context.send(to, note)

    def _hand_over(self, to: AgentId, note: Notification) -> None:
        """Send ``note`` to ``to`` from the current agent, the object itself if it runs in this
        group (see :meth:`ReactionContext.hand_over`), else encoded as any send."""
        if to.server != self.server_id or not self._chain_open():
            self._send_from(self._current, to, note)
            return
        self._chain_append(_Handed(self._current, to, note))
        self._sent()

    def route(self, msg: Message) -> None:
        """Queue ``msg`` in this group: locally into qin, else through the channel.

        Engine thread only. A target on a server that is not part of the bus cannot exist: the
        sender gets its ``UnknownAgent`` at once.
        """
        to = msg.target
        if to.server == self.server_id:
            if self._chain_open():
                self._chain_append(msg)
            else:
                self.store.qin.put(msg)
        elif self.channel is not None and self.channel.knows(to.server):
            self.channel.send(msg)
        else:
            self._unknown_agent(msg.sender, to, self.codec.decode(msg.body))
            return
        self._sent()

    def _sent(self) -> None:
        self._count("sent")
        if self.failpoints.armed:
            self.failpoints.hit("engine.send")

    def _chain_open(self) -> bool:
        """Whether a local message sent now joins the chain (see _group_steps): reactions are
        running outside careful mode and qin is empty."""
        return self._chain is not None and not self.store.qin

    def _chain_append(self, entry: Message | _Handed) -> None:
        """Run ``entry`` later in this group, never written to qin. No undo entry: the chain
        exists only while reactions run outside careful mode, where any failure aborts the
        whole group and the chain with it."""
        assert self._chain is not None
        self._chain.append(entry)
        if self._near_sends:
            self._near_left += 1


class _Handed(NamedTuple):
    """A chain's entry that is a notification handed over as an object (never encoded unless
    it must wait in qin): see :meth:`ReactionContext.hand_over`."""

    sender: AgentId
    target: AgentId
    note: Notification


def _to_the_end(steps: Steps) -> None:
    """Run a group's steps on a thread that never sets a group aside (the channel yields
    nothing there)."""
    for waiting in steps:
        raise RuntimeError(f"a group asked to be set aside on a thread that cannot: {waiting!r}")


class _EngineContext:
    """The :class:`~aaabus.model.context.ReactionContext` the engine installs around a reaction."""

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
        engine = self._engine
        if engine._folds:
            kinds = engine._folds.get(to.stamp)
            if (
                kinds is not None
                and isinstance(note, kinds)
                and to.server == to.origin == engine.server_id
                and engine._fold(to, note)
            ):
                return
        engine._send_from(engine._current, to, note)

    def send_all(self, targets: Iterable[AgentId], note: Notification) -> None:
        engine = self._engine
        sender = engine._current
        body: bytes | None = None
        for to in targets:
            if not isinstance(to, AgentId):
                raise TypeError(f"send_all() needs AgentIds, got {type(to).__name__}")
            if body is None:
                body = engine.codec.encode(note)
            engine.route(Message(sender, to, body))

    def gather(self, to: AgentId, item: object, build: Build) -> None:
        self._engine.gather(to, item, build)

    def hand_over(self, to: AgentId, note: Notification) -> None:
        if not isinstance(to, AgentId):
            raise TypeError(f"hand_over() needs an AgentId, got {type(to).__name__}")
        self._engine._hand_over(to, note)

    def deploy(self, agent: Agent, server: int, reply: bool) -> AgentId:
        engine = self._engine
        record = engine.store.record
        stamp = max(record.next_stamp, FIRST_USER_STAMP)
        record.next_stamp = stamp + 1
        agent_id = AgentId(engine.server_id, server, stamp)
        # The caller's object learns its id now; if the deployment is rolled back (the reaction,
        # or a call's group, is replayed), it must be deployable again.
        agent._aaabus_id = agent_id
        engine.effects.undo(setattr, agent, "_aaabus_id", None)
        if travels_by_name(type(agent)):
            payload = engine.codec.encode_agent(agent)  # TypeError names an attribute
        else:
            # A class defined in __main__ or a function: by value, which the target loads
            # only if its operator allowed code.
            payload = cloudpickle.dumps(agent)
        engine._send_from(
            engine._current, AgentId.factory(server), AgentCreateRequest(agent_id, payload, reply)
        )
        return agent_id

    def notify(self, key: str, value: object) -> None:
        self._engine._notify(key, value)

    def delete(self, agent_id: AgentId) -> None:
        engine = self._engine
        if agent_id != engine._current or agent_id.server != engine.server_id:
            raise RuntimeError("an agent can only delete itself, from its own reaction")
        engine._delete(agent_id)
