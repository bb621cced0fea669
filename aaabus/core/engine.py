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
functions, listeners and after-commit actions alike). The turn is a token
(:class:`~aaabus.core.turn.Turn`) handed to the group its holder runs, never inferred from which
thread runs it. The price: while a reaction runs there,
that I/O thread reads no other socket, which is also back-pressure. A group run there that
must wait for a durability notice before its commit does not wait on that thread, the one that
reads the notice: it is set aside, transaction open and turn held, and that thread resumes it
(:meth:`Engine.resume`) from its loop; a group is a generator of its steps for that reason.

In-memory effects of a group (frames staged, agents initialised or unpickled, actions for after
the commit, counters) are recorded in :class:`~aaabus.core.effects.TransactionEffects` with the way
to undo them, so that the transaction itself -- abort or savepoint rollback -- takes them back
together with the store. No code path undoes anything by hand.

The engine is a façade over its rooms, each one idea: :mod:`aaabus.core.turn` (who runs the next
group, and the work waiting for it), :mod:`aaabus.core.group` (the group transaction: inputs,
reactions, the chain, commit, replay), :mod:`aaabus.core.sends` (what a reaction does: sends,
gathering, handing over, the one fold mechanism, observers: the reaction context) and
:mod:`aaabus.core.factory` (the factory ``#s.s.1`` and the stored agents). The order in which
a commit's data managers run is :mod:`aaabus.core.commitorder`'s.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

from aaabus.config.trust import TrustPolicy
from aaabus.core.effects import TransactionEffects
from aaabus.core.factory import AgentBox, Factory
from aaabus.core.failpoints import Failpoints
from aaabus.core.group import MAX_GROUP_FAILURES, EngineStats, Group, Steps, to_the_end
from aaabus.core.sends import NOT_FOLDED, Build, ChannelPort, Entry, Sends
from aaabus.core.turn import Input, Turn, Turns
from aaabus.errors import DependencyLost, EngineStopped, StoreWriteFailed
from aaabus.model.agent import Agent
from aaabus.model.context import running
from aaabus.model.ids import FACTORY_STAMP, FIRST_USER_STAMP, SERVER_STAMP, AgentId
from aaabus.model.notifications import Notification
from aaabus.wire.codec import Codec
from aaabus.wire.message import Message

if TYPE_CHECKING:
    from aaabus.core.store import Store
    from aaabus.core.trace import Tracer

__all__ = [
    "MAX_GROUP_FAILURES",
    "NOT_FOLDED",
    "AgentBox",
    "Build",
    "ChannelPort",
    "Engine",
    "EngineStats",
    "Input",
    "Steps",
]

log = logging.getLogger("aaabus.engine")

T = TypeVar("T")


class Engine:
    """Runs reactions, one at a time, in committed groups. See the module docstring.

    Other threads talk to it only through :meth:`submit` and its variants (hand inputs over),
    :meth:`call`, :meth:`run_batch`, :meth:`resume`/:meth:`cancel` (a group they set aside)
    and :meth:`stop`.
    """

    def __init__(
        self,
        store: Store,
        server_id: int,
        *,
        channel: ChannelPort | None = None,
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
        #: The agent reacting now (the sender of what is sent), ``#s.s.0`` outside reactions.
        self.current = self._me = AgentId.server_of(server_id)
        #: The rooms (see the module docstring).
        self.turns = Turns(lambda: bool(store.qin))
        self.group = Group(self)
        self.sends = Sends(self)
        self.factory = Factory(self)
        name = name or f"engine-{server_id}"
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        # The engine thread's own turn (it may not set a group aside: nobody would resume it).
        self._own_turn = Turn(name, may_set_aside=False)
        # The group another thread runs inline, while it runs or is set aside, and its turn.
        self._aside: Steps | None = None
        self._aside_turn: Turn | None = None
        self._on_exit = on_exit

    # -- settings -------------------------------------------------------------------------------

    @property
    def run_inline(self) -> bool:
        """Whether a thread that hands inputs over with ``run_here`` (the network's, for
        received frames) runs their group itself when the engine is idle, instead of waking
        the engine thread (property ``aaabus.engine.inline``): one thread wake-up less per
        hop. Set before start."""
        return self.turns.run_inline

    @run_inline.setter
    def run_inline(self, value: bool) -> None:
        self.turns.run_inline = value

    @property
    def lazy_delay_s(self) -> float:
        """How long lazy work waits for a group to ride along with (see :meth:`submit_lazy`)."""
        return self.turns.lazy_delay_s

    @lazy_delay_s.setter
    def lazy_delay_s(self, value: float) -> None:
        self.turns.lazy_delay_s = value

    # -- other threads ------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self.turns.started = True

    def submit(self, item: Input) -> None:
        """Hand ``item`` to the engine thread; it runs inside the next group's transaction.

        ``item(engine)`` must only touch the store, and record any in-memory effect in
        :attr:`effects` (follow-up work goes to ``effects.after_commit``). If it raises, the
        group is aborted and its inputs are applied again, one savepoint each: an item that
        raises a second time is logged and dropped (an input that fails twice would fail
        forever), one that raised by accident (a transient fault) is applied once, as if the
        first attempt never happened.
        """
        self.turns.submit(item)

    def submit_many(
        self,
        items: Iterable[Input],
        lazy: Iterable[Input] = (),
        *,
        run_here: bool = False,
        set_aside: bool = False,
    ) -> object | None:
        """:meth:`submit` each of ``items`` and :meth:`submit_lazy` each of ``lazy``, in order,
        with one lock and one wake-up.

        ``run_here``: if the engine is idle (no group running, the engine thread waiting), the
        calling thread takes the turn and runs the group itself, with the same rules and the
        same store, and returns once it has committed; otherwise, or with :attr:`run_inline`
        off, the engine thread is woken as by :meth:`submit`. Whatever the group leaves
        (reactions beyond ``max_batch``, a replay after a failure) goes to the engine thread.

        ``set_aside``: the caller comes back to a group that must wait before its commit (the
        network's I/O thread, which reads the durability notice the group waits for: see
        :meth:`ChannelPort.before_commit`): the group may then be set aside, and this returns what
        the channel yielded; the group keeps its transaction and the turn until the caller
        :meth:`resume`-s it or :meth:`cancel`-s it, on this same thread. Without it, such a
        group waits where it runs.
        """
        thread = threading.current_thread().name
        take = Turn(thread, set_aside) if run_here else None
        inputs = self.turns.offer(items, lazy, take)
        if inputs is None:
            return None
        assert take is not None
        self._aside = self.group.steps(inputs, take)
        self._aside_turn = take
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
        steps, turn = self._aside, self._aside_turn
        assert steps is not None and turn is not None, "no group is set aside"
        failure: BaseException | None = None
        try:
            return next(steps) if throw is None else steps.throw(throw)
        except StopIteration:
            pass
        except BaseException as exc:
            # The store failed under this thread (the group replays everything else itself):
            # the engine thread stops on it, exactly as if it had run the group.
            failure = exc
        self._aside = self._aside_turn = None
        self.turns.give_back(turn, failure)
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
            engine.current = engine._me
            try:
                with running(engine.sends):
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
            engine.current = engine._me
            with running(engine.sends):
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

    def submit_lazy(self, item: Input) -> None:
        """Like :meth:`submit`, for work that may wait: it rides along with the next group.

        Used for acknowledgements: applying one costs a commit of its own if done at once, while
        delaying it only keeps a message in an outgoing queue a little longer (a crash meanwhile
        means one more resend, absorbed as a duplicate). If nothing else happens, lazy work is
        done after ``lazy_delay_s``.
        """
        self.turns.submit_lazy(item)

    def stop(self, timeout: float = 10.0) -> None:
        """Finish the group in flight (commit or abort) and stop the thread."""
        self.turns.stop()
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
        return self.turns.failure

    # -- set before start ----------------------------------------------------------------------

    def observe(self, key: str, observer: Callable[[list[object]], None]) -> None:
        """Call ``observer(values)`` once per durable group with the values that its reactions
        handed over with :meth:`ReactionContext.notify` under ``key``, in order (engine thread:
        it must not block). Engine thread, or before start."""
        self.sends.observe(key, observer)

    def unobserve(self, key: str) -> None:
        """Stop :meth:`observe`-ing ``key`` (engine thread)."""
        self.sends.unobserve(key)

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
        self.group.handlers[stamp] = fn

    def fold(self, stamp: int, kinds: tuple[type, ...], entry: Entry | None = None) -> None:
        """Hand the notifications of ``kinds`` sent to this server's system agent
        ``#s.s.<stamp>`` to that agent at once, inside the sending reaction, instead of
        queueing them (set before start). ``entry(agent, sender, note)`` is how they enter it
        (``agent.react`` by default); what it returns, :meth:`fold_now` returns.

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
        self.sends.fold(stamp, kinds, entry)

    def fold_now(self, to: AgentId, note: Notification, sender: AgentId | None = None) -> object:
        """Hand ``note`` from ``sender`` (the current agent by default) to ``to``, folded (see
        :meth:`fold`): the same path as an agent's ``send_to``, for the server's own operations
        (an MQTT device's publication, as ``#s.s.0``). Engine thread, in the group.

        Returns what the fold's entry returned; :data:`NOT_FOLDED` if ``note`` was sent as a
        message instead (``to`` not stored here yet, or ``note`` not of a folded kind).
        """
        return self.sends.fold_now(to, note, sender)

    def add_listener(self, listener: Callable[[AgentId, Notification], None]) -> None:
        """Call ``listener(sender, note)`` after commit for notifications to ``#s.s.0``.

        Runs on the engine thread: it must not block.
        """
        self.group.listeners.append(listener)

    # -- engine thread --------------------------------------------------------------------------

    def after_commit(self, action: Callable[[], object]) -> None:
        """Run ``action`` once the current group has committed (dropped if it aborts)."""
        self.effects.after_commit(action)

    def run_in_transaction(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` as a boot-time operation with ``#s.s.0`` as sender, and commit it."""
        self.current = self._me
        try:
            with running(self.sends):
                fn()
            to_the_end(self.group.commit_steps(self._own_turn))
        except BaseException:
            self.group.abort()
            raise

    def install(self, agent_id: AgentId, agent: Agent) -> Agent:
        """Store ``agent`` under the reserved ``agent_id`` unless an agent is there already;
        return the stored one. Engine thread, in a transaction (the boot's).

        For the system agents every server has (the topic representative ``#s.s.2``): created
        by the server itself at boot, not deployed, so no reaction runs and nothing is sent;
        ``on_init(False)`` runs before its first reaction as for any agent.
        """
        return self.factory.install(agent_id, agent)

    def send(self, to: AgentId, note: Notification) -> None:
        """Send ``note`` to ``to`` in the current group, as ``send_to`` does in a reaction.

        Engine thread only (a boot service, or a function passed to :meth:`call`). The sender
        is the agent reacting now, or the server itself (``#s.s.0``) outside a reaction.
        Raises ``TypeError`` for a target that is not an :class:`AgentId`.
        """
        self.sends.send(to, note)

    def route(self, msg: Message) -> None:
        """Queue ``msg`` in this group: locally, else through the channel (engine thread)."""
        self.sends.route(msg)

    def deliver(self, msg: Message) -> None:
        """Queue a message that became deliverable here (engine thread, in the group)."""
        self.group.deliver(msg)

    def gather(self, to: AgentId, item: object, build: Build) -> None:
        """See :meth:`ReactionContext.gather` (engine thread, in a reaction)."""
        self.sends.gather(to, item, build)

    def _run(self) -> None:
        turn = self._own_turn
        turns = self.turns
        try:
            while True:
                inputs = turns.wait_for_work(turn)
                if inputs is None:
                    return
                # A group that raises keeps the turn (below): no other thread may start one
                # on a store that failed, nor between the failure and the abort.
                to_the_end(self.group.steps(inputs, turn))
                turns.end(turn)
        except BaseException as exc:  # the store failed: stop rather than acknowledge anything
            turns.fail(turn, exc)
            # A failed write explains itself in one line; anything else is a bug: full trace.
            expected = isinstance(exc, StoreWriteFailed | EngineStopped)
            log.critical(
                "engine of server %s stopped: %s", self.server_id, exc, exc_info=not expected
            )
            try:
                self.group.abort()
            except Exception:
                log.debug("abort after failure failed", exc_info=True)
        finally:
            if self._on_exit is not None:
                self._on_exit()
