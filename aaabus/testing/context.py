"""A reaction context with no engine behind it: runs one agent's reaction alone and keeps what
it sends, for tests and micro-benchmarks of an agent's own logic (the topic representative's).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification

__all__ = ["RecordingContext"]


class RecordingContext:
    """A :class:`~aaabus.model.context.ReactionContext` of server ``server_id`` whose current
    agent is ``current``: every send is kept in :attr:`sent` as ``(target, notification)``, in
    order, and nothing else happens. Each reaction is an event of its own, so what is gathered
    (``gather``) is kept at once as the message its event would send. Deploying, deleting and
    notifying observers raise ``AssertionError``: code that needs them needs an engine.

    Use it with :class:`aaabus.model.context.running` around the call of ``react``.
    """

    def __init__(self, current: AgentId, server_id: int | None = None) -> None:
        self.current = current
        self.server_id = current.server if server_id is None else server_id
        self.sent: list[tuple[AgentId, Notification]] = []

    def send(self, to: AgentId, note: Notification) -> None:
        self.sent.append((to, note))

    def hand_over(self, to: AgentId, note: Notification) -> None:
        self.sent.append((to, note))

    def send_all(self, targets: Iterable[AgentId], note: Notification) -> None:
        self.sent.extend((to, note) for to in targets)

    def gather(self, to: AgentId, item: object, build: Callable[[tuple[Any, ...]], Any]) -> None:
        self.sent.append((to, build((item,))))

    def deploy(self, agent: Any, server: int, reply: bool) -> AgentId:
        raise AssertionError(f"{self.current} deployed {type(agent).__name__}: not here")

    def delete(self, agent_id: AgentId) -> None:
        raise AssertionError(f"{self.current} deleted {agent_id}: not here")

    def notify(self, key: str, value: object) -> None:
        raise AssertionError(f"{self.current} notified observer {key!r}: not here")
