"""The channel's protocol rules, sans-IO: frames in, events out; no socket, no engine, no store.

Three servers 0, 1 and 2 share domain D. Each test drives LinkProtocol objects by hand, the way
the channel does on the engine thread, and checks what the rules promise: frames round-trip,
resends are recognised, acknowledgements only cover what was delivered without a gap, queues
shrink with acknowledgements, a reconnect sends again exactly what is unacknowledged, and a
message never overtakes one it depends on.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable

import pytest
from BTrees.OOBTree import OOBTree

from aaabus.core.clock import DomainClock, Verdict
from aaabus.core.protocol import Deliver, LinkProtocol, SendAck
from aaabus.core.store import PersistentQueue
from aaabus.model.ids import AgentId
from aaabus.wire.linkframes import (
    data_frame_size,
    decode_ack,
    decode_data,
    decode_state,
    encode_ack,
    encode_data,
)
from aaabus.wire.message import Message

D = "D"
MEMBERS = (0, 1, 2)


def protocol(me: int, *, max_frame: int = 16 << 20) -> LinkProtocol:
    clocks = {D: DomainClock(len(MEMBERS), MEMBERS.index(me))}
    qout = {(peer, D): PersistentQueue() for peer in MEMBERS if peer != me}
    return LinkProtocol(me, {D: MEMBERS}, clocks, {D: OOBTree()}, qout, max_frame=max_frame)


def message(sender: int, target: int, text: str) -> Message:
    return Message(AgentId(sender, sender, 16), AgentId(target, target, 16), pickle.dumps(text))


def delivered(events: list[Deliver | SendAck]) -> list[object]:
    return [pickle.loads(e.message.body) for e in events if isinstance(e, Deliver)]


def acked(events: list[Deliver | SendAck]) -> int:
    """The last acknowledgement level among ``events`` (-1 when none)."""
    levels = [e.upto for e in events if isinstance(e, SendAck)]
    return levels[-1] if levels else -1


def test_data_and_ack_frames_round_trip_and_are_told_apart() -> None:
    sender = protocol(0)
    msg = message(0, 1, "hello")
    frame = sender.stamp(1, D, msg)
    seq, domain, stamp, decoded = decode_data(frame)
    assert (seq, domain, decoded) == (1, D, msg)
    assert stamp  # the clock's stamp travels with it
    assert decode_ack(encode_ack("Dé", 41)) == ("Dé", 41)
    assert decode_ack(frame) is None  # a data frame is not an acknowledgement
    assert decode_data(encode_data(7, D, b"s", msg)) == (7, D, b"s", msg)
    with pytest.raises(ValueError):
        decode_data(frame[: -len(msg.body) - 1])  # cut inside the fields


def test_in_order_frames_are_delivered_and_each_acknowledged_up_to_itself() -> None:
    sender, receiver = protocol(0), protocol(1)
    frames = [sender.stamp(1, D, message(0, 1, f"m{i}")) for i in range(1, 4)]
    for i, frame in enumerate(frames, 1):
        events = list(receiver.receive(0, frame))
        assert delivered(events) == [f"m{i}"]
        assert events[-1] == SendAck(0, D, i)


def test_a_resent_frame_is_recognised_as_a_duplicate_and_only_acknowledged_again() -> None:
    sender, receiver = protocol(0), protocol(1)
    frame = sender.stamp(1, D, message(0, 1, "once"))
    assert delivered(list(receiver.receive(0, frame))) == ["once"]
    again = list(receiver.receive(0, frame))
    assert delivered(again) == []
    assert again == [SendAck(0, D, 1)]


def test_acknowledgements_drop_the_queued_messages_through_their_level() -> None:
    sender = protocol(0)
    for i in range(5):
        sender.stamp(1, D, message(0, 1, f"m{i}"))
    sender.stamp(2, D, message(0, 2, "other link"))
    assert sender.depths() == ({1: 5, 2: 1}, 0)
    sender.acknowledged(1, D, 3)
    assert sender.depths() == ({1: 2, 2: 1}, 0)
    sender.acknowledged(1, D, 2)  # an older acknowledgement changes nothing
    assert sender.depths() == ({1: 2, 2: 1}, 0)
    sender.acknowledged(1, "unknown domain", 99)
    assert sender.depths() == ({1: 2, 2: 1}, 0)


def test_after_a_reconnect_exactly_the_unacknowledged_frames_are_sent_again_in_order() -> None:
    sender, receiver = protocol(0), protocol(1)
    frames = [sender.stamp(1, D, message(0, 1, f"m{i}")) for i in range(1, 4)]
    events = list(receiver.receive(0, frames[0]))  # m2 and m3 are lost with the connection
    sender.acknowledged(1, D, acked(events))
    resent, reacks = sender.resend(1)
    assert resent == frames[1:]
    assert reacks == []  # nothing was delivered from server 1 to server 0
    got = [list(receiver.receive(0, frame)) for frame in [frames[0], *resent]]
    assert [delivered(e) for e in got] == [[], ["m2"], ["m3"]]
    # The receiver acknowledges again on reconnect what it delivered, in case an ack was lost.
    assert receiver.resend(0) == ([], [SendAck(0, D, 3)])


def test_queues_hold_the_frames_they_resend() -> None:
    """One bytes object per entry: cheap to pickle and resent as it is. (A store written before
    queues held frames kept ``(stamp, message)`` pairs: the upgrade step at boot rewrites them,
    tests/test_store_upgrade.py.)"""
    qout = {(peer, D): PersistentQueue() for peer in (1, 2)}
    sender = LinkProtocol(0, {D: MEMBERS}, {D: DomainClock(3, 0)}, {D: OOBTree()}, qout)
    frames = [sender.stamp(1, D, message(0, 1, f"m{i}")) for i in range(1, 3)]
    assert list(qout[1, D].values()) == frames
    assert sender.resend(1)[0] == frames


def test_a_frame_ahead_of_a_gap_is_held_back_and_does_not_vouch_for_the_gap() -> None:
    sender, receiver = protocol(0), protocol(1)
    first, second = (sender.stamp(1, D, message(0, 1, f"m{i}")) for i in (1, 2))
    early = list(receiver.receive(0, second))
    assert delivered(early) == []
    assert acked(early) == 0  # not 2: the sender must keep m1
    assert receiver.depths() == ({0: 0, 2: 0}, 1)
    assert delivered(list(receiver.receive(0, second))) == []  # a resend of it: still held once
    assert receiver.depths()[1] == 1
    late = list(receiver.receive(0, first))
    assert delivered(late) == ["m1", "m2"]
    assert acked(late) == 2
    assert receiver.depths()[1] == 0


def test_a_message_never_overtakes_one_it_causally_depends_on() -> None:
    s0, s1, s2 = protocol(0), protocol(1), protocol(2)
    to_2 = s0.stamp(2, D, message(0, 2, "first, from 0"))
    to_1 = s0.stamp(1, D, message(0, 1, "to 1"))
    assert delivered(list(s1.receive(0, to_1))) == ["to 1"]
    after = s1.stamp(2, D, message(1, 2, "after it, from 1"))
    # Server 2 gets 1's message first: it depends on 0's, which it has not seen yet.
    assert delivered(list(s2.receive(1, after))) == []
    assert delivered(list(s2.receive(0, to_2))) == ["first, from 0", "after it, from 1"]


def test_frames_the_rules_cannot_accept_are_refused() -> None:
    oversized = protocol(0, max_frame=1024)
    with pytest.raises(ValueError, match=r"aaabus\.max_frame"):
        oversized.stamp(1, D, message(0, 1, "x" * 2000))
    assert oversized.depths() == ({1: 0, 2: 0}, 0)  # nothing queued (the reaction rolls back)
    sender, receiver = protocol(0), protocol(1)
    frame = sender.stamp(1, D, message(0, 1, "fits"))
    with pytest.raises(ValueError, match="does not share"):
        list(receiver.receive(7, frame))  # server 7 is not in domain D
    with pytest.raises(ValueError, match="bad frame"):
        list(receiver.receive(0, b"D" + b"\0" * 10))
    assert delivered(list(receiver.receive(0, frame))) == ["fits"]  # the clock was untouched


def test_the_messages_of_one_event_are_stamped_together_whatever_their_order() -> None:
    s0, s1, s2 = protocol(0), protocol(1), protocol(2)
    sends = [(1, D, message(0, 1, "to 1")), (2, D, message(0, 2, "to 2, sent second"))]
    (peer1, to_1), (peer2, to_2) = s0.stamp_event(sends)
    assert (peer1, peer2) == (1, 2)
    assert s0.depths() == ({1: 1, 2: 1}, 0)
    assert delivered(list(s1.receive(0, to_1))) == ["to 1"]
    after = s1.stamp(2, D, message(1, 2, "after it, from 1"))
    # Sent before its sibling, the message to 1 still carries it: server 2 waits for it.
    assert delivered(list(s2.receive(1, after))) == []
    assert delivered(list(s2.receive(0, to_2))) == ["to 2, sent second", "after it, from 1"]


def test_the_size_check_at_send_time_allows_for_the_largest_stamp() -> None:
    sender = protocol(0, max_frame=1024)
    largest = sender.clocks[D].max_stamp_size()
    assert largest == 8 + 12 * 9  # header, then every entry of a 3x3 matrix (key, value)
    # A body one byte too big for a frame with the largest stamp (1024 less the session's 64).
    overhead = data_frame_size(D, largest, message(0, 1, "x" * 500)) - 500
    tight = message(0, 1, "x" * (1024 - 64 + 1 - overhead))
    with pytest.raises(ValueError, match=r"up to 961 bytes"):
        sender.check_size(D, tight)
    # The stamp it would get now is much smaller: it fits, but a reaction cannot know that.
    ((_, frame),) = sender.stamp_event([(1, D, tight)])
    assert len(frame) <= 1024 - 64


@pytest.mark.parametrize("first_arrives", ["first", "last"])
def test_an_events_messages_on_one_link_are_delivered_together(first_arrives: str) -> None:
    """Server 0 sends m1 and m2 to server 1 in one event. Delivering m1 alone would let what
    server 1 does next (say, tell server 2, which answers it) overtake m2, which the reaction's
    single clock tick puts before it: m1 is held until m2 has come, then both go at once."""
    s0, s1 = protocol(0), protocol(1)
    sends = [
        (1, D, message(0, 1, "m1")),
        (2, D, message(0, 2, "to 2")),
        (1, D, message(0, 1, "m2")),
    ]
    (_, f1), _, (_, f2) = s0.stamp_event(sends)
    early, late = (f1, f2) if first_arrives == "first" else (f2, f1)
    held = list(s1.receive(0, early))
    assert delivered(held) == []
    assert acked(held) == 0  # nothing delivered on the link yet
    assert s1.depths()[1] == 1
    both = list(s1.receive(0, late))
    assert delivered(both) == ["m1", "m2"]
    assert acked(both) == 2
    assert s1.depths()[1] == 0
    assert delivered(list(s1.receive(0, f1))) == []  # resends of either are duplicates
    assert delivered(list(s1.receive(0, f2))) == []


def test_a_held_event_waits_for_its_causes_then_goes_out_whole() -> None:
    # Server 1's m3 to 2 knows of m1, which 0 sent to 2 in one event with m2.
    s0, s1, s2 = protocol(0), protocol(1), protocol(2)
    (_, to_1), (_, m1), (_, m2) = s0.stamp_event(
        [(1, D, message(0, 1, "to 1")), (2, D, message(0, 2, "m1")), (2, D, message(0, 2, "m2"))]
    )
    assert delivered(list(s1.receive(0, to_1))) == ["to 1"]
    m3 = s1.stamp(2, D, message(1, 2, "m3"))
    assert delivered(list(s2.receive(1, m3))) == []
    assert delivered(list(s2.receive(0, m1))) == []  # the rest of its event is missing
    assert delivered(list(s2.receive(0, m2))) == ["m1", "m2", "m3"]


def test_a_large_event_on_one_link_costs_clock_checks_in_proportion_to_its_size() -> None:
    """A producer pours 200 notifications to one server in one reaction (perf stream): held
    until the last is in, the event must not be re-examined whole at every arrival (that made
    the stream twelve times slower)."""
    s0, s1 = protocol(0), protocol(1)
    n = 200
    frames = s0.stamp_event([(1, D, message(0, 1, f"m{i}")) for i in range(n)])
    clock = s1.clocks[D]
    checks = 0
    real_check = clock.check

    def counting_check(src: int, stamp: bytes, seq: int | None = None) -> Verdict:
        nonlocal checks
        checks += 1
        return real_check(src, stamp, seq)

    clock.check = counting_check  # type: ignore[method-assign]
    out = [note for _, frame in frames for note in delivered(list(s1.receive(0, frame)))]
    assert out == [f"m{i}" for i in range(n)]
    assert checks <= 3 * n, checks


class UndoLog:
    """What a transaction's effects record (``undo(fn, *args)``), with savepoints."""

    def __init__(self) -> None:
        self.entries: list[tuple[Callable[..., object], tuple[object, ...]]] = []

    def __call__(self, fn: Callable[..., object], *args: object) -> None:
        self.entries.append((fn, args))

    def savepoint(self) -> int:
        return len(self.entries)

    def rollback(self, savepoint: int) -> None:
        while len(self.entries) > savepoint:
            fn, args = self.entries.pop()
            fn(*args)


def receiver_state(undo: UndoLog | None = None) -> tuple[LinkProtocol, OOBTree, DomainClock]:
    """Server 1's protocol with its held-back set and clock at hand (the persistent state)."""
    clock, waiting = DomainClock(len(MEMBERS), 1), OOBTree()
    qout = {(peer, D): PersistentQueue() for peer in (0, 2)}
    return LinkProtocol(1, {D: MEMBERS}, {D: clock}, {D: waiting}, qout, undo=undo), waiting, clock


def event_frames(sender: LinkProtocol, texts: list[str]) -> list[bytes]:
    """The frames of ONE event of server 0 sending ``texts`` to server 1."""
    return [f for _, f in sender.stamp_event([(1, D, message(0, 1, t)) for t in texts])]


def test_an_event_arriving_in_order_is_gathered_in_memory_then_delivered_at_its_last() -> None:
    receiver, waiting, _clock = receiver_state()
    frames = event_frames(protocol(0), ["a", "b", "c", "d", "e"])
    for i, frame in enumerate(frames[:-1], 1):
        events = list(receiver.receive(0, frame))
        assert delivered(events) == []
        # Nothing of the link delivered: nothing vouched for; the first sibling says so, the
        # next ones add nothing (no acknowledgement per message of a gathered event).
        assert acked(events) == (0 if i == 1 else -1)
        assert len(waiting) == 0  # the persistent held-back set is not written
        assert receiver.depths()[1] == i  # but the messages count as held back
    last = list(receiver.receive(0, frames[-1]))
    assert delivered(last) == ["a", "b", "c", "d", "e"]
    assert acked(last) == 5
    assert receiver.depths()[1] == 0
    assert delivered(list(receiver.receive(0, frames[0]))) == []  # a resend is a duplicate


def test_a_frame_out_of_order_moves_the_gathered_messages_to_the_held_back_set() -> None:
    receiver, waiting, _clock = receiver_state()
    f1, f2, f3, f4 = event_frames(protocol(0), ["m1", "m2", "m3", "m4"])
    for frame in (f1, f2, f4):  # f3 is late (it comes by another route: a resend)
        assert delivered(list(receiver.receive(0, frame))) == []
    assert sorted(waiting.keys()) == [(0, 1), (0, 2), (0, 4)]
    events = list(receiver.receive(0, f3))
    assert delivered(events) == ["m1", "m2", "m3", "m4"]
    assert acked(events) == 4
    assert len(waiting) == 0


def test_a_rollback_takes_the_gathered_messages_back_with_the_transaction() -> None:
    undo = UndoLog()
    receiver, _waiting, _clock = receiver_state(undo)
    f1, f2, f3 = event_frames(protocol(0), ["x", "y", "z"])
    list(receiver.receive(0, f1))
    savepoint = undo.savepoint()
    list(receiver.receive(0, f2))
    undo.rollback(savepoint)  # the input that received f2 failed: as if it never came
    assert receiver.depths()[1] == 1
    assert delivered(list(receiver.receive(0, f2))) == []  # applied again, once
    assert receiver.depths()[1] == 2
    undo.rollback(0)  # the whole group aborts (before any clock change): nothing gathered
    assert receiver.depths()[1] == 0
    for frame in (f1, f2):
        assert delivered(list(receiver.receive(0, frame))) == []
    assert delivered(list(receiver.receive(0, f3))) == ["x", "y", "z"]


def test_gathered_messages_lost_with_memory_come_again_with_the_senders_resend() -> None:
    """A restart forgets what was gathered; it was never acknowledged, so the sender still
    holds it and sends it again when the link comes back: delivered once, in order."""
    sender = protocol(0)
    first, waiting, clock = receiver_state()
    frames = event_frames(sender, ["p", "q", "r"])
    for frame in frames[:2]:
        assert acked(list(first.receive(0, frame))) in (0, -1)  # never beyond 0
    qout = {(peer, D): PersistentQueue() for peer in (0, 2)}
    rebooted = LinkProtocol(1, {D: MEMBERS}, {D: clock}, {D: waiting}, qout)
    resent, _acks = sender.resend(1)
    assert resent == frames
    got = [delivered(list(rebooted.receive(0, frame))) for frame in resent]
    assert got == [[], [], ["p", "q", "r"]]


def _states_agree(a: LinkProtocol, b: LinkProtocol) -> list[str]:
    """What ``b`` says of ``a``'s announced states of their links (decode_state each)."""
    facts = []
    for frame in a.link_states(b.me):
        state = decode_state(frame)
        assert state is not None
        facts += b.check_state(a.me, *state)
    return facts


def test_a_peer_restarted_on_an_older_store_is_named_by_both_sides() -> None:
    """Both stores only move forward: a peer that says it delivered less than it acknowledged,
    or sent less than was delivered from it, restarted on a store older than it committed."""
    sender, receiver = protocol(0), protocol(1)
    frames = [sender.stamp(1, D, message(0, 1, f"m{i}")) for i in range(1, 5)]
    for frame in frames[:2]:
        events = list(receiver.receive(0, frame))
    sender.acknowledged(1, D, acked(events))  # 1 and 2 are forgotten; 3 and 4 still queued
    list(sender.receive(1, receiver.stamp(0, D, message(1, 0, "back"))))
    # Stores that agree (one message still in flight each way is no disagreement).
    assert _states_agree(sender, receiver) == []
    assert _states_agree(receiver, sender) == []
    assert decode_state(encode_ack(D, 3)) is None  # an acknowledgement is not a state
    # Server 1 restarts on an empty store: each side sees both facts, from its own view.
    fresh = protocol(1)
    seen_by_fresh = _states_agree(sender, fresh)
    seen_by_sender = _states_agree(fresh, sender)
    assert len(seen_by_fresh) == len(seen_by_sender) == 2
    lost, reused = seen_by_fresh
    assert "server 1's store is older than server 0 remembers" in lost
    assert "messages 1-2 are lost" in lost
    assert "server 1's store is older" in reused and "reuse numbers" in reused
    assert all("server 1's store is older" in fact for fact in seen_by_sender)
    assert "messages 1-2 are lost" in seen_by_sender[0]
    # One message is said as one.
    assert "message 1 is lost" in fresh.check_state(0, D, 1, 1, 0)[0]
    # A domain the two do not share is nobody's disagreement.
    assert sender.check_state(1, "other", 9, 9, 9) == []
