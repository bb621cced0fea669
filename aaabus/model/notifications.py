"""Notifications: the only thing agents exchange.

A notification is a plain picklable Python object. Subclass :class:`Notification` (a dataclass is
the natural way) and keep it small: it is pickled when sent, so the receiver gets a copy, never the
sender's object.

The system notifications below are produced by the engine and the agent factory; the default
:meth:`aaabus.Agent.react` knows how to handle the ones an agent can receive.
"""

from __future__ import annotations

from dataclasses import dataclass

from aaabus.model.ids import AgentId


class Notification:
    """Base class of every notification. Subclasses must be picklable."""

    __slots__ = ()


@dataclass
class ExceptionNotification(Notification):
    """Sent back to the sender when ``target``'s reaction to ``notification`` raised.

    The reaction was rolled back (state and sends) and its input consumed: the engine does not
    retry a notification whose reaction raises, because it would most likely raise again.
    """

    target: AgentId
    notification: Notification
    error_type: str
    error_message: str


@dataclass
class UnknownAgent(Notification):
    """Sent back to the sender of ``notification`` because ``target`` does not exist."""

    target: AgentId
    notification: Notification


@dataclass
class AgentCreateRequest(Notification):
    """Asks a server's factory (``#s.s.1``) to create an agent.

    ``agent`` is the pickled agent (cloudpickle, so that a class defined in ``__main__`` travels by
    value); ``agent_id`` is the identifier the deploying side already allocated; ``reply`` asks for
    an :class:`AgentCreateReply` to the sender.
    """

    agent_id: AgentId
    agent: bytes
    reply: bool = False


@dataclass
class AgentCreateReply(Notification):
    """The factory's answer to an :class:`AgentCreateRequest` made with ``reply=True``."""

    agent_id: AgentId
    ok: bool
    error: str = ""


@dataclass
class AgentDeleteRequest(Notification):
    """Asks the receiving agent to delete itself; the default ``react`` does it and acknowledges."""


@dataclass
class AgentDeleteAck(Notification):
    """Sent to the requester once ``agent_id`` has been deleted."""

    agent_id: AgentId
