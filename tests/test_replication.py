"""Replicas of a server (issue 42): real server and replica processes on 127.0.0.1, real log
stores. A replica receives its primary's commits and its directory opens as the primary's store;
a replica that starts late, or comes back, catches up; with ``aaabus.replication.sync=1`` a
commit is not durable -- nothing it sends is delivered -- while its replica is stopped; bad
replica configurations are one line and a non-zero exit."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from aaabus.core.logstorage import LogStorage
from aaabus.core.store import LOG_DIR, open_store
from aaabus.errors import AaabusError, WireError
from aaabus.model.ids import TOPICS_STAMP
from aaabus.tools.client import Client
from aaabus.tools.launch import Bus, ServerProcess
from tests.support.harness import REPO_ROOT, aaabus_cli, free_ports

pytestmark = pytest.mark.slow

READY_S = 30.0


def replicated_config(
    make_config: Callable[..., Path], servers: int = 1, sync: int = 1
) -> tuple[Path, int]:
    """A bus whose server 0 has replica 1 (listening on the returned port)."""
    (port,) = free_ports(1)
    config = make_config(
        servers=servers,
        extra={0: f'<replica index="1" port="{port}"/>'},
        properties={"aaabus.replication.sync": str(sync)},
    )
    return config, port


@contextmanager
def processes(*procs: ServerProcess) -> Iterator[tuple[ServerProcess, ...]]:
    """Start each process and wait for its ready line, in order; stop them all at the end."""
    try:
        for proc in procs:
            proc.start()
            proc.wait_ready(READY_S)
        yield procs
    finally:
        for proc in reversed(procs):
            if proc.proc is not None and proc.proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot take its SIGTERM
            proc.stop()


def replica_of_0(config: Path, storage: Path) -> ServerProcess:
    return ServerProcess(config, 0, storage, cwd=REPO_ROOT, replica=1)


def server(config: Path, sid: int, storage: Path) -> ServerProcess:
    return ServerProcess(config, sid, storage, cwd=REPO_ROOT)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        pause.wait(0.02)  # another process's state, read through its admin port


def replica_figures(config: Path) -> dict[str, Any]:
    with Client(config, 0, timeout=10) as client:
        figures: dict[str, Any] = client.status()["replication"]
        return figures


def caught_up(config: Path) -> bool:
    rep = replica_figures(config)["replicas"]["1"]
    return bool(rep["connected"]) and rep["behind_commits"] == 0


def write_content(config: Path, tag: str, count: int) -> None:
    """Commits of many kinds on server 0: retained publications, a durable subscription's
    mailbox filled by them."""
    with Client(config, 0, timeout=30) as client:
        client.subscribe(f"{tag}/#", name=f"keep-{tag}")
        for i in range(count):
            client.publish(f"{tag}/{i}", {"n": i, "tag": tag}, retain=True)


def same_store(primary: Path, replica: Path, retained: int) -> None:
    """The replica holds every record of the primary, byte for byte, and the same side
    records (queues and clocks); it may still hold objects the primary's collector dropped,
    which nothing reaches. Then it opens as server 0's store with the same agents, retained
    publications and mailboxes (at least ``retained`` of the former)."""
    objects, side = records_of(primary)
    copied, copied_side = records_of(replica)
    missing = [oid.hex() for oid in objects if oid not in copied]
    assert not missing, f"objects missing on the replica: {missing[:5]}"
    differ = [oid.hex() for oid, data in objects.items() if copied[oid] != data]
    assert not differ, f"objects that differ on the replica: {differ[:5]}"
    assert copied_side == side
    stores = [open_store("log", path, 0) for path in (primary, replica)]
    try:
        agents = [sorted(map(str, store.agents.keys())) for store in stores]
        assert agents[0] == agents[1]
        topics = [store.agents[(0, TOPICS_STAMP)].figures() for store in stores]
        assert topics[0] == topics[1]
        assert topics[0]["retained"] >= retained and topics[0]["mailboxes"] >= 1
    finally:
        for store in stores:
            store.close()


def records_of(directory: Path) -> tuple[dict[bytes, bytes], dict[bytes, bytes]]:
    storage = LogStorage(directory / LOG_DIR, read_only=True)
    try:
        objects: dict[bytes, bytes] = {}
        cursor: bytes | None = None
        while True:
            oid, _tid, data, cursor = storage.record_iternext(cursor)
            objects[oid] = data
            if cursor is None:
                break
        return objects, storage.side_records()
    finally:
        storage.close()


def test_replica_receives_the_commits_and_opens_as_the_primary_store(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config, _port = replicated_config(make_config)
    with processes(replica_of_0(config, tmp_path / "r1"), server(config, 0, tmp_path / "s0")):
        write_content(config, "live", 20)
        # sync=1: every commit above was acknowledged by the replica before its answer came.
        assert caught_up(config)
    same_store(tmp_path / "s0", tmp_path / "r1", 20)


def test_replica_that_starts_late_or_comes_back_catches_up(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config, _port = replicated_config(make_config, sync=0)
    primary = server(config, 0, tmp_path / "s0")
    with processes(primary):
        write_content(config, "before", 15)
        figures = replica_figures(config)["replicas"]["1"]
        assert not figures["connected"] and figures["behind_commits"] is None
        shown = aaabus_cli("status", str(config), "--id", "0")
        assert shown.returncode == 0, shown.stderr
        assert "server 0 replica 1 (127.0.0.1:" in shown.stdout
        assert "NOT connected" in shown.stdout and "lag unknown" in shown.stdout
        with processes(replica_of_0(config, tmp_path / "r1")):
            # An empty replica gets the whole store.
            wait_until(lambda: caught_up(config), 30, "the late replica to catch up")
        write_content(config, "away", 15)
        figures = replica_figures(config)["replicas"]["1"]
        assert not figures["connected"] and figures["behind_commits"] >= 15
        with processes(replica_of_0(config, tmp_path / "r1")):
            # A replica that comes back gets what it missed, from the commit it has.
            wait_until(lambda: caught_up(config), 30, "the returning replica to catch up")
            write_content(config, "after", 5)
            wait_until(lambda: caught_up(config), 30, "the replica to follow again")
    same_store(tmp_path / "s0", tmp_path / "r1", 35)


def test_sync_replica_stopped_holds_the_commit_until_it_continues(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config, _port = replicated_config(make_config, servers=2, sync=1)
    replica = replica_of_0(config, tmp_path / "r1")
    bus = (replica, server(config, 0, tmp_path / "s0"), server(config, 1, tmp_path / "s1"))
    with (
        processes(*bus),
        Client(config, 1, timeout=30) as reader,
        Client(config, 0, timeout=60) as writer,
    ):
        sub = reader.subscribe("ha/#")
        # The subscription reaches server 0 after a few link delays: publish until one
        # publication through server 0 arrives.
        first = None
        deadline = time.monotonic() + 30
        while first is None and time.monotonic() < deadline:
            writer.publish("ha/warmup", "ping")
            first = sub.get(timeout=0.5)
        assert first is not None, "the subscription never reached server 0"
        while sub.get(timeout=0.2) is not None:
            pass  # the other warm-up publications
        os.kill(replica.pid, signal.SIGSTOP)
        done = threading.Event()

        def publish() -> None:
            with Client(config, 0, timeout=60) as other:
                other.publish("ha/held", "held")
            done.set()

        thread = threading.Thread(target=publish, name="test-publish", daemon=True)
        thread.start()
        try:
            wait_until(
                lambda: (replica_figures(config)["waiting_s"] or 0) >= 1.0,
                30,
                "server 0 to report a commit waiting for its replica",
            )
            # The commit waits: the publication has not left server 0, nor was it answered.
            assert sub.get(timeout=0.5) is None
            assert not done.is_set()
        finally:
            os.kill(replica.pid, signal.SIGCONT)
        got = sub.get(timeout=30)
        assert got is not None and got.topic == "ha/held" and got.payload == "held"
        thread.join(30)
        assert done.is_set()
        assert replica_figures(config)["waiting_s"] is None


@pytest.mark.parametrize(
    ("extra", "sync", "expected"),
    [
        ('<replica index="1" port="{port}"/>', "2", "asks for 2 synchronous replica(s)"),
        ('<replica index="1" port="{net}"/>', "1", "is used twice"),
        ('<replica index="0" port="{port}"/>', "1", "index='0' is not an integer in 1..255"),
        (
            '<replica index="1" port="{port}"/><replica index="1" port="{port2}"/>',
            "1",
            "two replicas of index 1",
        ),
    ],
    ids=["sync-above-replicas", "duplicate-address", "bad-index", "duplicate-index"],
)
def test_bad_replica_config_is_one_line(
    tmp_path: Path, make_config: Callable[..., Path], extra: str, sync: str, expected: str
) -> None:
    port, port2 = free_ports(2)
    config = make_config(properties={"aaabus.replication.sync": sync})
    net = config.read_text().split('port="')[1].split('"')[0]
    text = config.read_text()
    end = text.index("</server>")
    xml = extra.format(port=port, port2=port2, net=net)
    config.write_text(text[:end] + xml + text[end:])
    check = aaabus_cli("check", str(config))
    assert check.returncode != 0
    lines = check.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "a3.xml:" in lines[0], check.stderr


def _refused(config: Path, storage: Path, *extra: str) -> str:
    """Start server 0 of ``config`` (``extra``: e.g. ``--replica K``) and see it refuse: exit
    status 2 and one line on stderr, which is returned."""
    proc = aaabus_cli(
        "server", "--id", "0", *extra, *("--config", str(config), "--storage", str(storage))
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_unknown_replica_is_one_line(tmp_path: Path, make_config: Callable[..., Path]) -> None:
    config, _port = replicated_config(make_config)
    line = _refused(config, tmp_path / "r2", "--replica", "2")
    assert "has no replica 2 (replicas: 1)" in line


def test_a_replica_refuses_another_server(tmp_path: Path, make_config: Callable[..., Path]) -> None:
    """Only its own primary opens a replication link: server 1 claiming to be server 0 with the
    key it holds for server 0 (their link's) is refused, and the replica still serves server 0."""
    from aaabus.config.reader import load_config
    from aaabus.config.secret import load_server_keys, secret_path
    from aaabus.io.replink import ReplicaLink

    config, port = replicated_config(make_config, servers=2)
    bus = load_config(config)
    other = load_server_keys(secret_path(bus, 1), 1, bus.servers)
    replica = replica_of_0(config, tmp_path / "r1")
    with processes(replica):
        with pytest.raises((AaabusError, WireError, OSError)):
            link = ReplicaLink.dial(
                ("127.0.0.1", port), other.link_key(0), 0, timeout=5, max_frame=1 << 20
            )
            link.receive_bytes()  # the replica hangs up on a failed proof
        wait_until(
            lambda: any("refused a connection" in line for line in replica.lines),
            10,
            "the replica's refusal line",
        )
        with processes(server(config, 0, tmp_path / "s0")):
            wait_until(lambda: caught_up(config), 30, "the real primary to be followed")


def test_the_launcher_starts_the_replicas(tmp_path: Path, make_config: Callable[..., Path]) -> None:
    """``aaabus launch`` (the launcher's Bus) starts each server's replicas beside it, in
    ``s<id>r<index>``; with sync 1 the server boots only once its replica follows it."""
    config, _port = replicated_config(make_config)
    with Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT) as bus:
        assert set(bus.replicas) == {(0, 1)}
        assert bus.replicas[(0, 1)].is_ready()
        write_content(config, "launched", 3)
        assert caught_up(config)
    assert (tmp_path / "store" / "s0r1" / LOG_DIR).is_dir()
    same_store(tmp_path / "store" / "s0", tmp_path / "store" / "s0r1", 3)


def test_silent_connections_do_not_keep_the_primary_out(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """Connections that never authenticate hold at most 4 handshakes, each for at most 5 s;
    more are closed at once, and the primary gets in once they expire."""
    import socket

    config, port = replicated_config(make_config)
    replica = replica_of_0(config, tmp_path / "r1")
    silent: list[socket.socket] = []
    with processes(replica):
        try:
            for _ in range(10):
                silent.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            wait_until(
                lambda: any("handshakes under way" in line for line in replica.lines),
                10,
                "the replica's line about refused connections",
            )
            with processes(server(config, 0, tmp_path / "s0")):
                wait_until(lambda: caught_up(config), 30, "the primary to get in")
        finally:
            for sock in silent:
                sock.close()


def test_a_key_file_without_the_replicas_key_is_one_line(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """A server key file made before the server had replicas lacks the key of its link with
    itself: the replica (and the server) refuse to start in one line saying how to remake it."""
    from aaabus.config.secret import write_server_keys

    (port,) = free_ports(1)
    config = make_config(
        extra={
            0: f'<replica index="1" port="{port}"/><property name="aaabus.secret" value="s0.key"/>'
        }
    )
    write_server_keys(tmp_path / "s0.key", tmp_path / "bus.key", 0, [0])
    for extra in (("--replica", "1"), ()):
        line = _refused(config, tmp_path / "store", *extra)
        assert "has no key for its replicas" in line and "aaabus secret --server 0" in line


def test_a_server_stopped_while_a_commit_waits_stops_and_says_so(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """SIGTERM while a commit waits for a stopped replica: the server does not hang, says what
    it did not acknowledge, and the replica (once it continues) marks that commit aborted as
    the server did: both stores hold the same."""
    config, _port = replicated_config(make_config, sync=1)
    replica = replica_of_0(config, tmp_path / "r1")
    primary = server(config, 0, tmp_path / "s0")
    with processes(replica, primary):
        write_content(config, "kept", 3)
        os.kill(replica.pid, signal.SIGSTOP)
        try:

            def publish() -> None:
                with contextlib.suppress(AaabusError), Client(config, 0, timeout=20) as other:
                    other.publish("lost/1", "never acknowledged", retain=True)

            thread = threading.Thread(target=publish, name="test-publish", daemon=True)
            thread.start()
            wait_until(
                lambda: (replica_figures(config)["waiting_s"] or 0) >= 1.0,
                30,
                "server 0 to report a commit waiting for its replica",
            )
            primary.terminate()
            assert primary.proc is not None
            primary.proc.wait(30)  # it stops (TimeoutExpired if it hangs)
        finally:
            os.kill(replica.pid, signal.SIGCONT)
        wait_until(
            lambda: any("stopped while a commit waited" in line for line in primary.lines),
            10,
            "the server's last line",
        )
        thread.join(30)
    same_store(tmp_path / "s0", tmp_path / "r1", 3)
    store = open_store("log", tmp_path / "r1", 0)
    try:
        assert store.agents[(0, TOPICS_STAMP)].figures()["retained"] == 3
    finally:
        store.close()
