"""``python -m perf commit``: what one store commit costs, against the disk's floor, in ONE run.

Contenders, measured in interleaved rounds (each round runs every contender once, in an order
that rotates, so that the machine's mood weighs on all alike):

* ``floor``: the raw floor, one ~600-byte ``os.pwrite`` and one ``os.fdatasync`` per iteration
  appended to a preallocated, zero-filled file;
* ``floor_falloc``: the same into an ``fallocate``'d file (why the log store zero-fills);
* ``mem``: a ZODB commit on a MappingStorage (no disk): ZODB's own share of every commit;
* ``zodb_floor``: a ``mem`` commit followed by a ``floor`` write and sync: the best any ZODB
  storage with one sync per commit could do (ZODB's work also runs slower when it resumes
  after each sync than in the ``mem`` loop: caches and CPU have cooled meanwhile);
* ``file``: a ZODB commit on FileStorage (``aaabus.store=file``);
* ``log``: a ZODB commit on LogStorage (the default store);
* ``journal``: a hop as the bus commits it now on the log store (the default): a ~300-byte
  frame put in a link's outgoing queue, the previous one acknowledged, the clock counting the
  send, all as side records of the journal (:mod:`aaabus.core.journal`), ZODB taking no part:
  the commit of a hop whose agent's state did not change (a reply, a relay, a router);
* ``journal_agent``: the same with an agent whose counter moves, in ZODB, in the same block;
* ``file_storage`` and ``log_storage``: the same records committed through each storage's own
  two-phase commit (``tpc_begin``, two ``store``, ``tpc_vote``, ``tpc_finish``), already pickled:
  what the storage itself costs, without ZODB's connection (pickling, object bookkeeping),
  which is the same whatever the storage.

Every ZODB contender commits what one bus hop commits: a persistent agent whose counter moves,
and a queue (the bus's ``PersistentQueue``, one BTree bucket) that gets one ~300-byte message
put and the previous one popped.

``--stream N`` adds a compaction run: N more such commits on two LogStorages with small
segments, in alternating chunks, one with its compactor running and one with it off: the worst
and the p99.9 commit latencies of both, and of the commits that ran beside a compaction round
or GC pass (CPython's cyclic collector runs between chunks, not during them), the directory's
peak size and its size at the end.

Prints a table, then one JSON line (``--json``: only that line) with at least ``floor_p50_us``,
``file_p50_us``, ``log_p50_us``, ``log_vs_floor``, ``file_vs_floor``, ``journal_vs_floor`` and
``journal_agent_vs_floor``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import transaction
import ZODB
import ZODB.FileStorage
from persistent import Persistent
from ZODB.Connection import TransactionMetaData
from ZODB.utils import p64, z64

from aaabus.core.logstorage import LogStorage
from aaabus.core.logstorage.segments import zero_fill
from aaabus.core.store import PersistentQueue, open_store

RECORD_BYTES = 600
MESSAGE = b"m" * 300
CONTENDERS = (
    "floor",
    "floor_falloc",
    "mem",
    "zodb_floor",
    "file",
    "log",
    "file_storage",
    "log_storage",
    "journal",
    "journal_agent",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add this suite's options to its sub-command parser."""
    parser.add_argument("--rounds", type=int, default=20, help="interleaved rounds")
    parser.add_argument("--per-round", type=int, default=250, help="commits per contender/round")
    parser.add_argument("--warmup", type=int, default=50, help="unmeasured commits per contender")
    parser.add_argument(
        "--stream", type=int, default=0, help="commits of the compaction run (0: no such run)"
    )
    parser.add_argument(
        "--stream-segment", type=int, default=256 << 10, help="segment size of the stream run"
    )
    parser.add_argument(
        "--stream-compare",
        type=int,
        default=20_000,
        help="commits of the stream run that the compactor-off store takes part in",
    )
    parser.add_argument("--workdir", help="keep the files here (default: a temporary dir)")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")


class Agent(Persistent):
    """Stands for a bus agent: a few attributes, one of which moves at every reaction."""

    def __init__(self) -> None:
        self.count = 0
        self.name = "agent-0"
        self.state = b"s" * 150


class Hop:
    """One ZODB database committing bus hops, on a connection of its own."""

    def __init__(self, storage: Any) -> None:
        self.db = ZODB.DB(storage, cache_size=10_000)
        self.tm = transaction.TransactionManager()
        self.conn = self.db.open(transaction_manager=self.tm)
        root = self.conn.root()
        root["agent"] = Agent()
        root["queue"] = PersistentQueue()
        self.tm.commit()
        self.agent: Agent = root["agent"]
        self.queue: PersistentQueue = root["queue"]
        self.queue.put(MESSAGE)
        self.tm.commit()

    def __call__(self) -> None:
        self.agent.count += 1
        self.queue.put(MESSAGE)
        self.queue.pop()
        self.tm.commit()

    def close(self) -> None:
        self.tm.abort()
        self.conn.close()
        self.db.close()


class StorageCommit:
    """The records of one hop (agent and queue, as a :class:`Hop` pickles them) committed
    through the storage's own two-phase commit, without a ZODB connection."""

    def __init__(self, storage: Any) -> None:
        self.storage = storage
        # The pickles of a hop, and the root that keeps them reachable (the log store's
        # collector drops unreachable records): taken from a hop on a MappingStorage.
        model = Hop(None)
        model()
        source = model.db.storage
        self.records = {oid: source.load(oid)[0] for oid in (p64(0), p64(1), p64(2))}
        model.close()
        self.serials = dict.fromkeys(self.records, z64)
        self._commit(list(self.records))
        self.moving = [p64(1), p64(2)]

    def _commit(self, oids: list[bytes]) -> None:
        storage = self.storage
        txn = TransactionMetaData()
        storage.tpc_begin(txn)
        for oid in oids:
            storage.store(oid, self.serials[oid], self.records[oid], "", txn)
        storage.tpc_vote(txn)
        tid = storage.tpc_finish(txn)
        for oid in oids:
            self.serials[oid] = tid

    def __call__(self) -> None:
        self._commit(self.moving)

    def close(self) -> None:
        self.storage.close()


class JournalHop:
    """A hop through the bus's own store (a log store with its journal): the link's frame
    queued, the one before it acknowledged, a clock page changed; with ``agent``, an agent whose
    counter moves too."""

    def __init__(self, directory: Path, agent: bool) -> None:
        self.store = open_store("log", directory, 0)
        links = self.store.links
        self.clock = links.new_clock("D", 2, 0, "delta", "causal")
        self.out = links.outgoing(1, "D")
        self.agent: Agent | None = None
        if agent:
            self.agent = self.store.agents[(0, 1)] = Agent()
        self.store.commit()

    def __call__(self) -> None:
        # The stamp itself is the reaction's work, not the commit's: what the commit sees of it
        # is the changed page of the clock.
        page = self.clock._pages[0]
        seq = page.d[1] + 1
        page.d[1] = seq
        page._p_changed = True
        self.out[seq] = MESSAGE
        self.out.pop_through(seq - 1)
        if self.agent is not None:
            self.agent.count += 1
        self.store.commit()

    def close(self) -> None:
        self.store.close()


class Floor:
    """One pwrite + fdatasync per call, appended to a preallocated file (wrapping around)."""

    def __init__(self, path: Path, size: int, fallocate: bool) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        if fallocate:
            os.posix_fallocate(self.fd, 0, size)
            os.fsync(self.fd)
        else:
            zero_fill(self.fd, size)
        self.size = size
        self.offset = 0
        self.buf = os.urandom(RECORD_BYTES)

    def __call__(self) -> None:
        if self.offset + RECORD_BYTES > self.size:
            self.offset = 0
        os.pwrite(self.fd, self.buf, self.offset)
        os.fdatasync(self.fd)
        self.offset += RECORD_BYTES

    def close(self) -> None:
        os.close(self.fd)


class ZodbThenFloor:
    """A commit on a MappingStorage, then the floor's write and sync."""

    def __init__(self, hop: Hop, floor: Floor) -> None:
        self.hop = hop
        self.floor = floor

    def __call__(self) -> None:
        self.hop()
        self.floor()

    def close(self) -> None:
        self.hop.close()
        self.floor.close()


def _percentile(sorted_ns: list[int], q: float) -> float:
    index = min(len(sorted_ns) - 1, int(q * len(sorted_ns)))
    return sorted_ns[index] / 1000.0


def _summary(samples: list[int]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50": _percentile(ordered, 0.50),
        "p90": _percentile(ordered, 0.90),
        "p99": _percentile(ordered, 0.99),
        "p999": _percentile(ordered, 0.999),
        "max": ordered[-1] / 1000.0,
        "mean": sum(ordered) / len(ordered) / 1000.0,
    }


def _timed(step: Callable[[], None], count: int, into: list[int]) -> None:
    clock = time.perf_counter_ns
    for _ in range(count):
        started = clock()
        step()
        into.append(clock() - started)


def _dir_bytes(path: Path) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())


def measure(root: Path, rounds: int, per_round: int, warmup: int) -> dict[str, dict[str, float]]:
    """The interleaved rounds: latency figures (µs) per contender."""
    floor_size = max(64 << 20, (rounds * per_round + warmup) * RECORD_BYTES * 2)
    floor_size = min(floor_size, 1 << 30)
    steps: dict[str, Any] = {
        "floor": Floor(root / "floor.bin", floor_size, fallocate=False),
        "floor_falloc": Floor(root / "floor-falloc.bin", floor_size, fallocate=True),
        "mem": Hop(None),
        "zodb_floor": ZodbThenFloor(Hop(None), Floor(root / "floor2.bin", floor_size, False)),
        "file": Hop(ZODB.FileStorage.FileStorage(str(root / "data.fs"))),
        "log": Hop(LogStorage(root / "log")),
        "file_storage": StorageCommit(ZODB.FileStorage.FileStorage(str(root / "raw.fs"))),
        "log_storage": StorageCommit(LogStorage(root / "rawlog")),
        "journal": JournalHop(root / "journal", agent=False),
        "journal_agent": JournalHop(root / "journal-agent", agent=True),
    }
    samples: dict[str, list[int]] = {name: [] for name in CONTENDERS}
    try:
        for name in CONTENDERS:
            _timed(steps[name], warmup, [])
        for index in range(rounds):
            shift = index % len(CONTENDERS)
            for name in CONTENDERS[shift:] + CONTENDERS[:shift]:
                _timed(steps[name], per_round, samples[name])
    finally:
        for step in steps.values():
            step.close()
    return {name: _summary(values) for name, values in samples.items()}


def stream(root: Path, count: int, segment_size: int, compare: int) -> dict[str, Any]:
    """The compaction run: the same hops on two small-segment LogStorages, compactor on and off,
    in alternating chunks (the one without compactor, whose directory only grows, stops after
    ``compare`` commits); every 100 commits also drops a BTree and adds a new one (garbage
    that only GC can find)."""
    stores = {
        "on": LogStorage(root / "stream-on", segment_size=segment_size),
        "off": LogStorage(root / "stream-off", segment_size=segment_size, compact=False),
    }
    hops = {name: Hop(storage) for name, storage in stores.items()}
    # CPython's cyclic collector pauses any commit for 20+ ms now and then, whatever the store:
    # it runs between chunks here, untimed, so that the worst latencies are the store's.
    gc.disable()
    samples: dict[str, list[int]] = {"on": [], "off": [], "beside": []}
    peak = 0
    chunk = 500
    done = 0
    try:
        while done < count:
            for name, hop in hops.items():
                if name == "off" and done >= compare:
                    continue
                n = min(chunk, count - done)
                storage = stores[name]
                for i in range(n):
                    if (done + i) % 100 == 0:
                        _churn(hop)
                    busy = storage.compacting
                    _timed(hop, 1, samples[name])
                    if busy or storage.compacting:
                        samples["beside"].append(samples[name][-1])
            done += min(chunk, count - done)
            peak = max(peak, _dir_bytes(root / "stream-on"))
            gc.collect()
        stats = stores["on"].stats()
        result = {
            "commits": count,
            "compared_commits": min(count, compare),
            "segment_size": segment_size,
            "on": _summary(samples["on"]),
            "off": _summary(samples["off"]),
            "beside_compaction": {
                "commits": len(samples["beside"]),
                **(_summary(samples["beside"]) if samples["beside"] else {}),
            },
            "peak_dir_bytes": peak,
            "end_dir_bytes": _dir_bytes(root / "stream-on"),
            "off_dir_bytes": _dir_bytes(root / "stream-off"),
            "live_bytes": stats["live_bytes"],
            "compactions": stats["compactions"],
            "gc_passes": stats["gc_passes"],
        }
    finally:
        gc.enable()
        for hop in hops.values():
            hop.close()
    return result


def _churn(hop: Hop) -> None:
    root = hop.conn.root()
    root.pop("scratch", None)
    scratch = PersistentQueue()
    scratch.put(MESSAGE)
    root["scratch"] = scratch


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="aaabus-commit-") as tmp:
        root = Path(args.workdir) if args.workdir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        figures = measure(root, args.rounds, args.per_round, args.warmup)
        streamed = None
        if args.stream:
            streamed = stream(root, args.stream, args.stream_segment, args.stream_compare)
    floor = figures["floor"]["p50"]
    result: dict[str, Any] = {
        "rounds": args.rounds,
        "per_round": args.per_round,
        "record_bytes": RECORD_BYTES,
    }
    for name, summary in figures.items():
        for key in ("p50", "p90", "p99", "max"):
            result[f"{name}_{key}_us"] = round(summary[key], 1)
    result["log_vs_floor"] = round(figures["log"]["p50"] / floor, 3)
    result["journal_vs_floor"] = round(figures["journal"]["p50"] / floor, 3)
    result["journal_agent_vs_floor"] = round(figures["journal_agent"]["p50"] / floor, 3)
    result["file_vs_floor"] = round(figures["file"]["p50"] / floor, 3)
    result["falloc_vs_floor"] = round(figures["floor_falloc"]["p50"] / floor, 3)
    result["log_storage_vs_floor"] = round(figures["log_storage"]["p50"] / floor, 3)
    result["file_storage_vs_floor"] = round(figures["file_storage"]["p50"] / floor, 3)
    result["log_vs_zodb_floor"] = round(figures["log"]["p50"] / figures["zodb_floor"]["p50"], 3)
    result["log_own_p50_us"] = round(figures["log"]["p50"] - figures["zodb_floor"]["p50"], 1)
    if streamed is not None:
        result["stream"] = streamed
    if not args.json:
        _print_table(figures, result, streamed)
    print(json.dumps(result), flush=True)
    return 0


def _print_table(
    figures: dict[str, dict[str, float]], result: dict[str, Any], streamed: dict[str, Any] | None
) -> None:
    floor = figures["floor"]["p50"]
    heads = ("p50 µs", "p90 µs", "p99 µs", "max µs")
    print(f"{'contender':<13} " + " ".join(f"{h:>9}" for h in heads) + f" {'p50/floor':>10}")
    for name, summary in figures.items():
        print(
            f"{name:<13} {summary['p50']:9.1f} {summary['p90']:9.1f} {summary['p99']:9.1f} "
            f"{summary['max']:9.1f} {summary['p50'] / floor:10.2f}"
        )
    zodb = figures["zodb_floor"]["p50"] - floor
    print(
        f"log p50 {figures['log']['p50']:.1f} µs = floor {floor:.1f} + ZODB {zodb:.1f} "
        f"(hot, in a loop of its own: {figures['mem']['p50']:.1f}) "
        f"+ the log store's own {result['log_own_p50_us']:.1f}"
    )
    if streamed is not None:
        on, off, beside = streamed["on"], streamed["off"], streamed["beside_compaction"]
        if beside["commits"]:
            print(
                f"commits beside a compaction round or GC pass: {beside['commits']}, "
                f"p99 {beside['p99']:.0f} µs, max {beside['max']:.0f} µs"
            )
        print(
            f"stream of {streamed['commits']} commits "
            f"({streamed['compared_commits']} without compactor), "
            f"{streamed['segment_size'] >> 10} KiB segments: "
            f"compactor on p99.9 {on['p999']:.0f} µs max {on['max']:.0f} µs; "
            f"off p99.9 {off['p999']:.0f} µs max {off['max']:.0f} µs; "
            f"directory peak {streamed['peak_dir_bytes'] >> 10} KiB, "
            f"end {streamed['end_dir_bytes'] >> 10} KiB "
            f"(without compaction {streamed['off_dir_bytes'] >> 10} KiB); "
            f"{streamed['compactions']} compactions, {streamed['gc_passes']} GC passes"
        )
