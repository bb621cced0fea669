"""The cache sweeper frees what left the persistent graph and keeps everything else intact."""

from __future__ import annotations

import transaction
import ZODB
from BTrees.LOBTree import LOBucket
from persistent.mapping import PersistentMapping

from aaabus.core.cachesweep import CacheSweeper
from aaabus.core.store import PersistentQueue, open_store

WINDOW = 300


def slide(queue: PersistentQueue, tm: transaction.TransactionManager, items: int) -> None:
    """A producer's outgoing queue in a flow-controlled stream: put, commit, drop what was
    acknowledged, commit; the keys only grow, so buckets are made at one end, emptied at the
    other."""
    for seq in range(items):
        queue.put(("item", seq))
        if seq % 100 == 99:
            tm.commit()
            queue.pop_through(seq - WINDOW)
            tm.commit()


def cached_buckets(cache: object) -> int:
    return sum(isinstance(obj, LOBucket) for _, obj in cache.lru_items())  # type: ignore[attr-defined]


def test_emptied_buckets_are_ghosted_and_the_queue_and_held_objects_are_intact() -> None:
    db = ZODB.DB(None, cache_size=100_000)
    tm = transaction.TransactionManager()
    conn = db.open(transaction_manager=tm)
    sweeper = CacheSweeper(conn._cache, min_growth=200)
    tm.registerSynch(sweeper)
    root = conn.root()
    root["queue"] = queue = PersistentQueue()
    root["detached"] = held = PersistentMapping({"kept": True})
    tm.commit()
    del root["detached"]  # out of the graph, but this test still holds it
    tm.commit()

    slide(queue, tm, 12_000)  # about 400 buckets made, all but about 10 emptied
    sweeper.sweep()

    assert sweeper.freed > 300
    assert cached_buckets(conn._cache) <= len(queue) // 10
    assert held._p_status == "saved" and held["kept"]
    assert list(queue.keys()) == list(range(12_000 - WINDOW, 12_000))
    assert queue.peek() == ("item", 12_000 - WINDOW)  # reloaded from the storage if swept
    conn.close()
    db.close()


def test_a_store_sweeps_its_cache_by_itself_as_it_commits() -> None:
    store = open_store("memory", None, 0)
    try:
        store.queues["out"] = queue = PersistentQueue()
        store.commit()
        slide(queue, store.tm, 90_000)  # about 3,000 buckets made: over the sweep's threshold
        assert cached_buckets(store.conn._cache) < 2_000
    finally:
        store.close()


def test_large_dead_buckets_are_swept_by_their_size_before_their_count() -> None:
    db = ZODB.DB(None, cache_size=100_000)
    tm = transaction.TransactionManager()
    conn = db.open(transaction_manager=tm)
    sweeper = CacheSweeper(conn._cache, min_growth=1_000_000, min_growth_bytes=1 << 20)
    tm.registerSynch(sweeper)
    conn.root()["queue"] = queue = PersistentQueue()
    tm.commit()
    for round_ in range(30):  # about 3 MB through the queue, each round acknowledged as a whole
        for seq in range(100):
            queue.put((round_ * 100 + seq).to_bytes(4, "big") * 250)  # distinct: pickled whole
        tm.commit()
        queue.pop_through(queue.maxKey())  # cleared at once: its buckets keep what they held
        tm.commit()

    assert sweeper.freed >= 30  # the count threshold alone would not have swept any
    assert conn._cache.total_estimated_size < 3 << 19
    conn.close()
    db.close()
