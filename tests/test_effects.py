"""The transaction-driven undo log of in-memory effects (aaabus.core.effects), against a real
FileStorage or log store sharing the same transactions, as the engine uses it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import transaction
import ZODB
import ZODB.FileStorage
from persistent.mapping import PersistentMapping

from aaabus.core.effects import TransactionEffects
from aaabus.core.logstorage import LogStorage


class _Db:
    """A store and the effects sharing its transactions, as on a server: a FileStorage, or a
    log store, whose vote makes a transaction durable (Store.durable_at_vote)."""

    def __init__(self, storage: ZODB.FileStorage.FileStorage | LogStorage) -> None:
        self.storage = storage
        self.db = ZODB.DB(storage)
        self.tm = transaction.TransactionManager()
        self.conn = self.db.open(transaction_manager=self.tm)
        self.root = self.conn.root()
        if isinstance(storage, LogStorage):
            # The storage sees the connection's metadata of the transaction, not the transaction.
            self.effects = TransactionEffects(
                self.tm, lambda txn: storage.voted(txn.data(self.conn))
            )
        else:
            self.effects = TransactionEffects(self.tm)

    def close(self) -> None:
        self.tm.abort()
        self.conn.close()
        self.db.close()

    def committed_value(self) -> object:
        """What another connection (another transaction) reads: only durable data."""
        tm = transaction.TransactionManager()
        conn = self.db.open(transaction_manager=tm)
        try:
            return conn.root().get("value")
        finally:
            tm.abort()
            conn.close()


@pytest.fixture
def db(tmp_path: Path) -> Iterator[_Db]:
    d = _Db(ZODB.FileStorage.FileStorage(str(tmp_path / "data.fs")))
    try:
        yield d
    finally:
        d.close()


@pytest.fixture
def logdb(tmp_path: Path) -> Iterator[_Db]:
    d = _Db(LogStorage(tmp_path / "log"))
    try:
        yield d
    finally:
        d.close()


def test_abort_undoes_everything_in_reverse_and_drops_the_actions(db: _Db) -> None:
    state: list[str] = []
    ran: list[str] = []
    for item in ("a", "b", "c"):
        state.append(item)
        db.effects.undo(state.remove, item)
    db.effects.after_commit(lambda: ran.append("never"))
    db.root["value"] = 1
    undone: list[str] = []
    db.effects.undo(undone.append, "first")
    db.effects.undo(undone.append, "second")
    db.tm.abort()
    assert state == [] and ran == [] and undone == ["second", "first"]
    assert "value" not in db.root
    db.tm.commit()  # nothing left over from the aborted transaction
    assert ran == []


def test_savepoint_rollback_undoes_only_what_came_after_it(db: _Db) -> None:
    state: list[int] = []
    ran: list[int] = []
    state.append(1)
    db.effects.undo(state.remove, 1)
    db.effects.after_commit(lambda: ran.append(1))
    savepoint = db.tm.savepoint()
    state.append(2)
    db.effects.undo(state.remove, 2)
    db.effects.after_commit(lambda: ran.append(2))
    savepoint.rollback()
    assert state == [1]
    state.append(3)  # a savepoint may be rolled back more than once
    db.effects.undo(state.remove, 3)
    savepoint.rollback()
    assert state == [1]
    db.tm.commit()
    assert ran == [1] and state == [1]


def test_actions_run_in_order_after_the_store_is_durable(db: _Db) -> None:
    seen: list[object] = []
    db.root["value"] = "new"
    db.effects.after_commit(lambda: seen.append(("first", db.committed_value())))
    db.effects.after_commit(lambda: seen.append(("second", db.committed_value())))
    assert db.committed_value() is None
    db.tm.commit()
    assert seen == [("first", "new"), ("second", "new")]


def test_a_failing_action_does_not_stop_the_others(db: _Db) -> None:
    ran: list[str] = []

    def boom() -> None:
        raise RuntimeError("an action with a bug")

    db.effects.after_commit(boom)
    db.effects.after_commit(lambda: ran.append("after"))
    db.tm.commit()
    assert ran == ["after"]


def test_once_actions_are_registered_again_after_a_rollback_removed_them(db: _Db) -> None:
    ran: list[str] = []

    def flush() -> None:
        ran.append("flush")

    # Joined before the savepoint, so that the savepoint is ours (a manager that joins after
    # a savepoint is rolled back by a whole abort, a different path).
    db.effects.after_commit(lambda: ran.append("first"))
    savepoint = db.tm.savepoint()
    db.effects.when_durable_once(flush)
    db.effects.when_durable_once(flush)  # already there
    savepoint.rollback()  # takes the registration back ...
    db.effects.when_durable_once(flush)  # ... so this one must register it again
    db.tm.commit()
    assert ran == ["first", "flush"]
    db.effects.when_durable_once(flush)  # a new transaction starts with nothing registered
    db.tm.commit()
    assert ran == ["first", "flush", "flush"]


def test_joining_after_a_savepoint_is_rolled_back_by_that_savepoint(db: _Db) -> None:
    # The effects join the transaction only at their first record: here, after the savepoint.
    db.root["value"] = 1
    savepoint = db.tm.savepoint()
    state = ["late"]
    db.effects.undo(state.remove, "late")
    db.effects.after_commit(lambda: state.append("never"))
    savepoint.rollback()
    assert state == []
    later: list[str] = []
    db.effects.after_commit(lambda: later.append("ran"))  # joins again
    db.tm.commit()
    assert state == [] and later == ["ran"]


def test_a_failed_commit_undoes_the_effects(db: _Db, tmp_path: Path) -> None:
    state = ["x"]
    ran: list[str] = []
    db.effects.undo(state.remove, "x")
    db.effects.after_commit(lambda: ran.append("never"))
    db.root["value"] = PersistentMapping()

    class Refuses:
        """A data manager that votes no, as a store that cannot write would."""

        transaction_manager = db.tm

        def abort(self, txn: object) -> None: ...
        def tpc_begin(self, txn: object) -> None: ...
        def commit(self, txn: object) -> None: ...
        def tpc_abort(self, txn: object) -> None: ...
        def sortKey(self) -> str:
            return "~refuses"

        def tpc_vote(self, txn: object) -> None:
            raise OSError("no space left on device")

    db.tm.get().join(Refuses())
    with pytest.raises(OSError):
        db.tm.commit()
    db.tm.abort()
    assert state == [] and ran == []


class _Veto:
    """A participant that votes no, sorted before the effects manager as any other one is."""

    def __init__(self) -> None:
        self.aborted = False

    def sortKey(self) -> str:
        return "zzz veto"

    def tpc_begin(self, txn: object) -> None:
        pass

    def commit(self, txn: object) -> None:
        pass

    def tpc_vote(self, txn: object) -> None:
        raise RuntimeError("veto")

    def tpc_finish(self, txn: object) -> None:
        raise AssertionError("a vetoed transaction is never finished")

    def tpc_abort(self, txn: object) -> None:
        self.aborted = True

    def abort(self, txn: object) -> None:
        self.aborted = True


def test_durable_actions_run_once_the_log_store_voted_before_zodb_finishes(
    logdb: _Db,
) -> None:
    seen: list[tuple[str, bool, bytes]] = []
    before = logdb.storage.lastTransaction()

    def probe(name: str) -> None:
        meta = logdb.tm.get().data(logdb.conn)
        seen.append((name, logdb.storage.voted(meta), logdb.storage.lastTransaction()))

    logdb.root["value"] = 1
    logdb.effects.after_commit(lambda: probe("after"))
    logdb.effects.when_durable_once(lambda: probe("durable"))
    logdb.tm.commit()
    # The durable one ran first, with the record voted (on disk) but the storage not yet
    # finished (its last transaction is still the old one); the other ran after the commit.
    assert [name for name, _v, _t in seen] == ["durable", "after"]
    assert seen[0][1] is True and seen[0][2] == before
    assert seen[1][2] == logdb.storage.lastTransaction() != before


def test_durable_actions_wait_for_the_commit_when_the_store_is_not_durable_at_vote(
    db: _Db,
) -> None:
    order: list[str] = []
    db.root["value"] = 1
    db.effects.when_durable_once(lambda: order.append(f"durable {db.committed_value()}"))
    db.effects.after_commit(lambda: order.append("after"))
    db.tm.commit()
    assert order == ["durable 1", "after"]  # in registration order, after the commit


def test_durable_actions_of_a_vetoed_transaction_never_run(logdb: _Db, tmp_path: Path) -> None:
    ran: list[str] = []
    veto = _Veto()
    logdb.root["value"] = 1
    logdb.effects.when_durable_once(lambda: ran.append("durable"))
    logdb.tm.get().join(veto)
    with pytest.raises(RuntimeError, match="veto"):
        logdb.tm.commit()
    logdb.tm.abort()
    assert ran == [] and veto.aborted
    # The log store cancelled what it had voted: a reopened store does not have it.
    logdb.close()
    again = _Db(LogStorage(tmp_path / "log"))
    try:
        assert "value" not in again.root
    finally:
        again.close()


def test_a_rolled_back_durable_action_does_not_run(logdb: _Db) -> None:
    ran: list[str] = []
    logdb.root["value"] = 1
    savepoint = logdb.tm.savepoint()
    logdb.effects.when_durable_once(lambda: ran.append("rolled back"))
    savepoint.rollback()
    logdb.root["value"] = 2
    logdb.tm.commit()
    assert ran == []
