"""An MQTT session's QoS 2 state on a log store (issue 43): the packet ids of the device's
publications awaiting their PUBREL and the items it PUBREC'd are side records kept with the
session's backlog (:mod:`aaabus.core.backlogs`), so a QoS 2 step commits no ZODB object; a
session that holds some in its record's trees (a store of an earlier version, state moved in
from another server) is read and finished from both. Real log stores on disk; the topic
representative is left out (what it routes is beside the point here)."""

from __future__ import annotations

from typing import Any

from aaabus.core.backlogs import K_BOX_MARKS
from aaabus.core.logstorage.format import is_side
from aaabus.core.store import Store
from aaabus.model.notifications import Notification
from aaabus.mqtt.sessions import MqttSessions, SessionRecord
from tests.support.stores import Stores
from tests.test_mailbox_backlogs import OWNER, _last_commit, backlog, box_of, note, stored_box

CLIENT = "meter-7"


def sessions_on(store: Store) -> tuple[MqttSessions, list[Any]]:
    folded: list[Notification] = []
    sessions = MqttSessions(
        0,
        100,
        lambda: store.agents,
        store.conn.root,
        lambda _to, _note: None,
        fold_to_rep=folded.append,
    )
    return sessions, folded


def with_session(store: Store) -> MqttSessions:
    stored_box(store)
    for n in range(1, 4):
        backlog(store).append(note(n), 100)
    sessions, _folded = sessions_on(store)
    sessions._table()[CLIENT] = SessionRecord(CLIENT, OWNER, None, False)
    store.commit()
    return sessions


def kinds_of_last_commit(store: Store) -> list[int | str]:
    return [key[1] if is_side(key) else "zodb" for key in _last_commit(store)]


def test_each_qos2_step_commits_side_records_only(log_stores: Stores) -> None:
    store = log_stores()
    sessions = with_session(store)
    steps = [
        lambda: sessions.publish_now(CLIENT, "m/7", b"kWh", False, 2, 41, user="u"),
        lambda: sessions.received_now(CLIENT, 2),  # PUBREC of item 2
        lambda: sessions.release_now(CLIENT, 41),  # PUBREL of the publication
    ]
    for step in steps:
        step()
        store.commit()
        assert kinds_of_last_commit(store) == [K_BOX_MARKS]
    record = sessions.record_now(CLIENT)
    assert record is not None and not record.inbound and not record.released
    assert [d.seq for d in sessions.take_now(CLIENT, 0, 10) or [] if d.release] == [2]


def test_a_retransmission_is_published_once_across_a_reopen_and_a_finished_id_is_free(
    log_stores: Stores,
) -> None:
    store = log_stores()
    with_session(store)
    sessions, folded = sessions_on(store)
    assert sessions.publish_now(CLIENT, "m/7", b"one", False, 2, 41, user="u") is True
    store.commit()
    store = log_stores()
    sessions, folded = sessions_on(store)
    sessions.publish_now(CLIENT, "m/7", b"one", False, 2, 41, user="u")  # DUP: not again
    assert folded == []
    sessions.release_now(CLIENT, 41)
    store.commit()
    store = log_stores()
    sessions, folded = sessions_on(store)
    sessions.publish_now(CLIENT, "m/7", b"two", False, 2, 41, user="u")  # a new message
    assert [getattr(n, "payload", None) for n in folded] == [b"two"]


def test_state_kept_in_the_record_is_read_and_finished_from_both_places(
    log_stores: Stores,
) -> None:
    store = log_stores()
    sessions = with_session(store)
    record = sessions.record_now(CLIENT)
    assert record is not None
    record.inbound.insert(5)  # as an earlier version, or a move, left them
    record.released[1] = True
    store.commit()
    sessions.received_now(CLIENT, 3)
    store.commit()
    assert sorted(sessions._released(record)) == [1, 3]
    moved = sessions.state_of(record)
    assert list(moved["inbound"]) == [5] and sorted(moved["released"]) == [1, 3]
    assert sessions.publish_now(CLIENT, "m/7", b"again", False, 2, 5, user="u") is True
    sessions.release_now(CLIENT, 5)
    sessions.ack_now(CLIENT, 3)
    store.commit()
    store = log_stores()
    sessions = sessions_on(store)[0]
    record = sessions.record_now(CLIENT)
    assert record is not None and not record.inbound and not sessions._released(record)
    assert box_of(store).count == 0
