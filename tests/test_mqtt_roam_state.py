"""What a roaming MQTT session carries between servers (docs/mqtt.md, "Sessions that follow a
device"): the whole record as data, and the backlog with its numbers, through the data codec."""

from __future__ import annotations

from BTrees.OOBTree import OOBTree

from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification
from aaabus.model.pubsub import Publication
from aaabus.mqtt.roaming import _cut
from aaabus.mqtt.roamnotes import MovedItems, SessionMoved
from aaabus.mqtt.sessions import SessionRecord
from aaabus.topics.mailbox import Mailbox
from aaabus.wire.codec import Codec


def a_record() -> SessionRecord:
    record = SessionRecord("dev-1", AgentId(0, 0, 40), "alice", False)
    record.filters["a/#"] = 2
    record.filters["b/+"] = 1
    record.inbound.insert(7)
    record.released[12] = True
    record.expiry = 3600
    record.options = OOBTree({"a/#": (0x04, 9)})
    record.anchor = 0
    record.left_at = 1234.5
    return record


def test_the_whole_record_and_the_backlog_cross_the_codec() -> None:
    record = a_record()
    items: list[tuple[int, Notification]] = [
        (
            12,
            Publication(
                "a/x", b"\x00bytes", AgentId(1, 1, 0), ("a/#",), False, qos=2, origin="pub"
            ),
        ),
        (13, Publication("b/y", "text", AgentId(1, 1, 0), ("b/+",), True, qos=1)),
        (14, Publication("a/z", None, AgentId(2, 2, 0), ("a/#",))),
    ]
    moved = SessionMoved("dev-1", 0, record.state(), items, 15, 3)
    codec = Codec()
    back = codec.decode(codec.encode(moved))
    assert isinstance(back, SessionMoved)
    assert back.items == items and (back.next_seq, back.dropped) == (15, 3)
    copy = SessionRecord("dev-1", AgentId(4, 4, 41), None, False)
    copy.restore(back.state)
    assert copy.box == AgentId(4, 4, 41)  # the new server's own mailbox
    assert dict(copy.filters) == {"a/#": 2, "b/+": 1}
    assert list(copy.inbound) == [7] and dict(copy.released) == {12: True}
    assert (copy.user, copy.expiry, copy.anchor, copy.left_at) == ("alice", 3600, 0, 1234.5)
    assert copy.options is not None and dict(copy.options) == {"a/#": (0x04, 9)}


def test_a_record_from_before_an_attribute_existed_keeps_its_class_default() -> None:
    old = SessionRecord("dev-2", AgentId(0, 0, 40), None, False)
    state = old.state()
    assert "expiry" not in state and "anchor" not in state  # never set: not carried
    copy = SessionRecord("dev-2", AgentId(1, 1, 40), None, False)
    copy.restore(state)
    assert copy.expiry is None and copy.options is None


def test_a_mailbox_restores_items_with_their_numbers() -> None:
    box = Mailbox("mqtt:dev-3", None, 100)
    box.push = "mqtt"
    items: list[tuple[int, Notification]] = [
        (5, Publication("t", b"5", AgentId(0, 0, 0))),
        (6, Publication("t", b"6", AgentId(0, 0, 0))),
    ]
    box.restore(items, 7, 2)
    assert box.take(0, 10) == items
    assert (box.next_seq, box.count, box.dropped) == (7, 2, 2)
    assert box.take_all() == items
    assert box.count == 0 and box.next_seq == 7  # numbering goes on where it was


def test_a_large_backlog_is_cut_into_parts_under_the_budget() -> None:
    items: list[tuple[int, Notification]] = [
        (i, Publication("t", b"x" * 1000, AgentId(0, 0, 0))) for i in range(1, 51)
    ]
    parts, size = _cut(items, 8192)
    assert len(parts) > 5
    assert [item for part in parts for item in part] == items
    codec = Codec()
    for part in parts:
        assert len(codec.encode(MovedItems("dev", part))) < 8192 + 1100
    assert 50 * 1000 < size < 50 * 1200  # the bytes moved, charged to the move budget
    assert _cut([], 8192) == ([[]], 0)
