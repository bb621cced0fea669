"""Groups run by the thread that hands the inputs over (``aaabus.engine.inline``), on a real
log store: when the engine is idle the caller runs the group and returns once it committed;
otherwise the engine thread does, as before; groups never overlap; failures and stops behave
as if the engine thread had run the group."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from aaabus.core.engine import Engine
from aaabus.core.store import Store, open_store
from aaabus.core.turn import Turn
from tests.support.topics import wait_until

TIMEOUT = 10.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = open_store("log", tmp_path / "s0", 0)
    yield store
    store.close()


@pytest.fixture
def engine(store: Store) -> Iterator[Engine]:
    engine = Engine(store, 0, name="engine-under-test")
    engine.start()
    yield engine
    engine.stop()


def writer(key: str, ran_on: list[str], committed: list[str]) -> Callable[[Engine], None]:
    """An input that stores ``key`` and notes on which thread it ran and when it committed."""

    def item(engine: Engine) -> None:
        ran_on.append(threading.current_thread().name)
        engine.store.queues[key] = len(ran_on)
        engine.after_commit(lambda: committed.append(key))

    return item


def test_an_idle_engine_lets_the_caller_run_the_group_and_commit_before_returning(
    engine: Engine,
) -> None:
    ran_on: list[str] = []
    committed: list[str] = []
    engine.submit_many([writer("a", ran_on, committed)], run_here=True)
    assert ran_on == [threading.current_thread().name]
    assert committed == ["a"]  # durable before submit_many returned: no wait needed
    assert engine.stats.commits >= 1


def test_a_busy_engine_keeps_the_inputs_for_its_own_thread(engine: Engine) -> None:
    started, release, done = threading.Event(), threading.Event(), threading.Event()

    def blocker(_engine: Engine) -> None:
        started.set()
        assert release.wait(TIMEOUT)

    engine.submit(blocker)
    assert started.wait(TIMEOUT)
    ran_on: list[str] = []
    committed: list[str] = []
    engine.submit_many([writer("b", ran_on, committed)], run_here=True)
    assert ran_on == []  # not run here: the engine thread has the turn
    engine.submit(lambda e: e.after_commit(done.set))
    release.set()
    assert done.wait(TIMEOUT)
    assert ran_on == ["engine-under-test"]
    assert committed == ["b"]


def test_with_inline_off_the_engine_thread_runs_every_group(store: Store) -> None:
    engine = Engine(store, 0, name="engine-no-inline")
    engine.run_inline = False
    engine.start()
    try:
        done = threading.Event()
        ran_on: list[str] = []
        committed: list[str] = []
        engine.submit_many(
            [writer("c", ran_on, committed), lambda e: e.after_commit(done.set)], run_here=True
        )
        assert done.wait(TIMEOUT)
        assert ran_on == ["engine-no-inline"]
    finally:
        engine.stop()


class Fatal(BaseException):
    """Something no group may survive (what a broken store raises past the group's replay)."""


def test_a_group_that_fails_past_its_replay_stops_the_engine_as_on_its_own_thread(
    engine: Engine,
) -> None:
    def fatal(_engine: Engine) -> None:
        raise Fatal("the disk is gone")

    engine.submit_many([fatal], run_here=True)  # returns: the failure is the engine's now
    engine._thread.join(TIMEOUT)
    assert not engine.alive
    assert isinstance(engine.failure, Fatal)
    ran_on: list[str] = []
    engine.submit_many([writer("d", ran_on, [])], run_here=True)
    assert ran_on == []  # a stopped engine runs nothing, here or there


def test_stop_waits_for_a_group_in_flight_on_another_thread(engine: Engine) -> None:
    inside, release = threading.Event(), threading.Event()
    committed: list[str] = []

    def slow(e: Engine) -> None:
        inside.set()
        assert release.wait(TIMEOUT)
        e.store.queues["slow"] = 1
        e.after_commit(lambda: committed.append("slow"))

    runner = threading.Thread(
        target=engine.submit_many, args=([slow],), kwargs={"run_here": True}, name="io-like"
    )
    runner.start()
    assert inside.wait(TIMEOUT)
    stopper = threading.Thread(target=engine.stop, name="stopper")
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive()  # the engine cannot stop under a group it does not run
    release.set()
    runner.join(TIMEOUT)
    stopper.join(TIMEOUT)
    assert not stopper.is_alive() and not engine.alive
    assert committed == ["slow"]
    ran_on: list[str] = []
    engine.submit_many([writer("e", ran_on, [])], run_here=True)
    assert ran_on == []  # nothing runs inline once stopped


def test_lazy_work_waits_its_delay_after_a_group_took_the_lazy_work_before_it(
    store: Store,
) -> None:
    """The deadline belongs to the lazy work waiting, not to the engine thread's last wait: an
    acknowledgement taken by an inline group must not leave an expired deadline behind for the
    next one (which would then cost a commit of its own at once)."""
    engine = Engine(store, 0, name="engine-lazy")
    engine.lazy_delay_s = 0.2
    engine.start()
    try:
        applied: list[float] = []
        done = threading.Event()

        def ack(e: Engine) -> None:
            applied.append(time.monotonic())
            e.after_commit(done.set)

        engine.submit_lazy(lambda e: None)  # arms a deadline; the engine thread waits on it
        engine.submit_many([writer("f", [], [])], run_here=True)  # takes that lazy work along
        # Not a synchronisation: the scenario needs the first deadline to be past.
        time.sleep(0.3)
        submitted = time.monotonic()
        engine.submit_lazy(ack)
        assert done.wait(TIMEOUT)
        assert applied[0] - submitted >= 0.15  # its own delay, not the expired one
    finally:
        engine.stop()


@contextmanager
def turn_held_by_another_thread(engine: Engine) -> Iterator[None]:
    """For the block, an inline group on a thread of its own holds the engine's turn; the
    block's end lets that group end and waits for it."""
    started, release = threading.Event(), threading.Event()

    def blocker(_engine: Engine) -> None:
        started.set()
        assert release.wait(TIMEOUT)

    inline = threading.Thread(
        target=engine.submit_many,
        args=([blocker],),
        kwargs={"run_here": True},
        name="inline-group",
    )
    inline.start()
    try:
        assert started.wait(TIMEOUT)
        yield
    finally:
        release.set()
        inline.join(TIMEOUT)
    assert not inline.is_alive()


class CountingCondition(threading.Condition):
    """The engine's real condition, counting its wake-ups (each costs the waker a futex call,
    and on a VM an interrupt to the other CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.notified = 0
        self.asleep = threading.Event()  # someone waits without a deadline
        self.sleeps = threading.Semaphore(0)  # released at each wait without a deadline

    def notify(self, n: int = 1) -> None:
        self.notified += 1
        super().notify(n)

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is None:
            self.asleep.set()
            self.sleeps.release()
        return super().wait(timeout)


def test_work_handed_over_while_a_group_runs_wakes_nobody_and_is_done_after_it(
    store: Store,
) -> None:
    """Whoever holds the turn looks for more work when its group ends: waking the engine
    thread meanwhile (it could only go back to sleep) would cost the hand-over for nothing.
    Lazy work is the exception, once: the engine thread asleep without a deadline must learn
    of it."""
    engine = Engine(store, 0, name="engine-wakes")
    cond = engine.turns._cond = CountingCondition()  # before the engine thread ever waits on it
    engine.start()
    try:
        assert cond.asleep.wait(TIMEOUT)  # the engine thread is idle, with no deadline
        done = threading.Event()
        committed: list[str] = []
        with turn_held_by_another_thread(engine):
            before = cond.notified
            for key in "abc":
                engine.submit(writer(key, [], committed))
            engine.submit_many([writer("d", [], committed)], run_here=True)  # queued, not run
            assert cond.notified == before  # nobody woken while the group runs
            engine.submit_lazy(lambda e: None)
            engine.submit_lazy(lambda e: e.after_commit(done.set))
            assert cond.notified == before + 1  # the first lazy work only
        assert done.wait(TIMEOUT)  # the end of the group handed the rest to the engine thread
        assert committed == ["a", "b", "c", "d"]
    finally:
        engine.stop()


def test_lazy_work_handed_over_during_an_inline_group_is_done_within_its_delay(
    store: Store,
) -> None:
    """The engine thread asleep without a deadline learns of the first lazy work even while
    another thread holds the turn, and comes back for it by itself once the turn is free."""
    engine = Engine(store, 0, name="engine-lazy-inline")
    engine.lazy_delay_s = 0.1
    engine.start()
    try:
        done = threading.Event()
        with turn_held_by_another_thread(engine):
            engine.submit_lazy(lambda e: e.after_commit(done.set))
        assert done.wait(TIMEOUT)  # nothing else came: the engine thread did it on its own
        assert engine.stats.commits == 2  # the inline group, then the lazy work's own
    finally:
        engine.stop()


def test_lazy_work_due_while_another_group_runs_is_done_as_that_group_ends(store: Store) -> None:
    """Lazy work that falls due while another thread holds the turn is the engine thread's
    as soon as the turn is free: it sleeps without a deadline once the work is due (nothing
    to come back for by itself), and the end of the group wakes it, rather than leaving the
    work to a periodic look that could make it twice as late as its delay."""
    engine = Engine(store, 0, name="engine-lazy-due")
    engine.lazy_delay_s = 0.05
    cond = engine.turns._cond = CountingCondition()
    engine.start()
    try:
        assert cond.sleeps.acquire(timeout=TIMEOUT)  # idle, no deadline
        done = threading.Event()
        with turn_held_by_another_thread(engine):
            engine.submit_lazy(lambda e: e.after_commit(done.set))  # wakes the engine thread
            # It finds the turn taken, waits for the lazy deadline, finds the turn still
            # taken and sleeps without a deadline: the group's end is now what it waits for.
            assert cond.sleeps.acquire(timeout=TIMEOUT)
            assert not done.is_set()
            before = cond.notified
        assert cond.notified == before + 1  # the group's end woke it for the due lazy work
        assert done.wait(TIMEOUT)
        assert engine.stats.commits == 2
    finally:
        engine.stop()


class Pausing:
    """A channel whose next commit on a turn that may be set aside is set aside once (as the
    channel sets aside, on the network's I/O thread, a group waiting for a notice)."""

    def __init__(self) -> None:
        self.armed = False
        self.refused: list[Turn] = []

    def knows(self, server: int) -> bool:
        return False

    def send(self, message: object) -> None:
        raise AssertionError("nothing is sent here")

    def seal(self) -> None:
        pass

    def before_commit(self, turn: Turn) -> Iterator[str]:
        if self.armed:
            if not turn.may_set_aside:
                self.refused.append(turn)
                return
            self.armed = False
            yield "aside"


@pytest.fixture
def pausing(store: Store) -> Iterator[tuple[Engine, Pausing]]:
    channel = Pausing()
    engine = Engine(store, 0, channel=channel, name="engine-under-test")
    engine.start()
    channel.armed = True
    yield engine, channel
    engine.stop()


def test_a_group_set_aside_keeps_its_transaction_and_the_turn_until_resumed(
    pausing: tuple[Engine, Pausing],
) -> None:
    engine, _ = pausing
    ran_on: list[str] = []
    committed: list[str] = []
    assert (
        engine.submit_many([writer("a", ran_on, committed)], run_here=True, set_aside=True)
        == "aside"
    )
    assert committed == [] and engine.stats.commits == 0
    # Its turn is held: what comes meanwhile waits for it, on no thread.
    assert engine.submit_many([writer("b", ran_on, committed)], run_here=True) is None
    # "b" is queued, not run: nobody may take the turn while "a" holds it.
    with engine.turns._cond:
        assert len(engine.turns._inbox) == 1 and engine.turns.held
    assert ran_on == [threading.current_thread().name]
    assert engine.resume() is None  # committed, the turn given back
    assert committed[0] == "a" and engine.store.queues["a"] == 1
    wait_until("b committed", lambda: committed == ["a", "b"], TIMEOUT)
    assert ran_on[1] == "engine-under-test"


def test_a_group_set_aside_and_cancelled_is_replayed_by_the_engine_thread(
    pausing: tuple[Engine, Pausing],
) -> None:
    engine, _ = pausing
    ran_on: list[str] = []
    committed: list[str] = []
    assert (
        engine.submit_many([writer("a", ran_on, committed)], run_here=True, set_aside=True)
        == "aside"
    )
    engine.cancel("what it waited for is gone")
    assert engine.stats.aborts == 1 and "a" not in engine.store.queues
    wait_until("a replayed and committed", lambda: committed == ["a"], TIMEOUT)
    assert ran_on == [threading.current_thread().name, "engine-under-test"]


def test_only_a_turn_that_may_set_a_group_aside_lets_it_wait_aside(
    pausing: tuple[Engine, Pausing],
) -> None:
    """Whether a group may be set aside is the turn's to say, not the thread's: the same
    thread, taking the turn without ``set_aside``, gets a group that waits where it runs (and
    so does the engine thread's own turn); with it, the group is set aside."""
    engine, channel = pausing
    committed: list[str] = []
    assert engine.submit_many([writer("a", [], committed)], run_here=True) is None
    assert committed == ["a"]  # committed in place, never set aside
    assert [turn.may_set_aside for turn in channel.refused] == [False]
    assert channel.refused[0].holder == threading.current_thread().name
    engine.submit(writer("b", [], committed))
    wait_until("b committed", lambda: committed == ["a", "b"], TIMEOUT)
    assert [turn.holder for turn in channel.refused] == [
        threading.current_thread().name,
        "engine-under-test",
    ]
    assert engine.submit_many([writer("c", [], committed)], run_here=True, set_aside=True) == (
        "aside"
    )
    assert engine.resume() is None
    assert committed == ["a", "b", "c"]
