"""One retry policy for everything that reconnects: exponential backoff with jitter.

A server redialling a peer (:class:`aaabus.io.peerdial.PeerDial`) and a client retrying a request
(:class:`aaabus.tools.client.Client`) both wait :meth:`Backoff.next_delay` between attempts:
``first`` seconds after the first failure, doubled by each further one up to ``ceiling``, each
delay drawn in ``[delay / 2, delay]`` so that the many parties that lost the same server at once
(its peers, its clients) do not all come back in step. :meth:`Backoff.reset` starts over once an
attempt has shown the other side works; what counts as working is the caller's to say.

Sans-IO: no clock, no sleep, no lock (each user owns its instance).
"""

from __future__ import annotations

import random
from collections.abc import Callable

__all__ = ["Backoff"]

# Beyond this many doublings the delay is at its ceiling whatever the figures: the exponent
# stays small, however long a peer stays away.
_MAX_DOUBLINGS = 16


class Backoff:
    """Delays between attempts: ``first`` seconds, doubled per failure up to ``ceiling``, each
    less a random part of at most a half (the jitter). ``uniform(a, b)`` draws the jitter
    (tests pass their own)."""

    __slots__ = ("ceiling", "failures", "first", "uniform")

    def __init__(
        self,
        first: float,
        ceiling: float,
        *,
        uniform: Callable[[float, float], float] = random.uniform,
    ) -> None:
        if not 0 < first <= ceiling:
            raise ValueError(f"backoff from {first} s up to {ceiling} s: need 0 < first <= ceiling")
        self.first = first
        self.ceiling = ceiling
        self.uniform = uniform
        #: Failures since the last :meth:`reset`.
        self.failures = 0

    def next_delay(self) -> float:
        """Seconds to wait before the next attempt; counts one more failure."""
        delay = min(self.ceiling, self.first * (2 ** min(self.failures, _MAX_DOUBLINGS)))
        self.failures += 1
        return delay * self.uniform(0.5, 1.0)

    def reset(self) -> None:
        """The other side works: the next failure waits ``first`` again."""
        self.failures = 0
