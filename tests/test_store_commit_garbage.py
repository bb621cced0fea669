"""A store's commits leave no garbage behind them (issue 43's soak: the receiving server held
about 5,500 dead ZODB commit writers, 33 MB, between two of its rare young collections)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
from ZODB.serialize import ObjectWriter

from aaabus.config.trust import TrustPolicy
from aaabus.core.store import PersistentQueue, open_store


@pytest.fixture
def no_collection() -> Iterator[None]:
    """No cycle collection during the test: what is freed is freed by reference counting."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def writers() -> int:
    return sum(isinstance(obj, ObjectWriter) for obj in gc.get_objects())


@pytest.mark.usefixtures("no_collection")
@pytest.mark.parametrize(
    "trust", [None, TrustPolicy(["tests.support.agents"])], ids=["plain", "vetted"]
)
def test_commit_writers_are_freed_without_a_collection(
    tmp_path: Path, trust: TrustPolicy | None
) -> None:
    store = open_store("log", tmp_path / "s0", 0, trust)
    try:
        store.queues["box"] = queue = PersistentQueue()
        store.commit()
        for seq in range(200):  # a backlog that slides: put one, drop the acknowledged
            queue.put(seq.to_bytes(4, "big") * 40)
            store.commit()
            if seq >= 50:
                queue.pop_through(seq - 50)
        assert writers() == 0
    finally:
        store.close()
