"""The channel's queues and clocks, wherever a store keeps them: the journal of a log store
(side records, :mod:`aaabus.core.journal`) and the ZODB objects of a file store
(:class:`aaabus.core.store.ZodbQueues`).

The behaviour tests run against both kinds (one checker, every implementation); those about
how the journal writes run against the log store alone. Real stores on disk throughout.
"""

from __future__ import annotations

from typing import Any

import pytest
from persistent import Persistent

from aaabus import AgentId
from aaabus.core.clock import DomainClock, Verdict
from aaabus.core.journal import K_OUT, K_WAIT, qin_key
from aaabus.core.logstorage import LogStorage
from aaabus.core.logstorage.format import is_side
from aaabus.core.store import Store
from aaabus.errors import StoreError
from aaabus.wire.linkframes import encode_data
from aaabus.wire.message import Message
from tests.support.stores import Stores

ME = AgentId(0, 0, 16)
PEER = 1
DOMAIN = "D"


class Counter(Persistent):
    def __init__(self) -> None:
        self.count = 0


def message(n: int) -> Message:
    return Message(AgentId(1, 1, n), ME, b"note %d" % n)


def frame(seq: int) -> bytes:
    return encode_data(seq, DOMAIN, b"stamp", message(seq))


def link_state(store: Store) -> dict[str, Any]:
    """What a store holds for the channel, as plain values (to compare across reopens)."""
    links = store.links
    clock = links.clock(DOMAIN)
    return {
        "qin": [m.sender.stamp for m in _drain_copy(store)],
        "out": [seq for seq, _frame in links.outgoing(PEER, DOMAIN).items()],
        "wait": sorted(links.waiting(DOMAIN).keys()),
        "clock": None if clock is None else (clock.sent_to(PEER), clock.received_from(PEER)),
    }


def _drain_copy(store: Store) -> list[Message]:
    return list(store.qin.values())


def with_domain(store: Store) -> DomainClock:
    clock = store.links.clock(DOMAIN)
    if clock is None:
        clock = store.links.new_clock(DOMAIN, 2, 0, "delta", "causal")
    return clock


# -- every kind ------------------------------------------------------------------------------


def test_what_was_consumed_never_comes_back_and_the_rest_survives_a_reopen(
    stores: Stores,
) -> None:
    store = stores()
    clock = with_domain(store)
    out = store.links.outgoing(PEER, DOMAIN)
    for n in range(6):
        store.qin.put(message(n))
        clock.prepare_send(1)
        out[clock.sent_to(1)] = frame(clock.sent_to(1))
        store.commit()
    for _ in range(4):
        store.qin.pop()
    out.pop_through(4)
    store.commit()
    expected = {"qin": [4, 5], "out": [5, 6], "wait": [], "clock": (6, 0)}
    assert link_state(store) == expected
    store = stores()
    assert link_state(store) == expected
    # Consume the rest: a reopen finds nothing, though the records were never overwritten.
    store.qin.pop()
    store.qin.pop()
    store.links.outgoing(PEER, DOMAIN).pop_through(6)
    store.commit()
    store = stores()
    assert link_state(store) == {"qin": [], "out": [], "wait": [], "clock": (6, 0)}
    store.qin.put(message(9))  # numbering goes on after a queue that emptied
    store.commit()
    assert [m.sender.stamp for m in _drain_copy(stores())] == [9]


def test_an_abort_leaves_queues_and_clock_as_last_committed(stores: Stores) -> None:
    store = stores()
    clock = with_domain(store)
    out = store.links.outgoing(PEER, DOMAIN)
    store.qin.put(message(1))
    clock.prepare_send(1)
    out[1] = frame(1)
    store.commit()
    before = link_state(store)
    store.qin.put(message(2))
    store.qin.pop()
    clock.prepare_send(1)
    out[2] = frame(2)
    out.pop_through(1)
    store.abort()
    assert link_state(store) == before
    store.commit()  # nothing left to write
    assert link_state(stores()) == before


def test_a_savepoint_takes_back_only_what_came_after_it(stores: Stores) -> None:
    store = stores()
    clock = with_domain(store)
    out = store.links.outgoing(PEER, DOMAIN)
    store.commit()
    store.qin.put(message(1))
    clock.prepare_send(1)
    out[1] = frame(1)
    savepoint = store.tm.savepoint()
    store.qin.put(message(2))
    store.qin.pop()
    clock.prepare_send(1)
    out[2] = frame(2)
    savepoint.rollback()
    kept = {"qin": [1], "out": [1], "wait": [], "clock": (1, 0)}
    assert link_state(store) == kept
    savepoint.rollback()  # twice is allowed, and changes nothing more
    store.commit()
    assert link_state(stores()) == kept


def test_a_delivered_message_stays_delivered_and_a_held_back_one_waits(stores: Stores) -> None:
    store = stores()
    clock = with_domain(store)
    peer = DomainClock(2, 1)  # the sending side
    stamps = [peer.prepare_send(0) for _ in range(3)]
    wait = store.links.waiting(DOMAIN)
    for seq in (2, 3):  # the third and second arrive before the first
        assert clock.check(1, stamps[seq - 1], seq) is Verdict.WAIT
        wait[PEER, seq] = (1, stamps[seq - 1], message(seq))
    store.commit()
    assert link_state(stores())["wait"] == [(PEER, 2), (PEER, 3)]
    store = stores()
    clock = with_domain(store)  # the stored one
    wait = store.links.waiting(DOMAIN)
    assert clock.receive(1, stamps[0], 1) is Verdict.DELIVER
    src, stamp, held = wait.pop((PEER, 2))
    assert (src, held) == (1, message(2))
    clock.deliver(1, stamp, 2)
    store.commit()
    assert link_state(stores()) == {"qin": [], "out": [], "wait": [(PEER, 3)], "clock": (0, 2)}


def test_a_rebuilt_domain_starts_afresh(stores: Stores) -> None:
    store = stores()
    clock = with_domain(store)
    clock.prepare_send(1)
    store.links.outgoing(PEER, DOMAIN)[1] = frame(1)
    store.commit()
    assert store.links.pending(DOMAIN) == 1
    store.links.outgoing(PEER, DOMAIN).pop_through(1)
    store.commit()
    assert store.links.pending(DOMAIN) == 0
    store.links.drop(DOMAIN)
    store.links.new_clock(DOMAIN, 3, 0, "delta", "causal")
    store.commit()
    store = stores()
    rebuilt = store.links.clock(DOMAIN)
    assert rebuilt is not None and (rebuilt.size, rebuilt.sent_to(1)) == (3, 0)
    assert [name for name, _clock in store.links.domains()] == [DOMAIN]


# -- the journal -----------------------------------------------------------------------------


def _last_commit(store: Store) -> list[bytes]:
    """The keys the last committed transaction wrote (the log store's index)."""
    log = store._db.storage._log
    return [oid for oid, entry in log.index.items() if entry[2] == log.last_tid]


def test_a_hop_whose_agent_did_not_change_never_enters_zodb(log_stores: Stores) -> None:
    store = log_stores()
    clock = with_domain(store)
    store.agents[(0, 1)] = agent = Counter()
    store.commit()
    clock.prepare_send(1)
    store.links.outgoing(PEER, DOMAIN)[1] = frame(1)
    store.commit()
    written = _last_commit(store)
    assert written and all(is_side(key) for key in written)
    # With an agent: one transaction, one block (one tid) for both.
    agent.count += 1
    clock.prepare_send(1)
    store.links.outgoing(PEER, DOMAIN)[2] = frame(2)
    store.commit()
    written = _last_commit(store)
    assert {is_side(key) for key in written} == {True, False}


def test_consumed_records_found_at_boot_are_forgotten(log_stores: Stores) -> None:
    store = log_stores()
    clock = with_domain(store)
    for n in range(3):  # three transactions: three runs of one frame each
        store.qin.put(message(n))
        clock.prepare_send(1)
        store.links.outgoing(PEER, DOMAIN)[n + 1] = frame(n + 1)
        store.commit()
    store.qin.pop()
    store.links.outgoing(PEER, DOMAIN).pop_through(2)
    store.commit()
    log_stores.close()
    # The storage alone finds the dead records again (no compaction ran since they were
    # forgotten): the two acknowledged runs beside the one still queued.
    storage = LogStorage(log_stores.path / "log", compact=False)
    kinds = sorted(key[1] for key in storage.side_records() if key[1] in (K_OUT,))
    storage.close()
    assert kinds == [K_OUT] * 3
    store = log_stores()  # the journal tells them apart, and forgets the dead ones
    index = store._db.storage._log.index
    assert qin_key(0) not in index
    assert sum(1 for key in index if is_side(key) and key[1] in (K_OUT, K_WAIT)) == 1


def test_a_run_partly_acknowledged_keeps_only_its_owed_frames(log_stores: Stores) -> None:
    store = log_stores()
    clock = with_domain(store)
    out = store.links.outgoing(PEER, DOMAIN)
    for seq in range(1, 6):  # one transaction: one run
        clock.prepare_send(1)
        out[seq] = frame(seq)
    store.commit()
    out.pop_through(3)
    store.commit()
    store = log_stores()
    out = store.links.outgoing(PEER, DOMAIN)
    assert [f for _seq, f in out.items()] == [frame(4), frame(5)]
    out.pop_through(5)
    store.commit()
    store = log_stores()
    assert not store.links.outgoing(PEER, DOMAIN)
    assert not any(is_side(k) and k[1] == K_OUT for k in store._db.storage._log.index)


@pytest.mark.parametrize("damage", ["garbage in the input queue", "a run cut short"])
def test_a_damaged_queue_record_is_refused_in_one_line(log_stores: Stores, damage: str) -> None:
    store = log_stores()
    store.qin.put(message(1))
    clock = with_domain(store)
    clock.prepare_send(1)
    store.links.outgoing(PEER, DOMAIN)[1] = frame(1)
    store.commit()
    run_key = next(k for k in store._db.storage._log.index if is_side(k) and k[1] == K_OUT)
    log_stores.close()
    storage = LogStorage(log_stores.path / "log")
    if damage == "a run cut short":
        bad = {run_key: storage.side_records()[run_key][:3]}
    else:
        bad = {qin_key(0): b"garbage"}
    meta = object()
    storage.tpc_begin(meta)
    storage.write_side(meta, bad, ())
    storage.tpc_vote(meta)
    storage.tpc_finish(meta)
    storage.close()
    with pytest.raises(StoreError, match="damaged queue records") as caught:
        log_stores()
    assert "\n" not in str(caught.value)


def test_garbage_collection_and_compaction_keep_the_journal(log_stores: Stores) -> None:
    # Nothing in ZODB refers to a side record: a collector that went by references alone would
    # drop every queued message. A pack (collection without grace, then every segment compacted)
    # must keep them, and reclaim the records forgotten before it.
    store = log_stores(segment_size=4096)
    clock = with_domain(store)
    out = store.links.outgoing(PEER, DOMAIN)
    for seq in range(1, 41):  # forty transactions: forty runs, over several segments
        store.qin.put(message(seq))
        clock.prepare_send(1)
        out[seq] = frame(seq)
        store.commit()
    out.pop_through(30)
    for _ in range(30):
        store.qin.pop()
    store.commit()
    expected = link_state(store)
    storage = store._db.storage
    storage.collect_garbage(grace=False)
    storage.pack(0)
    assert link_state(store) == expected
    side = [key for key in storage._log.index if is_side(key) and key[1] == K_OUT]
    assert len(side) == 10  # the runs still owed; the thirty acknowledged are gone
    store = log_stores(segment_size=4096)
    assert (
        link_state(store)
        == expected
        == {
            "qin": list(range(31, 41)),
            "out": list(range(31, 41)),
            "wait": [],
            "clock": (40, 0),
        }
    )
    # Recovery left the side keys out of the next oid: ZODB's objects keep their own range.
    assert store._db.storage.new_oid()[0] != 0xFF
