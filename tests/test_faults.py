"""Network and storage faults, on real server processes (and one in-process bus for the checker).

Network: s0 dials s1 through a :class:`FaultProxy` (property ``aaabus.dial.1`` on s0), which
delays, stalls, cuts connections in the middle of a frame, and partitions then heals. A rally
(every volley checked, in order, once) measures that traffic resumes; after a heal, the time to
the next volley is the recovery time, bounded by the 1 s cap of the redial backoff plus one round
trip. Gossip across two domains through a cut-and-partitioned link is judged by the checker.

Storage, on both durable kinds: a server whose disk fills stops with one error line and a
non-zero status instead of acknowledging what it could not store, and the sender delivers
everything once the space is back. FileStorage: a data.fs cut short or overwritten with garbage
is refused at boot (exit 2, one line), while the torn tail a crash leaves behind is recovered
silently, as it must be. Log store: a damaged block or segment header is refused at boot in one
line naming the segment file and the byte offset (its torn tails are tested in
``test_logstorage.py`` and by the SIGKILL tests of ``test_server_process.py``, which run on the
default store).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from aaabus.config.reader import load_config
from aaabus.node.inprocess import InProcessBus
from aaabus.testing.crash import read_progress, wait_progress
from aaabus.testing.proxy import FaultProxy
from aaabus.tools.launch import Bus, ServerProcess
from tests.support.bus import add_to_server, wait_json
from tests.support.gossip import deploy_gossipers, kick_all, wait_and_check
from tests.support.harness import REPO_ROOT
from tests.support.topics import wait_until

# Real server processes, subprocesses or Spark: not in the fast lane (make check).
pytestmark = pytest.mark.slow

# -- network faults ------------------------------------------------------------------------------


def rally_through_proxy(
    tmp_path: Path, make_config: Callable[..., Path]
) -> tuple[Path, FaultProxy, Path]:
    progress = tmp_path / "rally.json"
    config = make_config(servers=2)
    cfg = load_config(config)
    proxy = FaultProxy(("127.0.0.1", cfg.servers[1].networks[0].port), name="s0-s1")
    add_to_server(config, 0, f'<property name="aaabus.dial.1" value="127.0.0.1:{proxy.port}"/>')
    spec = json.dumps({"echo": 1, "n": 10**9, "done": str(progress), "every": 1})
    service = f"<service class=\"aaabus.testing.workload:bounce_setup\" args='{spec}'/>"
    add_to_server(config, 0, service)
    return config, proxy, progress


def wait_change(
    progress: Path, since: int, procs: Iterable[ServerProcess], timeout: float
) -> float:
    """Seconds until the rally's count moves past ``since`` (polled every 2 ms)."""
    t0 = time.monotonic()
    pause = threading.Event()
    while read_progress(progress)["count"] <= since:
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"no volley within {timeout}s")
        for proc in procs:
            assert proc.running(), list(proc.lines)[-5:]
        pause.wait(0.002)  # another process writes the file: poll it
    return time.monotonic() - t0


def test_rally_survives_delay_stall_cuts_and_partitions(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config, proxy, progress = rally_through_proxy(tmp_path, make_config)
    rng = random.Random(5)
    recoveries: list[float] = []
    try:
        with Bus(config, [0, 1], tmp_path / "stores", cwd=REPO_ROOT) as bus:
            procs = list(bus.servers.values())
            wait_progress(progress, 20, procs)

            # Delay: slower, never wrong.
            proxy.set_delay(0.03)
            at = read_progress(progress)["count"]
            wait_progress(progress, at + 5, procs)
            proxy.set_delay(0.0)

            # Stall: bytes pile up in the proxy; nothing is lost when it resumes.
            proxy.stall()
            # The stall holds the rally's volley (one at a time, each waits for the last), not
            # a window of time: once the proxy holds bytes, nothing can cross until it resumes.
            wait_until("a volley held by the stalled proxy", lambda: proxy.holding() > 0)
            stalled_at = read_progress(progress)["count"]
            proxy.resume()
            wait_progress(progress, stalled_at + 20, procs)

            # Cuts in the middle of frames, in either direction, at random byte counts.
            for _ in range(5):
                at = read_progress(progress)["count"]
                proxy.cut(after_bytes=rng.randint(1, 60))
                wait_progress(progress, at + 10, procs)

            # The round trip right now: the machine may be loaded by other work, and the bound
            # below must hold for the bus, not for an idle machine.
            at = read_progress(progress)["count"]
            t0 = time.monotonic()
            wait_progress(progress, at + 10, procs)
            rtt = (time.monotonic() - t0) / 10

            # Partitions, healed after a while: measure heal -> next volley.
            for _ in range(3):
                proxy.partition()
                threading.Event().wait(rng.uniform(0.2, 1.2))  # the partition lasts: the fault
                at = read_progress(progress)["count"]
                proxy.heal()
                recoveries.append(wait_change(progress, at, procs, 10))
            final = wait_progress(progress, read_progress(progress)["count"] + 20, procs)
        assert final["errors"] == 0, final
    finally:
        proxy.stop()
    print(f"recovery after heal: {[round(r, 3) for r in recoveries]} s (round trip {rtt:.4f} s)")
    # The redial backoff is capped at 1 s (times 0.5..1 of jitter); then come a handshake, the
    # resend and one volley's round trip. 1.5 s holds on an idle machine; a few round trips of
    # margin keep it true when other work slows every round trip down.
    assert max(recoveries) <= 1.5 + 5 * rtt, (recoveries, rtt)


def test_gossip_across_domains_through_a_faulty_link_is_causal(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    # D0 [s0 s1]  D1 [s1 s2]: s1 routes, and its dial to s2 goes through the proxy.
    config = make_config(layout=[[0, 1], [1, 2]], properties={"aaabus.store": "memory"})
    cfg = load_config(config)
    proxy = FaultProxy(("127.0.0.1", cfg.servers[2].port_in("D1")), name="s1-s2")
    add_to_server(config, 1, f'<property name="aaabus.dial.2" value="127.0.0.1:{proxy.port}"/>')
    rng = random.Random(9)
    try:
        with InProcessBus(load_config(config)) as bus:
            agents = deploy_gossipers(bus.servers, per_server=2, seed=3)
            expected = kick_all(bus.servers, agents, count=3, ttl=25)
            proxy.set_delay(0.01)
            for _ in range(4):
                threading.Event().wait(rng.uniform(0.05, 0.3))  # a random moment: the schedule
                proxy.cut(after_bytes=rng.randint(1, 200))
                # More traffic, so that bytes cross the armed cut however fast the earlier
                # gossip went: the fault must happen, not just be scheduled.
                expected += kick_all(bus.servers, agents, count=1, ttl=5)
            proxy.partition()
            threading.Event().wait(0.5)  # the partition lasts: the fault
            proxy.heal()
            proxy.set_delay(0.0)
            report = wait_and_check(bus.servers, expected, timeout=60)
        assert report.ok, report.summary()
        assert report.messages == expected
        assert proxy.connections >= 3, "the faults never forced a reconnection"
    finally:
        proxy.stop()


# -- storage faults ------------------------------------------------------------------------------


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        timeout=30,
    )
    return done.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


@pytest.mark.parametrize("kind", ["log", "file"])
def test_disk_full_stops_the_server_and_nothing_unstored_is_acknowledged(
    tmp_path: Path, make_config: Callable[..., Path], kind: str
) -> None:
    small = tmp_path / "small"
    if not _mount_tmpfs(small, "1m"):
        pytest.skip("needs root to mount a 1 MB tmpfs (a full disk)")
    try:
        done = tmp_path / "done.json"
        n = 1500  # parcels of 8 KB: over 10 MB, ten times what fits in the 1 MB file system
        # The depot keeps every parcel (live data): the disk fills whatever the store reclaims
        # and however many parcels a commit holds. Rewriting the depot alone filled a file
        # store (every revision kept) only while commits were small: on a loaded machine the
        # parcels that arrive together run in one group (`max_batch` does not bound them), a
        # few dozen revisions were written for 1,500 parcels and the disk never filled (the
        # test waited 60 s for a stop that could not come). The log store's 64 KiB segments
        # let it fit the 1 MB file system at first.
        spec = json.dumps(
            {"depot_server": 1, "n": n, "size": 8192, "done": str(done), "hoard": True}
        )
        service = f"<service class=\"aaabus.testing.shipping:shipping_setup\" args='{spec}'/>"
        # Small groups: each commit writes the depot and its 8 KB again.
        properties = {
            "aaabus.engine.max_batch": "1",
            "aaabus.store": kind,
            "aaabus.store.segment_kb": "64",
        }
        config = make_config(servers=2, extra={0: service}, properties=properties)
        s0 = ServerProcess(config, 0, tmp_path / "s0", cwd=REPO_ROOT)
        s1 = ServerProcess(config, 1, small / "s1", cwd=REPO_ROOT)
        try:
            s0.start()
            s1.start()
            s0.wait_ready(30)
            s1.wait_ready(30)
            assert s1.proc is not None
            code = s1.proc.wait(60)  # the disk fills: the server must stop on its own
            s1.stop()
            assert code != 0
            last = list(s1.lines)[-1]
            assert last.startswith("aaabus server: error: server 1 stopped:"), last
            assert "No space left on device" in last, last
            assert not done.exists()
            assert s0.running(), "the sender must not be affected"
            # Space is back: the restarted server takes everything, each parcel once, in order.
            # Room for the hoard (12 MB live) and, in a file store, its revisions until a pack.
            subprocess.run(["mount", "-o", "remount,size=160m", str(small)], check=True, timeout=30)
            s1.start().wait_ready(30)
            result = wait_json(done, [s0, s1], 120)
            assert result == {"count": n, "errors": 0}
            assert s1.stop() == 0
        finally:
            s0.stop()
            s1.stop()
    finally:
        _umount(small)


def _counter_store(
    tmp_path: Path, make_config: Callable[..., Path], kind: str = "file"
) -> tuple[Path, Path]:
    """A stopped server 0 whose store (of ``kind``) holds a counter that reached 200."""
    done = tmp_path / "done.json"
    args = json.dumps({"n": 200, "done": str(done)})
    service = f"<service class=\"tests.support.agents:durability_setup\" args='{args}'/>"
    config = make_config(extra={0: service}, properties={"aaabus.store": kind})
    storage = tmp_path / "s0"
    proc = ServerProcess(config, 0, storage, cwd=REPO_ROOT).start()
    try:
        proc.wait_ready(30)
        wait_json(done, [proc], 60)
    finally:
        assert proc.stop() == 0
    return config, storage


def _boot(config: Path, storage: Path) -> subprocess.CompletedProcess[str] | None:
    """Start server 0 on ``storage``: the finished process if it refused, None if it booted."""
    proc = ServerProcess(config, 0, storage, cwd=REPO_ROOT).start()
    try:
        proc.wait_ready(30)
    except Exception:
        assert proc.proc is not None
        code = proc.proc.wait(10)
        proc.stop()
        return subprocess.CompletedProcess([], code, "\n".join(proc.lines), "")
    assert proc.stop() == 0
    return None


def _refused_at_boot(config: Path, storage: Path, what: str) -> str:
    """Start server 0 on ``storage``, which must refuse it (``what`` it is, for the message):
    exit status 2 and no traceback. Its last line, the reason."""
    refused = _boot(config, storage)
    assert refused is not None, f"{what}: it booted"
    assert refused.returncode == 2
    assert "Traceback" not in refused.stdout
    return refused.stdout.strip().splitlines()[-1]


def _counter_value(storage: Path, kind: str = "file") -> int:
    from aaabus.core.store import open_store
    from tests.support.agents import Counter

    store = open_store(kind, storage, 0)
    try:
        return next(a.count for a in store.agents.values() if isinstance(a, Counter))
    finally:
        store.close()


def _last_transaction(data: Path) -> tuple[int, bytes]:
    """Position and bytes of the last transaction record of a FileStorage file."""
    raw = data.read_bytes()
    length = int.from_bytes(raw[-8:], "big")
    start = len(raw) - 8 - length
    return start, raw[start:]


def test_store_cut_short_is_refused_at_boot(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config, storage = _counter_store(tmp_path, make_config)
    data = storage / "data.fs"
    size = data.stat().st_size
    os.truncate(data, size - 30)  # the last committed transaction loses its end
    last = _refused_at_boot(config, storage, "a store missing committed bytes")
    assert "is truncated: the committed transaction at byte" in last, last


def test_torn_tail_of_a_crash_is_recovered(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """What SIGKILL in the middle of a commit leaves: a last transaction still marked "c" (in
    progress), possibly incomplete. FileStorage drops it at open (keeping the bytes in
    data.fs.tr0) and the server boots with the last committed state: nothing acknowledged is
    lost, because nothing is acknowledged before the status byte is flipped and fsync'd."""
    config, storage = _counter_store(tmp_path, make_config)
    data = storage / "data.fs"
    _start, last = _last_transaction(data)
    torn = bytearray(last[: len(last) // 2])
    torn[16:17] = b"c"  # the status byte of the copied header: "checkpoint", in progress
    with data.open("ab") as f:
        f.write(torn)
    (storage / "data.fs.index").unlink()  # as after a crash: no index written at close
    assert _boot(config, storage) is None
    assert (storage / "data.fs.tr0").exists()
    assert _counter_value(storage) == 200


def _oid_of(storage: Path, which: str) -> bytes:
    from ZODB.utils import z64

    from aaabus.core.store import open_store
    from tests.support.agents import Counter

    if which == "root":
        return z64  # every boot reads it anyway
    store = open_store("file", storage, 0)
    try:  # an agent: nothing but the boot check reads it before its next notification
        oid: bytes = next(a for a in store.agents.values() if isinstance(a, Counter))._p_oid
        return oid
    finally:
        store.close()


@pytest.mark.parametrize("which", ["root", "agent"])
def test_garbage_over_a_live_record_is_refused_at_boot(
    tmp_path: Path, make_config: Callable[..., Path], which: str
) -> None:
    import ZODB.FileStorage
    from ZODB.FileStorage.format import DATA_HDR_LEN

    config, storage = _counter_store(tmp_path, make_config)
    data = storage / "data.fs"
    oid = _oid_of(storage, which)
    fs = ZODB.FileStorage.FileStorage(str(data), read_only=True)
    try:
        pos = fs._lookup_pos(oid)
    finally:
        fs.close()
    with data.open("r+b") as f:
        f.seek(pos + DATA_HDR_LEN + 4)
        f.write(b"\xde\xad\xbe\xef" * 4)
    last = _refused_at_boot(config, storage, "a store with a garbled live record")
    assert f"storage {data} is damaged: object 0x{int.from_bytes(oid, 'big'):x}" in last, last


def test_garbage_in_an_old_revision_is_harmless(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """Old revisions are never read again (no pack, no undo here): garbage there is not found
    at boot, and does not matter. Documented, not wished for."""
    config, storage = _counter_store(tmp_path, make_config)
    data = storage / "data.fs"
    first_txn_end = 4 + int.from_bytes(data.read_bytes()[12:20], "big") + 8
    with data.open("r+b") as f:
        f.seek(first_txn_end + 60)  # inside the second transaction's data, long superseded
        f.write(b"\x00" * 8)
    assert _boot(config, storage) is None
    assert _counter_value(storage) == 200


def test_check_of_a_copied_store_is_unaffected(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    # A whole copy of a stopped store is a valid backup: the boot checks accept it.
    config, storage = _counter_store(tmp_path, make_config)
    copy = tmp_path / "copy"
    shutil.copytree(storage, copy)
    (copy / "data.fs.lock").unlink(missing_ok=True)
    assert _boot(config, copy) is None
    assert _counter_value(copy) == 200


# -- the same faults on a log store (the default) --------------------------------------------------


def test_damaged_log_block_is_refused_at_boot_naming_segment_and_offset(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config, storage = _counter_store(tmp_path, make_config, "log")
    segments = sorted((storage / "log").glob("*.seg"))
    first = next(p for p in segments if not p.name.startswith("free-"))
    before = first.read_bytes()
    # Inside the body of the first block: acknowledged blocks follow it, so it is damage, not
    # a torn write.
    with first.open("r+b") as f:
        f.seek(64 + 24 + 10)
        f.write(b"\xde\xad")
    last = _refused_at_boot(config, storage, "a log store with a damaged committed block")
    assert f"log store segment {first} is damaged at byte 64:" in last, last
    assert first.read_bytes()[:64] == before[:64], "refused, yet changed"


def test_damaged_log_segment_header_is_refused_at_boot(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config, storage = _counter_store(tmp_path, make_config, "log")
    first = sorted((storage / "log").glob("[0-9a-f]*.seg"))[0]
    with first.open("r+b") as f:
        f.seek(20)
        f.write(b"\xff")
    last = _refused_at_boot(config, storage, "a log store with a damaged segment header")
    assert f"log store segment {first} is damaged at byte 0:" in last, last


def test_copy_of_a_stopped_log_store_boots(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config, storage = _counter_store(tmp_path, make_config, "log")
    copy = tmp_path / "copy"
    shutil.copytree(storage, copy)
    assert _boot(config, copy) is None
    assert _counter_value(copy, "log") == 200


def test_a_store_of_the_other_kind_is_refused_at_boot(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    config, storage = _counter_store(tmp_path, make_config, "file")
    other = config.with_name("log.xml")
    other.write_text(config.read_text().replace('value="file"', 'value="log"'))
    last = _refused_at_boot(other, storage, "a file store opened as an empty log store")
    assert f"storage directory {storage} holds a file store" in last, last
    assert "set property aaabus.store=file to keep using it" in last, last
    assert not (storage / "log").exists()
