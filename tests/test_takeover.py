"""A candidate's guards (issue 42), in process with real sockets, real log stores and a real
voter (an in-process server with its admin port): a follower whose primary is silent does not
take over when the voter refuses, nor when another follower holds more than it does, nor when
another candidate already claimed the other follower; an idle primary's heartbeats keep its
follower from standing at all. A server that shares no domain (no voter): its members vote on
their replication ports, a takeover needs a strict majority of all of them, each grant given
once per epoch and kept on disk, and with one replica no member stands."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from aaabus.config.reader import BusConfig, load_config
from aaabus.config.secret import load_server_keys, secret_path
from aaabus.core.epoch import EPOCH_KEY, NO_EPOCH, read_epoch
from aaabus.core.logstorage import LogStorage
from aaabus.core.replication import (
    BALLOT,
    CLAIM,
    FENCE,
    NEWER,
    RELEASED,
    VOTED,
    decode_epoch,
    epoch_message,
)
from aaabus.core.store import LOG_DIR
from aaabus.io.replink import ReplicaLink
from aaabus.node.epochs import EpochBook
from aaabus.node.replica import ReplicaServer
from aaabus.node.replication import ReplicationLinks
from aaabus.node.server import AgentServer
from aaabus.node.takeover import Takeover
from tests.support.harness import free_ports

DELAY_MS = 300


def tid(n: int) -> bytes:
    return (0x040D000000000000 + n).to_bytes(8, "big")


def two_replicas(make_config: Callable[..., Path]) -> BusConfig:
    """flat-2; server 0 has replicas 1 and 2 (on 127.0.0.2, 127.0.0.3); server 1 votes."""
    ports = free_ports(3)
    replicas = "".join(
        f'<replica index="{k}" hostname="127.0.0.{k + 1}" port="{ports[k]}"/>' for k in (1, 2)
    )
    path = make_config(
        servers=2,
        extra={0: replicas + f'<property name="aaabus.replication.port" value="{ports[0]}"/>'},
        properties={"aaabus.failover.delay_ms": str(DELAY_MS)},
    )
    return load_config(path)


def store_at(directory: Path, last: int) -> None:
    """A follower's store: epoch 1 of member 0 at tid 1, commits up to tid ``last``."""
    storage = LogStorage(directory / LOG_DIR)
    try:
        for n in range(1, last + 1):
            records = {EPOCH_KEY: NO_EPOCH.next(1, 0, bytes(8)).encode()} if n == 1 else {}
            records[bytes((0xFF, 0x7E)) + n.to_bytes(6, "big")] = b"x"
            txn = object()
            storage.tpc_begin(txn, tid(n))
            storage.write_side(txn, records, ())
            storage.tpc_vote(txn)
            storage.tpc_finish(txn)
    finally:
        storage.close()


@contextmanager
def follower(config: BusConfig, index: int, directory: Path, last: int) -> Iterator[ReplicaServer]:
    store_at(directory, last)
    member = ReplicaServer(config, 0, index, directory)
    member.start()
    try:
        yield member
    finally:
        member.stop()


@contextmanager
def voter(config: BusConfig, directory: Path) -> Iterator[AgentServer]:
    server = AgentServer(config, 1, storage=directory, endpoints=True)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def silent(member: ReplicaServer) -> None:
    """Until ``member`` has heard nothing from a primary for the delay (none runs)."""
    done = threading.Event()
    while member.silent_for() < DELAY_MS / 1000 or member.candidate_for() < DELAY_MS / 1000:
        done.wait(0.02)


def running(server: AgentServer) -> None:
    """Until the voter has run for the delay (before, it refuses every candidate)."""
    done = threading.Event()
    while time.monotonic() - server.started_at < DELAY_MS / 1000 + 0.1:
        done.wait(0.02)


def test_a_refused_vote_keeps_the_candidate_a_follower(
    tmp_path: Path, make_config: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    config = two_replicas(make_config)
    # The voter already knows epoch 5 of server 0: a candidate for epoch 2 is refused.
    (tmp_path / "s1").mkdir(mode=0o700)
    EpochBook(tmp_path / "s1").raise_to(0, 5, 2)
    with (
        follower(config, 2, tmp_path / "r2", 3),
        follower(config, 1, tmp_path / "r1", 3) as candidate,
        voter(config, tmp_path / "s1") as server,
    ):
        running(server)
        silent(candidate)
        assert Takeover(config, 0, 1, candidate).stand() == 0
        assert "0 of 1 voters granted epoch 2" in caplog.text
        # It follows again, its claim released: a primary of epoch 1 is not refused.
        assert candidate.store_position() is not None
        assert candidate.fence == (1, 0, True)


def test_a_candidate_behind_another_follower_does_not_stand(
    tmp_path: Path, make_config: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    config = two_replicas(make_config)
    with (
        follower(config, 2, tmp_path / "r2", 4),  # one commit more
        follower(config, 1, tmp_path / "r1", 3) as candidate,
        voter(config, tmp_path / "s1") as server,
    ):
        running(server)
        silent(candidate)
        assert Takeover(config, 0, 1, candidate).stand() == 0
        assert "member 2 has more" in caplog.text
        assert "voters granted" not in caplog.text and "voted in" not in caplog.text


def test_the_follower_behind_no_one_is_voted_in(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """The same bus, the candidate as far as the other follower: it takes over, epoch 2 in its
    store (what the two refusals above are measured against)."""
    config = two_replicas(make_config)
    with (
        follower(config, 2, tmp_path / "r2", 3),
        follower(config, 1, tmp_path / "r1", 3) as candidate,
        voter(config, tmp_path / "s1") as server,
    ):
        running(server)
        silent(candidate)
        assert Takeover(config, 0, 1, candidate).stand() == 2
    storage = LogStorage(tmp_path / "r1" / LOG_DIR, read_only=True)
    try:
        assert read_epoch(storage).epoch == 2
    finally:
        storage.close()


def test_a_second_candidate_is_refused_where_the_first_claimed(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = two_replicas(make_config)
    keys = load_server_keys(secret_path(config, 0), 0, config.servers)
    with follower(config, 2, tmp_path / "r2", 3) as member:
        address = (member.spec.hostname, member.spec.replication_port)
        first = ReplicaLink.ask(
            address, keys.link_key(0), 0, epoch_message(FENCE, 2, 1, CLAIM), 5, 1 << 20
        )
        assert first[:1] != NEWER
        second = ReplicaLink.ask(
            address, keys.link_key(0), 0, epoch_message(FENCE, 2, 0, CLAIM), 5, 1 << 20
        )
        assert second[:1] == NEWER and decode_epoch(second) == (2, 1, 0)


@contextmanager
def shipping(
    tmp_path: Path, config: BusConfig, heartbeat_s: float
) -> Iterator[tuple[LogStorage, ReplicaServer]]:
    """Server 0's store shipping to its follower 1 (followed within 10 s), both closed after."""
    keys = load_server_keys(secret_path(config, 0), 0, config.servers)
    primary = LogStorage(tmp_path / "s0" / LOG_DIR)
    with follower(config, 1, tmp_path / "r1", 2) as member:
        links = ReplicationLinks(
            0, (member.spec,), 1, keys.link_key(0), primary, epoch=1, heartbeat_s=heartbeat_s
        )
        links.start()
        try:
            done, deadline = threading.Event(), time.monotonic() + 10
            while member.following() is None:
                assert time.monotonic() < deadline, "the follower never followed"
                done.wait(0.02)
            yield primary, member
        finally:
            links.stop()
            primary.close()


def test_an_idle_primary_keeps_its_follower_hearing_it(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    with shipping(tmp_path, two_replicas(make_config), 0.05) as (_primary, member):
        threading.Event().wait(3 * DELAY_MS / 1000)  # idle: nothing is committed meanwhile
        assert member.silent_for() < DELAY_MS / 1000


def test_a_busy_primary_sends_no_heartbeat_between_its_commits(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """A heartbeat goes only after a heartbeat period with nothing written: commits written by
    the committing thread itself count (each one used to wake the writer thread into sending a
    heartbeat behind it, a thread switch and a frame per commit)."""
    with shipping(tmp_path, two_replicas(make_config), 5.0) as (primary, member):
        before, began = member.beats, time.monotonic()
        for n in range(20):  # each waits for the follower's acknowledgement (sync 1)
            txn = object()
            primary.tpc_begin(txn)
            primary.write_side(txn, {bytes((0xFF, 0x7E)) + n.to_bytes(6, "big"): b"x"}, ())
            primary.tpc_vote(txn)
            primary.tpc_finish(txn)
        assert time.monotonic() - began < 5.0  # else a heartbeat would be due anyway
        assert member.beats == before


# -- a server that shares no domain: its members vote ------------------------------------------


def lone(make_config: Callable[..., Path], replicas: int, sync: int = 1) -> BusConfig:
    """flat-1: server 0 alone, with ``replicas`` replicas on 127.0.0.2, 127.0.0.3..."""
    ports = free_ports(replicas + 1)
    members = "".join(
        f'<replica index="{k}" hostname="127.0.0.{k + 1}" port="{ports[k]}"/>'
        for k in range(1, replicas + 1)
    )
    path = make_config(
        servers=1,
        extra={0: members + f'<property name="aaabus.replication.port" value="{ports[0]}"/>'},
        properties={
            "aaabus.failover.delay_ms": str(DELAY_MS),
            "aaabus.replication.sync": str(sync),
        },
    )
    return load_config(path)


def ballot(config: BusConfig, member: ReplicaServer, epoch: int, candidate: int) -> bytes:
    keys = load_server_keys(secret_path(config, 0), 0, config.servers)
    address = (member.spec.hostname, member.spec.replication_port)
    question = epoch_message(FENCE, epoch, candidate, BALLOT)
    return ReplicaLink.ask(address, keys.link_key(0), 0, question, 5, 1 << 20)


def test_a_lone_server_is_taken_over_by_two_of_its_three_members(
    tmp_path: Path, make_config: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    config = lone(make_config, replicas=2)
    assert config.voters(0) == () and config.lone_warning(0) is None
    with (
        follower(config, 2, tmp_path / "r2", 3) as other,
        follower(config, 1, tmp_path / "r1", 3) as candidate,
    ):
        silent(other)
        silent(candidate)
        assert Takeover(config, 0, 1, candidate).stand() == 2
        assert "voted in by 2 of 3 members" in caplog.text
        # The other member's grant is on its disk, and it refuses epoch 1's primary.
        assert EpochBook(tmp_path / "r2").granted(0) == (2, 1)
        assert other.fence == (2, 1, True)
    assert EpochBook(tmp_path / "r1").granted(0) == (2, 1)  # its own vote, persisted too
    storage = LogStorage(tmp_path / "r1" / LOG_DIR, read_only=True)
    try:
        assert read_epoch(storage).epoch == 2
    finally:
        storage.close()


def test_a_member_that_heard_the_primary_within_the_delay_refuses_its_ballot(
    tmp_path: Path, make_config: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    config = lone(make_config, replicas=2)
    with follower(config, 1, tmp_path / "r1", 3) as candidate:
        silent(candidate)
        # Member 2 starts now: it counts its boot as the primary's last word.
        with follower(config, 2, tmp_path / "r2", 3) as other:
            assert Takeover(config, 0, 1, candidate).stand() == 0
            assert "1 of 3 members granted epoch 2: not a majority" in caplog.text
            assert "within the failover delay" in caplog.text
            assert EpochBook(tmp_path / "r2").granted(0) is None
            assert other.fence == (1, 0, True)
        # Its own grant holds (a grant fences even if its candidate loses): it refuses
        # epoch 1's primary from now on, and stands higher next time.
        assert candidate.fence == (2, 1, False)


def test_a_member_grants_each_epoch_once_and_remembers_it_across_a_restart(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = lone(make_config, replicas=2)
    with follower(config, 2, tmp_path / "r2", 3) as member:
        silent(member)
        assert decode_epoch(ballot(config, member, 2, 1)) == (2, 1, VOTED)
        assert decode_epoch(ballot(config, member, 2, 1)) == (2, 1, VOTED)  # a retry
        assert decode_epoch(ballot(config, member, 2, 0)) == (2, 1, RELEASED)
        assert member.fence == (2, 1, False)
    member = ReplicaServer(config, 0, 2, tmp_path / "r2")
    member.start()
    try:
        assert member.fence == (2, 1, False)  # a primary of epoch 1 is refused
        silent(member)
        assert decode_epoch(ballot(config, member, 2, 0)) == (2, 1, RELEASED)
        assert decode_epoch(ballot(config, member, 3, 0)) == (3, 0, VOTED)
        # What its store or fence holds is known too, whatever its book says.
        member.voted(4, 1)
        assert decode_epoch(ballot(config, member, 4, 0)) == (4, 1, RELEASED)
    finally:
        member.stop()


def test_a_lone_server_with_one_replica_never_stands(
    tmp_path: Path, make_config: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    config = lone(make_config, replicas=1)
    warning = config.lone_warning(0)
    assert warning is not None and "cannot fail over" in warning
    assert warning in config.member_warnings()  # aaabus check
    with follower(config, 1, tmp_path / "r1", 3) as candidate:
        silent(candidate)
        takeover = Takeover(config, 0, 1, candidate)
        assert caplog.text.count("cannot fail over") == 1  # said once, at startup
        assert takeover.stand() == 0
        assert "standing" not in caplog.text
        assert candidate.fence == (1, 0, True)


def test_a_lone_candidate_needs_a_majority_of_all_members_not_of_those_it_reached(
    tmp_path: Path, make_config: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """With sync 2 of 2 the candidate needs no other follower's position; alone, its own vote
    is 1 of 3 members."""
    config = lone(make_config, replicas=2, sync=2)
    with follower(config, 1, tmp_path / "r1", 3) as candidate:
        silent(candidate)
        assert Takeover(config, 0, 1, candidate).stand() == 0
        assert "1 of 3 members granted epoch 2: not a majority" in caplog.text


def test_half_of_an_even_number_of_members_is_no_majority(
    tmp_path: Path, make_config: Callable[..., Path], caplog: pytest.LogCaptureFixture
) -> None:
    """Four members: the candidate and one follower grant, the third follower heard the primary
    within the delay: 2 of 4 (another candidate could have had the other 2)."""
    config = lone(make_config, replicas=3)
    with (
        follower(config, 2, tmp_path / "r2", 3) as other,
        follower(config, 1, tmp_path / "r1", 3) as candidate,
    ):
        silent(other)
        silent(candidate)
        with follower(config, 3, tmp_path / "r3", 3):
            assert Takeover(config, 0, 1, candidate).stand() == 0
        assert "2 of 4 members granted epoch 2: not a majority" in caplog.text


def test_a_member_of_a_server_with_voters_gives_no_ballot(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config = two_replicas(make_config)  # server 1 votes on server 0's takeovers
    with follower(config, 2, tmp_path / "r2", 3) as member:
        silent(member)
        assert decode_epoch(ballot(config, member, 2, 1)) == (1, 0, RELEASED)
        assert EpochBook(tmp_path / "r2").granted(0) is None
