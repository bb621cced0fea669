"""Frames that leave before their group is durable, and the groups that wait for them.

A hop used to be strictly sequential: the sender's group is written and synced, THEN its frames
leave, THEN the receiver decodes, tests, reacts and prepares its own commit. The sender's sync
(hundreds of µs) and the receiver's work (as much again) can overlap without weakening what
either side commits, if the receiver is told which frames are not durable yet:

* **sending** (property ``aaabus.link.early``, default on): as a group's commit starts, before
  ZODB prepares its records, its frames leave, each batch behind a ``TENTATIVE`` frame; once
  the store's vote made the group durable, a ``DURABLE`` frame follows on every connection that
  got tentative frames. A server's groups commit one after another, so on one connection
  each ``DURABLE`` vouches for every data frame before it.
* **receiving**: a data frame read after a ``TENTATIVE`` and before the next ``DURABLE`` is
  applied like any other (clock test, delivery, reaction), but the group that applied it is a
  *dependant*: before it commits (:meth:`aaabus.core.channel.Channel.before_commit`) it waits
  until the ``DURABLE`` frame has come -- so nothing this server stores, acknowledges, shows
  (after-commit actions) or sends ever derives from a frame its sender might lose. Its own
  frames leave after that wait: a tentative frame hangs on its own group's durability only,
  never on another server's, and a crash never cascades beyond the frames it cut short.
* **losing**: if the connection closes before that ``DURABLE`` frame, the frame may never have
  been durable. The group waiting for it is aborted (:class:`~aaabus.errors.DependencyLost`)
  and replayed without it. Nothing is lost either way: a frame that was durable is still in the
  sender's outgoing queue (this server never acknowledged it) and is sent again when the link
  comes back up; one that was not never existed, and the sender's next groups reuse its number.
  A sender whose group aborts after its frames left (the disk failed) closes the connections
  they went through, so that its receivers drop them.
* **waiting apart**: a group waits for a notice at most ``aaabus.link.notice_wait_ms``; past
  that, the sender is *late* (for :data:`LATE_FOR_S`): the group is aborted and replayed, and
  meanwhile that connection's tentative frames (and every frame read after them) are *parked*
  -- kept outside the engine, in order, and handed back to it when their notice comes or the
  connection closes (a frame already in the engine's queue may overtake them: the clock's
  hold-back puts it back in order). A slow sender then delays its own frames only, and a peer
  that never sends its notice stalls nothing; what a connection may park is capped (frames and
  bytes), past which it is closed (its durable frames come again with the resends).

* **reading the notice**: the group that applies a read's tentative frames runs, when the
  engine is idle, on the network's I/O thread that read them (as any group of a read does), and
  does not wait there: it is set aside before its commit, transaction open and turn held, and
  the network's loop, which reads the notice, resumes it (:meth:`EarlyLinks.ready` tells it
  whether to go on): no hand-off to the engine thread and back. Meanwhile the loop serves the
  other connections (their frames queue for the engine: the turn is held), and the wait's
  budget and lateness are those of any wait.

The receiving side's state, one :class:`Incoming` per connection, is written by the network's
I/O thread (the order of the frames, the notices) and by whichever thread holds the engine's turn
(parking); what both touch changes under this module's condition, which the turn's holder waits
on with a deadline.

What a user may observe: a reaction can run on a frame whose sender then loses it, and be rolled
back -- as any reaction of a group that aborts is. Effects outside the store belong in
``after_commit`` actions, which only ever see committed, durable state.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import transaction
from transaction.interfaces import IDataManagerSavepoint, ISavepointDataManager
from zope.interface import implementer

from aaabus.core.commitorder import sort_key
from aaabus.errors import DependencyLost

#: An engine input (see :meth:`aaabus.core.engine.Engine.submit`).
Item = Callable[[Any], None]

#: What one connection may park (frames waiting outside the engine for their notice) before it
#: is closed: a peer that never sends its notice cannot make this server hold more.
MAX_PARKED_FRAMES = 10_000
MAX_PARKED_BYTES = 64 << 20

#: How long a connection stays *late* after a group waited for its notice past the budget: its
#: tentative frames are parked meanwhile, so that a sender whose syncs are slow holds up no
#: group of this server, not even once per notice.
LATE_FOR_S = 1.0

_SORT_KEY = sort_key("early")


class Incoming:
    """One connection from a peer, as its receiver sees it (one per ``on_up``)."""

    __slots__ = (
        "closed",
        "durable",
        "late_until",
        "parked",
        "parked_bytes",
        "parked_ids",
        "peer",
        "received",
        "tentative",
    )

    def __init__(self, peer: int) -> None:
        self.peer = peer
        #: Data frames read on this connection (I/O thread).
        self.received = 0
        #: Whether the frames being read now are tentative: a TENTATIVE frame came and its
        #: DURABLE frame not yet (I/O thread).
        self.tentative = False
        # The rest changes under the condition.
        #: The first ``durable`` data frames read are durable at their sender.
        self.durable = 0
        #: The connection is gone, or was closed for parking too much.
        self.closed = False
        #: A group waited for this connection's notice past its budget: until this
        #: ``time.monotonic()``, its tentative frames are parked rather than applied.
        self.late_until = 0.0
        #: Its frames waiting outside the engine for a notice, in the order parked (None: none),
        #: their bytes, and their identities (a replayed group offers a parked frame again).
        self.parked: list[Item] | None = None
        self.parked_bytes = 0
        self.parked_ids: set[int] = set()


#: What a frame hangs on: its connection and its position there.
Dependency = tuple[Incoming, int]


class EarlyLinks:
    """The receiving side of early frames, for every peer of one server (thread-safe).

    ``release(items)`` hands parked frames back to the engine, in order, once their notice came
    or their connection closed (called on the I/O thread, outside the lock).
    """

    def __init__(
        self,
        release: Callable[[list[Item]], None],
        *,
        max_parked_frames: int = MAX_PARKED_FRAMES,
        max_parked_bytes: int = MAX_PARKED_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cond = threading.Condition()
        self._incoming: dict[int, Incoming] = {}
        self._release = release
        self._max_frames = max_parked_frames
        self._max_bytes = max_parked_bytes
        self._clock = clock  # what "late for a second" is measured with
        #: Connections seen come up (I/O thread); threads sleeping in :meth:`wait` now (under
        #: the condition); tentative frames dropped because never vouched for (engine thread);
        #: frames parked until their notice, since start (under the condition).
        self.ups = 0
        self.sleeping = 0
        self.dropped = 0
        self.parked = 0

    # -- the I/O thread -----------------------------------------------------------------------

    def up(self, peer: int) -> None:
        """A new connection with ``peer``: what follows is read on it."""
        with self._cond:
            old = self._incoming.get(peer)
            freed = self._close(old) if old is not None else None
            self._incoming[peer] = Incoming(peer)
            self.ups += 1
        if freed:
            self._release(freed)

    def down(self, peer: int) -> None:
        """The connection with ``peer`` is gone: what was still tentative on it is lost."""
        with self._cond:
            conn = self._incoming.pop(peer, None)
            freed = self._close(conn) if conn is not None else None
        if freed:
            self._release(freed)

    def connection(self, peer: int) -> Incoming:
        """The current connection with ``peer`` (I/O thread, while reading its frames: the
        network announces a connection, :meth:`up`, before it hands over any of its frames)."""
        return self._incoming[peer]

    def durable(self, conn: Incoming) -> None:
        """A DURABLE frame: every data frame read before it on ``conn`` is durable."""
        conn.tentative = False
        with self._cond:
            if conn.closed:
                return
            conn.durable = conn.received
            freed = self._unpark(conn)
            self._cond.notify_all()
        if freed:
            self._release(freed)

    def hold(self, conn: Incoming, item: Item, size: int) -> bool | None:
        """A data frame just read on ``conn``: True if parked behind older frames still waiting
        for their notice (order is kept), False if it goes to the engine now, None if parking
        it would exceed the connection's cap (the caller closes the connection)."""
        if conn.parked is None:
            # The usual case, without the lock: only the turn's holder creates a parked list;
            # one created just now lets this frame overtake it, which the clock's hold-back
            # puts back in order (see the module docstring).
            return False
        with self._cond:
            if conn.parked is None:
                return False
            return self._park(conn, item, size)

    # -- the engine thread --------------------------------------------------------------------

    def admit(self, dep: Dependency, tentative: bool, item: Item, size: int) -> str:
        """What to do with a frame now that a group applies it: ``"apply"``, ``"drop"`` (it
        will never be vouched for: its sender resends it if it was durable after all),
        ``"park"`` (it waits outside the engine for its notice, and ``item`` runs again then;
        parking the same item twice, as a replayed group does, keeps one) or ``"reset"``
        (parking it would exceed the cap: close the connection)."""
        conn, position = dep
        if conn.parked is None and (
            not tentative
            or conn.durable >= position
            or (not conn.closed and conn.late_until <= self._clock())
        ):
            # The usual cases, without the lock: a parked list is only ever created by the
            # turn's holder (this thread), ``durable`` only grows, and a connection that
            # closes or turns late just after this look is met by the group's wait, as it is
            # when that happens just after the look under the lock.
            return "apply"
        with self._cond:
            if conn.parked is not None:  # older frames of the connection wait: behind them
                return "park" if self._park(conn, item, size) else "reset"
            if not tentative or conn.durable >= position:
                return "apply"
            if conn.closed:
                return "drop"
            if conn.late_until > self._clock():
                return "park" if self._park(conn, item, size) else "reset"
            return "apply"  # optimistic: the group waits for the notice before it commits

    def wait(self, deps: dict[Incoming, int], budget_s: float, spin_ns: int = 0) -> None:
        """Return once every ``deps`` (connection -> last position applied) is durable.

        Raises :class:`DependencyLost` if a connection closed first, or if ``budget_s`` went by
        (the connection is then *late*: until its notice, its tentative frames are parked
        instead of applied, so that a slow sender delays its own frames only, not the groups
        of every other peer, and a peer that never sends its notice stalls nothing).

        ``spin_ns``: poll for that long first, yielding the CPU between looks, before sleeping on
        the condition. A notice usually comes within a sync's time, and a thread put to sleep
        on a condition wakes tens of µs after it is notified, on every hop of a chain of
        notices (measured: a quarter of a remote round trip); polling costs a core meanwhile.
        """
        if spin_ns:
            self._spin(deps, time.perf_counter_ns() + spin_ns)
        deadline = time.monotonic() + budget_s
        with self._cond:
            for conn, position in deps.items():
                while conn.durable < position:
                    self._check(conn, deadline, budget_s)
                    self.sleeping += 1
                    try:
                        self._cond.wait(deadline - time.monotonic())
                    finally:
                        self.sleeping -= 1

    def ready(self, deps: dict[Incoming, int], deadline: float, budget_s: float) -> bool:
        """Whether every ``deps`` is durable now, without waiting: for the thread that reads the
        notices (the network's I/O thread, holding the turn for a group set aside until then).
        Raises as :meth:`wait` does once a connection closed or ``deadline`` (of a budget of
        ``budget_s``) passed.
        """
        # No lock: this thread is the one that writes ``durable`` and ``closed`` (on_read,
        # on_down), or the turn's holder that parks (and may close) -- both are this one.
        for conn, position in deps.items():
            if conn.durable < position:
                self._check(conn, deadline, budget_s)
                return False
        return True

    def parked_now(self) -> int:
        """Frames waiting apart for their sender's notice now, over every connection."""
        with self._cond:
            return sum(len(c.parked) for c in self._incoming.values() if c.parked is not None)

    # -- helpers (holding the condition, or on the thread that writes what they read) ---------

    def _check(self, conn: Incoming, deadline: float, budget_s: float) -> None:
        """Raise if a group waiting for ``conn``'s notice must give up: the connection closed,
        or the wait's ``deadline`` passed (the connection is then late). For :meth:`wait` and
        :meth:`ready`."""
        if conn.closed:
            raise DependencyLost(
                f"the connection from server {conn.peer} closed before the frames this group "
                "applied were durable there"
            )
        if time.monotonic() >= deadline:
            conn.late_until = self._clock() + LATE_FOR_S
            raise DependencyLost(
                f"server {conn.peer} did not say within {budget_s * 1000:g} ms that the frames "
                "this group applied were durable; they wait apart"
            )

    def _park(self, conn: Incoming, item: Item, size: int) -> bool:
        parked = conn.parked if conn.parked is not None else []
        if id(item) in conn.parked_ids:
            return True  # a replayed group offers it again: it is already waiting
        if len(parked) >= self._max_frames or conn.parked_bytes + size > self._max_bytes:
            self._close(conn)  # what it parked is dropped: its sender resends it after
            return False
        parked.append(item)
        conn.parked = parked
        conn.parked_bytes += size
        conn.parked_ids.add(id(item))
        self.parked += 1
        return True

    @staticmethod
    def _unpark(conn: Incoming) -> list[Item] | None:
        freed, conn.parked, conn.parked_bytes = conn.parked, None, 0
        conn.parked_ids = set()
        return freed

    def _close(self, conn: Incoming) -> list[Item] | None:
        conn.closed = True
        freed = self._unpark(conn)
        self._cond.notify_all()
        return freed

    @staticmethod
    def _spin(deps: dict[Incoming, int], until_ns: int) -> None:
        # Plain reads without the lock: a stale value only means one more look, and wait()
        # decides under the lock afterwards. sched_yield releases the GIL (the I/O thread
        # needs it to read the notice) and lets any other runnable thread have this core.
        clock = time.perf_counter_ns
        yield_cpu = os.sched_yield
        for conn, position in deps.items():
            while conn.durable < position and not conn.closed:
                if clock() >= until_ns:
                    return
                yield_cpu()


@implementer(ISavepointDataManager)
class EarlyVote:
    """A participant of every transaction that sends frames or applied tentative ones, so that
    the channel hears how it ends; it comes first in each phase (:meth:`sortKey`).

    ``vote()`` runs in :meth:`tpc_vote`, once ZODB has prepared the records and before the store
    writes them (if it raises, the transaction aborts); ``aborted()`` whenever a transaction it
    joined ends without committing, ``finished()`` when it committed. All run on the thread
    that commits.
    """

    def __init__(
        self,
        tm: transaction.TransactionManager,
        *,
        vote: Callable[[], None],
        aborted: Callable[[], None],
        finished: Callable[[], None],
    ) -> None:
        self.transaction_manager = tm
        self._vote = vote
        self._aborted = aborted
        self._finished = finished
        self._joined = False

    def join(self) -> None:
        """Take part in the open transaction (once)."""
        if not self._joined:
            self.transaction_manager.get().join(self)
            self._joined = True

    def abort(self, txn: Any) -> None:
        self._joined = False
        self._aborted()

    def tpc_begin(self, txn: Any) -> None:
        pass

    def commit(self, txn: Any) -> None:
        pass

    def tpc_vote(self, txn: Any) -> None:
        self._vote()

    def tpc_finish(self, txn: Any) -> None:
        self._joined = False
        self._finished()

    def tpc_abort(self, txn: Any) -> None:
        self.abort(txn)

    def sortKey(self) -> str:
        # First in every phase (aaabus.core.commitorder): its vote marks the end of ZODB's
        # preparation, before the store's write.
        return _SORT_KEY

    def savepoint(self) -> _NoSavepoint:
        # What this manager holds (frames staged, dependencies) lives in the channel and is
        # settled there; a rolled-back dependency only makes the vote wait a little longer.
        return _NoSavepoint()


@implementer(IDataManagerSavepoint)
class _NoSavepoint:
    __slots__ = ()

    def rollback(self) -> None:
        pass
