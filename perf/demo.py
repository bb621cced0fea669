"""What ``make demo`` runs: real server processes from ``domains/``, ping-pong and stream, and a
summary table. Every server started is stopped, also on failure or Ctrl-C."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from perf import pingpong, stream
from perf.harness import REPO_ROOT

DOMAINS = REPO_ROOT / "domains"


def _row(label: str, result: dict[str, Any]) -> str:
    if "rtt_ms" in result:
        r = result["rtt_ms"]
        return (
            f"{label:<44} {r['p50']:>8.3f} {r['p90']:>8.3f} {r['p99']:>8.3f} "
            f"{result['wall_ms_per_round']:>10.3f}"
        )
    return f"{label:<44} {result['msgs_per_s']:>10.0f} notifications/s"


def run_demo() -> int:
    steps: list[tuple[str, Callable[[], dict[str, Any]]]] = [
        (
            "local ping-pong, 1 server (flat-1.xml)",
            lambda: pingpong.run(DOMAINS / "flat-1.xml", "local", 2000),
        ),
        (
            "remote ping-pong, 2 servers (flat-2.xml)",
            lambda: pingpong.run(DOMAINS / "flat-2.xml", "remote", 1000),
        ),
        (
            "remote ping-pong via routers (star-30.xml)",
            lambda: pingpong.run(DOMAINS / "star-30.xml", "remote", 300, warmup=20),
        ),
        (
            "stream s0 -> s1 (flat-2.xml)",
            lambda: stream.run(DOMAINS / "flat-2.xml", 20000),
        ),
    ]
    print("aaabus demo: every figure below comes from real server processes on this machine,")
    print("FileStorage stores fsync'd at every commit. Round trips in ms.\n")
    header = f"{'measurement':<44} {'p50':>8} {'p90':>8} {'p99':>8} {'wall/round':>10}"
    results: dict[str, Any] = {}
    lines = []
    for label, step in steps:
        t0 = time.monotonic()
        print(f"... {label}", flush=True)
        result = step()
        result.pop("rtts_ns", None)
        results[label] = result
        lines.append(_row(label, result))
        print(f"    done in {time.monotonic() - t0:.1f} s", flush=True)
    print()
    print(header)
    print("\n".join(lines))
    print(json.dumps({"demo": results}))
    return 0
