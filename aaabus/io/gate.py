"""The waiting room of a listening port: unauthenticated connections, bounded and logged cheaply.

A connection that has not yet proven it holds a bus credential costs a file descriptor (and on
the admin port a thread) and may never finish its handshake. :class:`PendingTable` bounds how
many such connections a port holds, overall and per remote address, and when a bound is reached
it **evicts the oldest** waiting connection instead of refusing the newest: a flood then cycles
through the table, while a legitimate client, whose handshake takes milliseconds, gets in
between two evictions. Every connection also keeps an absolute deadline (set by its owner).

:class:`RefusalLog` keeps the log from amplifying a flood: it writes up to ``burst`` refusal
lines per ``window`` seconds, then one summary line per window counting what it left out.

Threads: neither class locks; each owner calls them from one thread (the network's I/O thread)
or under its own lock (the admin endpoint).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Generic, TypeVar

__all__ = ["PendingTable", "RefusalLog"]

C = TypeVar("C")


class PendingTable(Generic[C]):
    """Waiting connections by age, at most ``capacity`` in all and ``per_address`` per address.

    :meth:`add` returns the connections its caller must now close (oldest first): the oldest of
    the same address when that address is at its cap, else the oldest overall when full.
    """

    def __init__(
        self, capacity: int, per_address: int, room: Mapping[str, int] | None = None
    ) -> None:
        """``room``: a larger cap for some addresses (say, one host running many peers)."""
        self.capacity = capacity
        self.per_address = per_address
        self.room = dict(room or {})
        self._all: OrderedDict[C, tuple[str, float]] = OrderedDict()
        self._by_address: dict[str, OrderedDict[C, None]] = {}

    def __len__(self) -> int:
        return len(self._all)

    def __contains__(self, conn: object) -> bool:
        return conn in self._all

    def add(self, conn: C, address: str, now: float = 0.0, grace: float = 0.0) -> list[C]:
        """``grace``: an address over its cap loses its oldest connection only if that one has
        waited this long (by ``now``); else the newcomer is let in while the whole table has
        room (a burst of real clients from one address is not evicted before it could speak),
        and the oldest overall goes when it has none."""
        evicted: list[C] = []
        mine = self._by_address.setdefault(address, OrderedDict())
        oldest = next(iter(mine), None)
        if (
            oldest is not None
            and len(mine) >= self.room.get(address, self.per_address)
            and now - self._all[oldest][1] >= grace
        ):
            evicted.append(oldest)
        elif len(self._all) >= self.capacity:
            evicted.append(next(iter(self._all)))
        for old in evicted:
            self.remove(old)
        self._all[conn] = (address, now)
        self._by_address.setdefault(address, OrderedDict())[conn] = None
        return evicted

    def remove(self, conn: C) -> bool:
        """Forget ``conn`` (authenticated, or closed); False if it was not waiting."""
        entry = self._all.pop(conn, None)
        if entry is None:
            return False
        address = entry[0]
        mine = self._by_address[address]
        del mine[conn]
        if not mine:
            del self._by_address[address]
        return True

    def added_before(self, cutoff: float) -> list[C]:
        """The connections added (``now`` of :meth:`add`) before ``cutoff``."""
        return [conn for conn, (_address, since) in self._all.items() if since < cutoff]

    def replace(self, old: C, new: C) -> bool:
        """Put ``new`` in ``old``'s place (same address and age); False if ``old`` was not here."""
        entry = self._all.pop(old, None)
        if entry is None:
            return False
        address = entry[0]
        del self._by_address[address][old]
        self._all[new] = entry
        self._by_address[address][new] = None
        return True


class RefusalLog:
    """Refusal lines, at most ``burst`` per ``window`` seconds, then a count of the rest."""

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        *,
        burst: int = 10,
        window: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = log
        self._what = what
        self._burst = burst
        self._window = window
        self._clock = clock
        self._start = clock()
        self._written = 0
        self._dropped = 0

    def refused(self, where: str, reason: str) -> None:
        """Record one refused connection from ``where`` (logged, or counted for the summary)."""
        now = self._clock()
        if now - self._start >= self._window:
            if self._dropped:
                self._log.warning(
                    "%s: %d more connections refused in the last %.0f s (not logged one by one)",
                    self._what,
                    self._dropped,
                    now - self._start,
                )
            self._start, self._written, self._dropped = now, 0, 0
        if self._written < self._burst:
            self._written += 1
            self._log.warning("%s: refused connection from %s: %s", self._what, where, reason)
        else:
            self._dropped += 1
