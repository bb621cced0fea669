"""A mailbox's backlog, wherever a store keeps it: the mailbox's own attributes (file store) and
the journal's records (log store, :mod:`aaabus.core.backlogs`).

One checker runs against both implementations of :class:`aaabus.topics.mailbox.Backlog`; the
tests about the journal's records (what a reboot finds, what never enters ZODB, an earlier
version's mailbox moving in) run against the log store alone. Real stores on disk throughout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aaabus import AgentId
from aaabus.core.backlogs import K_BOX_HEAD, K_BOX_ITEM, K_BOX_MARKS, JournalBacklog
from aaabus.core.logstorage import LogStorage
from aaabus.core.logstorage.format import is_side
from aaabus.core.store import Store, open_store
from aaabus.model.agent import BACKLOGS_ATTRIBUTE
from aaabus.model.notifications import Notification
from aaabus.model.pubsub import Publication
from aaabus.topics.mailbox import Backlog, BacklogKeeper, FlowMarks, Mailbox
from tests.support.stores import Stores

KEY = (0, 40)
OWNER = AgentId(0, 0, 40)
PUBLISHER = AgentId(1, 1, 0)


def note(n: int) -> Publication:
    return Publication("t/a", b"payload %d" % n, PUBLISHER, ("t/#",), qos=1)


def stored_box(store: Store, limit: int = 100, push: str | None = "mqtt") -> Mailbox:
    """A mailbox as the factory leaves it: stored under its key, with its id."""
    box = Mailbox("mqtt:dev", None, limit)
    box.push = push
    box._aaabus_id = OWNER
    store.agents[KEY] = box
    store.commit()
    return box


def box_of(store: Store) -> Mailbox:
    box = store.agents[KEY]
    assert isinstance(box, Mailbox)
    return box


def backlog(store: Store) -> Backlog:
    """The backlog a change goes to (the journal's on a log store)."""
    return box_of(store)._writable()


def state(store: Store) -> dict[str, Any]:
    """What a mailbox holds, as plain values (to compare across reopens and kinds)."""
    box = box_of(store)
    return {
        "items": [(seq, item.payload) for seq, item in box.take(0, 10_000)],  # type: ignore[attr-defined]
        "next_seq": box.next_seq,
        "count": box.count,
        "dropped": box.dropped,
        "oldest": box.oldest(),
    }


def payloads(*seqs: int) -> list[tuple[int, bytes]]:
    return [(seq, b"payload %d" % seq) for seq in seqs]


# -- every kind ------------------------------------------------------------------------------


def test_what_was_acknowledged_or_withdrawn_never_comes_back_and_the_rest_survives_a_reopen(
    stores: Stores,
) -> None:
    store = stores()
    stored_box(store)
    for n in range(1, 8):  # one transaction per item, as one delivery per commit
        assert backlog(store).append(note(n), 100) == n
        store.commit()
    box_of(store).ack(3)
    assert box_of(store).withdraw(5) == note(5)
    assert box_of(store).withdraw(5) is None
    store.commit()
    expected = {
        "items": payloads(4, 6, 7),
        "next_seq": 8,
        "count": 3,
        "dropped": 0,
        "oldest": 4,
    }
    assert state(store) == expected
    store = stores()
    assert state(store) == expected
    assert box_of(store).take(4, 1) == [(6, note(6))]  # the withdrawn gap is skipped
    box_of(store).ack(6)
    store.commit()
    store = stores()
    assert state(store)["items"] == payloads(7)


def test_beyond_the_limit_the_oldest_are_dropped_and_counted(stores: Stores) -> None:
    store = stores()
    stored_box(store, limit=3)
    for n in range(1, 7):
        backlog(store).append(note(n), 3)
    store.commit()
    store = stores()
    assert state(store) == {
        "items": payloads(4, 5, 6),
        "next_seq": 7,
        "count": 3,
        "dropped": 3,
        "oldest": 4,
    }


def test_an_abort_leaves_the_backlog_as_last_committed(stores: Stores) -> None:
    store = stores()
    stored_box(store, limit=3)
    for n in range(1, 4):
        backlog(store).append(note(n), 3)
    store.commit()
    before = state(store)
    backlog(store).append(note(4), 3)  # drops 1
    box_of(store).ack(2)
    box_of(store).withdraw(3)
    box_of(store).take_all()
    box_of(store).restore([(9, note(9))], 12, 5)
    assert state(store) != before
    store.abort()
    assert state(store) == before
    backlog(store).append(note(4), 3)  # the numbering, too, is as committed
    store.commit()
    store = stores()
    assert state(store)["items"] == payloads(2, 3, 4)


def test_a_savepoint_takes_back_only_what_came_after_it(stores: Stores) -> None:
    store = stores()
    stored_box(store)
    backlog(store).append(note(1), 100)
    savepoint = store.tm.savepoint()
    backlog(store).append(note(2), 100)
    box_of(store).ack(1)
    savepoint.rollback()
    store.commit()
    store = stores()
    assert state(store)["items"] == payloads(1)
    assert state(store)["next_seq"] == 2


def test_emptied_then_restored_items_keep_their_numbers_across_a_reopen(stores: Stores) -> None:
    # A roaming session's anchor: its items leave with the session (take_all), then come back
    # with their own numbers (restore), which are below what was taken.
    store = stores()
    stored_box(store)
    for n in range(1, 5):
        backlog(store).append(note(n), 100)
    store.commit()
    moved = box_of(store).take_all()
    store.commit()
    assert [seq for seq, _ in moved] == [1, 2, 3, 4]
    assert state(stores())["items"] == []
    store = stores()
    box_of(store).restore(moved[1:], 9, 1)
    store.commit()
    store = stores()
    assert state(store) == {
        "items": payloads(2, 3, 4),
        "next_seq": 9,
        "count": 3,
        "dropped": 1,
        "oldest": 2,
    }


# -- the log store's journal -----------------------------------------------------------------


def _last_commit(store: Store) -> list[bytes]:
    log = store._db.storage._log
    return [oid for oid, entry in log.index.items() if entry[2] == log.last_tid]


def test_a_log_stores_mailboxes_find_the_journals_keeper(log_stores: Stores) -> None:
    store = log_stores()
    assert store.journal is not None
    keeper: BacklogKeeper = store.journal.backlogs  # mypy checks it answers the protocol
    assert getattr(store.conn, BACKLOGS_ATTRIBUTE) is keeper


def test_a_delivery_and_its_acknowledgement_never_enter_zodb(log_stores: Stores) -> None:
    store = log_stores()
    stored_box(store)
    backlog(store).append(note(1), 100)  # the first change moves the backlog to the journal
    store.commit()
    assert isinstance(box_of(store).backlog, JournalBacklog)
    for n in range(2, 5):
        backlog(store).append(note(n), 100)
        store.commit()
        written = _last_commit(store)
        assert written and all(is_side(key) for key in written), written
        assert sorted({key[1] for key in written}) == [K_BOX_HEAD, K_BOX_ITEM]
    box_of(store).ack(2)
    store.commit()
    written = _last_commit(store)
    assert [key[1] for key in written] == [K_BOX_HEAD]  # the items are forgotten, not written


def test_dead_records_found_at_boot_are_forgotten(log_stores: Stores) -> None:
    store = log_stores()
    stored_box(store)
    for n in range(1, 6):
        backlog(store).append(note(n), 100)
        store.commit()
    box_of(store).ack(2)
    box_of(store).withdraw(4)
    store.commit()
    log_stores.close()
    # The storage alone finds them again (no compaction ran): five items and the head.
    storage = LogStorage(log_stores.path / "log", compact=False)
    on_disk = [key for key in storage.side_records() if key[1] in (K_BOX_HEAD, K_BOX_ITEM)]
    kinds = sorted(key[1] for key in on_disk)
    storage.close()
    assert kinds == [K_BOX_HEAD] + [K_BOX_ITEM] * 5
    store = log_stores()
    assert state(store)["items"] == payloads(3, 5)
    index = store._db.storage._log.index
    # The two acknowledged items are forgotten; the withdrawn one stays until the floor passes it.
    assert sum(1 for key in index if is_side(key) and key[1] == K_BOX_ITEM) == 3
    box_of(store).ack(5)
    store.commit()
    store = log_stores()
    index = store._db.storage._log.index
    assert sum(1 for key in index if is_side(key) and key[1] == K_BOX_ITEM) == 0
    # A new record never takes the number of one still on disk (dead records found again at
    # a boot would otherwise pass for it).
    backlog(store).append(note(6), 100)
    store.commit()
    (new,) = [key for key in _last_commit(store) if key[1] == K_BOX_ITEM]
    assert new[2:] > max(key[2:] for key in on_disk)


def test_a_deleted_mailboxs_records_are_swept_at_boot(log_stores: Stores) -> None:
    store = log_stores()
    stored_box(store)
    for n in range(1, 4):
        backlog(store).append(note(n), 100)
    store.commit()
    box = box_of(store)
    keeper = store.journal.backlogs if store.journal is not None else None
    assert keeper is not None
    keeper.drop(box.id)  # what the mailbox's on_delete does in its deletion
    del store.agents[KEY]
    store.commit()
    store = log_stores()
    index = store._db.storage._log.index
    assert not [key for key in index if is_side(key) and key[1] in (K_BOX_HEAD, K_BOX_ITEM)]
    # A deletion whose records were never forgotten (the agent gone, its backlog not): swept.
    stored_box(store)
    backlog(store).append(note(1), 100)
    store.commit()
    del store.agents[KEY]
    store.commit()
    store = log_stores()
    assert store.journal is not None and store.journal.backlogs.box(OWNER) is None
    index = store._db.storage._log.index
    assert not [key for key in index if is_side(key) and key[1] in (K_BOX_HEAD, K_BOX_ITEM)]


def test_a_mailbox_of_an_earlier_version_moves_its_items_into_the_journal(
    log_stores: Stores,
) -> None:
    store = log_stores()
    box = Mailbox("mqtt:dev", None, 100)
    box.push = "mqtt"
    box._aaabus_id = OWNER
    # What an earlier version stored: the items in the agent (a box not on a log store's
    # connection keeps them itself).
    held: list[tuple[int, Notification]] = [(4, note(4)), (5, note(5))]
    box.restore(held, 6, 3)
    store.agents[KEY] = box
    store.commit()
    assert not box.journaled and box.take(0, 10) == held
    store = log_stores()
    assert state(store) == {
        "items": payloads(4, 5),
        "next_seq": 6,
        "count": 2,
        "dropped": 3,
        "oldest": 4,
    }
    backlog(store).append(note(6), 100)  # the first change moves them
    store.commit()
    assert box_of(store).journaled and "items" not in box_of(store).__dict__
    store = log_stores()
    assert state(store)["items"] == payloads(4, 5, 6)
    assert (state(store)["next_seq"], state(store)["dropped"]) == (7, 3)


def test_compaction_keeps_the_live_items_and_reclaims_the_rest(tmp_path: Path) -> None:
    store = open_store("log", tmp_path, 0, segment_size=4096)
    try:
        stored_box(store)
        for n in range(1, 41):  # over several segments
            backlog(store).append(note(n), 100)
            store.commit()
        box_of(store).ack(30)
        store.commit()
        storage = store._db.storage
        storage.collect_garbage(grace=False)
        storage.pack(0)
        items = [key for key in storage._log.index if is_side(key) and key[1] == K_BOX_ITEM]
        assert len(items) == 10
    finally:
        store.close()
    store = open_store("log", tmp_path, 0, segment_size=4096)
    try:
        assert [seq for seq, _ in box_of(store).take(0, 100)] == list(range(31, 41))
        assert store._db.storage.new_oid()[0] != 0xFF
    finally:
        store.close()


# -- an MQTT session's QoS 2 state beside its backlog (journal only) ---------------------------


def marks(store: Store) -> FlowMarks:
    found = box_of(store).marks(moving=True)
    assert found is not None, "a log store keeps the marks with the backlog"
    return found


def marked(store: Store) -> tuple[list[int], list[int]]:
    found = marks(store)
    return found.inbound_ids(), sorted(found.released)


def test_a_qos2_flow_writes_side_records_only_and_a_finished_one_never_comes_back(
    log_stores: Stores,
) -> None:
    store = log_stores()
    stored_box(store)
    for n in range(1, 4):
        backlog(store).append(note(n), 100)
    store.commit()
    marks(store).add_inbound(7)  # the device's QoS 2 PUBLISH, before its PUBREC
    marks(store).add_inbound(9)
    marks(store).release(2)  # the device PUBREC'd item 2
    store.commit()
    assert [key[1] for key in _last_commit(store)] == [K_BOX_MARKS]
    assert marks(store).remove_inbound(7) and not marks(store).remove_inbound(8)
    store.commit()
    assert [key[1] for key in _last_commit(store)] == [K_BOX_MARKS]
    store = log_stores()
    # Packet id 7's PUBREL came: a retransmission of a new publication with id 7 must not
    # pass for the old one's (it would be swallowed).
    assert marked(store) == ([9], [2])
    assert marks(store).has_inbound(9) and not marks(store).has_inbound(7)
    box_of(store).ack(2)  # PUBCOMP: the item and its mark go together
    store.commit()
    store = log_stores()
    assert marked(store) == ([9], [])
    assert state(store)["items"] == payloads(3)


def test_an_abort_takes_back_the_marks_of_its_transaction(log_stores: Stores) -> None:
    store = log_stores()
    stored_box(store)
    backlog(store).append(note(1), 100)
    marks(store).add_inbound(5)
    store.commit()
    marks(store).add_inbound(6)
    marks(store).remove_inbound(5)
    marks(store).release(1)
    store.abort()
    assert marked(store) == ([5], [])
    marks(store).add_inbound(8)  # the next transaction's change is written at its commit
    store.commit()
    store = log_stores()
    assert marked(store) == ([5, 8], [])


def test_emptying_the_backlog_for_a_move_clears_the_marks_for_good(log_stores: Stores) -> None:
    """A roaming move carries the QoS 2 state in the session's own state: the marks left
    behind (on disk until compaction) are of an older incarnation, dead at the next boot."""
    store = log_stores()
    stored_box(store)
    backlog(store).append(note(1), 100)
    marks(store).add_inbound(3)
    marks(store).release(1)
    store.commit()
    assert [(seq, item) for seq, item in box_of(store).take_all()] == [(1, note(1))]
    assert marked(store) == ([], [])
    store.commit()
    box_of(store).restore([(1, note(1))], 2, 0)  # it comes back: its items, not the marks
    store.commit()
    log_stores.close()
    storage = LogStorage(log_stores.path / "log", compact=False)
    assert [key[1] for key in storage.side_records()].count(K_BOX_MARKS) == 1  # the dead one
    storage.close()
    store = log_stores()
    assert marked(store) == ([], [])
    assert state(store)["items"] == payloads(1)
    index = store._db.storage._log.index
    assert not any(is_side(key) and key[1] == K_BOX_MARKS for key in index)


def test_marks_are_written_once_at_the_commit_as_they_are_then(log_stores: Stores) -> None:
    """Many changes in one transaction, a savepoint rolled back among them, an emptying for a
    move and new marks after it: what the commit writes is the marks' final state, once."""
    store = log_stores()
    stored_box(store)
    backlog(store).append(note(1), 100)
    for packet_id in range(1, 101):
        marks(store).add_inbound(packet_id)
    savepoint = store.tm.savepoint()
    marks(store).add_inbound(500)
    marks(store).remove_inbound(1)
    savepoint.rollback()
    for packet_id in range(2, 51):
        marks(store).remove_inbound(packet_id)
    store.commit()
    assert [key[1] for key in _last_commit(store)].count(K_BOX_MARKS) == 1
    store = log_stores()
    assert marked(store) == ([1, *range(51, 101)], [])
    box_of(store).take_all()
    marks(store).add_inbound(7)  # after the emptying, under the new incarnation
    store.commit()
    store = log_stores()
    assert marked(store) == ([7], [])
    marks(store).add_inbound(9)
    box_of(store).take_all()  # in the same transaction: nothing of the marks is left to write
    store.commit()
    store = log_stores()
    assert marked(store) == ([], [])
