"""Notifications: the only thing agents exchange.

A notification is a dataclass deriving from :class:`Notification`. Keep it small: it is encoded
as data when sent (:mod:`aaabus.wire.codec`), so the receiver gets a copy, never the sender's
object, and a field's annotation is checked when it arrives.

The system notifications below are produced by the engine and the agent factory; the default
:meth:`aaabus.Agent.react` knows how to handle the ones an agent can receive.
"""

from __future__ import annotations

from dataclasses import dataclass

from aaabus.model.ids import AgentId

#: Every notification class of this process, by tag (``module:QualName``): what a body may name.
_TYPES: dict[str, type[Notification]] = {}


class Notification:
    """Base class of every notification: subclass it with ``@dataclass``.

    A subclass registers itself when its module is imported: that is all a server needs to
    decode it (:mod:`aaabus.wire.codec`), and the only classes a body can make a server build.
    """

    __slots__ = ()

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        _TYPES[f"{cls.__module__}:{cls.__qualname__}"] = cls


def registered(tag: str) -> type[Notification] | None:
    """The notification class registered under ``tag`` in this process, if any."""
    return _TYPES.get(tag)


@dataclass
class ExceptionNotification(Notification):
    """Sent back to the sender when ``target``'s reaction to ``notification`` raised.

    The reaction was rolled back (state and sends) and its input consumed: the engine does not
    retry a notification whose reaction raises, because it would most likely raise again.
    """

    target: AgentId
    #: ``None`` when the input itself could not be decoded.
    notification: Notification | None
    error_type: str
    error_message: str


@dataclass
class UnknownAgent(Notification):
    """Sent back to the sender of ``notification`` because ``target`` does not exist."""

    target: AgentId
    notification: Notification | None


@dataclass
class AgentCreateRequest(Notification):
    """Asks a server's factory (``#s.s.1``) to create an agent.

    ``agent`` is the encoded agent: its class's name and its attributes as data
    (:meth:`aaabus.wire.codec.Codec.encode_agent`), or, for a class no other process could import
    (defined in ``__main__`` or a function), the agent *by value* (cloudpickle: code, which a
    server loads only where its operator allowed it, docs/security.md). ``agent_id`` is the
    identifier the deploying side already allocated; ``reply`` asks for an
    :class:`AgentCreateReply` to the sender.
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
