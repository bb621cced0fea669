"""A store's commits leave no garbage for the full collections (issue 43's soak: the receiving
server grew by tens of MB, ZODB's per-commit ``ObjectWriter`` cycles promoted by collections run
while they were alive, then waiting for a full collection that the server's thresholds make
rare)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from ZODB.serialize import ObjectWriter

from aaabus.core.store import PersistentQueue, open_store


@pytest.fixture
def eager_young_rare_full() -> Iterator[None]:
    """Young collections every 50 allocations (one runs inside every commit), older ones after
    each, full ones never: the server's thresholds, scaled down to a test."""
    thresholds, enabled = gc.get_threshold(), gc.isenabled()
    gc.collect()
    gc.set_threshold(50, 1, 1_000_000)
    gc.enable()
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if not enabled:
            gc.disable()


def writers() -> int:
    return sum(isinstance(obj, ObjectWriter) for obj in gc.get_objects())


@pytest.mark.usefixtures("eager_young_rare_full")
def test_commit_writers_do_not_pile_up_between_full_collections(tmp_path: Path) -> None:
    store = open_store("log", tmp_path / "s0", 0)
    try:
        store.queues["box"] = queue = PersistentQueue()
        store.commit()
        for seq in range(400):  # a backlog that slides: put one, drop the acknowledged
            queue.put(seq.to_bytes(4, "big") * 40)
            store.commit()
            if seq >= 100:
                queue.pop_through(seq - 100)
        assert gc.isenabled()  # given back after every commit
        assert writers() <= 2  # at most the last commit's, until the next young collection
    finally:
        store.close()
