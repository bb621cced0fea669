"""The divergent-history rule on a replication link (issue 42), in process with real sockets
and real log stores: a follower whose last commit is of an older epoch but was made after the
commit the new primary took over from (the old primary's last commit, that only this follower
received) is told to start empty and is copied whole; a follower inside the history keeps its
store and gets only what it lacks."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from aaabus.config.reader import load_config
from aaabus.config.secret import load_server_keys, secret_path
from aaabus.core.epoch import EPOCH_KEY, NO_EPOCH, EpochRecord
from aaabus.core.logstorage import LogStorage
from aaabus.core.store import LOG_DIR
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
        deadline = time.monotonic() + 20
        while links.figures()["replicas"]["0"]["acknowledged"] != tid(4).hex():
            assert time.monotonic() < deadline, "the follower never caught up"
            time.sleep(0.02)
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
