"""The queue of logins waiting for their password check (aaabus.io.loginqueue): bounded in all
and per address, served round-robin across addresses, a withdrawn login never handed out."""

from __future__ import annotations

from aaabus.io.loginqueue import LoginQueue


def test_one_address_cannot_hold_the_queue_and_others_take_turns() -> None:
    queue: LoginQueue[str, str] = LoginQueue(total=6, per_address=3, workers=1)
    assert [queue.add("flood", f"f{i}", f"f{i}") for i in range(5)] == [True] * 3 + [False] * 2
    assert queue.add("site", "s0", "s0") and queue.add("site", "s1", "s1")
    assert queue.add("other", "o0", "o0")
    assert not queue.add("late", "l0", "l0")  # 6 waiting in all
    order = []
    while len(queue) or queue.running:
        job = queue.take()
        assert queue.take() is None  # one worker: nothing more until it is released
        assert job is not None
        order.append(job)
        queue.release()
    assert order == ["f0", "s0", "o0", "f1", "s1", "f2"]


def test_a_withdrawn_login_is_not_handed_out_and_frees_its_place() -> None:
    queue: LoginQueue[str, str] = LoginQueue(total=10, per_address=2, workers=2)
    assert queue.add("a", "a0", "a0") and queue.add("a", "a1", "a1")
    assert not queue.add("a", "a2", "a2")
    queue.remove("a0")
    queue.remove("never queued")
    assert queue.add("a", "a2", "a2")
    assert [queue.take(), queue.take(), queue.take()] == ["a1", "a2", None]
    queue.remove("a1")  # handed out already: nothing to withdraw
    assert len(queue) == 0 and queue.running == 2
