"""The reactions-per-second figure of ``aaabus status``, from periodic samples of a counter.

:meth:`RateMeter.sample` runs on the admin listener thread between polls (no thread of its own);
:meth:`RateMeter.rate` on an admin connection thread. A lock keeps the samples consistent.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["RATE_WINDOW", "RateMeter"]

#: Window of the reactions-per-second figure, in seconds.
RATE_WINDOW = 10.0


class RateMeter:
    """Reactions per second over the last :data:`RATE_WINDOW` seconds, from periodic samples."""

    def __init__(self, read: Callable[[], int]) -> None:
        self._read = read
        self._samples: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()
        self.sample()

    def sample(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._samples and now - self._samples[-1][0] < 1.0:
                return
            self._samples.append((now, self._read()))
            while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW:
                self._samples.popleft()

    def rate(self) -> float:
        now, value = time.monotonic(), self._read()
        with self._lock:
            then, before = self._samples[0]
        return round((value - before) / (now - then), 1) if now - then > 0.1 else 0.0
