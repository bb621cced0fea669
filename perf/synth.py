"""``python -m perf synth``: synthetic timing traces with known growth laws.

The traces have the real schema (:mod:`aaabus.analysis.schema`) and the real layout (``rtt/`` and
``hops/``, one Parquet file per measured point), so ``aaabus analyze`` can be checked against
answers known in advance and timed on a million rows without running a sweep of real servers.

The laws are invented for testing the analysis; they are *not* measurements of aaabus. They are
shaped like the report's findings: a flat bus with full matrix stamps grows as n², domains make the
growth linear with a small slope, a local round trip does not depend on n at all. Every law is
``a·n² + b·n + c`` milliseconds; each rtt row is the law times a mean-one log-normal noise, so the
mean of a point converges on the law. The laws used are written to ``DIR/synth_laws.json``.

Clock costs (``hops/``) follow the matrix size k of the domain (k = n when flat, else the domain
size): full stamps and full clock writes cost k² entries, delta ones about k.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: The report's sweep: 10, 20, ..., 150 servers.
DEFAULT_SERVERS = tuple(range(10, 151, 10))
DOMAIN_SIZE = 10  # servers per domain of the domained topologies
BASE_TS_US = 1_767_225_600_000_000  # 2026-01-01T00:00:00Z: a fixed origin keeps output stable


@dataclass(frozen=True)
class Law:
    """One series and its round-trip law: ``rtt_ms(n) = a·n² + b·n + c``."""

    topology: str
    clock_mode: str
    test: str
    a: float
    b: float
    c: float

    def rtt_ms(self, n: int) -> float:
        return self.a * n * n + self.b * n + self.c

    @property
    def expected(self) -> str:
        """The verdict the analysis should reach on enough rows."""
        if self.a > 0:
            return "quadratic"
        if self.b != 0:
            return "linear" if self.b > 0 else "decreasing"
        return "constant"


def default_laws() -> list[Law]:
    """Four topologies x two clock modes x three tests, shaped like the report's curves."""
    laws: list[Law] = []
    # (b, c) of the domained topologies: a bus crosses more routers, so it has the larger slope.
    remote_dom = {"bus": (0.05, 1.5), "star": (0.02, 1.6), "tree": (0.025, 1.8)}
    bcast_dom = {"bus": (1.2, 6.0), "star": (0.9, 5.0), "tree": (1.0, 5.5)}
    for mode in ("full", "delta"):
        cheap = 0.6 if mode == "delta" else 1.0  # delta stamps shave the per-message cost
        laws.append(Law("flat", mode, "local", 0.0, 0.0, 0.4))
        if mode == "full":
            laws.append(Law("flat", mode, "remote", 0.002, 0.05, 1.0))
            laws.append(Law("flat", mode, "broadcast", 0.06, 0.8, 5.0))
        else:
            laws.append(Law("flat", mode, "remote", 0.0, 0.06, 1.0))
            laws.append(Law("flat", mode, "broadcast", 0.01, 0.8, 5.0))
        for topo in ("bus", "star", "tree"):
            laws.append(Law(topo, mode, "local", 0.0, 0.0, 0.45))
            b, c = remote_dom[topo]
            laws.append(Law(topo, mode, "remote", 0.0, round(b * cheap, 6), c))
            b, c = bcast_dom[topo]
            laws.append(Law(topo, mode, "broadcast", 0.0, round(b * cheap, 6), c))
    return laws


def _hops(topology: str, test: str, n: int) -> int:
    """Network hops one way to the farthest responder, as a sweep of that topology would log."""
    if test == "local":
        return 0
    if topology == "flat":
        return 1
    domains = max(1, math.ceil(n / DOMAIN_SIZE))
    if topology == "bus":
        return domains
    if topology == "star":
        return 2
    return 1 + max(1, math.ceil(math.log(domains, DOMAIN_SIZE)))  # a tree of fan-out 10


def write_traces(
    out: str | Path,
    laws: Sequence[Law],
    servers: Iterable[int],
    rows: int,
    *,
    seed: int = 0,
    noise: float = 0.15,
    hop_ratio: float = 0.5,
    process_mode: str = "inprocess",
) -> dict[str, Any]:
    """Write ``rows`` rtt rows spread evenly over every (law, servers) point; return a summary.

    ``noise`` is the sigma of the log-normal factor on each rtt; ``hop_ratio`` hop rows are written
    per rtt row. Existing ``*.parquet`` files under ``out/rtt`` and ``out/hops`` are replaced.
    """
    # numpy comes with matplotlib and pyspark (both perf dependencies): it is what makes a
    # million rows take a second instead of a minute of per-row Python.
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from aaabus.analysis.schema import HOP_SCHEMA, RTT_SCHEMA, SCHEMA_VERSION

    root = Path(out)
    rtt_dir, hop_dir = root / "rtt", root / "hops"
    for sub in (rtt_dir, hop_dir):
        sub.mkdir(parents=True, exist_ok=True)
        for old in sub.glob("*.parquet"):
            old.unlink()
    rng = np.random.default_rng(seed)
    points = [(law, n) for law in laws for n in sorted(set(servers))]
    if not points:
        raise ValueError("no series or no servers counts to synthesise")
    base, extra = divmod(rows, len(points))
    written = hop_written = 0
    clock_us = BASE_TS_US  # the points are measured one after the other
    series: set[tuple[str, str, str]] = set()

    def run_cols(law: Law, n: int, m: int, ts: Any) -> list[Any]:
        k = n if law.topology == "flat" else DOMAIN_SIZE
        return [
            pa.repeat(pa.scalar(SCHEMA_VERSION, pa.int32()), m),
            pa.repeat(pa.scalar(f"synth-{law.topology}-{n}-{law.clock_mode}-{law.test}"), m),
            pa.array(ts, pa.timestamp("us", tz="UTC")),
            pa.repeat(pa.scalar(law.topology), m),
            pa.repeat(pa.scalar(n, pa.int32()), m),
            pa.repeat(pa.scalar(k, pa.int32()), m),
            pa.repeat(pa.scalar(law.clock_mode), m),
            pa.repeat(pa.scalar(law.test), m),
            pa.repeat(pa.scalar(process_mode), m),
        ]

    for index, (law, n) in enumerate(points):
        m = base + (1 if index < extra else 0)
        if m == 0:
            continue
        series.add((law.topology, law.clock_mode, law.test))
        run_id = f"synth-{law.topology}-{n}-{law.clock_mode}-{law.test}"
        # Mean-one log-normal: exp(N(-s²/2, s)) has expectation 1, so point means follow the law.
        factor = np.exp(rng.normal(-noise * noise / 2, noise, m))
        rtt_ns = np.maximum(1, law.rtt_ms(n) * 1e6 * factor).astype(np.int64)
        start = clock_us
        ts = start + np.cumsum(rtt_ns // 1000 + 50)  # back-to-back rounds, 50 µs apart
        clock_us = int(ts[-1]) + 1_000_000
        table = pa.Table.from_arrays(
            [
                *run_cols(law, n, m, ts),
                pa.array(np.arange(m, dtype=np.int32)),
                pa.repeat(pa.scalar(0, pa.int32()), m),
                pa.array(rtt_ns),
                pa.repeat(pa.scalar(_hops(law.topology, law.test, n), pa.int32()), m),
            ],
            schema=RTT_SCHEMA,
        )
        pq.write_table(table, rtt_dir / f"{run_id}.parquet")
        written += m

        h = max(1, round(m * hop_ratio))
        k = n if law.topology == "flat" else DOMAIN_SIZE
        full = law.clock_mode == "full"
        send = rng.random(h) < 0.5
        group = rng.integers(1, 9, h, dtype=np.int32)  # hops sharing one commit
        # Per message: full clocks persist and stamp the k² matrix; delta ones about one row.
        per_msg_bytes = 8 * k * k + 16 if full else 12 * (k + 2)
        stamp = 8 * k * k + 8 if full else 12 * (2 + k // 10) + 8
        clock_ns = (40 * k * k + 3000 if full else 15 * k + 2000) * rng.uniform(0.9, 1.1, h)
        hop_ts = start + np.sort(rng.integers(0, clock_us - start, h))
        hops = pa.Table.from_arrays(
            [
                *run_cols(law, n, h, hop_ts),
                pa.array(rng.integers(0, n, h, dtype=np.int32)),
                pa.repeat(pa.scalar("D0"), h),
                pa.array(np.where(send, "send", "receive")),
                pa.array(rng.integers(0, n, h, dtype=np.int32)),
                pa.array(np.full(h, stamp, dtype=np.int32), mask=~send),
                pa.array(np.full(h, "deliver", dtype=object), pa.string(), mask=send),
                pa.array(clock_ns.astype(np.int64)),
                pa.array(rng.integers(50_000, 150_000, h, dtype=np.int64)),
                pa.array(group.astype(np.int64) * per_msg_bytes),
                pa.array(group),
            ],
            schema=HOP_SCHEMA,
        )
        pq.write_table(hops, hop_dir / f"{run_id}.parquet")
        hop_written += h

    (root / "synth_laws.json").write_text(
        json.dumps({"seed": seed, "noise": noise, "laws": [asdict(law) for law in laws]}, indent=1)
    )
    return {"rows": written, "hop_rows": hop_written, "out": str(root), "series": len(series)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m perf synth``."""
    parser.add_argument("--rows", type=int, required=True, help="rtt rows to write in total")
    parser.add_argument("--out", required=True, help="traces directory (rtt/ and hops/ inside)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--noise", type=float, default=0.15, help="log-normal sigma of each rtt")
    parser.add_argument("--hop-ratio", type=float, default=0.5, help="hop rows per rtt row")


def run(args: argparse.Namespace) -> int:
    if args.rows < 0:
        raise SystemExit("perf synth: error: --rows must be >= 0")
    t0 = time.monotonic()
    summary = write_traces(
        args.out,
        default_laws(),
        DEFAULT_SERVERS,
        args.rows,
        seed=args.seed,
        noise=args.noise,
        hop_ratio=args.hop_ratio,
    )
    summary["seconds"] = round(time.monotonic() - t0, 3)
    print(json.dumps(summary))
    return 0
