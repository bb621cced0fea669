"""Freeing the objects only the ZODB connection cache keeps alive.

ZODB's pickle cache holds a strong reference to every unghosted object, and evicts by count
(``cache_size``, least recently used first) at each transaction boundary. An object that falls
out of the persistent graph therefore stays in memory until that count pushes it out: a
server's outgoing queue is a BTree whose keys only grow, so a long stream creates a new bucket
every few tens of messages and empties the oldest; each emptied bucket lingered, and the
producer's RSS grew by tens of MiB over millions of messages until the cache was full of dead
buckets.

:class:`CacheSweeper` turns such objects back into ghosts, which frees them: an object that
nothing but the cache references is unreachable from any unghosted object and from any Python
code, so if the graph ever reaches it again it is loaded afresh, exactly as after an eviction.
It is a synchronizer of the store's transaction manager, so it runs on the thread that commits
(the engine's), after a commit or an abort, when no object holds uncommitted changes.

Emptied buckets stay linked to each other (each still points at the bucket that followed it),
and one of them may still be referenced by reference cycles that ZODB's commit machinery left
for Python's cyclic collector, old enough to wait for a full collection: that one pins every
bucket emptied after it. A sweep therefore starts with a full ``gc.collect()`` and then visits
the objects least recently used first, so that freeing one bucket frees the next in the same
pass. Sweeps are rare (see GROWTH), so the full collection costs about what Python's own
full collections cost, which follow the same kind of growth rule.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

#: A sweep runs once the unghosted objects grew, since the last sweep left them, by this fraction
#: of their count (and by at least MIN_GROWTH objects) or of their estimated size (ZODB's: the
#: size of their records; at least MIN_GROWTH_BYTES): its cost, one full collection and one pass
#: over them, is then paid back in proportion to the growth, and a cache whose contents are all
#: live is almost never swept. The size matters when the dead objects are large: a queue emptied
#: at once by ``clear()`` leaves its buckets with the messages they held. A cache whose live
#: objects come near its count bound may not reach the threshold: the bound then evicts least
#: recently used objects first, the dead ones among them, as without a sweeper.
GROWTH = 0.25
MIN_GROWTH = 2_000
MIN_GROWTH_BYTES = 8 << 20

#: ``sys.getrefcount`` of an object that only the cache's LRU ring references, counted in the
#: sweep loop below: the ring, the loop's local name and the call's own argument (CPython's
#: counts; tests/test_cachesweep.py fails if they change).
_RING_ONLY = 3


class CacheSweeper:
    """Ghosts, at transaction boundaries, the cached objects nothing else references.

    Register it with ``transaction_manager.registerSynch`` and keep a reference to it (the
    manager holds synchronizers weakly). Exceptions: none of its own; ``_p_deactivate`` of a
    saved object does not fail.
    """

    def __init__(
        self,
        cache: Any,
        *,
        growth: float = GROWTH,
        min_growth: int = MIN_GROWTH,
        min_growth_bytes: int = MIN_GROWTH_BYTES,
    ) -> None:
        """``cache``: the connection's ``_cache`` (a persistent PickleCache)."""
        self._cache = cache
        self._growth = growth
        self._min_growth = min_growth
        self._min_growth_bytes = min_growth_bytes
        self._next_count = 0
        self._next_bytes = 0
        self._set_thresholds()
        #: Objects freed by all sweeps so far (for tests and diagnostics).
        self.freed = 0

    def _set_thresholds(self) -> None:
        count, size = self._cache.cache_non_ghost_count, self._cache.total_estimated_size
        self._next_count = count + max(self._min_growth, int(count * self._growth))
        self._next_bytes = size + max(self._min_growth_bytes, int(size * self._growth))

    def sweep(self) -> int:
        """Ghost every unghosted object only the cache references; return how many."""
        gc.collect()
        items = self._cache.lru_items()
        items.reverse()  # least recently used first, popped from the end
        freed = 0
        while items:
            # Popped one by one so that the list does not count as a reference.
            _, obj = items.pop()
            if sys.getrefcount(obj) <= _RING_ONLY and not obj._p_changed:
                obj._p_deactivate()
                freed += 1
        self.freed += freed
        self._set_thresholds()
        return freed

    # The ISynchronizer interface of ``transaction``.

    def beforeCompletion(self, txn: Any) -> None:
        pass

    def afterCompletion(self, txn: Any) -> None:
        cache = self._cache
        if (
            cache.cache_non_ghost_count >= self._next_count
            or cache.total_estimated_size >= self._next_bytes
        ):
            self.sweep()

    def newTransaction(self, txn: Any) -> None:
        pass
