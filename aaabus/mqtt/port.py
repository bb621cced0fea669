"""The narrow port through which MQTT reaches the engine: what the listener and the bridge may ask
of it, and nothing else.

The server hands its :class:`~aaabus.core.engine.Engine` to the listener
(:class:`~aaabus.mqtt.listener.MqttListener`) and to the bridge
(:class:`~aaabus.mqtt.bridge.MqttBridge`), which take it as an :class:`EnginePort`: mypy then
refuses any other use of the engine from this package, and a change of the engine that breaks
one of these calls is found at the server's call site. The port names no class of the core:
the package depends on the engine's methods, not on its module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol, TypeVar

from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification

__all__ = ["EnginePort", "StoreView"]

T = TypeVar("T")


class StoreView(Protocol):
    """What the bridge reads of the store, on the engine thread only (inside a batch)."""

    #: Agents by (origin, stamp): the bridge's mailbox is found there.
    agents: Any
    #: The ZODB connection: the bridge keeps its record under a key of the root.
    conn: Any
    #: The transaction manager of the groups (a batch's trace marks its commit's start).
    tm: Any

    def vote_marks(self) -> tuple[int, int, int] | None:
        """The last commit's vote, write and sync times (``perf_counter_ns``), if the store
        reports them (the log store): a batch's trace."""
        ...


class EnginePort(Protocol):
    """What MQTT may ask of the engine (each method documented on
    :class:`~aaabus.core.engine.Engine`)."""

    @property
    def store(self) -> StoreView:
        """The server's store: engine thread only."""
        ...

    def run_batch(
        self,
        ops: Sequence[Callable[[], object]],
        done: Callable[[list[object]], None],
        *,
        run_here: bool = False,
        lazy: bool = False,
    ) -> None:
        """Run ``ops`` in one group; ``done(outcomes)`` once it is durable (any thread)."""
        ...

    def observe(self, key: str, observer: Callable[[list[object]], None]) -> None:
        """Register the observer of the notifications sent to ``key`` (engine thread)."""
        ...

    def send(self, to: AgentId, note: Notification) -> None:
        """Send ``note`` to ``to`` from the current group (engine thread)."""
        ...

    def call(self, fn: Callable[[], T]) -> Future[T]:
        """Run ``fn`` on the engine thread in the next group; its result once committed."""
        ...
