"""The in-memory effects of the engine's open transaction, undone by the transaction itself.

A ZODB transaction rolls back what it stored: agents, queues, clocks. Beside the store, the engine
thread keeps state in memory that a group changes as it goes: frames and acknowledgements staged
for the network, agents whose ``on_init`` already ran or that were unpickled this boot, actions to
run once the group is durable, counters. Those changes must share the fate of the transaction
that made them, at every granularity the engine uses: the whole group (abort), one reaction or
one input (savepoint rollback), a deployment whose ``on_init`` raised (savepoint rollback).

:class:`TransactionEffects` does that with one mechanism. It is a data manager of the
``transaction`` package (``IDataManager`` and ``ISavepointDataManager``): it joins the open
transaction at the first effect recorded in it, and

* every effect is recorded with the function that undoes it (an *undo log*); ``abort`` runs the
  whole log backwards, and the rollback of a savepoint runs it backwards down to the position
  the savepoint remembered;
* actions to run after the commit are kept in the same log's order; a rollback drops those
  registered after its savepoint, an abort drops them all, and they run only once the
  transaction has committed (an after-commit hook of the transaction, which the ``transaction``
  package calls after every data manager's ``tpc_finish``, i.e. after the store's fsync).

Some actions only need the group to be *durable*, not ZODB's bookkeeping after it: handing the
group's frames and acknowledgements to the network (:meth:`TransactionEffects.when_durable_once`).
With a store whose vote is its durable write (the log store: one ``pwritev`` and one
``fdatasync`` in ``tpc_vote``, see :mod:`aaabus.core.logstorage`), they run in this manager's own
``tpc_vote``, which comes after every other participant's (:meth:`TransactionEffects.sortKey`):
by then the store's record is on disk and nobody is left who could veto, so the transaction
cannot end otherwise than committed -- a crash at that point reboots with it, and ``tpc_finish``
cannot fail. That takes ZODB's ``tpc_finish`` (index switch, invalidations, synchronizers: tens
of µs) off every hop's critical path. With any other store they run with the after-commit
actions.

Nobody undoes anything by hand: code that changes in-memory state in a transaction records the
inverse here, and whichever way the transaction ends, the log is settled by the transaction.
A data manager that joins after a savepoint was taken is rolled back by an abort of it
(``transaction``'s ``AbortSavepoint``), which undoes exactly what it recorded since then.

Engine thread only, like the store: no locking.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import transaction
from transaction.interfaces import IDataManagerSavepoint, ISavepointDataManager
from zope.interface import implementer

from aaabus.core.commitorder import sort_key

log = logging.getLogger("aaabus.effects")

Undo = Callable[..., object]
Action = Callable[[], object]

_SORT_KEY = sort_key("effects")


@implementer(ISavepointDataManager)
class TransactionEffects:
    """Undo log and after-commit actions of the transactions of one transaction manager.

    Record with :meth:`undo` (how to take back a change just made in memory) and
    :meth:`after_commit` / :meth:`when_durable_once` (what to do once the changes are durable).
    Both join the current transaction if needed.
    """

    def __init__(
        self,
        tm: transaction.TransactionManager,
        durable_at_vote: Callable[[Any], bool] = lambda txn: False,
    ) -> None:
        """``durable_at_vote(txn)``: whether the store's vote in ``txn`` has made it durable
        (asked in this manager's ``tpc_vote``, which comes last)."""
        self.transaction_manager = tm
        self._durable_at_vote = durable_at_vote
        self._undo: list[tuple[Undo, tuple[Any, ...]]] = []
        # After-commit actions in order, each with whether durability alone suffices for it.
        self._after: list[tuple[Action, bool]] = []
        self._once: set[Action] = set()
        self._joined = False
        # The transaction whose after-commit hook runs our actions: registered once per
        # transaction, even if we leave it (an aborted late savepoint) and join it again.
        self._hooked: Any = None

    # -- recording (engine thread, inside a transaction) ------------------------------------------

    def undo(self, fn: Undo, *args: Any) -> None:
        """Record that ``fn(*args)`` takes back a change just made in memory."""
        if not self._joined:
            self._join()
        self._undo.append((fn, args))

    def after_commit(self, action: Action) -> None:
        """Run ``action()`` once the current transaction has committed; dropped if it does not.

        Actions run in the order they were registered, on the thread that commits. One that
        raises is logged and does not stop the others: an action must therefore handle its own
        failure (see :meth:`aaabus.core.channel.Channel._flush`).
        """
        if not self._joined:
            self._join()
        self._after.append((action, False))

    def when_durable_once(self, action: Action) -> None:
        """Run ``action()`` once the current transaction is durable (dropped if it aborts), once
        however often it is registered (compared with ``==``).

        With a store durable at its vote, that is in this manager's ``tpc_vote``, before ZODB
        finishes the commit (see the module docstring); otherwise after the commit, in order
        with the other actions. Same failure rule as :meth:`after_commit`.
        """
        if action in self._once:
            return
        if not self._joined:
            self._join()
        self._after.append((action, True))
        self._once.add(action)
        self._undo.append((self._once.discard, (action,)))

    def when_durable(self, action: Action) -> None:
        """Like :meth:`when_durable_once`, every time it is registered."""
        if not self._joined:
            self._join()
        self._after.append((action, True))

    @property
    def pending(self) -> int:
        """How many undo entries and actions the open transaction has recorded (for tests)."""
        return len(self._undo) + len(self._after)

    def _join(self) -> None:
        txn = self.transaction_manager.get()
        txn.join(self)
        self._joined = True
        if txn is not self._hooked:
            self._hooked = txn
            txn.addAfterCommitHook(self._committed)

    # -- settling ---------------------------------------------------------------------------------

    def _rollback_to(self, undo_mark: int, after_mark: int) -> None:
        entries = self._undo
        while len(entries) > undo_mark:
            fn, args = entries.pop()
            try:
                fn(*args)
            except Exception:  # a bug in an undo function: finish the others anyway
                log.critical("undoing %r failed", fn, exc_info=True)
        del self._after[after_mark:]

    def _committed(self, status: bool) -> None:
        """After-commit hook: run the actions of a transaction that committed."""
        if not status:
            return
        actions, self._after = self._after, []
        _run([action for action, _durable in actions])

    # -- IDataManager -----------------------------------------------------------------------------

    def abort(self, txn: Any) -> None:
        self._rollback_to(0, 0)
        self._once.clear()
        self._joined = False

    def tpc_begin(self, txn: Any) -> None:
        pass

    def commit(self, txn: Any) -> None:
        pass

    def tpc_vote(self, txn: Any) -> None:
        # Last to vote (sortKey): if the store's vote made the transaction durable, nothing
        # can abort it any more, so what only needs durability runs now.
        if not any(durable for _action, durable in self._after):
            return
        if not self._durable_at_vote(txn):
            return
        now = [action for action, durable in self._after if durable]
        self._after = [(action, False) for action, durable in self._after if not durable]
        _run(now)

    def tpc_finish(self, txn: Any) -> None:
        # The changes are kept: forget how to undo them. The actions wait for the hook, which
        # runs after every data manager's tpc_finish (the store's is the durable write).
        self._undo.clear()
        self._once.clear()
        self._joined = False

    def tpc_abort(self, txn: Any) -> None:
        self.abort(txn)

    def sortKey(self) -> str:
        # Last in every phase (aaabus.core.commitorder): our tpc_vote must come when the store
        # has voted and nobody is left to veto.
        return _SORT_KEY

    # -- ISavepointDataManager --------------------------------------------------------------------

    def savepoint(self) -> _Savepoint:
        return _Savepoint(self, len(self._undo), len(self._after))


def _run(actions: list[Action]) -> None:
    for action in actions:
        try:
            action()
        except Exception:
            log.error("after-commit action %r failed", action, exc_info=True)


@implementer(IDataManagerSavepoint)
class _Savepoint:
    """Where the log stood when a savepoint was taken; rolling back may happen more than once."""

    __slots__ = ("_after", "_effects", "_undo")

    def __init__(self, effects: TransactionEffects, undo: int, after: int) -> None:
        self._effects = effects
        self._undo = undo
        self._after = after

    def rollback(self) -> None:
        self._effects._rollback_to(self._undo, self._after)
