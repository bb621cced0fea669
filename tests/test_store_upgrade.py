"""Store upgrades (aaabus.core.upgrades): a store written in an earlier layout is brought to this
version's once, at its first boot, each step in the transaction that records it; a store of a
newer schema is refused in one line. Old stores are made here by writing the old layout
directly into a real store on disk (docs/architecture.md, Upgrades)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from BTrees.OOBTree import OOBTree, OOTreeSet

from aaabus import AgentId, StoreError
from aaabus.core import upgrades
from aaabus.core.store import Store, ZodbQueues, open_store
from aaabus.mqtt.sessions import SessionRecord
from aaabus.tools.launch import Bus
from aaabus.topics.mailbox import Mailbox
from aaabus.topics.representative import TopicRepresentative
from aaabus.wire.frames import BODY_VERSION as VERSION
from aaabus.wire.linkframes import encode_data
from aaabus.wire.message import Message
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.mqtt import Device

ME = AgentId(0, 0, 16)
PEER = 1
DOMAIN = "D0"
MAILBOX_KEY = (0, 90)
FIXTURE = Path(__file__).parent / "fixtures" / "store_b267a4b"
SUBSCRIBER = AgentId(0, 0, 91)


def _message(n: int) -> Message:
    return Message(AgentId(1, 1, n), ME, b"note %d" % n)


def _old_layout(store: Store) -> ZodbQueues:
    """Make ``store`` read as one written before schema versions (version 0), and return its
    ZODB queues (where versions before the journal kept the channel's, log stores too)."""
    root = store.conn.root()
    del root[upgrades.SCHEMA_KEY]
    return ZodbQueues(store.queues, root["qin"])


def _as_written_by(path: Path, version: int | None, queued: int, kind: str = "file") -> None:
    """Make the store at ``path`` look written by wire ``version`` (None: before versions were
    recorded), holding ``queued`` messages in its input queue, as a ZODB object."""
    store = open_store(kind, path, 0)
    try:
        _old_layout(store)
        if version is None:
            del store.record.wire_version
        else:
            store.record.wire_version = version
        for i in range(queued):
            store.conn.root()["qin"].put(_message(i))
        store.commit()
    finally:
        store.close()


def _write_every_old_shape(path: Path) -> bytes:
    """A log store holding each shape an upgrade step changes: queues, clocks and a
    ``(stamp, message)`` outgoing entry as ZODB objects; records lacking the attributes added
    since (server record, MQTT session, mailbox); a topic representative without tries.
    Returns the frame the ``(stamp, message)`` entry stands for."""
    store = open_store("log", path, 0)
    try:
        zodb = _old_layout(store)
        del store.record.bus_identity
        clock = zodb.new_clock(DOMAIN, 2, 0, "delta", "causal")
        stamps = [clock.prepare_send(1) for _ in range(2)]
        store.conn.root()["qin"].put(_message(7))
        zodb.outgoing(PEER, DOMAIN)[1] = encode_data(1, DOMAIN, stamps[0], _message(1))
        zodb.outgoing(PEER, DOMAIN)[2] = (stamps[1], _message(2))  # before queues held frames
        zodb.waiting(DOMAIN)[PEER, 5] = (1, b"stamp", _message(5))
        session = SessionRecord("c1", AgentId(0, 0, 20), "alice", True)
        del session.user, session.clean
        store.conn.root()["mqtt_sessions"] = OOBTree({"c1": session})
        box = Mailbox("m", None, 10)
        del box.__dict__["watched"]  # before the attribute existed
        store.agents[MAILBOX_KEY] = box
        rep = TopicRepresentative({}, 10)
        rep.local["a/+"] = OOTreeSet([SUBSCRIBER])
        del rep.local_trie, rep.remote_trie, rep.retained_trie
        store.agents[0, 2] = rep
        store.commit()
        return encode_data(2, DOMAIN, stamps[1], _message(2))
    finally:
        store.close()


def test_a_new_store_is_made_at_this_schema_and_runs_no_step(tmp_path: Path) -> None:
    store = open_store("file", tmp_path / "s0", 0)
    try:
        assert store.upgraded == []
        assert store.conn.root()[upgrades.SCHEMA_KEY] == upgrades.SCHEMA_VERSION
        assert store.record.wire_version == VERSION
    finally:
        store.close()


def test_an_old_store_is_upgraded_once_and_keeps_what_it_held(tmp_path: Path) -> None:
    frame = _write_every_old_shape(tmp_path / "s0")
    store = open_store("log", tmp_path / "s0", 0)
    try:
        assert store.upgraded == [step.version for step in upgrades.STEPS]
        root = store.conn.root()
        assert root[upgrades.SCHEMA_KEY] == upgrades.SCHEMA_VERSION
        # The channel's structures left ZODB for the journal, the old entry as a frame.
        assert not store.queues and not root["qin"]
        assert len(store.qin) == 1 and store.qin.peek().sender.stamp == 7
        clock = store.links.clock(DOMAIN)
        assert clock is not None and clock.sent_to(PEER) == 2
        out = dict(store.links.outgoing(PEER, DOMAIN).items())
        assert sorted(out) == [1, 2] and out[2] == frame
        assert list(store.links.waiting(DOMAIN).keys()) == [(PEER, 5)]
        # Records have the attributes added since, with the values they meant before.
        assert store.record.bus_identity is None
        session = root["mqtt_sessions"]["c1"]
        assert (session.user, session.clean) == (None, False)
        assert store.agents[MAILBOX_KEY].watched is True
        rep = store.agents[0, 2]
        assert rep.local_trie.match("a/b") == [("a/+", rep.local["a/+"])]
    finally:
        store.close()
    store = open_store("log", tmp_path / "s0", 0)
    try:
        assert store.upgraded == []  # the second boot runs no step
        assert len(store.qin) == 1 and store.qin.peek().sender.stamp == 7
    finally:
        store.close()


def test_a_step_that_fails_is_not_recorded_and_runs_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _write_every_old_shape(tmp_path / "s0")
    last = upgrades.STEPS[-1]

    def crash(store: upgrades.Store) -> None:
        last.run(store)  # its changes are made, then the boot dies before the commit
        raise StoreError("crashed in the middle of the step")

    monkeypatch.setattr(upgrades, "STEPS", (*upgrades.STEPS[:-1], last._replace(run=crash)))
    with pytest.raises(StoreError, match="crashed in the middle"):
        open_store("log", tmp_path / "s0", 0)
    monkeypatch.undo()
    store = open_store("log", tmp_path / "s0", 0)
    try:
        assert store.upgraded == [last.version]  # the steps before it stayed done
        assert store.agents[MAILBOX_KEY].watched is True
    finally:
        store.close()


def test_a_store_of_a_newer_schema_is_refused_untouched(tmp_path: Path) -> None:
    store = open_store("log", tmp_path / "s0", 0)
    store.conn.root()[upgrades.SCHEMA_KEY] = upgrades.SCHEMA_VERSION + 1
    store.commit()
    store.close()
    for _ in range(2):
        with pytest.raises(StoreError) as refused:
            open_store("log", tmp_path / "s0", 0, identity=b"i" * 32)
        line = str(refused.value)
        assert "\n" not in line
        assert f"store schema {upgrades.SCHEMA_VERSION + 1}, newer than" in line
        assert "run the aaabus version that wrote it" in line


def test_a_server_refuses_a_newer_store_at_boot_in_one_line(
    tmp_path: Path, make_config: Any
) -> None:
    config = make_config()
    store = open_store("log", tmp_path / "s0", 0)
    store.conn.root()[upgrades.SCHEMA_KEY] = upgrades.SCHEMA_VERSION + 1
    store.commit()
    store.close()
    run = subprocess.run(
        [sys.executable, "-m", "aaabus", "server", "--id", "0", "--config", str(config),
         "--storage", str(tmp_path / "s0")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    lines = run.stderr.strip().splitlines()
    assert run.returncode != 0 and len(lines) == 1, run.stderr
    assert "newer than the" in lines[0] and "Traceback" not in run.stderr


# -- the wire step: a store of another wire version boots only drained --------------------------


@pytest.mark.parametrize("version", [None, VERSION - 1])
def test_an_older_store_with_queued_messages_is_refused_and_keeps_them(
    tmp_path: Path, version: int | None
) -> None:
    _as_written_by(tmp_path / "s0", version, queued=2)
    with pytest.raises(StoreError) as refused:
        open_store("file", tmp_path / "s0", 0)
    line = str(refused.value)
    assert "\n" not in line and "still holds 2 queued messages" in line and "drained" in line
    with pytest.raises(StoreError, match="still holds 2 queued"):  # refused again: kept
        open_store("file", tmp_path / "s0", 0)


def test_an_older_log_store_refused_keeps_its_queue_where_its_version_reads_it(
    tmp_path: Path,
) -> None:
    # The journal step would move the queue out of ZODB: a refused store must not have it
    # moved, or the version that wrote it would boot with an empty queue.
    _as_written_by(tmp_path / "s0", VERSION - 1, queued=2, kind="log")
    for _ in range(2):
        with pytest.raises(StoreError, match="still holds 2 queued"):
            open_store("log", tmp_path / "s0", 0)


def test_a_drained_older_store_boots_and_records_the_new_version(tmp_path: Path) -> None:
    _as_written_by(tmp_path / "s0", None, queued=0)
    store = open_store("file", tmp_path / "s0", 0)
    store.close()
    store = open_store("file", tmp_path / "s0", 0)
    try:
        assert store.record.wire_version == VERSION and store.record.__dict__.get("wire_version")
    finally:
        store.close()


# -- a store written by the code of b267a4b (tests/fixtures/store_b267a4b) -----------------------


def test_a_store_of_the_release_before_boots_and_its_mqtt_session_resumes(
    tmp_path: Path, make_config: Any
) -> None:
    storage = tmp_path / "store"
    (storage / "s0").mkdir(mode=0o700, parents=True)
    data = storage / "s0" / "data.fs"
    shutil.copyfile(FIXTURE / "data.fs", data)
    data.chmod(0o600)
    (port,) = free_ports(1)
    props = {"aaabus.mqtt.port": str(port), "aaabus.mqtt.anonymous": "true"}
    config = make_config(properties={**props, "aaabus.store": "file"})
    bus = Bus(config, [0], storage, cwd=REPO_ROOT).start()
    keeper, late = Device(port, "keeper", clean=False), Device(port, "late")
    try:
        assert keeper.connect() == (0, True)  # the session, stored under its old class path
        assert keeper.receive(1) == [("plant/meter", b"42", 1, False)]  # kept while away
        assert late.connect()[0] == 0
        late.subscribe("plant/#", 1)
        assert late.receive(1) == [("plant/state", b"on", 1, True)]  # the retained copy
    finally:
        keeper.close()
        late.close()
        bus.stop()
    store = open_store("file", storage / "s0", 0)
    try:
        assert store.upgraded == []  # every step ran at the first boot
        assert store.conn.root()[upgrades.SCHEMA_KEY] == upgrades.SCHEMA_VERSION
    finally:
        store.close()
