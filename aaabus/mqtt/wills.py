"""MQTT 5.0's delayed wills (Will Delay Interval), kept by the listener until they fall due.

A device that ends without DISCONNECT and whose will has a delay leaves it here: it is
published when the delay passes, dropped if a connection resumes the session first, published
at once if a connection starts the session anew. Kept in memory: a server that stops meanwhile
drops it, as it drops the wills of the connections it cuts. Threads: the listener's loop alone
(``mqtt-<id>``), which owns the table: no lock; the publication is an operation of the
engine's next batch, as every store write of the listener's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from aaabus.mqtt.sessions import MqttSessions, Will

__all__ = ["DelayedWills"]


class DelayedWills:
    """The wills waiting for their delay on ``loop``, by client id. ``add_op(fn, then)``
    queues a store operation for the engine's next batch; ``refused(where, reason)`` counts
    and logs a will the sessions refuse (a retained bound)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sessions: MqttSessions,
        add_op: Callable[[Callable[[], Any], Callable[[Any], None]], None],
        refused: Callable[[str, str], None],
    ) -> None:
        self._loop, self._sessions = loop, sessions
        self._add_op, self._refused = add_op, refused
        self._wills: dict[str, tuple[asyncio.TimerHandle, Will, str]] = {}

    def delay(self, client_id: str, will: Will, delay: float, user: str) -> None:
        """Publish ``client_id``'s will ``delay`` seconds from now, for ``user`` (the retained
        bounds count it as that user's), unless a connection to its session comes first (the
        connection caps ``delay`` at the session's expiry, so the will goes when the session
        ends at the latest)."""
        handle = self._loop.call_later(delay, self._due, client_id)
        old = self._wills.get(client_id)
        if old is not None:
            old[0].cancel()
        self._wills[client_id] = (handle, will, user)

    def claimed(self, client_id: str, clean_start: bool) -> None:
        """A connection took ``client_id``: a will waiting for its delay is dropped if the
        connection resumes the session, published now if it starts a new one (the old session
        ends)."""
        entry = self._wills.pop(client_id, None)
        if entry is not None:
            entry[0].cancel()
            if clean_start:
                self._publish(client_id, entry[1], entry[2])

    def _due(self, client_id: str) -> None:
        entry = self._wills.pop(client_id, None)
        if entry is not None:
            self._publish(client_id, entry[1], entry[2])

    def _publish(self, client_id: str, will: Will, user: str) -> None:
        sessions, now = self._sessions, time.time()

        def then(outcome: Any) -> None:
            if isinstance(outcome, str):
                self._refused(client_id, f"client {client_id!r}: delayed will refused: {outcome}")

        self._add_op(lambda: sessions.will_now(client_id, will, now, user), then)
