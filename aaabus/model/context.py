"""The context of the reaction being run: what ``send_to``, ``deploy`` and ``delete`` talk to.

The engine thread sets it around every reaction and every boot-time service call; agent code never
passes it around. A context variable (not a module global) keeps several servers in one process —
the in-process simulation mode — from seeing each other's reactions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, Protocol

from aaabus.errors import OutsideReactionError
from aaabus.model.ids import AgentId

if TYPE_CHECKING:
    from aaabus.model.notifications import Notification


class ReactionContext(Protocol):
    """What the engine offers to the code running inside one transaction.

    Every operation is transactional: sends, deployments and deletions take effect only if the
    enclosing reaction commits, and vanish if it raises.
    """

    @property
    def server_id(self) -> int:
        """The id of the agent server running this reaction."""
        ...

    @property
    def current(self) -> AgentId:
        """The agent whose reaction is running (``#s.s.0`` inside a boot service)."""
        ...

    def send(self, to: AgentId, note: Notification) -> None:
        """Queue ``note`` for ``to``, sent by :attr:`current`."""
        ...

    def send_all(self, targets: Iterable[AgentId], note: Notification) -> None:
        """Queue ``note`` for each of ``targets``, sent by :attr:`current`, encoded once (a
        publication to the subscribers of one server). ``note`` must not change afterwards:
        every target receives what it was at this call. Never folded (see
        :meth:`aaabus.core.engine.Engine.fold`): each target gets a message."""
        ...

    def hand_over(self, to: AgentId, note: Notification) -> None:
        """Like :meth:`send`, giving ``note`` itself away: if ``to``'s reaction runs in this
        group (a local message sent while nothing is queued), it receives this very object,
        never encoded nor decoded. The caller must hold no reference it would use again, nor
        share any part of ``note`` that someone else may change (a publication relayed in from
        another server, delivered to its one subscriber here)."""
        ...

    # `agent` is an aaabus.model.agent.Agent (its only caller is Agent.deploy). Typed Any here
    # because naming Agent would make this module and agent.py import each other.
    def deploy(self, agent: Any, server: int, reply: bool) -> AgentId:
        """Allocate an id for ``agent`` and ask ``server``'s factory to create it."""
        ...

    def delete(self, agent_id: AgentId) -> None:
        """Remove ``agent_id`` (an agent of this server) when the reaction commits."""
        ...

    def gather(self, to: AgentId, item: object, build: Callable[[tuple[Any, ...]], Any]) -> None:
        """Send ``build(items)`` to ``to``, sent by :attr:`current`, once the running event ends
        (the reaction, or the input of a boot service or call), ``items`` being every ``item``
        gathered for ``to`` by that agent during the event, in order.

        One message instead of many to one place (the topic representative's relays per next
        hop: a burst of publications crosses a link as one). Transactional like :meth:`send`.
        """
        ...

    def notify(self, key: str, value: object) -> None:
        """Hand ``value`` to the in-memory observer this server registered under ``key`` once
        the reaction is durable (nothing if none is registered; dropped if it rolls back).

        For the bus's own agents that feed something outside the store, e.g. a device's
        session mailbox pushing to its live MQTT connection: nothing is written for it.
        """
        ...


_current: ContextVar[ReactionContext | None] = ContextVar("aaabus_reaction", default=None)


def current_context(operation: str) -> ReactionContext:
    """Return the running context, or raise a clear error naming ``operation``."""
    ctx = _current.get()
    if ctx is None:
        raise OutsideReactionError(
            f"{operation} called outside a reaction: agents act only inside react(), "
            "on_init() or a boot-time service"
        )
    return ctx


class running:
    """Make ``ctx`` the current context for the duration of the block (engine thread only).

    A class rather than a ``contextlib.contextmanager``: it is entered at every reaction, and a
    generator-based manager cost several µs of the engine thread's time per message."""

    __slots__ = ("_ctx", "_token")

    def __init__(self, ctx: ReactionContext) -> None:
        self._ctx = ctx

    def __enter__(self) -> None:
        self._token = _current.set(self._ctx)

    def __exit__(self, *exc: object) -> None:
        _current.reset(self._token)
