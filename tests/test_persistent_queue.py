"""The store's FIFO queue (aaabus.core.store.PersistentQueue) on a real FileStorage: what a
commit keeps and an abort takes back, for each way of removing items."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import transaction
import ZODB
import ZODB.FileStorage

from aaabus.core.store import PersistentQueue


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[tuple[PersistentQueue, transaction.TransactionManager]]:
    db = ZODB.DB(ZODB.FileStorage.FileStorage(str(tmp_path / "data.fs")))
    tm = transaction.TransactionManager()
    conn = db.open(transaction_manager=tm)
    conn.root()["q"] = PersistentQueue()
    tm.commit()
    try:
        yield conn.root()["q"], tm
    finally:
        tm.abort()
        conn.close()
        db.close()


def test_items_come_out_in_the_order_they_went_in(queue: tuple[PersistentQueue, object]) -> None:
    q, _tm = queue
    assert [q.put(x) for x in "abc"] == [0, 1, 2]
    assert q.peek() == "a" and q.pop() == "a" and q.pop() == "b"
    assert q.put("d") == 3  # numbers go on from the largest key while the queue is not empty
    assert list(q.values()) == ["c", "d"]


@pytest.mark.parametrize("upto", [2, 5, 9, 100])  # part of it, all of it exactly, all and more
def test_pop_through_removes_exactly_the_items_up_to_a_number(
    queue: tuple[PersistentQueue, transaction.TransactionManager], upto: int
) -> None:
    q, tm = queue
    for seq in range(1, 10):
        q[seq] = f"m{seq}"
    tm.commit()
    removed = q.pop_through(upto)
    assert removed == min(upto, 9)
    assert list(q.keys()) == list(range(min(upto, 9) + 1, 10))
    tm.abort()  # an aborted acknowledgement gives everything back
    assert list(q.keys()) == list(range(1, 10))
    assert q.pop_through(upto) == min(upto, 9)
    tm.commit()
    assert list(q.keys()) == list(range(min(upto, 9) + 1, 10))
    assert q.pop_through(0) == 0 and PersistentQueue().pop_through(5) == 0
