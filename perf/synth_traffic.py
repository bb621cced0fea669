"""``python -m perf synth-traffic``: synthetic traffic traces with a known group structure.

The rows have the real schema (:data:`aaabus.analysis.schema.TRAFFIC_SCHEMA`) and the real layout
(``OUT/traffic/*.parquet``), so ``aaabus plan`` can be checked against a structure known in
advance and timed on millions of rows without running a bus.

The structure: ``--servers`` servers are dealt into ``--groups`` groups of near-equal sizes, in
an order shuffled by the seed (group members are not consecutive ids, so a planner cannot
succeed by following the ids). Each row is one (window, src, dst) count: ``src`` uniform over the
servers; with probability ``--inside``, ``dst`` is another member of src's group, otherwise a
server of another group (uniform over the other groups, then over their members). ``notes`` is
1 + Poisson(``--mean-notes`` - 1) and independent of the rest, so about ``--inside`` of the
notifications stay inside a group; ``bytes`` is notes x a per-row message size drawn from
64..4,096 bytes. Rows are spread evenly over consecutive windows. A pair may appear more than
once in a window (as if two batches of a recorder had been written), which sums the same.

The groups are written to ``OUT/synth_groups.json`` (``{"groups": [[ids...], ...], ...}``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

#: Rows per file and per row group: several files and row groups, as many servers would write.
FILE_ROWS = 1_000_000
ROW_GROUP_ROWS = 250_000
BASE_WINDOW_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z: a fixed origin keeps output stable


def groups_of(servers: int, groups: int, seed: int) -> list[list[int]]:
    """The known structure: ``servers`` ids dealt into ``groups`` groups, sorted ids in each."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(servers)
    return [sorted(int(s) for s in part) for part in np.array_split(order, groups)]


def write_traffic(
    out: str | Path,
    rows: int,
    *,
    servers: int = 60,
    groups: int = 6,
    inside: float = 0.9,
    seed: int = 0,
    window_ms: int = 10_000,
    rows_per_window: int = 5_000,
    mean_notes: float = 20.0,
) -> dict[str, Any]:
    """Write ``rows`` traffic rows under ``out/traffic/``; return a summary.

    Existing ``*.parquet`` files under ``out/traffic`` are replaced. Raises ValueError on
    arguments that cannot give the structure asked for.
    """
    # numpy (a pyspark and matplotlib dependency) draws whole columns at once: ten million rows
    # in seconds rather than minutes of per-row Python.
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from aaabus.analysis.schema import TRAFFIC_SCHEMA

    if rows < 0 or window_ms < 1 or rows_per_window < 1 or mean_notes < 1:
        raise ValueError("--rows must be >= 0, window and notes sizes >= 1")
    if groups < 1 or servers < 2 * groups:
        raise ValueError(
            f"{servers} servers in {groups} groups: every group needs 2 servers or more "
            "(ask for at least twice as many servers as groups)"
        )
    if not 0.0 <= inside <= 1.0 or (groups == 1 and inside < 1.0):
        raise ValueError(
            f"--inside {inside}: a fraction in 0..1, and 1 when there is a single group"
        )
    members = groups_of(servers, groups, seed)
    sizes = np.array([len(group) for group in members])
    table = np.full((groups, int(sizes.max())), -1, dtype=np.int32)  # members, padded
    for g, group in enumerate(members):
        table[g, : len(group)] = group
    group_of = np.empty(servers, dtype=np.int64)
    rank_of = np.empty(servers, dtype=np.int64)  # position of a server in its group
    for g, group in enumerate(members):
        group_of[group] = g
        rank_of[group] = np.arange(len(group))

    root = Path(out)
    traffic_dir = root / "traffic"
    traffic_dir.mkdir(parents=True, exist_ok=True)
    for old in traffic_dir.glob("*.parquet"):
        old.unlink()
    rng = np.random.default_rng(seed + 1)
    inside_notes = total_notes = 0
    files = 0
    for first in range(0, rows, FILE_ROWS):
        m = min(FILE_ROWS, rows - first)
        src = rng.integers(0, servers, m)
        grp = group_of[src]
        stay = rng.random(m) < inside
        # Inside: another member of the group (skip src's own rank).
        pick = rng.integers(0, sizes[grp] - 1)
        pick += pick >= rank_of[src]
        dst = table[grp, pick]
        # Outside: another group (offset 1..groups-1), then one of its members.
        if groups > 1:
            other = (grp + rng.integers(1, groups, m)) % groups
            far = table[other, rng.integers(0, sizes[other])]
            dst = np.where(stay, dst, far)
        notes = 1 + rng.poisson(mean_notes - 1, m)
        size = rng.integers(64, 4097, m)
        window = BASE_WINDOW_MS + (first + np.arange(m)) // rows_per_window * window_ms
        batch = pa.Table.from_arrays(
            [
                pa.array(window, pa.int64()),
                pa.repeat(pa.scalar(window_ms, pa.int32()), m),
                pa.array(src.astype(np.int32)),
                pa.array(dst.astype(np.int32)),
                pa.array(notes.astype(np.int64)),
                pa.array((notes * size).astype(np.int64)),
            ],
            schema=TRAFFIC_SCHEMA,
        )
        pq.write_table(
            batch, traffic_dir / f"part-{files:05d}.parquet", row_group_size=ROW_GROUP_ROWS
        )
        files += 1
        total_notes += int(notes.sum())
        inside_notes += int(notes[group_of[dst] == grp].sum())
    (root / "synth_groups.json").write_text(
        json.dumps(
            {"seed": seed, "servers": servers, "inside": inside, "groups": members}, indent=1
        )
    )
    return {
        "rows": rows,
        "files": files,
        "notes": total_notes,
        "inside_share": round(inside_notes / total_notes, 4) if total_notes else None,
        "out": str(root),
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``python -m perf synth-traffic``."""
    parser.add_argument("--rows", type=int, required=True, help="traffic rows to write")
    parser.add_argument("--out", required=True, help="traces directory (traffic/ inside)")
    parser.add_argument("--servers", type=int, default=60, help="servers (default 60)")
    parser.add_argument("--groups", type=int, default=6, help="groups of servers (default 6)")
    parser.add_argument(
        "--inside", type=float, default=0.9, help="share of traffic inside a group (default 0.9)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window-ms", type=int, default=10_000, help="window length (ms)")
    parser.add_argument(
        "--rows-per-window", type=int, default=5_000, help="rows in each window (default 5000)"
    )
    parser.add_argument(
        "--mean-notes", type=float, default=20.0, help="mean notifications per row (default 20)"
    )


def run(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    try:
        summary = write_traffic(
            args.out,
            args.rows,
            servers=args.servers,
            groups=args.groups,
            inside=args.inside,
            seed=args.seed,
            window_ms=args.window_ms,
            rows_per_window=args.rows_per_window,
            mean_notes=args.mean_notes,
        )
    except (ValueError, OSError) as exc:  # bad sizes, or OUT cannot be written
        print(f"perf synth-traffic: error: {exc}", file=sys.stderr)
        return 2
    summary["seconds"] = round(time.monotonic() - t0, 3)
    print(json.dumps(summary))
    return 0
