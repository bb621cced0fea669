"""What the admin endpoint and the metrics page may use of their server: a narrow interface.

:class:`~aaabus.node.server.AgentServer` satisfies it; the endpoints see nothing else of it (no
engine, channel or store), so they do not import the server module, which starts them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from aaabus.config.reader import BusConfig
from aaabus.config.secret import ServerKeys
from aaabus.config.trust import TrustPolicy
from aaabus.model.agent import Agent
from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification
from aaabus.node.mailboxes import MailboxDesk
from aaabus.node.voter import Voter
from aaabus.wire.codec import Codec

__all__ = ["NodeControl"]


class NodeControl(Protocol):
    """A running server, as its endpoints see it (methods callable from any thread)."""

    @property
    def server_id(self) -> int: ...
    @property
    def config(self) -> BusConfig: ...
    @property
    def keys(self) -> ServerKeys:
        """Its keys: clients of the admin port prove ``keys.admin_key(scope)``."""
        ...

    @property
    def trust(self) -> TrustPolicy:
        """What pickles it loads (admin requests are loaded under it too)."""
        ...

    @property
    def codec(self) -> Codec:
        """How requests' notifications, agents and payloads are decoded (data only, unless the
        bus opted in to pickles)."""
        ...

    @property
    def max_frame(self) -> int: ...

    @property
    def voter(self) -> Voter | None:
        """What answers the candidates of a failover (None: the server is not started)."""
        ...

    @property
    def mailboxes(self) -> MailboxDesk:
        """The mailboxes of outside consumers (client subscriptions and requests)."""
        ...

    def status(self, timeout: float = 10.0, detail: bool = False) -> dict[str, Any]:
        """One consistent snapshot (:func:`aaabus.node.status.server_status`)."""
        ...

    def reactions(self) -> int:
        """Reactions run since the server started (0 before its engine runs)."""
        ...

    def request_stop(self) -> None:
        """Stop as on SIGTERM; returns at once."""
        ...

    def accept_once(
        self, request_id: str, fn: Callable[[], str], timeout: float = 30.0
    ) -> tuple[str, bool]:
        """Run ``fn`` on the engine thread unless ``request_id`` was accepted before."""
        ...

    def send_now(self, to: AgentId, note: Notification) -> str:
        """Engine thread only (inside :meth:`accept_once`): send ``note``."""
        ...

    def deploy_now(self, agent: Agent, server: int | None) -> str:
        """Engine thread only (inside :meth:`accept_once`): deploy ``agent``."""
        ...

    def arm_failpoints(self, text: str) -> None:
        """Arm failpoints (tests only; refused unless the process allows it)."""
        ...
