"""LogStorage on real disks and real processes: commits that returned survive SIGKILL, a torn
last write is dropped silently, damage to committed bytes is refused in one line, compaction
and GC keep the directory bounded without losing a commit, and the bus's own store runs on it.

ZODB's conformance suites run in ``test_logstorage_zodb.py``.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import random
import selectors
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import transaction
import ZODB
import ZODB.serialize
from BTrees.OOBTree import OOBTree
from persistent import Persistent
from ZODB.Connection import TransactionMetaData
from ZODB.POSException import POSKeyError, ReadConflictError
from ZODB.tests.MinPO import MinPO
from ZODB.tests.StorageTestBase import zodb_pickle
from ZODB.utils import p64, z64

from aaabus.core.logstorage import LogStorage
from aaabus.core.logstorage.format import (
    BLOCK_HEAD,
    DATA_START,
    KIND_COMMIT,
    SegmentScan,
    decode_segment_header,
    scan_segment,
)
from aaabus.core.logstorage.segments import parse_name
from aaabus.core.store import CACHE_SIZE, PersistentQueue, Store, _verify_current_records
from aaabus.errors import LogStoreDamaged, StoreError, StoreInUse
from aaabus.model.ids import AgentId
from aaabus.wire.message import Message
from tests.support.harness import REPO_ROOT
from tests.support.logstore_child import DROP_EVERY, KEEP
from tests.test_faults import _mount_tmpfs, _umount

# -- helpers -------------------------------------------------------------------------------------


class Item(Persistent):
    def __init__(self, value: int = 0) -> None:
        self.value = value


def commit_raw(storage: LogStorage, oid: bytes, serial: bytes, value: Any) -> bytes:
    """One transaction storing ``MinPO(value)`` at ``oid`` through the storage API."""
    txn = TransactionMetaData()
    storage.tpc_begin(txn)
    try:
        storage.store(oid, serial, zodb_pickle(MinPO(value)), "", txn)
        storage.tpc_vote(txn)
    except BaseException:
        storage.tpc_abort(txn)
        raise
    return storage.tpc_finish(txn)


class _RefKeeping(pickle.Unpickler):
    """Leaves persistent references as they are (the test reads one record, not a graph)."""

    def persistent_load(self, pid: Any) -> Any:
        return pid


def value_of(storage: LogStorage, oid: bytes) -> Any:
    """The ``value`` attribute in the state of the current record of ``oid`` (MinPO or Item)."""
    unpickler = _RefKeeping(io.BytesIO(storage.load(oid)[0]))
    unpickler.load()  # the class
    state = unpickler.load()
    return state["value"] if isinstance(state, dict) else state


def segments_of(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if parse_name(p.name) is not None)


def scan(path: Path) -> SegmentScan:
    buf = path.read_bytes()
    return scan_segment(buf, decode_segment_header(buf[:DATA_START]).seq)


def crash_image(directory: Path, into: Path) -> Path:
    """What the disk holds if the machine stopped now: every synced byte (the page cache and
    the disk agree for synced files, so a copy is that image); the lock file is left out."""
    shutil.copytree(directory, into, ignore=shutil.ignore_patterns("lock"))
    return into


def dir_bytes(directory: Path) -> int:
    # The compactor renames segments (free-*, seg-*) on its own thread: a file listed may be
    # gone when its size is read. List again then: the sizes are the same, the names moved.
    deadline = time.monotonic() + 10
    while True:
        try:
            return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())
        except FileNotFoundError:
            assert time.monotonic() < deadline, f"{directory} kept changing for 10 s"


@pytest.fixture
def opened() -> Iterator[list[Any]]:
    """Storages and databases a test opens; closed whatever happens."""
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        thing.close()


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.01)  # the compactor has no event to offer a test: poll its figures


# -- crashes: real processes, SIGKILL ------------------------------------------------------------

CHILD_SEGMENT = 16 << 10


def read_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """One line of the child's unbuffered stdout: no line is left in a reader's buffer, where
    ``communicate`` (reading the raw pipe) would miss it after the kill."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError(f"the committing child printed nothing within {timeout} s")
    line = proc.stdout.readline()
    if not line:
        raise AssertionError(f"the committing child exited with status {proc.wait()}")
    return line.decode().strip()


def kill_and_check(directory: Path, rng: random.Random) -> int:
    """Start the committing child, SIGKILL it after a random number of commits, reopen the
    store: every counter it printed is there, both objects agree, no partial transaction."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.logstore_child", str(directory), str(CHILD_SEGMENT)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        bufsize=0,
    )
    try:
        acknowledged = int(read_line(proc, 30).split()[1])
        for _ in range(rng.randint(0, 400)):
            acknowledged = int(read_line(proc, 30))
    finally:
        proc.send_signal(signal.SIGKILL)
        raw_out, raw_err = proc.communicate(timeout=30)
    out, err = raw_out.decode(), raw_err.decode()
    assert proc.returncode == -signal.SIGKILL, err[-2000:]
    printed = [int(line) for line in out.split() if line.isdigit()]
    if printed:  # committed while the kill was on its way
        acknowledged = printed[-1]
    storage = LogStorage(directory, segment_size=CHILD_SEGMENT)
    db = ZODB.DB(storage)
    try:
        root = db.open().root()
        value = root["a"].value
        assert root["b"].value == value, "a transaction was half applied"
        assert acknowledged <= value <= acknowledged + 1, (acknowledged, value)
        assert list(root["queue"].values()) == list(range(max(1, value - KEEP + 1), value + 1))
        if value >= DROP_EVERY:
            assert list(root["tree"].keys()) == [value - value % DROP_EVERY]
        _verify_current_records(storage, directory)
    finally:
        db.close()
    return value


def run_kills(directory: Path, kills: int, seed: int) -> None:
    rng = random.Random(seed)
    previous = 0
    for _ in range(kills):
        value = kill_and_check(directory, rng)
        assert value >= previous
        previous = value
    assert previous > kills, "the child committed too little to test anything"
    # Every boot seals the heads it finds; the compactor recycles them: the directory follows
    # the live data (a few KB) whatever the number of crashes.
    storage = LogStorage(directory, segment_size=CHILD_SEGMENT)
    try:
        wait_for(
            lambda: dir_bytes(directory) <= 10 * CHILD_SEGMENT,
            30,
            "the compactor reclaiming the segments the crashed runs left",
        )
    finally:
        storage.close()


def test_sigkill_keeps_every_returned_commit(tmp_path: Path) -> None:
    run_kills(tmp_path / "store", kills=3, seed=11)


@pytest.mark.slow
def test_sigkill_keeps_every_returned_commit_30_kills(tmp_path: Path) -> None:
    run_kills(tmp_path / "store", kills=30, seed=2024)


def test_store_in_use_by_another_process_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.logstore_child", str(directory), str(CHILD_SEGMENT)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        read_line(proc, 30)
        with pytest.raises(StoreInUse, match="in use by another process"):
            LogStorage(directory)
    finally:
        proc.kill()
        proc.communicate(timeout=30)


# -- torn tails and damage -----------------------------------------------------------------------


def five_commits(directory: Path) -> tuple[bytes, list[bytes]]:
    """A store (left open: the caller takes a crash image) whose one object went 1..5."""
    storage = LogStorage(directory, segment_size=64 << 10, compact=False)
    oid = storage.new_oid()
    serial = z64
    tids = []
    for value in range(1, 6):
        serial = commit_raw(storage, oid, serial, value)
        tids.append(serial)
    return oid, tids


def commit_blocks(path: Path) -> list[Any]:
    return [b for b in scan(path).blocks if b.kind == KIND_COMMIT]


def test_torn_last_write_is_dropped_at_every_offset(tmp_path: Path, opened: list[Any]) -> None:
    live = tmp_path / "live"
    oid, tids = five_commits(live)
    image = crash_image(live, tmp_path / "image")
    head = segments_of(image)[-1]
    last = commit_blocks(head)[-1]
    original = head.read_bytes()
    rng = random.Random(5)
    offsets = sorted(
        {0, 1, 7, BLOCK_HEAD.size, last.end - last.offset - 1}
        | set(rng.sample(range(last.end - last.offset), 40))
    )
    for cut in offsets:
        for fill in ("zeros", "garbage"):
            trial = tmp_path / f"trial-{cut}-{fill}"
            shutil.copytree(image, trial)
            tail = last.end - last.offset - cut
            if fill == "zeros":
                junk = bytes(tail)
            else:  # differs from the original at every byte
                junk = bytes(
                    b ^ rng.randint(1, 255) for b in original[last.offset + cut : last.end]
                )
            with open(trial / head.name, "r+b") as f:
                f.seek(last.offset + cut)
                f.write(junk)
            storage = LogStorage(trial, segment_size=64 << 10, compact=False)
            assert value_of(storage, oid) == 4, (cut, fill)
            # Counted when the block's first 8 bytes (magic and seq) made it: a started write.
            assert storage.stats()["torn_tails_dropped_at_open"] == (1 if cut >= 8 else 0)
            assert storage.lastTransaction() == tids[3]
            # The store goes on: the next commit lands, and survives a reopen.
            commit_raw(storage, oid, tids[3], 6)
            storage.close()
            storage = LogStorage(trial, segment_size=64 << 10, compact=False)
            assert value_of(storage, oid) == 6
            storage.close()
            shutil.rmtree(trial)


def test_damaged_record_in_the_middle_is_refused_naming_file_and_offset(tmp_path: Path) -> None:
    live = tmp_path / "live"
    five_commits(live)
    image = crash_image(live, tmp_path / "image")
    head = segments_of(image)[-1]
    middle = commit_blocks(head)[2]
    flip_byte(head, middle.body_start + 40)
    before = {p.name: p.read_bytes() for p in segments_of(image)}
    with pytest.raises(LogStoreDamaged) as caught:
        LogStorage(image)
    message = str(caught.value)
    assert "\n" not in message
    assert f"log store segment {head} is damaged at byte {middle.offset}:" in message
    assert "restore the store directory from a backup" in message
    assert {p.name: p.read_bytes() for p in segments_of(image)} == before, "refused, yet changed"


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x40]))


def test_damaged_segment_header_is_refused(tmp_path: Path) -> None:
    live = tmp_path / "live"
    five_commits(live)
    image = crash_image(live, tmp_path / "image")
    head = segments_of(image)[-1]
    flip_byte(head, 13)  # inside the seq field
    with pytest.raises(StoreError) as caught:
        LogStorage(image)
    assert str(caught.value) == (
        f"log store segment {head} is damaged at byte 0: segment header fails its checksum; "
        "restore the store directory from a backup (nothing was changed)"
    )


def test_damage_to_the_last_commit_after_a_clean_close_is_refused(tmp_path: Path) -> None:
    """A clean close seals the head, so even its last commit is followed by a whole block."""
    directory = tmp_path / "store"
    storage = LogStorage(directory, segment_size=64 << 10, compact=False)
    oid = storage.new_oid()
    commit_raw(storage, oid, commit_raw(storage, oid, z64, 1), 2)
    storage.close()
    head = segments_of(directory)[-1]
    last = commit_blocks(head)[-1]
    flip_byte(head, last.end - 3)
    with pytest.raises(LogStoreDamaged, match=f"damaged at byte {last.offset}: "):
        LogStorage(directory)


def test_segment_cut_short_is_refused(tmp_path: Path) -> None:
    live = tmp_path / "live"
    five_commits(live)
    image = crash_image(live, tmp_path / "image")
    head = segments_of(image)[-1]
    os.truncate(head, 3000)
    with pytest.raises(LogStoreDamaged, match="the file has 3000 bytes, its header says 65536"):
        LogStorage(image)


def test_abort_after_vote_is_not_committed_after_a_crash(tmp_path: Path) -> None:
    live = tmp_path / "live"
    storage = LogStorage(live, compact=False)
    oid = storage.new_oid()
    tid = commit_raw(storage, oid, z64, 1)
    txn = TransactionMetaData()
    storage.tpc_begin(txn)
    storage.store(oid, tid, zodb_pickle(MinPO(2)), "", txn)
    storage.tpc_vote(txn)  # on disk now
    storage.tpc_abort(txn)  # another participant vetoed
    image = crash_image(live, tmp_path / "image")
    storage.close()
    reopened = LogStorage(image)
    try:
        assert value_of(reopened, oid) == 1
        assert reopened.lastTransaction() == tid
    finally:
        reopened.close()


# -- compaction and GC ---------------------------------------------------------------------------


def test_disk_follows_live_data_under_a_stream_of_rewrites_and_dropped_trees(
    tmp_path: Path, opened: list[Any]
) -> None:
    segment = 32 << 10
    directory = tmp_path / "store"
    storage = LogStorage(directory, segment_size=segment)
    db = ZODB.DB(storage)
    opened.append(db)
    tm = transaction.TransactionManager()
    root = db.open(transaction_manager=tm).root()
    root["item"] = Item(0)
    root["queue"] = PersistentQueue()
    tm.commit()
    peak = 0
    commits = 3000
    for n in range(1, commits + 1):
        root["item"].value = n
        root["queue"].put(b"m" * 300)
        root["queue"].pop()
        if n % 50 == 0:  # the previous tree becomes unreachable: only GC can find it
            root["tree"] = OOBTree({n: Item(n)})
        tm.commit()
        if n % 100 == 0:
            peak = max(peak, dir_bytes(directory))
    written = commits * 700
    assert peak <= 12 * segment < written / 5, (peak, written)
    wait_for(lambda: storage.stats()["gc_passes"] >= 2, 30, "two GC passes")
    storage.pack(time.time(), ZODB.serialize.referencesf)  # drops what the last pass spared
    stats = storage.stats()
    assert stats["compactions"] > 10
    assert len(storage) == 5  # root, item, queue, the last tree (one bucket, inline), its Item
    assert stats["live_bytes"] < 4096
    lock = (directory / "lock").stat().st_size
    # The compactor may still be recycling a segment on its thread: the figures and the
    # directory agree once it is done.
    wait_for(
        lambda: storage.stats()["file_bytes"] == dir_bytes(directory) - lock,
        10,
        "file_bytes agrees with the directory",
    )
    assert root["item"].value == commits and list(root["tree"].keys()) == [commits]
    db.close()
    opened.clear()
    reopened = ZODB.DB(LogStorage(directory, segment_size=segment))
    opened.append(reopened)
    root = reopened.open().root()
    assert root["item"].value == commits
    assert root["tree"][commits].value == commits
    assert len(root["queue"]) == 0


def test_commits_racing_compaction_lose_nothing(tmp_path: Path, opened: list[Any]) -> None:
    directory = tmp_path / "store"
    storage = LogStorage(directory, segment_size=16 << 10)
    db = ZODB.DB(storage)
    opened.append(db)
    expected = [0] * 20
    done = threading.Event()
    failures: list[BaseException] = []

    def committer() -> None:
        try:
            tm = transaction.TransactionManager()
            root = db.open(transaction_manager=tm).root()
            root["items"] = [Item(0) for _ in expected]
            tm.commit()
            rng = random.Random(3)
            for _ in range(1500):
                for index in rng.sample(range(len(expected)), 3):
                    root["items"][index].value += 1
                    expected[index] += 1
                tm.commit()
        except BaseException as exc:
            failures.append(exc)
        finally:
            done.set()

    thread = threading.Thread(target=committer, name="test-committer")
    thread.start()
    packs = 0
    while not done.is_set():
        storage.pack(time.time(), ZODB.serialize.referencesf)
        packs += 1
    thread.join(60)
    assert not failures, failures
    assert packs > 3
    root = db.open().root()
    assert [item.value for item in root["items"]] == expected
    db.close()
    opened.clear()
    reopened = ZODB.DB(LogStorage(directory, segment_size=16 << 10))
    opened.append(reopened)
    assert [item.value for item in reopened.open().root()["items"]] == expected


def test_gc_drops_an_object_only_when_two_passes_find_it_unreachable(
    tmp_path: Path, opened: list[Any]
) -> None:
    storage = LogStorage(tmp_path / "store", compact=False)
    db = ZODB.DB(storage)
    opened.append(db)
    tm = transaction.TransactionManager()
    root = db.open(transaction_manager=tm).root()
    kept, relinked, dropped = Item(1), Item(2), Item(3)
    root["kept"], root["relinked"], root["dropped"] = kept, relinked, dropped
    tm.commit()
    oids = {name: root[name]._p_oid for name in ("kept", "relinked", "dropped")}
    del root["relinked"], root["dropped"]
    tm.commit()
    storage.collect_garbage()  # both unreachable: spared once
    assert len(storage) == 4
    root["relinked"] = relinked  # linked again before the next pass
    tm.commit()
    storage.collect_garbage()
    assert len(storage) == 3
    with pytest.raises(POSKeyError):
        storage.load(oids["dropped"])
    assert value_of(storage, oids["relinked"]) == 2
    assert value_of(storage, oids["kept"]) == 1


def test_a_recycled_revision_is_a_read_conflict(tmp_path: Path) -> None:
    storage = LogStorage(tmp_path / "store", compact=False)
    try:
        oid = storage.new_oid()
        first = commit_raw(storage, oid, z64, 1)
        second = commit_raw(storage, oid, first, 2)
        before = storage.loadBefore(oid, second)
        assert before is not None and before[:2] == (zodb_pickle(MinPO(1)), first)
        storage.pack(time.time(), ZODB.serialize.referencesf, gc=False)
        with pytest.raises(ReadConflictError, match="reclaimed by the log store's compaction"):
            storage.loadBefore(oid, second)
        after = storage.loadBefore(oid, p64(int.from_bytes(second, "big") + 1))
        assert after is not None and after[1] == second
    finally:
        storage.close()


# -- the bus's own store -------------------------------------------------------------------------


def test_the_bus_store_runs_on_a_log_storage(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    store = Store(ZODB.DB(LogStorage(directory), cache_size=CACHE_SIZE), "log store", 7)
    try:
        store.record.boots += 1
        for n in range(300):
            store.qin.put(Message(AgentId(7, 0, n), AgentId(7, 0, 1), b"note %d" % n))
            store.agents[(7, n % 5)] = Item(n)
            channel = store.queues.setdefault(f"out-{n % 3}", PersistentQueue())
            channel.put(n)
            if n % 2:
                store.qin.pop()
            store.commit()
        for queue in store.queues.values():
            queue.pop_through(queue.maxKey() - 5)  # keep the last five
        del store.queues["out-0"]
        store.commit()
    finally:
        store.close()
    storage = LogStorage(directory)
    _verify_current_records(storage, directory)
    store = Store(ZODB.DB(storage, cache_size=CACHE_SIZE), "log store", 7)
    try:
        assert store.record.boots == 1
        assert [store.qin.pop().sender.stamp for _ in range(len(store.qin))] == list(
            range(150, 300)
        )
        assert {key: item.value for key, item in store.agents.items()} == {
            (7, k): 295 + k for k in range(5)
        }
        assert sorted(store.queues) == ["out-1", "out-2"]
        assert list(store.queues["out-1"].values()) == [n for n in range(300) if n % 3 == 1][-5:]
    finally:
        store.close()
    with pytest.raises(StoreError, match="belongs to server 7, not 8"):
        Store(ZODB.DB(LogStorage(directory)), "log store", 8)


def test_stats_tell_live_and_file_bytes(tmp_path: Path) -> None:
    storage = LogStorage(tmp_path / "store", segment_size=64 << 10, compact=False)
    try:
        oid = storage.new_oid()
        commit_raw(storage, oid, z64, 1)
        stats = storage.stats()
        assert stats["objects"] == 1
        assert stats["live_bytes"] == 28 + len(zodb_pickle(MinPO(1)))
        assert stats["file_bytes"] == storage.getSize() == 64 << 10
        assert stats["last_compaction_at"] is None
    finally:
        storage.close()


def test_a_directory_that_holds_no_store_is_refused_without_create(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for path, options in (
        (tmp_path / "missing", {"create": False}),
        (tmp_path / "empty", {"create": False}),
        (tmp_path / "empty", {"read_only": True}),
    ):
        with pytest.raises(StoreError, match=f"^{path} holds no log store; fix the path"):
            LogStorage(path, **options)
    assert not (tmp_path / "missing").exists()


def test_a_transaction_larger_than_a_segment_gets_a_segment_of_its_own(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    storage = LogStorage(directory, segment_size=64 << 10, compact=False)
    big = os.urandom(300 << 10)
    try:
        oid, other = storage.new_oid(), storage.new_oid()
        txn = TransactionMetaData()
        storage.tpc_begin(txn)
        storage.store(oid, z64, big, "", txn)
        storage.store(other, z64, zodb_pickle(MinPO(1)), "", txn)
        storage.tpc_vote(txn)
        tid = storage.tpc_finish(txn)
        assert max(p.stat().st_size for p in segments_of(directory)) > 300 << 10
        storage.close()
        storage = LogStorage(directory, segment_size=64 << 10, compact=False)
        assert storage.load(oid) == (big, tid)
        commit_raw(storage, oid, tid, 2)  # the big revision is dead now
        storage.pack(time.time(), ZODB.serialize.referencesf, gc=False)
        assert value_of(storage, oid) == 2 and value_of(storage, other) == 1
        assert max(p.stat().st_size for p in segments_of(directory)) == 64 << 10
        assert storage.getSize() < 300 << 10
    finally:
        storage.close()


def test_a_full_disk_vetoes_the_commit_and_the_store_goes_on_once_space_is_back(
    tmp_path: Path,
) -> None:
    small = tmp_path / "small"
    small.mkdir()
    if not _mount_tmpfs(small, "256k"):
        pytest.skip("needs root to mount a 256 KB tmpfs (a full disk)")
    try:
        storage = LogStorage(small / "store", segment_size=64 << 10, compact=False)
        oid = storage.new_oid()
        serial = z64
        committed = 0
        with pytest.raises(OSError) as caught:
            for value in range(1, 100_000):
                serial = commit_raw(storage, oid, serial, value)
                committed = value
        # Only a new segment can meet a full disk; the commit that needed it wrote nothing.
        assert caught.value.errno == errno.ENOSPC
        assert committed > 100
        assert value_of(storage, oid) == committed
        subprocess.run(["mount", "-o", "remount,size=4m", str(small)], check=True, timeout=30)
        commit_raw(storage, oid, serial, committed + 1)
        storage.close()
        storage = LogStorage(small / "store", segment_size=64 << 10, compact=False)
        assert value_of(storage, oid) == committed + 1
        storage.close()
    finally:
        _umount(small)
