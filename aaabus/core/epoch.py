"""A server's epoch, kept in its own store (issue 42, failover).

Every takeover raises the server's epoch; the primary of an epoch writes it in the first commit
of that epoch, as a side record of its log store, so that it travels to the followers with the
commits like everything else and every store says the epoch of the last commit it holds.

The record also keeps the *history* of the epochs this store went through: for each epoch the
member that served it and the last tid of the epoch before (the commit the new primary had when
it took over). With it a primary tells whether a follower's last commit (its epoch and tid, the
follower's HELLO) is in its own history (:meth:`EpochRecord.holds`): a follower of an older epoch
may hold commits that its primary made after the new primary's last one, which the new history
does not have; such a follower is copied again whole.

A store without the record (a new store, or one written before failover existed) is at epoch 0:
its member 0 starts it at epoch 1 without a vote; every later epoch is voted.

Who calls: the member process (``aaabus.node.member``) and the server's boot
(``aaabus.node.server``), each on the thread that owns the store at the time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from aaabus.core.logstorage import LogStorage
from aaabus.core.logstorage.format import Z64
from aaabus.errors import StoreError

#: The side record's key (kind 8 of the journal's side keys, :mod:`aaabus.core.journal`).
EPOCH_KEY = bytes((0xFF, 8)) + bytes(6)


@dataclass(frozen=True)
class EpochRecord:
    """``epoch`` served by ``member``; ``history``: (epoch, member, base tid) of every epoch of
    this store, oldest first, the last being this one."""

    epoch: int
    member: int
    history: tuple[tuple[int, int, bytes], ...]

    def encode(self) -> bytes:
        rows = [[e, m, base.hex()] for e, m, base in self.history]
        return json.dumps({"epoch": self.epoch, "member": self.member, "history": rows}).encode()

    @classmethod
    def decode(cls, data: bytes) -> EpochRecord:
        try:
            raw = json.loads(data)
            history = tuple((int(e), int(m), bytes.fromhex(base)) for e, m, base in raw["history"])
            return cls(int(raw["epoch"]), int(raw["member"]), history)
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(
                f"the store's epoch record is damaged ({type(exc).__name__}: {exc}); restore "
                "the store from a replica or a backup"
            ) from None

    def next(self, epoch: int, member: int, base: bytes) -> EpochRecord:
        """The record of ``epoch`` taken over by ``member`` from a store whose last tid is
        ``base``."""
        return EpochRecord(epoch, member, (*self.history, (epoch, member, base)))

    def holds(self, epoch: int, tid: bytes, last: bytes) -> bool:
        """Whether a store whose last commit is ``tid``, of ``epoch`` (0: a store without a
        record), holds only commits of this history (``last``: this store's last tid). An
        empty store always does."""
        if tid == Z64:
            return True
        for later, _member, base in self.history:
            if later > epoch:
                # The commits of ``epoch`` this history kept end at the next epoch's base.
                return tid <= base
        return epoch == self.epoch and tid <= last


#: A store without a record: epoch 0, no history.
NO_EPOCH = EpochRecord(0, 0, ())


def read_epoch(storage: LogStorage) -> EpochRecord:
    """The store's epoch record (:data:`NO_EPOCH` if it has none)."""
    data = storage.side_record(EPOCH_KEY)
    return NO_EPOCH if data is None else EpochRecord.decode(data)


def write_epoch(storage: LogStorage, record: EpochRecord) -> bytes:
    """Commit ``record`` on its own (the first commit of its epoch; shipped and waited for like
    any commit when the store has a shipper). Returns the commit's tid. The caller owns the
    store's commits (no other transaction is open)."""
    txn = object()
    storage.tpc_begin(txn)
    try:
        storage.write_side(txn, {EPOCH_KEY: record.encode()}, ())
        storage.tpc_vote(txn)
    except BaseException:
        storage.tpc_abort(txn)
        raise
    return storage.tpc_finish(txn)
