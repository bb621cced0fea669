"""The group transaction: apply the inputs, run the reactions, commit; recover from failures.

A group is one ZODB transaction run by the holder of the engine's turn (:mod:`aaabus.core.turn`)
and handed that turn explicitly (:meth:`Group.steps`). See :mod:`aaabus.core.engine` for what a
group promises, and docs/architecture.md ("Transactions: what one group commits").
"""

from __future__ import annotations

import collections
import logging
import time
import traceback
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Protocol

from aaabus.core.factory import ERROR_REPORTS, Factory
from aaabus.core.sends import ChannelPort, Handed, Sends
from aaabus.core.turn import Input, Turn, Turns
from aaabus.errors import BadBody, DependencyLost, EngineStopped, ReactionFailed
from aaabus.model.context import running
from aaabus.model.ids import FACTORY_STAMP, FIRST_USER_STAMP, SERVER_STAMP, AgentId
from aaabus.model.notifications import ExceptionNotification, Notification
from aaabus.wire.message import Message

if TYPE_CHECKING:
    from aaabus.core.effects import TransactionEffects
    from aaabus.core.failpoints import Failpoints
    from aaabus.core.store import Store
    from aaabus.core.trace import Tracer
    from aaabus.wire.codec import Codec

log = logging.getLogger("aaabus.engine")

#: The steps of a group: what it yields while it is set aside (see ChannelPort.before_commit).
Steps = Generator[object, None, None]

#: Consecutive failures of one group (outside agent code) before the engine gives up.
MAX_GROUP_FAILURES = 3


class EngineStats:
    """Counters of the engine's groups; read by other threads without locking (ints are atomic).

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


class Core(Protocol):
    """What the group uses of the engine it serves (:class:`aaabus.core.engine.Engine`); the
    engine is also what each input is applied to."""

    server_id: int
    store: Store
    codec: Codec
    effects: TransactionEffects
    failpoints: Failpoints
    channel: ChannelPort | None
    tracer: Tracer | None
    stats: EngineStats
    max_batch: int
    max_group_s: float
    #: The agent reacting now (the sender of what is sent).
    current: AgentId

    @property
    def turns(self) -> Turns: ...
    @property
    def sends(self) -> Sends: ...
    @property
    def factory(self) -> Factory: ...


def to_the_end(steps: Steps) -> None:
    """Run a group's steps for a turn that never sets a group aside (the channel yields
    nothing then)."""
    for waiting in steps:
        raise RuntimeError(f"a group asked to be set aside on a turn that cannot: {waiting!r}")


class Group:
    """The group transaction of one engine, and how the next one runs after a failure.

    Only the holder of the engine's turn calls it. ``handlers`` and ``listeners`` are the
    server's system handlers and its listeners of ``#s.s.0`` (see ``Engine.handle`` and
    ``Engine.add_listener``).
    """

    def __init__(self, engine: Core) -> None:
        self._engine = engine
        # System handlers (see Engine.handle): reserved stamp -> fn(sender, note), as reactions.
        self.handlers: dict[int, Callable[[AgentId, Any], None]] = {}
        self.listeners: list[Callable[[AgentId, Notification], None]] = []
        # How the next groups run after a failure: `_careful` reactions one per transaction,
        # inputs one savepoint each.
        self._careful = 0
        self._careful_inputs = False
        self._failures = 0
        self._ready: collections.deque[Message | Handed] = collections.deque()
        self._ready_ok = False
        # While a group runs its reactions (not in careful mode): the messages to run next in
        # this group, ahead of qin, never written to it (see steps). None otherwise.
        self._chain: collections.deque[Message | Handed] | None = None
        # How many arrivals, then near sends, are left at the chain's head, and whether the
        # running reaction's local sends are near ones (see steps).
        self._arrivals_left = 0
        self._near_left = 0
        self._near_sends = False
        # Reactions run by the open group so far (counted once it commits).
        self._ran = 0

    def steps(self, inputs: list[Input], turn: Turn) -> Steps:
        """One transaction on ``turn``: apply ``inputs``, run reactions, commit; recover from
        any failure. Yields while it waits, set aside, before its commit, if ``turn`` allows it
        (see :meth:`aaabus.core.engine.Engine.submit_many`).

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
        engine = self._engine
        self._ran = 0
        self._ready_ok = not self._careful
        try:
            if self._careful_inputs:
                self._careful_inputs = False
                self._apply_carefully(inputs)
            else:
                self._apply(inputs)
        except Exception:
            self.abort()
            self._drop_input(dropped=False)
            self._careful_inputs = True
            engine.turns.requeue(inputs)
            return
        try:
            self._ready_ok = False
            # Messages that arrived deliverable while the input queue was empty are run at once,
            # without ever being written to it: two records less in this commit.
            # The reactions' context is set once for all of them (it is the same object), not
            # around the commit: after-commit actions are not reactions.
            with running(engine.sends):
                self._react()
            yield from self.commit_steps(turn)
            # Counted once committed, all at once: an aborted group counts nothing.
            engine.stats.reactions += self._ran
        except ReactionFailed:
            self.abort()
            # Replay one reaction per transaction; the failing one is then alone in its own.
            self._careful = self._ran + 1
            engine.turns.requeue(inputs)
            return
        except DependencyLost as exc:
            # Not a failure of the group: a frame it applied will never be vouched for. The
            # replay drops that frame (its sender resends it if it was durable after all).
            self.abort()
            log.info("server %s: group replayed: %s", engine.server_id, exc)
            engine.turns.requeue(inputs)
            return
        except Exception as exc:
            self.abort()
            self._failures += 1
            if self._failures >= MAX_GROUP_FAILURES:
                raise EngineStopped(
                    f"server {engine.server_id} failed {self._failures} times in a row to run "
                    f"and commit the same group ({type(exc).__name__}: {exc}); see the log"
                ) from exc
            log.error(
                "server %s: group failed (%s: %s); replaying it carefully",
                engine.server_id,
                type(exc).__name__,
                exc,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
            self._careful = self._ran + 1
            self._careful_inputs = True
            engine.turns.requeue(inputs)
            return
        self._failures = 0
        if self._careful:
            self._careful = max(0, self._careful - self._ran)

    def _react(self) -> None:
        """Run the group's reactions (the chain's, then qin's) up to its bound, counting those
        that ran in ``_ran`` (a replay after a failure starts from that count)."""
        careful = bool(self._careful)
        ready = self._ready
        chain: collections.deque[Message | Handed] = collections.deque(ready)
        if ready:
            # Taken all at once (nothing is added while reactions run: _ready_ok is off), with
            # one undo entry rather than one per message.
            self._engine.effects.undo(ready.extend, list(chain))  # before the clear it undoes
            ready.clear()
        # The chain: messages this group runs ahead of qin without writing them to it (two
        # records less each), first those that arrived deliverable, then the local sends of its
        # reactions made while qin is empty (route). Its order is qin's: a message joins it only
        # while qin is empty, so it precedes everything in qin, and it runs first. In careful
        # mode everything goes through qin, one reaction per transaction.
        self._chain = None if careful else chain
        # What the chain holds, from its head: arrivals, then the sends of arrivals and of qin's
        # reactions (a publication's deliveries to local subscribers), then deeper sends (an
        # agent's message to itself, again and again). The first two always run in this group:
        # they are bounded by what came in. The rest counts against max_batch and max_group_ms
        # as qin's reactions do, and what is left at the bound goes to qin.
        self._arrivals_left = len(chain)
        self._near_left = 0
        limit = 1 if careful else self._engine.max_batch
        deadline = time.perf_counter() + self._engine.max_group_s
        qin = self._engine.store.qin
        reactions = 0
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
                        # The group's bound (max_batch, or its time is up): the deeper sends
                        # left go to qin, in order (qin is empty here: a message joins the
                        # chain only then, and nothing joins qin while the chain holds one).
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
                self._ran = reactions
                if time.perf_counter() > deadline:
                    limit = min(limit, reactions)
        finally:
            self._chain = None

    def _apply(self, inputs: list[Input]) -> None:
        engine = self._engine
        failpoints = engine.failpoints
        seal = engine.sends.seal
        for item in inputs:
            if failpoints.armed:
                failpoints.hit("engine.input")
            item(engine)
            seal()

    def _apply_carefully(self, inputs: list[Input]) -> None:
        """Apply inputs one savepoint each: a failing one is rolled back and dropped alone."""
        engine = self._engine
        failpoints = engine.failpoints
        for item in inputs:
            savepoint = engine.store.tm.savepoint()
            try:
                if failpoints.armed:
                    failpoints.hit("engine.input")
                item(engine)
                engine.sends.seal()
            except Exception:
                savepoint.rollback()
                self._drop_input(dropped=True)

    def _drop_input(self, dropped: bool) -> None:
        """Log the input that just raised (a bug, garbage or a transient fault)."""
        if dropped:
            self._engine.stats.errors += 1
        log.log(
            logging.ERROR if dropped else logging.INFO,
            "server %s: %s an input that failed: %s",
            self._engine.server_id,
            "dropping" if dropped else "will retry",
            traceback.format_exc(limit=4).strip().splitlines()[-1],
            exc_info=log.isEnabledFor(logging.DEBUG),
        )

    def commit_steps(self, turn: Turn) -> Steps:
        """Commit the open transaction; yields while the channel sets it aside (``turn``)."""
        engine = self._engine
        # Sends made outside any reaction or input (boot-time operations) are one last event.
        engine.sends.seal()
        failpoints = engine.failpoints
        if failpoints.armed:
            failpoints.hit("engine.commit")
        tracer = engine.tracer
        clock_bytes = 0
        if tracer is not None:
            clock_bytes = tracer.before_commit()
            tracer.mark("commit")
        if engine.channel is not None:
            yield from engine.channel.before_commit(turn)
        stats = engine.stats
        t0 = time.perf_counter_ns()
        # The effects' after-commit actions run inside this call, once the store is durable.
        engine.store.commit()
        stats.commit_ns = time.perf_counter_ns() - t0
        stats.commit_total_ns += stats.commit_ns
        stats.commits += 1
        if tracer is not None:
            voted = engine.store.vote_marks()
            if voted is not None and voted[0] >= t0:  # else this commit voted nothing
                for name, at in zip(("vote", "written", "synced"), voted, strict=True):
                    tracer.mark(name, at)
            tracer.committed(stats.commit_ns, clock_bytes)

    def abort(self) -> None:
        self._engine.store.abort()  # the effects of the group are undone with it
        self._engine.stats.aborts += 1

    # -- the chain --------------------------------------------------------------------------------

    def deliver(self, msg: Message | Handed) -> None:
        """Queue a message that became deliverable here (in the group): one from a peer, or a
        local send of an input being applied (an MQTT device's publication to the session
        mailboxes of this server). While the inputs are applied outside careful mode and qin is
        empty it joins the chain's arrivals, run in this group and never written to qin (two
        records less), a handed-over note as it is (never encoded nor decoded)."""
        if self._ready_ok and not self._engine.store.qin:
            self._ready.append(msg)
            self._engine.effects.undo(self._ready.pop)
        else:
            self._engine.store.qin.put(self._as_message(msg))

    def arrivals_open(self) -> bool:
        """Whether :meth:`deliver` would keep a message out of qin now."""
        return self._ready_ok and not self._engine.store.qin

    def chain_open(self) -> bool:
        """Whether a local message sent now joins the chain (see steps): reactions are running
        outside careful mode and qin is empty."""
        return self._chain is not None and not self._engine.store.qin

    def chain_append(self, entry: Message | Handed) -> None:
        """Run ``entry`` later in this group, never written to qin. No undo entry: the chain
        exists only while reactions run outside careful mode, where any failure aborts the
        whole group and the chain with it."""
        assert self._chain is not None
        self._chain.append(entry)
        if self._near_sends:
            self._near_left += 1

    def _as_message(self, msg: Message | Handed) -> Message:
        """A chain's entry as qin holds it: a handed-over note encoded."""
        if isinstance(msg, Handed):
            return Message(msg.sender, msg.target, self._engine.codec.encode(msg.note))
        return msg

    # -- one reaction -----------------------------------------------------------------------------

    def _react_one(self, msg: Message | Handed, careful: bool, from_qin: bool = False) -> None:
        engine = self._engine
        store = engine.store
        # In careful mode the reaction gets a savepoint of its own, so that it can be rolled
        # back alone without losing the inputs applied earlier in the same group.
        savepoint = store.tm.savepoint() if careful else None
        if from_qin:
            store.qin.pop()
        # (Counted in stats.reactions by the caller, once the group has committed.)
        failpoints = engine.failpoints
        tracer = engine.tracer
        if tracer is not None:
            tracer.mark("react_start")
        target = msg.target
        note: Any = None
        engine.current = target
        try:
            # Decoded inside the try: a body this server cannot decode (a type not registered
            # here, a field of the wrong type, garbage from a peer) fails this reaction alone,
            # like a raising react: consumed, its sender told, counted as a dead letter.
            note = msg.note if isinstance(msg, Handed) else engine.codec.decode(msg.body)
            # (The reaction's context is set by the caller, for the group's reactions.)
            if target.stamp == FACTORY_STAMP:
                engine.factory.react(msg.sender, note, careful)
            elif target.stamp < FIRST_USER_STAMP and target.stamp in self.handlers:
                self.handlers[target.stamp](msg.sender, note)
            elif target.stamp == SERVER_STAMP:
                for listener in self.listeners:
                    engine.effects.after_commit(lambda ln=listener: ln(msg.sender, note))  # type: ignore[misc]
            else:
                factory = engine.factory
                agent = factory.load(target)
                if agent is None:
                    engine.sends.unknown_agent(msg.sender, target, note)
                else:
                    if failpoints.armed:
                        failpoints.hit("engine.react")
                    agent.react(msg.sender, note)
                    if failpoints.armed:
                        failpoints.hit("engine.reacted")
                    factory.finish(target, agent)
            if tracer is not None:
                tracer.mark("reacted")
            # A reaction is one event: its remote sends are counted and stamped together.
            engine.sends.seal()
            if tracer is not None:
                tracer.mark("sealed")
        except Exception as exc:
            if savepoint is None:
                raise ReactionFailed() from exc
            savepoint.rollback()
            self._report_failure(self._as_message(msg), note, exc)

    def _report_failure(self, msg: Message, note: Any, exc: Exception) -> None:
        """Consume the input of a failed reaction and tell its sender (careful mode)."""
        engine = self._engine
        sends = engine.sends
        engine.store.qin.pop()
        sends.count("errors")
        if isinstance(exc, BadBody):
            sends.count("dead_letters")
            engine.stats.last_dead_letter = f"from {msg.sender} to {msg.target}: {exc}"
            log.warning(
                "server %s: dead letter from %s to %s: %s",
                engine.server_id,
                msg.sender,
                msg.target,
                exc,
            )
        else:
            log.warning(
                "server %s: reaction of %s to %s from %s raised %s: %s",
                engine.server_id,
                msg.target,
                type(note).__name__,
                msg.sender,
                type(exc).__name__,
                exc,
            )
        if isinstance(note, ERROR_REPORTS) or msg.sender.stamp == SERVER_STAMP:
            return
        report = ExceptionNotification(msg.target, note, type(exc).__name__, str(exc))
        sends.send_from(msg.target, msg.sender, report)
