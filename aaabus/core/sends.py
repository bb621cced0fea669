"""What a reaction does besides changing its agent: sending, gathering, handing over, folding,
deploying, notifying observers; the :class:`~aaabus.model.context.ReactionContext` the engine
installs around every reaction.

Everything here runs on the engine's turn, inside the open group (:mod:`aaabus.core.turn`),
and every in-memory change is recorded in the transaction's effects, so that an abort takes it
back with the store.

**Folding** is the one way a notification is handed to a stored agent's reaction *inside* the
reaction (or operation) that sends it, rather than queued: :meth:`Sends.fold` says which
notifications to which system agent, and :meth:`Sends.fold_now` runs that agent's reaction
there and then, as itself (its sends have it as sender). Agents' sends take it (the topic
representative's ``Publish``/``Subscribe``/``Unsubscribe``), and so do the server's own
operations that address the representative (the MQTT listener's, the bridge's): one path, one
set of rules (see :meth:`Sends.fold`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import cloudpickle

from aaabus.core.factory import ERROR_REPORTS, Factory
from aaabus.model.ids import FACTORY_STAMP, FIRST_USER_STAMP, SERVER_STAMP, AgentId
from aaabus.model.notifications import AgentCreateRequest, Notification, UnknownAgent
from aaabus.wire.codec import travels_by_name
from aaabus.wire.message import Message

if TYPE_CHECKING:
    from aaabus.core.effects import TransactionEffects
    from aaabus.core.failpoints import Failpoints
    from aaabus.core.store import Store
    from aaabus.core.turn import Turn
    from aaabus.model.agent import Agent
    from aaabus.wire.codec import Codec

log = logging.getLogger("aaabus.engine")

#: Makes the one notification of the items gathered for a target (see Sends.gather).
Build = Callable[[tuple[Any, ...]], Any]
#: How a folded notification enters its agent: ``entry(agent, sender, note)``, its result
#: returned by :meth:`Sends.fold_now` (``Agent.react`` unless the fold names another).
Entry = Callable[[Any, AgentId, Any], object]


class ChannelPort(Protocol):
    """What the engine needs from the channel side for messages to other servers.

    Every method runs on the engine's turn, inside the current group's transaction.
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

    def before_commit(self, turn: Turn) -> Iterator[object]:
        """The group is about to commit: wait for what it depends on, send what may leave
        early (see :mod:`aaabus.core.early`); ``DependencyLost`` replays the group.

        A generator: what it yields sets the group aside until ``Engine.resume``; it yields
        only if ``turn.may_set_aside`` (a holder that comes back to the group: see
        ``Engine.submit_many``), and waits where it is otherwise."""
        ...


class _Chain(Protocol):
    def chain_open(self) -> bool: ...
    def chain_append(self, entry: Message | Handed) -> None: ...
    def arrivals_open(self) -> bool: ...
    def deliver(self, msg: Message | Handed) -> None: ...


class Core(Protocol):
    """What the sending side uses of the engine it serves (:class:`aaabus.core.engine.Engine`)."""

    server_id: int
    store: Store
    codec: Codec
    effects: TransactionEffects
    failpoints: Failpoints
    channel: ChannelPort | None
    #: The agent reacting now (the sender of what is sent).
    current: AgentId

    @property
    def stats(self) -> object: ...
    @property
    def group(self) -> _Chain: ...
    @property
    def factory(self) -> Factory: ...


class _NotFolded:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_FOLDED"


#: What :meth:`Sends.fold_now` returns when it sent the notification as a message instead.
NOT_FOLDED: Any = _NotFolded()


class Handed(NamedTuple):
    """A chain's entry that is a notification handed over as an object (never encoded unless
    it must wait in qin): see :meth:`ReactionContext.hand_over`."""

    sender: AgentId
    target: AgentId
    note: Notification


class _Fold(NamedTuple):
    kinds: tuple[type, ...]
    entry: Entry


def _react(agent: Agent, sender: AgentId, note: Any) -> None:
    agent.react(sender, note)


def _decrement(obj: object, name: str) -> None:
    setattr(obj, name, getattr(obj, name) - 1)


class Sends:
    """The engine's sending side, and the reaction context agents see (``send_to`` and the
    rest go through it: :func:`aaabus.model.context.running`)."""

    __slots__ = ("_engine", "_flushers", "_folds", "_gathered", "_notified", "_observers")

    def __init__(self, engine: Core) -> None:
        self._engine = engine
        # Folded targets (see fold): stamp -> the notification types a send hands over at once.
        self._folds: dict[int, _Fold] = {}
        # Sends gathered in the open event (see gather): (sender, target) -> (build, items).
        self._gathered: dict[tuple[AgentId, AgentId], tuple[Build, list[Any]]] = {}
        # In-memory observers (ReactionContext.notify): key -> observer, the values notified
        # in the open group, and one flusher per key (registered once per group).
        self._observers: dict[str, Callable[[list[object]], None]] = {}
        self._notified: dict[str, list[object]] = {}
        self._flushers: dict[str, Callable[[], None]] = {}

    # -- the ReactionContext ------------------------------------------------------------------

    @property
    def server_id(self) -> int:
        return self._engine.server_id

    @property
    def current(self) -> AgentId:
        return self._engine.current

    def send(self, to: AgentId, note: Notification) -> None:
        if not isinstance(to, AgentId):
            raise TypeError(f"send_to() needs an AgentId, got {type(to).__name__}")
        engine = self._engine
        if self._folds:
            fold = self._folds.get(to.stamp)
            if (
                fold is not None
                and isinstance(note, fold.kinds)
                and to.server == to.origin == engine.server_id
                and self._fold(fold, to, engine.current, note) is not NOT_FOLDED
            ):
                return
        self.send_from(engine.current, to, note)

    def send_all(self, targets: Iterable[AgentId], note: Notification) -> None:
        engine = self._engine
        sender = engine.current
        body: bytes | None = None
        for to in targets:
            if not isinstance(to, AgentId):
                raise TypeError(f"send_all() needs AgentIds, got {type(to).__name__}")
            if body is None:
                body = engine.codec.encode(note)
            self.route(Message(sender, to, body))

    def gather(self, to: AgentId, item: object, build: Build) -> None:
        """Send ``build(items)`` to ``to`` at the end of this event, ``items`` being every item
        gathered for ``to`` by the current agent in the event, in order."""
        key = (self._engine.current, to)
        entry = self._gathered.get(key)
        effects = self._engine.effects
        if entry is None:
            entry = self._gathered[key] = (build, [])
            effects.undo(self._gathered.pop, key, None)
        items = entry[1]
        items.append(item)
        effects.undo(items.pop)

    def hand_over(self, to: AgentId, note: Notification) -> None:
        """Send ``note`` to ``to`` from the current agent, the object itself if it runs in this
        group, else encoded as any send."""
        if not isinstance(to, AgentId):
            raise TypeError(f"hand_over() needs an AgentId, got {type(to).__name__}")
        engine = self._engine
        group = engine.group
        if to.server == engine.server_id:
            # Run in this group: in its chain (a reaction's send) or among its arrivals (an
            # input's), never encoded.
            if group.chain_open():
                group.chain_append(Handed(engine.current, to, note))
                self._sent()
                return
            if group.arrivals_open():
                group.deliver(Handed(engine.current, to, note))
                self._sent()
                return
        self.send_from(engine.current, to, note)

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
        self.send_from(
            engine.current, AgentId.factory(server), AgentCreateRequest(agent_id, payload, reply)
        )
        return agent_id

    def notify(self, key: str, value: object) -> None:
        flusher = self._flushers.get(key)
        if flusher is None:
            return
        effects = self._engine.effects
        values = self._notified.get(key)
        if values is None:
            values = self._notified[key] = []
            effects.undo(self._notified.pop, key, None)
        values.append(value)
        effects.undo(values.pop)
        effects.when_durable_once(flusher)

    def delete(self, agent_id: AgentId) -> None:
        engine = self._engine
        if agent_id != engine.current or agent_id.server != engine.server_id:
            raise RuntimeError("an agent can only delete itself, from its own reaction")
        engine.factory.delete(agent_id)

    # -- the engine's side ----------------------------------------------------------------------

    def send_from(self, sender: AgentId, to: AgentId, note: Notification) -> None:
        self.route(Message(sender, to, self._engine.codec.encode(note)))

    def route(self, msg: Message) -> None:
        """Queue ``msg`` in this group: locally into the chain or qin, else through the
        channel. A target on a server that is not part of the bus cannot exist: the sender gets
        its ``UnknownAgent`` at once."""
        engine = self._engine
        to = msg.target
        if to.server == engine.server_id:
            group = engine.group
            if group.chain_open():
                group.chain_append(msg)
            else:
                group.deliver(msg)  # an input's send: an arrival of the group, or into qin
        elif engine.channel is not None and engine.channel.knows(to.server):
            engine.channel.send(msg)
        else:
            self.unknown_agent(msg.sender, to, engine.codec.decode(msg.body))
            return
        self._sent()

    def unknown_agent(self, sender: AgentId, target: AgentId, note: Any) -> None:
        """``note`` from ``sender`` went to ``target``, which does not exist: tell the sender
        (unless it is an error report itself, or the server's: they are logged)."""
        engine = self._engine
        if isinstance(note, ERROR_REPORTS) or sender.stamp == SERVER_STAMP:
            server_id = engine.server_id
            log.warning("server %s: %s for unknown agent %s dropped", server_id, note, target)
            return
        self.send_from(AgentId.server_of(engine.server_id), sender, UnknownAgent(target, note))

    def seal(self) -> None:
        """End of an event (a reaction or an input): send what it gathered, then stamp its
        remote sends as one clock event."""
        if self._gathered:
            self._send_gathered()
        channel = self._engine.channel
        if channel is not None:
            channel.seal()

    def _send_gathered(self) -> None:
        gathered = self._gathered
        self._gathered = {}
        self._engine.effects.undo(setattr, self, "_gathered", gathered)
        for (sender, to), (build, items) in gathered.items():
            self.send_from(sender, to, build(tuple(items)))

    def _sent(self) -> None:
        self.count("sent")
        failpoints = self._engine.failpoints
        if failpoints.armed:
            failpoints.hit("engine.send")

    def count(self, name: str) -> None:
        """Count one committed event in the engine's stats (taken back if the group aborts)."""
        stats = self._engine.stats
        setattr(stats, name, getattr(stats, name) + 1)
        self._engine.effects.undo(_decrement, stats, name)

    # -- folding ----------------------------------------------------------------------------------

    def fold(self, stamp: int, kinds: tuple[type, ...], entry: Entry | None = None) -> None:
        """See :meth:`aaabus.core.engine.Engine.fold`."""
        if not 0 <= stamp < FIRST_USER_STAMP or stamp in (SERVER_STAMP, FACTORY_STAMP):
            raise ValueError(f"stamp {stamp} cannot be folded")
        self._folds[stamp] = _Fold(kinds, entry or _react)

    def fold_now(self, to: AgentId, note: Notification, sender: AgentId | None = None) -> object:
        """See :meth:`aaabus.core.engine.Engine.fold_now`."""
        engine = self._engine
        if sender is None:
            sender = engine.current
        fold = self._folds.get(to.stamp)
        if (
            fold is not None
            and isinstance(note, fold.kinds)
            and to.server == to.origin == engine.server_id
        ):
            outcome = self._fold(fold, to, sender, note)
            if outcome is not NOT_FOLDED:
                return outcome
        self.send_from(sender, to, note)
        return NOT_FOLDED

    def _fold(self, fold: _Fold, target: AgentId, sender: AgentId, note: Any) -> object:
        """Run ``target``'s reaction to ``note`` now, inside the current one; NOT_FOLDED if it is
        not stored here (yet), to send ``note`` as a message instead."""
        engine = self._engine
        factory = engine.factory
        agent = factory.stored_as_itself(target)
        if agent is None:
            return NOT_FOLDED
        current = engine.current
        engine.current = target
        try:
            return fold.entry(factory.ready_to_react(agent), sender, note)
        finally:
            engine.current = current

    # -- observers --------------------------------------------------------------------------------

    def observe(self, key: str, observer: Callable[[list[object]], None]) -> None:
        """See :meth:`aaabus.core.engine.Engine.observe`."""
        self._observers[key] = observer

        def flush() -> None:
            values = self._notified.pop(key, None)
            if values:
                observer(values)

        self._flushers[key] = flush

    def unobserve(self, key: str) -> None:
        self._observers.pop(key, None)
        self._flushers.pop(key, None)
