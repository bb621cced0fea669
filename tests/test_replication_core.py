"""The shipping of a log store's commits to a replica, without sockets (aaabus.core.replication):
a primary's real log store, a replica's real log store, and the messages carried between them
by hand, so that every step (catch-up, commit, abort, forgotten side keys, wipe, the wait for
acknowledgements) is checked on what the replica's store then holds."""

from __future__ import annotations

import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from ZODB.POSException import POSKeyError
from ZODB.utils import p64

from aaabus.core.logstorage import LogStorage
from aaabus.core.logstorage.format import Z64
from aaabus.core.replication import WIPE, Follower, Shipper
from aaabus.errors import ReplicationStopped


def side_key(n: int) -> bytes:
    return b"\xff" + n.to_bytes(7, "big")


class Pair:
    """A primary store with a shipper, a replica's Follower, and the wire between them: every
    message the shipper sends is applied at once, and its acknowledgement given back."""

    def __init__(self, tmp_path: Path, sync: int = 1) -> None:
        self.primary = LogStorage(tmp_path / "primary")
        self.replica_dir = tmp_path / "replica"
        self.follower = Follower(lambda: LogStorage(self.replica_dir), self._wipe)
        self.shipper = Shipper(0, {1: "in-process"}, sync)
        self.primary.shipper = self.shipper
        self.connected = False
        self.messages = 0
        #: While set, the replica applies what it receives but its acknowledgements are lost.
        self.mute = False
        #: Set by attach(reader): acknowledgements go through a real socket, not a call.
        self.reader: SocketAcks | None = None

    def _wipe(self) -> None:
        shutil.rmtree(self.replica_dir)

    def _send(self, messages: list[bytes], size: int) -> None:
        for message in messages:
            self.messages += 1
            answer = self.follower.receive(message)
            if answer is not None and not self.mute:
                if self.reader is not None:
                    self.reader.theirs.sendall(answer[1:])  # read back by whoever drains
                else:
                    self.shipper.acked(1, answer[1:])

    def attach(self, reader: SocketAcks | None = None) -> bytes:
        self.connected = True
        self.reader = reader
        return self.shipper.attach(1, self.follower.position(), self.primary, self._send, reader)

    def detach(self) -> None:
        self.shipper.detach(1)
        self.follower.settle()

    def commit(
        self,
        objects: dict[int, bytes],
        side: dict[bytes, bytes] | None = None,
        forget: tuple[bytes, ...] | list[bytes] = (),
    ) -> bytes:
        storage = self.primary
        txn = object()
        storage.tpc_begin(txn)
        for n, data in objects.items():
            oid = p64(n)
            try:
                serial = storage.load(oid)[1]
            except POSKeyError:
                serial = Z64
            storage.store(oid, serial, data, "", txn)
        storage.write_side(txn, side or {}, list(forget))
        try:
            storage.tpc_vote(txn)
        except BaseException:
            storage.tpc_abort(txn)  # what ZODB's transaction manager does
            raise
        return storage.tpc_finish(txn)

    def close(self) -> None:
        self.primary.close()
        self.follower.close()


class SocketAcks:
    """An :class:`~aaabus.core.replication.AckReader` over a real socket pair: the replica's
    acknowledgements (tids) are written to ``theirs``; whoever drains ``mine`` hands them to
    the shipper. Records which threads drained, and how often."""

    def __init__(self, shipper: Shipper, index: int) -> None:
        self.mine, self.theirs = socket.socketpair()
        self._shipper = shipper
        self._index = index
        self.dead = False
        self.drains: list[str] = []

    def fileno(self) -> int:
        return self.mine.fileno()

    def drain(self) -> None:
        self.drains.append(threading.current_thread().name)
        if self.dead:
            return
        try:
            data = self.mine.recv(4096, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        if not data:
            self.dead = True  # the link ended: not to be read (or waited on) again
            return
        for at in range(0, len(data), 8):
            self._shipper.acked(self._index, data[at : at + 8])

    def close(self) -> None:
        self.mine.close()
        self.theirs.close()


class WaitingCommit:
    """A commit of the pair's primary on a thread of its own (it waits for its replica)."""

    def __init__(self, pair: Pair) -> None:
        self._pair = pair
        self.failed: list[BaseException] = []
        self.thread = threading.Thread(target=self._commit, name="test-commit")
        self.thread.start()

    def _commit(self) -> None:
        try:
            self._pair.commit({0: b"root"})
        except ReplicationStopped as exc:
            self.failed.append(exc)

    def fails_at_the_stop(self) -> None:
        """Still waiting; then the shipper closes and the commit fails, unacknowledged."""
        assert self.thread.is_alive()
        self._pair.shipper.close()
        self.thread.join(10)
        assert self.failed and "was not acknowledged" in str(self.failed[0])


def contents(directory: Path) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
    storage = LogStorage(directory, read_only=True)
    try:
        objects: dict[bytes, bytes] = {}
        cursor: bytes | None = None
        while len(storage):
            try:
                oid, _tid, data, cursor = storage.record_iternext(cursor)
            except POSKeyError:
                break  # only side records
            objects[oid] = data
            if cursor is None:
                break
        return objects, storage.side_records()
    finally:
        storage.close()


def test_commits_reach_the_replica_with_their_side_records(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    pair.attach()
    pair.commit({0: b"root", 1: b"one"}, {side_key(1): b"q1", side_key(2): b"q2"})
    pair.commit({1: b"one again", 2: b"two"}, forget=[side_key(1)])
    # A forgotten side key leaves the index at once (and comes back at a reopen until its
    # segment is compacted, on both sides alike: the journal judges what it reads at boot).
    # The replica finishes a commit when the next message comes (or its link ends).
    pair.follower.settle()
    assert pair.follower.storage.side_records() == {side_key(2): b"q2"}
    pair.close()
    assert contents(tmp_path / "replica") == contents(tmp_path / "primary")
    assert contents(tmp_path / "replica")[0][p64(1)] == b"one again"


def test_a_late_replica_gets_everything_and_a_returning_one_what_it_missed(
    tmp_path: Path,
) -> None:
    pair = Pair(tmp_path, sync=0)
    pair.commit({0: b"root", 1: b"before"}, {side_key(1): b"kept", side_key(2): b"dropped"})
    pair.attach()  # empty: the whole store
    pair.detach()
    sent = pair.messages
    pair.commit({2: b"while away"}, {side_key(3): b"new"}, forget=[side_key(2)])
    lag = pair.shipper.figures()["replicas"]["1"]
    assert not lag["connected"] and lag["behind_commits"] == 1 and lag["behind_bytes"] > 0
    pair.attach()  # from where it was: the one commit, and the side keys to keep
    assert pair.messages - sent == 2  # one RECORDS, one CATCHUP: not the whole store again
    assert pair.shipper.figures()["replicas"]["1"]["behind_commits"] == 0
    # The side key the primary forgot while the replica was away is forgotten there too.
    assert pair.follower.storage.side_records() == pair.primary.side_records()
    assert side_key(2) not in pair.follower.storage.side_records()
    pair.close()
    assert contents(tmp_path / "replica")[0] == contents(tmp_path / "primary")[0]


def test_an_abort_after_the_vote_is_undone_at_the_replica(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    pair.attach()
    pair.commit({0: b"root"})
    txn = object()
    pair.primary.tpc_begin(txn)
    pair.primary.store(p64(5), Z64, b"vetoed", "", txn)
    pair.primary.tpc_vote(txn)  # shipped, voted and acknowledged by the replica
    pair.primary.tpc_abort(txn)  # another participant vetoed
    pair.commit({6: b"after"})
    pair.close()
    objects, _side = contents(tmp_path / "replica")
    assert p64(5) not in objects and objects[p64(6)] == b"after"
    assert contents(tmp_path / "replica") == contents(tmp_path / "primary")


def test_a_wiped_replica_starts_again_from_the_whole_store(tmp_path: Path) -> None:
    pair = Pair(tmp_path)
    pair.attach()
    pair.commit({0: b"root", 1: b"one"})
    pair.detach()
    pair.follower.receive(WIPE)
    assert pair.follower.position() == Z64
    pair.attach()
    pair.close()
    assert contents(tmp_path / "replica") == contents(tmp_path / "primary")


def test_a_commit_waits_for_its_sync_replica_and_fails_when_the_server_stops(
    tmp_path: Path,
) -> None:
    pair = Pair(tmp_path, sync=1)
    waiting = WaitingCommit(pair)
    deadline = threading.Event()
    for _ in range(500):  # the committing thread reaches its wait
        if pair.shipper.figures()["waiting_s"] is not None:
            break
        deadline.wait(0.01)
    assert pair.shipper.figures()["waiting_s"] is not None
    waiting.fails_at_the_stop()
    pair.primary.shipper = None
    with pytest.raises(POSKeyError):
        pair.primary.load(p64(0))  # aborted, never current
    pair.close()


def test_the_lag_and_the_wait_are_metrics(tmp_path: Path) -> None:
    from aaabus.node.metrics import _replication_metrics

    pair = Pair(tmp_path, sync=0)
    pair.attach()
    pair.commit({0: b"root"})
    pair.detach()
    pair.commit({1: b"one"})
    pair.commit({2: b"two"})
    found = {
        (family.name, tuple(sample.labels.values())): sample.value
        for family in _replication_metrics("0", pair.shipper.figures())
        for sample in family.samples
    }
    assert found[("aaabus_replica_connected", ("0", "1"))] == 0
    assert found[("aaabus_replica_lag_commits", ("0", "1"))] == 2
    assert found[("aaabus_replica_lag_bytes", ("0", "1"))] > 0
    assert found[("aaabus_replication_waiting_seconds", ("0",))] == 0
    pair.close()


def test_a_replicated_server_key_file_holds_the_key_of_its_link_with_itself(
    tmp_path: Path,
) -> None:
    from aaabus.config.secret import (
        ensure_secret,
        link_key,
        load_secret,
        load_server_keys,
        write_server_keys,
    )

    ensure_secret(tmp_path / "bus.key")
    bus_key = load_secret(tmp_path / "bus.key")
    write_server_keys(tmp_path / "s1.key", tmp_path / "bus.key", 1, [0, 1], replicated=True)
    write_server_keys(tmp_path / "plain.key", tmp_path / "bus.key", 1, [0, 1])
    keys = load_server_keys(tmp_path / "s1.key", 1, [0])
    assert keys.link_key(1) == link_key(bus_key, 1, 1) != link_key(bus_key, 0, 1)
    with pytest.raises(KeyError):
        load_server_keys(tmp_path / "plain.key", 1, [0]).link_key(1)


def test_a_commit_cut_short_by_a_stop_is_aborted_at_the_replica_too(tmp_path: Path) -> None:
    """The replica voted it, its acknowledgement never came, the server stops: the replica
    gets the ABORT before the links close, and does not keep a commit its server never made."""
    pair = Pair(tmp_path, sync=1)
    pair.attach()
    pair.commit({0: b"root"})
    before = pair.follower.position()
    pair.mute = True
    failed: list[BaseException] = []

    def commit() -> None:
        try:
            pair.commit({7: b"never acknowledged"})
        except ReplicationStopped as exc:
            failed.append(exc)

    thread = threading.Thread(target=commit, name="test-commit")
    thread.start()
    pause = threading.Event()
    for _ in range(500):
        if pair.shipper.figures()["waiting_s"] is not None:
            break
        pause.wait(0.01)
    assert pair.follower.position() > before  # voted at the replica
    pair.shipper.close()
    pair.shipper.quiesce(10)
    thread.join(10)
    assert failed
    assert pair.follower.position() == before
    pair.primary.shipper = None
    pair.close()
    assert p64(7) not in contents(tmp_path / "replica")[0]
    assert contents(tmp_path / "replica")[0] == contents(tmp_path / "primary")[0]


def test_a_waiting_commit_reads_its_replicas_acknowledgement_itself(tmp_path: Path) -> None:
    # No thread reads the socket but the one whose commit waits: it must read it to go on.
    pair = Pair(tmp_path, sync=1)
    reader = SocketAcks(pair.shipper, 1)
    pair.attach(reader)
    tid = pair.commit({0: b"root", 1: b"one"})
    assert pair.shipper.figures()["replicas"]["1"]["acknowledged"] == tid.hex()
    assert set(reader.drains) == {threading.current_thread().name}
    pair.follower.settle()
    pair.close()
    reader.close()
    assert contents(tmp_path / "replica")[0] == contents(tmp_path / "primary")[0]


def test_a_waiting_commit_stops_reading_a_link_that_ended(tmp_path: Path) -> None:
    # The replica's end closes while a commit waits for it: the commit notices the end once,
    # then waits on the shipper (not on a socket that is readable for ever), until the stop.
    pair = Pair(tmp_path, sync=1)
    reader = SocketAcks(pair.shipper, 1)
    pair.attach(reader)
    pair.mute = True  # the replica writes the commit but its acknowledgement is lost
    waiting = WaitingCommit(pair)
    pause = threading.Event()
    deadline = time.monotonic() + 10
    while not reader.drains and time.monotonic() < deadline:
        pause.wait(0.01)  # the commit reaches its wait, and its first look at the socket
    reader.theirs.close()
    while not reader.dead and time.monotonic() < deadline:
        pause.wait(0.01)
    assert reader.dead
    looked = len(reader.drains)
    pause.wait(0.3)  # six of the wait's 50 ms polls, had it gone on polling the socket
    assert len(reader.drains) == looked
    waiting.fails_at_the_stop()
    pair.primary.shipper = None
    pair.close()
    reader.mine.close()
