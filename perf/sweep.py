"""``python -m perf sweep``: the report's measurement campaign, flat versus domained.

For every point (topology x servers x clock mode) it generates the configuration, launches the
servers (real processes, or all in this process with ``--inprocess``), runs the ping-pong tests
one after the other on that bus, stops everything, and appends the round trips and the traced
message hops to Parquet datasets under ``--out`` (schema: ``aaabus/analysis/schema.py``).
Finished points are recorded in ``points.jsonl``: an interrupted sweep started again with the
same ``--out`` skips them.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aaabus.analysis.schema import HOP_SCHEMA, RTT_SCHEMA, SCHEMA_VERSION
from aaabus.config.domains import Topology
from aaabus.config.reader import load_config
from aaabus.config.secret import ensure_secret
from aaabus.config.topology import KINDS, generate
from aaabus.core.store import DEFAULT_STORE_KIND, STORE_KINDS
from aaabus.core.trace import read_hops
from aaabus.node.inprocess import InProcessBus
from aaabus.tools.launch import Bus, free_port_base
from perf.harness import REPO_ROOT, with_services
from perf.pingpong import TESTS, responders_for

CLOCK_MODES = ("full", "delta")


@dataclass(frozen=True)
class Point:
    topology: str
    servers: int
    clock_mode: str

    @property
    def key(self) -> str:
        return f"{self.topology}-{self.servers}-{self.clock_mode}"


def _csv(text: str, allowed: tuple[str, ...] | None = None) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if allowed is not None:
        bad = [t for t in items if t not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"unknown value(s) {', '.join(bad)}; expected some of {', '.join(allowed)}"
            )
    return items


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes takes integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError("--sizes needs positive integers")
    return sizes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--topologies",
        type=lambda t: _csv(t, KINDS),
        default=list(KINDS),
        help=f"comma-separated, among {','.join(KINDS)} (default: all)",
    )
    parser.add_argument(
        "--sizes", type=_sizes, default=[10, 20, 30], help="servers per point, e.g. 10,20,30"
    )
    parser.add_argument(
        "--domain-size", type=int, default=10, help="servers per domain (not flat) (default: 10)"
    )
    parser.add_argument(
        "--tests",
        type=lambda t: _csv(t, TESTS),
        default=list(TESTS),
        help=f"comma-separated, among {','.join(TESTS)} (default: all)",
    )
    parser.add_argument(
        "--clock-modes",
        type=lambda t: _csv(t, CLOCK_MODES),
        default=list(CLOCK_MODES),
        help="full: full-matrix stamps, whole clock saved; delta: the bus's best (default: both)",
    )
    parser.add_argument("--rounds", type=int, default=100, help="measured rounds per test")
    parser.add_argument("--warmup", type=int, default=10, help="unmeasured rounds first")
    parser.add_argument("--payload", type=int, default=0, help="padding bytes per notification")
    parser.add_argument("--out", required=True, help="traces directory (resumable)")
    parser.add_argument(
        "--inprocess", action="store_true", help="run each point's servers in this process"
    )
    parser.add_argument(
        "--store",
        choices=list(STORE_KINDS),
        default=None,
        help=f"store kind (default: the bus's, {DEFAULT_STORE_KIND}, for processes; memory "
        "in-process)",
    )
    parser.add_argument(
        "--max-flat",
        type=int,
        default=200,
        help="skip flat points above this size (a flat bus of n servers opens n(n-1)/2 links)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="seconds a point may take (default: 600 + 3 per server)",
    )


def points_of(args: argparse.Namespace) -> list[Point]:
    return [
        Point(topology, size, mode)
        for mode in args.clock_modes
        for topology in args.topologies
        for size in args.sizes
        if not (topology == "flat" and size > args.max_flat)
    ]


def _done_keys(out: Path) -> set[str]:
    path = out / "points.jsonl"
    if not path.exists():
        return set()
    keys = set()
    for line in path.read_text().splitlines():
        if line.strip():
            keys.add(json.loads(line)["key"])
    return keys


def _config_text(point: Point, domain_size: int, base_port: int, props: dict[str, str]) -> str:
    text = generate(
        point.topology,
        point.servers,
        domain_size=domain_size,
        base_port=base_port,
        properties=props,
    )
    if point.clock_mode == "full":
        text = text.replace("<domain name=", '<domain stamps="full" name=')
    return text


def _ports_needed(point: Point, domain_size: int) -> int:
    # An upper bound: every server in at most two domains, the hub of a star in all of them.
    return 2 * point.servers + point.servers // max(1, domain_size - 1) + 2


def run_point(point: Point, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Run every test of one point; return the drivers' results (in test order)."""
    # Always from nothing: the stores of an attempt that failed (or of a sweep that was
    # killed) hold its messages in flight, and the retry's driver would time one of them as
    # a round trip of minutes.
    _cleanup(work)
    for stale in work.glob("result-*.json"):
        stale.unlink()
    work.mkdir(parents=True, exist_ok=True)
    store = args.store or ("memory" if args.inprocess else DEFAULT_STORE_KIND)
    props = {"aaabus.trace": "traces", "aaabus.store": store}
    base = free_port_base(_ports_needed(point, args.domain_size))
    plain = work / "base.xml"
    plain.write_text(_config_text(point, args.domain_size, base, props))
    ensure_secret(work / "bus.key")
    ids = list(range(point.servers))
    specs = [
        {
            "test": test,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "payload": args.payload,
            "responders": responders_for(test, ids),
            "out": str(work / f"result-{test}.json"),
        }
        for test in args.tests
    ]
    first = dict(specs[0], then=specs[1:])
    config = with_services(
        plain, work / "a3.xml", {0: [("perf.agents.pingpong:bench_service", json.dumps(first))]}
    )
    outs = [Path(spec["out"]) for spec in specs]
    deadline = time.monotonic() + (args.timeout or 600.0 + 3.0 * point.servers)
    if args.inprocess:
        with InProcessBus(load_config(config), store_kind=store, storage_root=work / "store"):
            _wait_all(outs, deadline, lambda: None)
    else:
        with Bus(config, ids, work / "store", cwd=REPO_ROOT) as bus:
            _wait_all(outs, deadline, lambda: _check_alive(bus))
    return [json.loads(p.read_text()) for p in outs]


def _check_alive(bus: Bus) -> None:
    for proc in bus.servers.values():
        if not proc.running():
            tail = " | ".join(list(proc.lines)[-3:])
            raise RuntimeError(f"server {proc.server_id} died: {tail}")


def _wait_all(outs: list[Path], deadline: float, check: Any) -> None:
    import threading

    pause = threading.Event()
    while not all(p.exists() for p in outs):
        check()
        if time.monotonic() > deadline:
            missing = [p.name for p in outs if not p.exists()]
            raise TimeoutError(f"point timed out waiting for {', '.join(missing)}")
        pause.wait(0.05)  # results are files written by agents: nothing else to wait on


def _rows(
    point: Point, args: argparse.Namespace, results: list[dict[str, Any]], work: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    topology = Topology.from_config(load_config(work / "a3.xml"))
    now = datetime.now(UTC)
    common = {
        "schema_version": SCHEMA_VERSION,
        "ts": now,
        "topology": point.topology,
        "servers": point.servers,
        "domain_size": point.servers if point.topology == "flat" else args.domain_size,
        "clock_mode": point.clock_mode,
        "process_mode": "inprocess" if args.inprocess else "process",
    }
    rtt_rows: list[dict[str, Any]] = []
    windows: list[tuple[str, int, int, str]] = []
    for result in results:
        test = result["test"]
        run_id = f"{point.key}-{test}"
        hops = max(
            (
                len(topology.route(0, r))
                for r in responders_for(test, list(range(point.servers)))
                if r != 0
            ),
            default=0,
        )
        for i, rtt in enumerate(result["rtts_ns"]):
            rtt_rows.append(
                dict(
                    common,
                    run_id=run_id,
                    test=test,
                    round=i,
                    payload_bytes=args.payload,
                    rtt_ns=int(rtt),
                    hops=hops,
                )
            )
        start, end = result["window_ns"]
        windows.append((test, start, end, run_id))
    hop_rows: list[dict[str, Any]] = []
    for rec in read_hops(work / "traces"):
        for test, start, end, run_id in windows:
            if start <= rec["t_ns"] <= end:
                hop_rows.append(
                    dict(
                        common,
                        run_id=run_id,
                        test=test,
                        server_id=rec["server"],
                        domain=rec["domain"],
                        event=rec["event"],
                        peer=rec["peer"],
                        stamp_bytes=rec.get("stamp_bytes"),
                        verdict=rec.get("verdict"),
                        clock_ns=rec["clock_ns"],
                        commit_ns=rec["commit_ns"],
                        clock_bytes=rec["clock_bytes"],
                        group_hops=rec["group_hops"],
                    )
                )
                break
    return rtt_rows, hop_rows


def _write(
    out: Path, point: Point, rtt_rows: list[dict[str, Any]], hop_rows: list[dict[str, Any]]
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, schema, rows in (("rtt", RTT_SCHEMA, rtt_rows), ("hops", HOP_SCHEMA, hop_rows)):
        if not rows:
            continue
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist(rows, schema=schema)
        tmp = folder / f".{point.key}.parquet.tmp"
        pq.write_table(table, tmp)
        tmp.replace(folder / f"{point.key}.parquet")


def _raise_fd_limit() -> None:
    # Hundreds of servers in one process hold thousands of sockets.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.inprocess:
        _raise_fd_limit()
    points = points_of(args)
    done = _done_keys(out)
    todo = [p for p in points if p.key not in done]
    rows = 0
    failed: list[str] = []
    from tqdm import tqdm

    with tqdm(
        total=len(points),
        initial=len(points) - len(todo),
        unit="point",
        file=sys.stderr,
        dynamic_ncols=True,
    ) as bar:
        for point in todo:
            bar.set_postfix_str(point.key)
            t0 = time.monotonic()
            work = out / "work" / point.key
            try:
                results = run_point(point, args, work)
                rtt_rows, hop_rows = _rows(point, args, results, work)
            except Exception as exc:  # a point that fails must not cost the points after it
                bar.write(
                    f"perf sweep: point {point.key} failed ({type(exc).__name__}: {exc}); "
                    "going on (the same command retries it later)",
                    file=sys.stderr,
                )
                failed.append(point.key)
                _cleanup(work)
                bar.update(1)
                continue
            _write(out, point, rtt_rows, hop_rows)
            rows += len(rtt_rows)
            summary = {
                "key": point.key,
                "seconds": round(time.monotonic() - t0, 1),
                "rtt_rows": len(rtt_rows),
                "hop_rows": len(hop_rows),
                "p50_ms": {r["test"]: r["rtt_ms"]["p50"] for r in results},
            }
            with (out / "points.jsonl").open("a") as f:
                f.write(json.dumps(summary) + "\n")
            _cleanup(work)
            bar.update(1)
    summary = {"points": len(points), "ran": len(todo), "rows": rows, "out": str(out)}
    print(json.dumps({**summary, "failed": failed}))
    return 1 if failed else 0


def _cleanup(work: Path) -> None:
    """Drop a point's stores and traces (they can be large); keep its config and results."""
    import shutil

    shutil.rmtree(work / "store", ignore_errors=True)
    shutil.rmtree(work / "traces", ignore_errors=True)
