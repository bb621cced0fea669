"""One higher peer's dial: its connection attempt and its redial policy (backoff, last error).

A server dials only the peers with higher ids (lower ids dial it). After a failed attempt or a
lost link, the next attempt waits :meth:`PeerDial.next_delay`: the bus's one retry policy
(:class:`aaabus.io.backoff.Backoff`, which a client's retries use too), from
:data:`BACKOFF_FIRST` to :data:`BACKOFF_MAX`, with jitter so that the servers that lost the same
peer at once do not all redial in step. A link resets it once the first session frame from the
peer passes its MAC (not merely when the handshake completes: a peer, or a relay, that completes
handshakes and then breaks the session must not earn fast redials). Used by the network thread
only (no lock).
"""

from __future__ import annotations

from typing import Generic, TypeVar

from aaabus.io.backoff import Backoff

__all__ = ["BACKOFF_FIRST", "BACKOFF_MAX", "PeerDial"]

#: Seconds before the first redial, doubled by each failure up to BACKOFF_MAX.
BACKOFF_FIRST = 0.02
BACKOFF_MAX = 1.0

C = TypeVar("C")


class PeerDial(Generic[C]):
    """Dialling state for one higher peer: its connection attempt, backoff, last error."""

    __slots__ = ("at", "backoff", "conn", "last_error")

    def __init__(self) -> None:
        self.conn: C | None = None
        #: Which of the peer's addresses (one per member of that server) is dialled.
        self.at = 0
        self.backoff = Backoff(BACKOFF_FIRST, BACKOFF_MAX)
        self.last_error = ""

    @property
    def failures(self) -> int:
        """Failed attempts since the link last worked."""
        return self.backoff.failures

    def next_delay(self) -> float:
        """Seconds until the next attempt; counts one more failure."""
        return self.backoff.next_delay()

    def succeeded(self) -> None:
        """The link works (a verified session frame): the next loss redials after the shortest
        delay, and its first error is worth a line."""
        self.backoff.reset()
        self.last_error = ""

    def first_time(self, reason: str) -> bool:
        """Whether ``reason`` differs from this peer's previous dial error (and remember it)."""
        new = reason != self.last_error
        self.last_error = reason
        return new
