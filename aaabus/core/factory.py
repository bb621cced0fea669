"""The factory ``#s.s.1`` and the agents of the store: creating, loading, boxing, deleting.

Everything here runs on the engine's turn, inside the open group (see :mod:`aaabus.core.turn`),
and records its in-memory effects (agents unpickled, ``on_init`` marks) in the transaction's
effects, so that an abort takes them back with the store.
"""

from __future__ import annotations

import importlib
import logging
import sys
from typing import TYPE_CHECKING, Any, Protocol

import cloudpickle
from persistent import Persistent

from aaabus.errors import BadBody
from aaabus.model.agent import Agent
from aaabus.model.ids import SERVER_STAMP, AgentId
from aaabus.model.notifications import (
    AgentCreateReply,
    AgentCreateRequest,
    ExceptionNotification,
    UnknownAgent,
)
from aaabus.wire.codec import is_pickle

if TYPE_CHECKING:
    from aaabus.config.trust import TrustPolicy
    from aaabus.core.effects import TransactionEffects
    from aaabus.core.failpoints import Failpoints
    from aaabus.core.store import Store
    from aaabus.model.notifications import Notification
    from aaabus.wire.codec import Codec

log = logging.getLogger("aaabus.engine")

#: Notifications that report an error: never answered with another error report, so that two
#: parties can never bounce errors at each other forever.
ERROR_REPORTS = (ExceptionNotification, UnknownAgent)

#: Volatile attribute marking an agent object whose on_init ran (see Factory.initialised).
_INITIALISED = "_v_aaabus_initialised"


class AgentBox(Persistent):
    """Storage of an agent whose class cannot be imported here (it came by value).

    ZODB records classes by reference, which would not load after a restart; the box keeps the
    agent cloudpickled instead and is refreshed after every reaction of the agent.
    """

    def __init__(self, agent: Agent) -> None:
        self.blob = cloudpickle.dumps(agent)


# The name stores record for the class (ZODB pickles classes by reference): the one it had
# before the engine was split into rooms, so that stores of either layout load with either code.
AgentBox.__module__ = "aaabus.core.engine"


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


class _Sender(Protocol):
    def send_from(self, sender: AgentId, to: AgentId, note: Notification) -> None: ...


class Core(Protocol):
    """What the factory uses of the engine it serves (:class:`aaabus.core.engine.Engine`)."""

    server_id: int
    store: Store
    trust: TrustPolicy
    codec: Codec
    effects: TransactionEffects
    failpoints: Failpoints
    #: The agent reacting now (the sender of what is sent).
    current: AgentId

    @property
    def sends(self) -> _Sender: ...


def _forget_initialised(agent: Agent) -> None:
    agent.__dict__.pop(_INITIALISED, None)


class Factory:
    """The agents of one engine's store: the factory's reactions, loading an agent for its
    reaction (``on_init(False)`` first if needed), boxes of agents that came by value."""

    def __init__(self, engine: Core) -> None:
        self._engine = engine
        self.id = AgentId.factory(engine.server_id)
        # Agents that came by value: unpickled once per boot (their box holds the durable copy).
        self._boxed: dict[AgentId, Agent] = {}

    def react(self, sender: AgentId, note: Any, careful: bool) -> None:
        """The factory's reaction: create the agent of an ``AgentCreateRequest``; answer it."""
        engine = self._engine
        server_id = engine.server_id
        if not isinstance(note, AgentCreateRequest):
            if isinstance(note, AgentCreateReply | ERROR_REPORTS):
                log.info("factory of server %s got %r from %s", server_id, note, sender)
                return
            raise TypeError(f"the agent factory does not handle {type(note).__name__}")
        agent_id = note.agent_id
        key = (agent_id.origin, agent_id.stamp)
        error = ""
        if agent_id.server != server_id:
            error = f"{agent_id} does not belong to server {server_id}"
        elif key in engine.store.agents:
            error = f"agent {agent_id} already exists"
        if not error:
            # The creation and on_init(True) share a savepoint: if either fails, everything
            # they did (the stored agent, what on_init sent, its in-memory marks) is undone.
            # A failure is final only when the creation ran alone (careful mode), like the
            # failure of any reaction: in a group it may be a fault of the moment, so the group
            # is replayed first.
            savepoint = engine.store.tm.savepoint()
            try:
                self._create(agent_id, note.agent)
            except Exception as exc:
                if not careful:
                    raise
                savepoint.rollback()
                error = f"{type(exc).__name__}: {exc}"
            finally:
                engine.current = self.id
        if error:
            log.warning("server %s: cannot create %s: %s", server_id, agent_id, error)
        if note.reply and sender.stamp != SERVER_STAMP:
            engine.sends.send_from(self.id, sender, AgentCreateReply(agent_id, not error, error))

    def _create(self, agent_id: AgentId, payload: bytes) -> None:
        engine = self._engine
        failpoints = engine.failpoints
        key = (agent_id.origin, agent_id.stamp)
        if is_pickle(payload):
            # By value: code, loaded only where the operator allowed it (trust.by_value).
            if not engine.trust.by_value:
                raise BadBody(
                    f"agent {agent_id} came by value (code) and server {engine.server_id} does "
                    "not load code: deploy a class of a module the servers import, or set "
                    "property aaabus.trust.by_value (docs/security.md)"
                )
            agent = engine.trust.loads(payload)
        else:
            agent = engine.codec.decode_agent(payload)
        if not isinstance(agent, Agent):
            raise TypeError(f"{type(agent).__name__} is not an aaabus.Agent")
        agent._aaabus_id = agent_id
        by_value = not _importable(type(agent))
        engine.store.agents[key] = AgentBox(agent) if by_value else agent
        if failpoints.armed:
            failpoints.hit("factory.create")
        engine.current = agent_id
        agent.on_init(True)
        self.initialised(agent)
        if failpoints.armed:
            failpoints.hit("factory.on_init")
        if by_value:
            self._boxed[agent_id] = agent
            engine.effects.undo(self._boxed.pop, agent_id, None)
            self.finish(agent_id, agent)

    def install(self, agent_id: AgentId, agent: Agent) -> Agent:
        """See :meth:`aaabus.core.engine.Engine.install`."""
        server_id = self._engine.server_id
        if not agent_id.is_system or agent_id.server != server_id:
            raise ValueError(f"{agent_id} is not a system agent id of server {server_id}")
        agents = self._engine.store.agents
        key = (agent_id.origin, agent_id.stamp)
        stored: Agent | None = agents.get(key)
        if stored is None:
            agent._aaabus_id = agent_id
            agents[key] = stored = agent
        return stored

    def load(self, agent_id: AgentId) -> Agent | None:
        """The stored agent ``agent_id``, ready to react; None if it is not stored here."""
        engine = self._engine
        entry = engine.store.agents.get((agent_id.origin, agent_id.stamp))
        if entry is None:
            return None
        if isinstance(entry, AgentBox):
            agent = self._boxed.get(agent_id)
            if agent is None:
                agent = self._boxed[agent_id] = engine.trust.loads(entry.blob)
            # The reaction may change the unpickled agent in memory: if it is rolled back, the
            # next reaction must start again from the box, which the rollback left as it was.
            engine.effects.undo(self._boxed.pop, agent_id, None)
        else:
            agent = entry
        return self.ready_to_react(agent)

    def stored_as_itself(self, agent_id: AgentId) -> Agent | None:
        """The agent ``agent_id`` if it is stored as itself (not boxed), as it is (see
        :meth:`ready_to_react`); None for any other."""
        entry = self._engine.store.agents.get((agent_id.origin, agent_id.stamp))
        if entry is None or isinstance(entry, AgentBox):
            return None
        return entry

    def ready_to_react(self, agent: Agent) -> Agent:
        """``agent``, its ``on_init(False)`` run if it has not run on this object yet."""
        if not getattr(agent, _INITIALISED, False):
            agent.on_init(False)
            self.initialised(agent)
        return agent

    def initialised(self, agent: Agent) -> None:
        """Mark ``agent``'s in-memory state as initialised (its ``on_init`` ran on it).

        The mark is a volatile attribute of the agent itself: ZODB drops it whenever it resets
        the object (a rollback of a transaction that changed the agent, an eviction from the
        cache), which is exactly when what ``on_init`` rebuilt in memory is gone too. It is also
        taken back with the transaction in which ``on_init`` ran, so that a rolled-back
        ``on_init`` (and whatever it sent) runs again on the replay.
        """
        setattr(agent, _INITIALISED, True)
        self._engine.effects.undo(_forget_initialised, agent)

    def finish(self, agent_id: AgentId, agent: Agent) -> None:
        """After a reaction: refresh the box of an agent that came by value (unless deleted)."""
        if agent_id in self._boxed:
            agents = self._engine.store.agents
            agents[(agent_id.origin, agent_id.stamp)].blob = cloudpickle.dumps(agent)

    def delete(self, agent_id: AgentId) -> None:
        """Remove the reacting agent now: the store and memory get it back if the group aborts."""
        engine = self._engine
        engine.store.agents.pop((agent_id.origin, agent_id.stamp), None)
        boxed = self._boxed.pop(agent_id, None)
        if boxed is not None:
            engine.effects.undo(self._boxed.__setitem__, agent_id, boxed)
        if engine.failpoints.armed:
            engine.failpoints.hit("engine.delete")
