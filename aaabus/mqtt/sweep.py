"""When the MQTT listener looks at its connections and its stored sessions again.

Two heaps, both the listener loop's (``mqtt-<id>``; no lock). The deadlines (CONNECT, then
keep-alive) are keyed by each connection's deadline as it was when pushed: a packet only moves
``conn.deadline`` forward, and the entry, once due, is pushed again with the new one. So a
sweep costs the entries due, not the connections: an idle device is looked at once per
keep-alive period. The session expiries are periodic (:data:`EXPIRE_S`, or half the configured
expiry when shorter) and, for 5.0 devices that set their own, when theirs falls due.
"""

from __future__ import annotations

import heapq
import time

from aaabus.mqtt.connection import MqttConnection

__all__ = ["EXPIRE_S", "SWEEP_S", "Sweep"]

#: Seconds between two sweeps of the deadlines (CONNECT, keep-alive) and between two
#: expiries of persistent sessions.
SWEEP_S = 1.0
EXPIRE_S = 60.0


class Sweep:
    """The deadlines of the connections and the times their sessions may expire
    (``session_expiry_s``: the configured expiry)."""

    def __init__(self, session_expiry_s: float) -> None:
        self._session_expiry_s = session_expiry_s
        self._deadlines: list[tuple[float, int, MqttConnection]] = []
        self._next_expiry = 0.0
        self._expiries: list[float] = []  # when 5.0 sessions' own expiries fall due

    def watch(self, conn: MqttConnection) -> None:
        """Look at ``conn`` when ``conn.deadline`` passes. Also when it moved earlier than
        the one it is in the heap with (a keep-alive shorter than ``connect_ms``): the old
        entry stays, a second one for the connection (each is pushed again when it falls
        due): such connections are looked at twice per keep-alive, the others once."""
        heapq.heappush(self._deadlines, (conn.deadline, conn.n, conn))

    def due(self, now: float) -> list[MqttConnection]:
        """The connections not ended whose deadline has passed at ``now``."""
        heap, due = self._deadlines, []
        while heap and heap[0][0] <= now:
            _at, n, conn = heapq.heappop(heap)
            if conn.ended:
                continue
            if conn.deadline > now:
                heapq.heappush(heap, (conn.deadline, n, conn))
            else:
                due.append(conn)
        return due

    def expires_in(self, seconds: float) -> None:
        """A session may expire in ``seconds`` (a 5.0 device's own expiry): the sweep after
        that expires sessions, not only the periodic one (slightly after: what is due is
        strictly older than its expiry)."""
        due = time.monotonic() + seconds + 0.1
        if due < self._next_expiry or not self._next_expiry:
            heapq.heappush(self._expiries, due)

    def expiry_due(self, now: float) -> bool:
        """Whether sessions are to be expired at ``now`` (then not again until the next)."""
        soon = self._expiries
        if now < self._next_expiry and not (soon and soon[0] <= now):
            return False
        if now >= self._next_expiry:
            # A short expiry (tests, or an operator's choice) is checked at half its length.
            self._next_expiry = now + min(EXPIRE_S, max(SWEEP_S, self._session_expiry_s / 2))
        while soon and soon[0] <= now:
            heapq.heappop(soon)
        return True
