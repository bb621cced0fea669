"""The agent: a persistent object that reacts to notifications.

Subclass :class:`Agent`, override :meth:`Agent.react`, and call :meth:`Agent.send_to` from it. The
agent's attributes are saved by the server's store at the end of every reaction that changed them.

The classic persistence trap: the store notices assignments to the agent's own attributes
(``self.count += 1``), but *not* in-place changes to a plain ``list`` or ``dict`` held in one
(``self.items.append(x)`` would be lost at the next restart). Use
:class:`~aaabus.PersistentList` and :class:`~aaabus.PersistentMapping` (re-exported by
:mod:`aaabus`) or an ``OOBTree`` for large maps — their changes are tracked — or reassign the
attribute.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

from persistent import Persistent

from aaabus.errors import UnknownNotificationError
from aaabus.model.context import current_context
from aaabus.model.ids import AgentId
from aaabus.model.notifications import (
    AgentCreateReply,
    AgentDeleteAck,
    AgentDeleteRequest,
    ExceptionNotification,
    Notification,
    UnknownAgent,
)
from aaabus.model.pubsub import Publish, Subscribe, Unsubscribe
from aaabus.model.topicnames import check_filter, check_topic

log = logging.getLogger("aaabus.agent")

#: The attribute of a store's ZODB connection (an agent's ``_p_jar``) holding what keeps state
#: for agents outside their own objects, when the store has it: a log store's journaled mailbox
#: backlogs (:mod:`aaabus.core.backlogs`, read by :mod:`aaabus.topics.mailbox`). Through the
#: connection because the agents' layer does not import the core that sets it.
BACKLOGS_ATTRIBUTE = "aaabus_backlogs"

#: Every agent class of this process, by tag (``module:QualName``): the classes a deployment by
#: class may name (:meth:`aaabus.wire.codec.Codec.decode_agent`).
_CLASSES: dict[str, type[Agent]] = {}


def registered_agent(tag: str) -> type[Agent] | None:
    """The agent class registered under ``tag`` in this process, if any."""
    return _CLASSES.get(tag)


class Agent(Persistent):
    """Base class of user agents.

    Every hook runs on the engine thread of the server hosting the agent, inside the transaction
    of one reaction (or, when the engine was idle, on the network thread that received the
    input: see ``aaabus.engine.inline``; never two hooks of a server at once). If a hook raises,
    that whole reaction is rolled back: the agent's attribute changes, its sends, deployments and
    deletions vanish, the input notification is consumed anyway, and its sender receives an
    :class:`~aaabus.ExceptionNotification`.

    A hook may also run and be rolled back without raising: when its group aborts (a store
    failure, a crash before the commit), and, with early frames (``aaabus.link.early``, the
    default), when the sender of its notification crashes before that notification was durable
    -- the reaction is then taken back with its group, and the notification never existed.
    Only what the store holds is certain: a hook must not act outside the bus in a way it
    cannot take back; such effects belong after the commit, e.g. in a listener of the server
    (``AgentServer.add_listener``, called once the notification sent to it is durable).
    """

    #: Topic filters the agent is subscribed to from its creation on: :meth:`deploy` sends the
    #: subscriptions with the creation request, so that no publication made after the deploy
    #: (in causal order) is missed. The boot-time way to declare subscriptions.
    subscriptions: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _CLASSES[f"{cls.__module__}:{cls.__qualname__}"] = cls

    def __init__(self, name: str = "") -> None:
        #: Free text shown in logs; not an address.
        self.name = name
        self._aaabus_id: AgentId | None = None

    # -- identity -----------------------------------------------------------------------------

    @property
    def id(self) -> AgentId:
        """This agent's identifier; set by :meth:`deploy`."""
        if self._aaabus_id is None:
            raise RuntimeError(f"{type(self).__name__} has no id yet: call deploy() first")
        return self._aaabus_id

    @property
    def deployed(self) -> bool:
        return self._aaabus_id is not None

    def __repr__(self) -> str:
        where = str(self._aaabus_id) if self._aaabus_id is not None else "not deployed"
        label = f" {self.name!r}" if getattr(self, "name", "") else ""
        return f"<{type(self).__name__}{label} {where}>"

    # -- hooks --------------------------------------------------------------------------------

    def react(self, sender: AgentId, note: Notification) -> None:
        """React to ``note`` sent by ``sender``. Override it.

        The default handles the system notifications an agent can receive: a delete request
        (the agent deletes itself and acknowledges), and the error reports of the bus
        (:class:`~aaabus.ExceptionNotification`, :class:`~aaabus.UnknownAgent`,
        :class:`~aaabus.AgentCreateReply` with ``ok=False``), which it logs. Any other
        notification raises :class:`~aaabus.UnknownNotificationError`, which the engine turns
        into an exception notification to the sender. Error reports are logged rather than
        raised so that two agents can never bounce errors at each other forever.
        """
        if isinstance(note, AgentDeleteRequest):
            self.delete()
            self.send_to(sender, AgentDeleteAck(self.id))
        elif isinstance(note, ExceptionNotification | UnknownAgent):
            log.warning("%r received %r from %s", self, note, sender)
        elif isinstance(note, AgentCreateReply | AgentDeleteAck):
            if isinstance(note, AgentCreateReply) and not note.ok:
                log.warning("%r: creation of %s failed: %s", self, note.agent_id, note.error)
        else:
            raise UnknownNotificationError(
                f"{type(self).__name__} {self.id} does not handle {type(note).__name__}"
            )

    def on_init(self, first_time: bool) -> None:
        """Called at creation, then before the first reaction after anything reset the agent.

        ``first_time`` is true once, in the transaction that creates the agent on its server.
        It is false at every later call: after each server boot, and whenever the store reset the
        agent's in-memory state (a rolled-back reaction that changed it, an eviction from the
        object cache) — use it to rebuild what is not stored (``_v_`` attributes, caches). The
        agent may send and deploy from here; those sends belong to the transaction that called
        ``on_init``, so they vanish with it if it rolls back, and ``on_init`` runs again on the
        replay. Runs on the engine thread; an exception rolls back the creation (the deployer
        gets an ``AgentCreateReply(ok=False)`` if it asked for one) or the reaction that
        triggered it (its sender gets an :class:`~aaabus.ExceptionNotification`).
        """

    def on_delete(self) -> None:
        """Called by :meth:`delete`, inside the reaction that deletes the agent.

        The last chance to tell others (sends from here are delivered if the reaction commits).
        Runs on the engine thread; an exception rolls the whole reaction back, so the agent is
        *not* deleted, and its sender receives an :class:`~aaabus.ExceptionNotification`.
        """

    # -- actions, valid only inside a reaction --------------------------------------------------

    def send_to(self, to: AgentId, note: Notification) -> None:
        """Send ``note`` to the agent ``to``, wherever it lives.

        Delivered exactly once, in causal order, if and only if the current reaction commits.
        """
        ctx = current_context("send_to()")
        ctx.send(to, note)

    def deploy(self, server: int | None = None, *, reply: bool = False) -> AgentId:
        """Create this agent on ``server`` (default: the current server) and return its id.

        Called from a reaction or a boot service. The id is usable at once: notifications sent to
        it after this call are delivered after the creation, thanks to causal order. With
        ``reply=True`` the caller receives an :class:`~aaabus.AgentCreateReply`. A class that
        cannot be imported on the target server (defined in ``__main__`` or a notebook) is sent
        by value with cloudpickle.
        """
        ctx = current_context("deploy()")
        if self._aaabus_id is not None:
            raise RuntimeError(f"{self!r} is already deployed")
        filters = [check_filter(f) for f in type(self).subscriptions]
        target = ctx.server_id if server is None else server
        agent_id = ctx.deploy(self, target, reply)
        # Same sender, same target server, sent after the creation request: the representative
        # receives them after the agent exists (causal order), before anything sent later.
        for topic_filter in filters:
            ctx.send(AgentId.topics_of(target), Subscribe(topic_filter, agent_id))
        return agent_id

    # -- topics, valid only inside a reaction (see aaabus.topics) --------------------------------

    def publish(self, topic: str, payload: Any, *, retain: bool = False) -> None:
        """Publish ``payload`` (any picklable value) on ``topic`` when the reaction commits.

        Every subscription whose filter matches receives a :class:`~aaabus.Publication` exactly
        once, in causal order with everything this agent published or received before.
        ``retain=True`` also keeps it as the topic's retained publication (``payload=None``
        clears it). Raises :class:`~aaabus.TopicError` for a malformed topic name.
        """
        ctx = current_context("publish()")
        ctx.send(AgentId.topics_of(ctx.server_id), Publish(check_topic(topic), payload, retain))

    def subscribe(self, topic_filter: str) -> None:
        """Subscribe this agent to ``topic_filter`` (``+`` one level, ``#`` the rest).

        Durable: the subscription is stored by the topic representative of the agent's server
        and lasts until :meth:`unsubscribe` or the agent's deletion. The retained publications
        matching the filter arrive first. Raises :class:`~aaabus.TopicError` for a bad filter.
        """
        ctx = current_context("subscribe()")
        ctx.send(AgentId.topics_of(ctx.server_id), Subscribe(check_filter(topic_filter)))

    def unsubscribe(self, topic_filter: str) -> None:
        """End this agent's subscription to ``topic_filter`` (nothing if it had none)."""
        ctx = current_context("unsubscribe()")
        ctx.send(AgentId.topics_of(ctx.server_id), Unsubscribe(check_filter(topic_filter)))

    def delete(self) -> None:
        """Delete this agent when the current reaction commits (its own reaction only).

        Calls :meth:`on_delete`. Notifications that reach the agent afterwards are
        answered with :class:`~aaabus.UnknownAgent`.
        """
        ctx = current_context("delete()")
        ctx.delete(self.id)
        # After the removal, so that the checks of ``ctx.delete`` come first; if the hook
        # raises, rolling the reaction back puts the agent back in the store.
        self.on_delete()
