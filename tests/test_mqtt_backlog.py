"""A connection's place in its session's backlog (aaabus.mqtt.backlog), without sockets."""

from __future__ import annotations

from dataclasses import dataclass

from aaabus.mqtt.backlog import Backlog


@dataclass(frozen=True)
class Item:
    seq: int
    payload: bytes = b"x"


def test_the_next_item_waits_in_memory_until_sent() -> None:
    backlog: Backlog[Item] = Backlog(limit=100)
    assert backlog.pushed(1, Item(1)) == "pump"
    assert backlog.pushed(2, Item(2)) == "pump"
    assert backlog.waiting
    assert backlog.pop() == Item(1)
    backlog.sent(1)
    assert backlog.pop() == Item(2)
    backlog.sent(2)
    assert not backlog.waiting and backlog.next == 3
    assert backlog.pushed(2, Item(2)) == ""  # sent already


def test_a_missed_item_makes_a_gap_that_the_store_fills() -> None:
    backlog: Backlog[Item] = Backlog(limit=100)
    assert backlog.pushed(3, Item(3)) == "fill"  # 1 and 2 are in the store only
    assert backlog.gap and backlog.heard == 3
    assert backlog.to_read(window=10, in_flight=0) == 10
    backlog.fetching = True
    assert backlog.to_read(window=10, in_flight=0) == 0  # one read at a time
    backlog.fetching = False
    for seq in (1, 2, 3):
        backlog.sent(seq)
    backlog.read(given=3, asked=10)  # the store had nothing more: memory is the backlog again
    assert not backlog.gap and backlog.next == 4
    assert backlog.pushed(4, Item(4)) == "pump"


def test_memory_stays_bounded_and_the_store_keeps_the_rest() -> None:
    backlog: Backlog[Item] = Backlog(limit=10)
    assert backlog.pushed(1, Item(1, b"x" * 8)) == "pump"
    assert backlog.pushed(2, Item(2, b"x" * 8)) == ""  # over the limit: left to the store
    assert backlog.gap
    assert backlog.to_read(window=10, in_flight=0) == 0  # memory first
    backlog.pop()
    backlog.sent(1)
    assert backlog.to_read(window=10, in_flight=6) == 0  # less than half the window free
    assert backlog.to_read(window=10, in_flight=4) == 6
    backlog.read(given=6, asked=6)  # a full window: more may wait, the gap stays
    assert backlog.gap
