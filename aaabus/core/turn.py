"""The engine's turn: who runs the next group, handed over as a token.

Groups never overlap: the store and everything reached from it have one user at a time. That
user is whoever holds the *turn*, a :class:`Turn` given by :class:`Turns` to one thread at a
time: the engine thread when it finds work, or a thread that hands inputs over with
``run_here`` while the engine is idle (the network's I/O thread for the frames of one read, the
MQTT listener for a batch of devices' operations), which then runs that group itself and gives
the turn back (see :mod:`aaabus.core.engine`). The token also says what its holder can do: only
a holder that comes back to a group it set aside (the network's loop, which reads the
durability notices the group waits for) may let the group yield before its commit
(:attr:`Turn.may_set_aside`); the channel asks the token, never which thread it runs on.

:class:`Turns` also keeps what waits for the next group: the inputs handed over (a deque) and
the lazy work (acknowledgements: they ride along with the next group, or wait
``lazy_delay_s``), under one condition, with the rule that nobody is woken for nothing (see
:meth:`Turns.wake_for_work`).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

#: An input: applied inside the next group's transaction (see Engine.submit).
Input = Callable[[Any], None]


class Turn:
    """The right to run one group, held by one thread; passed along with the group it runs.

    ``may_set_aside``: the holder comes back to a group that yields before its commit (see
    :meth:`aaabus.core.sends.ChannelPort.before_commit`); otherwise the group must wait where it
    is. ``holder`` names the thread, for logs and tests.
    """

    __slots__ = ("holder", "may_set_aside")

    def __init__(self, holder: str, may_set_aside: bool) -> None:
        self.holder = holder
        self.may_set_aside = may_set_aside

    def __repr__(self) -> str:
        return f"Turn({self.holder!r}, may_set_aside={self.may_set_aside})"


class Turns:
    """Who holds the turn, and the work waiting for it. Every method may run on any thread;
    the state is guarded by one condition (``_cond``), on which the engine thread sleeps.

    ``queued()`` (engine turn only: the caller holds it, or nobody does) says whether the store
    still has messages to react to, so that the end of a group wakes the engine thread for them.
    """

    def __init__(self, queued: Callable[[], bool], lazy_delay_s: float = 0.05) -> None:
        self._queued = queued
        self._cond = threading.Condition()
        self._inbox: collections.deque[Input] = collections.deque()
        # How many inputs at the head of the inbox are those of an aborted group, handed back
        # (requeue): the next group takes them before the lazy work (guarded by _cond).
        self._replay = 0
        self._lazy: list[Input] = []
        self.lazy_delay_s = lazy_delay_s
        # When the lazy work waiting now must be done at the latest (set as the first of it
        # arrives, cleared when a group takes it; guarded by _cond).
        self._lazy_deadline: float | None = None
        # The turn's holder, None while nobody runs a group (guarded by _cond).
        self._holder: Turn | None = None
        #: Whether a thread that hands inputs over with ``run_here`` may take the turn when the
        #: engine is idle (property ``aaabus.engine.inline``). Set before start.
        self.run_inline = True
        self.started = False
        self._stopping = False
        # The engine thread sleeps with no deadline (idle with no lazy work, or waiting for
        # another thread's group with no lazy work due later): the first lazy work, or the
        # end of that group with lazy work due, must wake it (guarded by _cond).
        self._asleep_untimed = False
        # What stopped a group run by another thread: the engine thread stops on it.
        self._inline_failure: BaseException | None = None
        # What stopped the engine thread: the turn is then its for good.
        self.failure: BaseException | None = None

    @property
    def held(self) -> bool:
        """Whether some thread runs a group now."""
        return self._holder is not None

    # -- handing work over (any thread) -------------------------------------------------------

    def submit(self, item: Input) -> None:
        with self._cond:
            self._inbox.append(item)
            self._wake_for_work()

    def submit_lazy(self, item: Input) -> None:
        with self._cond:
            if self._add_lazy((item,)):
                self._wake_for_deadline()

    def offer(
        self, items: Iterable[Input], lazy: Iterable[Input], take: Turn | None
    ) -> list[Input] | None:
        """Queue ``items`` and ``lazy`` with one lock and at most one wake-up; with ``take``,
        the caller's turn-to-be, take the turn if the engine is idle and return the inputs of
        the group the caller then runs (None: the engine thread does, or nothing is to run)."""
        with self._cond:
            # Only a group of these very items runs on the caller: older ones may have to wait
            # for something that thread itself must deliver (aaabus.core.early's notices).
            if self._inbox:
                take = None
            self._inbox.extend(items)
            armed = self._add_lazy(lazy) if lazy else False
            if not self._inbox:
                if armed:
                    self._wake_for_deadline()
                return None
            if take is None or not self._may_take_turn():
                self._wake_for_work()
                return None
            self._holder = take
            return self._take_inputs()

    def requeue(self, inputs: Iterable[Input]) -> None:
        """Hand back the inputs of a group that was aborted, ahead of the rest (its holder).

        Ahead of the lazy work queued since, too, which a group otherwise takes before its
        inputs: the aborted group took its own lazy work first, and lazy work must be applied
        in the order it came (a peer's link state is compared with the acknowledgements read
        before it, never with one read after it: :meth:`aaabus.core.channel.Channel.on_read`).
        """
        handed = list(inputs)
        with self._cond:
            self._inbox.extendleft(reversed(handed))
            self._replay += len(handed)

    def give_back(self, turn: Turn, failure: BaseException | None) -> None:
        """``turn``'s holder, not the engine thread, ends its group: the turn is free, and the
        engine thread is woken if there is work the holder leaves it (or its ``failure``)."""
        with self._cond:
            assert self._holder is turn, f"{turn} gave back a turn held by {self._holder}"
            self._holder = None
            self._inline_failure = failure
            if failure is not None or self._inbox or self._stopping or self._queued():
                self._cond.notify()
            elif self._lazy:
                self._wake_for_deadline()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    # -- the engine thread ----------------------------------------------------------------------

    def wait_for_work(self, turn: Turn) -> list[Input] | None:
        """The inputs of the next group, once the engine thread holds ``turn``; None to stop.
        Raises what stopped a group run by another thread."""
        with self._cond:
            while True:
                if self._inline_failure is not None:
                    raise self._inline_failure
                if self._holder is not None:
                    # Another thread runs a group: the store is not ours to read, not even
                    # qin. Its end wakes us for work it leaves (inbox, qin, failure, stop)
                    # and for lazy work if we sleep without a deadline; lazy work not yet due
                    # we come back for by ourselves, at its deadline (the group may end first
                    # and take it: the wait is then a stale one).
                    deadline = self._lazy_deadline
                    remaining = 0.0 if deadline is None else deadline - time.monotonic()
                    if remaining > 0:
                        self._cond.wait(remaining)
                    else:
                        self._sleep_untimed()
                    continue
                if self._stopping:
                    return None
                if self._inbox or self._queued():
                    break
                if self._lazy:
                    deadline = self._lazy_deadline
                    assert deadline is not None  # armed with the first lazy work (_add_lazy)
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                else:
                    self._sleep_untimed()
            self._holder = turn
            return self._take_inputs()

    def end(self, turn: Turn) -> None:
        """The engine thread's group ended: the turn is free (its loop looks for more work)."""
        with self._cond:
            assert self._holder is turn
            self._holder = None

    def fail(self, turn: Turn, exc: BaseException) -> None:
        """The engine thread stops on ``exc``: it keeps the turn for good (an inline group's
        too), so that no thread runs another group on a store that failed."""
        with self._cond:
            self._holder = turn
            self.failure = exc

    # -- under _cond --------------------------------------------------------------------------

    def _may_take_turn(self) -> bool:
        """Whether a thread other than the engine's may run a group now: inline groups on, the
        engine started, idle, not stopping and not failed."""
        return (
            self.run_inline
            and self.started
            and self._holder is None
            and not self._stopping
            and self._inline_failure is None
            and self.failure is None
        )

    def _add_lazy(self, items: Iterable[Input]) -> bool:
        """Queue lazy work; True if it is the first, which arms the deadline (the caller then
        wakes the engine thread if it must learn of it)."""
        first = not self._lazy
        self._lazy.extend(items)
        if first and self._lazy:
            self._lazy_deadline = time.monotonic() + self.lazy_delay_s
            return True
        return False

    # Waking the engine thread costs the waker a futex call and, on a VM, an interrupt to the
    # other CPU: tens of µs, measured on the I/O thread of a remote hop, on the critical path.
    # So it is woken only when nobody else will act on the work: not while a group runs (its
    # end looks for more work: the engine thread's loop, or the inline runner's give_back),
    # and for a lazy deadline only when it sleeps without one (waiting for another's group, it
    # comes back by itself at the deadline of lazy work queued before).

    def _wake_for_work(self) -> None:
        """New inputs are queued."""
        if self._holder is None:
            self._cond.notify()

    def _wake_for_deadline(self) -> None:
        """The first lazy work is queued."""
        if self._asleep_untimed:
            self._cond.notify()

    def _sleep_untimed(self) -> None:
        """Wait without a deadline: lazy work must wake us (_wake_for_deadline)."""
        self._asleep_untimed = True
        try:
            self._cond.wait()
        finally:
            self._asleep_untimed = False

    def _take_inputs(self) -> list[Input]:
        inbox = list(self._inbox)
        replay = self._replay
        inputs = inbox[:replay] + self._lazy + inbox[replay:] if replay else self._lazy + inbox
        self._replay = 0
        self._lazy = []
        self._lazy_deadline = None
        self._inbox.clear()
        return inputs
