"""What ``make demo`` runs: the whole story in a few minutes, on real server processes.

1. ping-pong on flat and domained layouts from ``domains/`` (local, remote, through routers,
   broadcast) and a one-way stream;
2. a small sweep, flat versus star, full versus delta clocks, written as Parquet traces;
3. the Spark analysis of those traces: tables, growth fits and plots in ``out/demo/report``;
4. a summary table and the report's path.

Every server started is stopped, also on failure or Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections.abc import Callable
from typing import Any

from aaabus.analysis import analyze
from aaabus.config import settings
from perf import pingpong, stream, sweep
from perf.harness import REPO_ROOT

DOMAINS = REPO_ROOT / "domains"
OUT = REPO_ROOT / "out" / "demo"


#: How each store kind commits, for the banner.
STORE_COMMITS = {
    "log": "the log store, one write and one fdatasync per commit",
    "file": "FileStorage, fsync'd at every commit",
    "memory": "in memory, nothing durable",
}


def banner() -> str:
    """The demo's first lines: where its figures come from, on the store every server of the
    demo runs (the default of property ``aaabus.store``: its configurations do not set it)."""
    kind = settings.find("aaabus.store").default
    return (
        "aaabus demo: every figure comes from real server processes on this machine, on the\n"
        f"default store (aaabus.store={kind}: {STORE_COMMITS[kind]}). Round trips in ms."
    )


def _row(label: str, result: dict[str, Any]) -> str:
    if "rtt_ms" in result:
        r = result["rtt_ms"]
        return (
            f"{label:<46} {result.get('hops', 0):>4} {r['p50']:>8.3f} {r['p90']:>8.3f} "
            f"{r['p99']:>8.3f} {result['wall_ms_per_round']:>10.3f}"
        )
    return f"{label:<46} {'':>4} {result['msgs_per_s']:>10.0f} notifications/s"


def _suite(module: Any, argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"perf {module.__name__}")
    module.add_arguments(parser)
    code: int = module.run(parser.parse_args(argv))
    return code


def run_demo() -> int:
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        (
            "local ping-pong, flat-1.xml",
            lambda: pingpong.run(DOMAINS / "flat-1.xml", "local", 2000),
        ),
        (
            "remote ping-pong, flat-2.xml",
            lambda: pingpong.run(DOMAINS / "flat-2.xml", "remote", 1000),
        ),
        (
            "remote ping-pong through 2 routers, bus-10.xml",
            lambda: pingpong.run(DOMAINS / "bus-10.xml", "remote", 300, warmup=20),
        ),
        (
            "broadcast to 13 servers, tree-13.xml",
            lambda: pingpong.run(DOMAINS / "tree-13.xml", "broadcast", 100, warmup=10),
        ),
        ("stream s0 -> s1, flat-2.xml", lambda: stream.run(DOMAINS / "flat-2.xml", 20000)),
    ]
    print(banner() + "\n", flush=True)
    lines = []
    results: dict[str, Any] = {}
    for label, step in steps:
        t0 = time.monotonic()
        print(f"... {label}", flush=True)
        result = step()
        result.pop("rtts_ns", None)
        result.pop("window_ns", None)
        results[label] = result
        lines.append(_row(label, result))
        print(f"    done in {time.monotonic() - t0:.1f} s", flush=True)

    traces = OUT / "traces"
    report = OUT / "report"
    shutil.rmtree(OUT, ignore_errors=True)
    print("... sweep: flat vs star, 3 to 9 servers, full vs delta clocks", flush=True)
    t0 = time.monotonic()
    sweep_argv = [
        "--topologies", "flat,star", "--sizes", "3,6,9", "--domain-size", "3",
        "--tests", "remote,broadcast", "--clock-modes", "full,delta",
        "--rounds", "30", "--warmup", "5", "--out", str(traces),
    ]  # fmt: skip
    if _suite(sweep, sweep_argv) != 0:
        return 1
    print(f"    done in {time.monotonic() - t0:.1f} s", flush=True)
    print("... Spark analysis of the sweep's traces", flush=True)
    t0 = time.monotonic()
    if _suite(analyze, [str(traces), "--out", str(report), "--master", "local[2]"]) != 0:
        return 1
    print(f"    done in {time.monotonic() - t0:.1f} s", flush=True)

    print()
    print(f"{'measurement':<46} {'hops':>4} {'p50':>8} {'p90':>8} {'p99':>8} {'wall/round':>10}")
    print("\n".join(lines))
    print(f"\nSweep points: {traces / 'points.jsonl'}")
    print(f"Report: {report / 'report.md'}")
    print(json.dumps({"demo": results, "report": str(report / "report.md")}))
    return 0
