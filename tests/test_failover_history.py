"""The guards of a replication link (issue 42), in process with real sockets and real log
stores. The divergent-history rule: a follower whose last commit is of an older epoch but was
made after the commit the new primary took over from (the old primary's last commit, that only
this follower received) is told to start empty and is copied whole; a follower inside the
history keeps its store. The fences: a follower refuses a primary of an older epoch (NEWER,
voted); a candidate's claim stops its acknowledgements without deposing the primary, until the
candidate releases it. A deposed primary's votes fail, even with sync 0."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from aaabus.config.reader import load_config
from aaabus.config.secret import load_server_keys, secret_path
from aaabus.core.epoch import EPOCH_KEY, NO_EPOCH, EpochRecord
from aaabus.core.logstorage import LogStorage
from aaabus.core.replication import (
    CLAIM,
    EPOCH,
    FENCE,
    NEWER,
    RELEASED,
    VOTED,
    Shipper,
    decode_epoch,
    decode_position,
    epoch_message,
)
from aaabus.core.store import LOG_DIR
from aaabus.errors import ReplicationStopped
from aaabus.io.replink import ReplicaLink
from aaabus.node.replica import ReplicaServer
from aaabus.node.replication import ReplicationLinks
from tests.support.harness import free_ports

#: A side record that only the old primary's last commit wrote.
STRAY = bytes((0xFF, 0x7F)) + bytes(6)
KEPT = bytes((0xFF, 0x7E)) + bytes(6)


def tid(n: int) -> bytes:
    return (0x040D000000000000 + n).to_bytes(8, "big")


def commit(storage: LogStorage, at: bytes, records: dict[bytes, bytes]) -> None:
    txn = object()
    storage.tpc_begin(txn, at)
    storage.write_side(txn, records, ())
    storage.tpc_vote(txn)
    storage.tpc_finish(txn)


def epoch1() -> EpochRecord:
    return NO_EPOCH.next(1, 0, bytes(8))


def follow(make_config: Callable[..., Path], tmp_path: Path, follower_commits: int) -> LogStorage:
    """A primary at epoch 2 (member 1 took over from tid 2) and a follower (member 0) holding
    epoch 1's commits 1..``follower_commits``; the follower's store once it is caught up."""
    (port,) = free_ports(1)
    path = make_config(
        extra={0: f'<replica index="1" port="{port}"/>'},
        properties={"aaabus.replication.sync": "1"},
    )
    config = load_config(path)
    primary = LogStorage(tmp_path / "primary" / LOG_DIR)
    commit(primary, tid(1), {EPOCH_KEY: epoch1().encode()})
    commit(primary, tid(2), {KEPT: b"kept"})
    commit(primary, tid(4), {EPOCH_KEY: epoch1().next(2, 1, tid(2)).encode()})
    old = LogStorage(tmp_path / "follower" / LOG_DIR)
    commit(old, tid(1), {EPOCH_KEY: epoch1().encode()})
    commit(old, tid(2), {KEPT: b"kept"})
    if follower_commits > 2:
        commit(old, tid(3), {STRAY: b"only the old primary's last commit"})
    old.close()
    # Member 1 serves; member 0 (the old primary) follows, as after a takeover.
    follower = ReplicaServer(config, 0, 0, tmp_path / "follower")
    follower.start()
    keys = load_server_keys(secret_path(config, 0), 0, config.servers)
    links = ReplicationLinks(
        0, (config.server(0).member(0),), 1, keys.link_key(0), primary, epoch=2, member=1
    )
    links.start()
    try:
        wait_for(lambda: links.figures()["replicas"]["0"]["acknowledged"] == tid(4).hex())
    finally:
        links.stop()
        follower.stop()
        primary.close()
    return LogStorage(tmp_path / "follower" / LOG_DIR, read_only=True)


def test_a_follower_outside_the_history_is_copied_whole(
    tmp_path: Path, make_config: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    store = follow(make_config, tmp_path, follower_commits=3)
    assert "is not in this server's history; it starts again empty" in caplog.text
    try:
        side = store.side_records()
        assert STRAY not in side, "the follower kept a commit the new primary never had"
        assert side[KEPT] == b"kept"
        assert EpochRecord.decode(side[EPOCH_KEY]).epoch == 2
    finally:
        store.close()


def test_a_follower_inside_the_history_keeps_its_store(
    tmp_path: Path, make_config: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    store = follow(make_config, tmp_path, follower_commits=2)
    assert "starts again empty" not in caplog.text
    try:
        side = store.side_records()
        assert side[KEPT] == b"kept"
        assert EpochRecord.decode(side[EPOCH_KEY]).epoch == 2
        assert store.lastTransaction() == tid(4)
    finally:
        store.close()


# -- the fences of a follower ----------------------------------------------------------------


def started_follower(
    make_config: Callable[..., Path], tmp_path: Path, epoch: int
) -> tuple[ReplicaServer, bytes, tuple[str, int]]:
    """Member 0 of server 0 following, its store at ``epoch`` (member 1's); its key and address."""
    (port,) = free_ports(1)
    path = make_config(
        extra={0: f'<replica index="1" port="{port}"/>'},
        properties={"aaabus.replication.sync": "1"},
    )
    config = load_config(path)
    record = epoch1() if epoch == 1 else epoch1().next(epoch, 1, tid(1))
    store = LogStorage(tmp_path / "follower" / LOG_DIR)
    commit(store, tid(2), {EPOCH_KEY: record.encode()})
    store.close()
    follower = ReplicaServer(config, 0, 0, tmp_path / "follower")
    follower.start()
    keys = load_server_keys(secret_path(config, 0), 0, config.servers)
    member = config.server(0).member(0)
    return follower, keys.link_key(0), (member.hostname, member.replication_port)


def test_a_follower_refuses_a_primary_of_an_older_epoch(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    follower, key, address = started_follower(make_config, tmp_path, epoch=2)
    try:
        answer = ReplicaLink.ask(address, key, 0, epoch_message(EPOCH, 1, 0), 5, 1 << 20)
        assert answer[:1] == NEWER
        assert decode_epoch(answer) == (2, 1, VOTED)  # voted: the old primary steps down
    finally:
        follower.stop()


def test_a_claim_holds_the_primary_back_until_released_and_deposes_nobody(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """A candidate's claim: the follower acknowledges nothing more of the primary's epoch (a
    commit waits), the primary is not deposed by a mere claim, and once the candidate releases
    it the follower follows the primary again (the commit is acknowledged)."""
    follower, key, address = started_follower(make_config, tmp_path, epoch=1)
    primary = LogStorage(tmp_path / "primary" / LOG_DIR)
    commit(primary, tid(2), {EPOCH_KEY: epoch1().encode()})
    deposed: list[tuple[int, int]] = []
    links = ReplicationLinks(
        0,
        (follower.spec,),
        1,
        key,
        primary,
        epoch=1,
        member=1,
        on_newer=lambda epoch, member: deposed.append((epoch, member)),
    )
    links.start()
    done = threading.Event()
    try:
        wait_for(lambda: links.figures()["replicas"]["0"]["acknowledged"] == tid(2).hex())
        answer = ReplicaLink.ask(address, key, 0, epoch_message(FENCE, 2, 2, CLAIM), 5, 1 << 20)
        assert decode_position(answer) == (1, tid(2))

        def write() -> None:
            commit(primary, tid(3), {KEPT: b"after the claim"})
            done.set()

        threading.Thread(target=write, name="test-commit", daemon=True).start()
        assert not done.wait(1.0), "a fenced follower acknowledged the primary's commit"
        ReplicaLink.ask(address, key, 0, epoch_message(FENCE, 2, 2, RELEASED), 5, 1 << 20)
        assert done.wait(20), "the follower did not follow its primary again"
        assert deposed == []
    finally:
        links.stop()
        follower.stop()
        primary.close()


def wait_for(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 20
    pause = threading.Event()
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        pause.wait(0.02)


def test_a_deposed_primary_acknowledges_nothing_even_asynchronous() -> None:
    shipper = Shipper(0, {1: "127.0.0.1:1"}, sync=0)
    shipper.depose("epoch 2 of member 1 took over")
    with pytest.raises(ReplicationStopped, match="took over"):
        shipper.wait(tid(5))
