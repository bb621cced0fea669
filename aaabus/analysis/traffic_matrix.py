"""The server-to-server traffic matrix of a traces directory, aggregated by Spark.

Two kinds of traces give traffic:

* ``TRACES/traffic/``: rows of :data:`aaabus.analysis.schema.TRAFFIC_SCHEMA` (live
  servers' :class:`aaabus.core.traffic.TrafficRecorder`, or ``perf synth-traffic``): end-to-end
  counts.
* ``TRACES/hops/``: the perf suites' hop traces (:data:`aaabus.analysis.schema.HOP_SCHEMA`);
  each ``send`` row is one notification from ``server_id`` to ``peer`` and its ``bytes`` are
  the stamp's. A hop is one leg: through routers, these are counts per leg, not end to end (the
  same on a flat bus). Hop traces of a whole sweep mix runs whose server ids mean different
  servers.

``traffic/`` is used when it holds Parquet files, ``hops/`` otherwise. Only the aggregate (one
row per (src, dst) pair) comes back to the driver, whatever the volume of the traces.

Stages (all on the caller's thread): :func:`validate` checks the footers with pyarrow before any
JVM starts (same rules and messages as ``aaabus analyze``); :func:`aggregate` runs one Spark
aggregation and checks what pyarrow could not (nulls, negative counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from aaabus.analysis.sparkjob import (
    check_footer,
    open_traces,
    parquet_files,
    read_dataset,
    spark_errors,
    spark_location,
)
from aaabus.errors import TraceError

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

KINDS = ("traffic", "hops")
#: The planner's matrices are dense (servers x servers float64): 200 MB each at this size.
MAX_SERVERS = 5_000


@dataclass
class Source:
    """What :func:`validate` found: the dataset to read (None: let Spark find out), its files
    and rows (None: not visible to the driver)."""

    kind: str | None
    files: int | None = None
    rows: int | None = None
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class TrafficMatrix:
    """``notes[i, j]`` and ``nbytes[i, j]``: sent from server ``ids[i]`` to ``ids[j]``."""

    kind: str
    ids: list[int]
    notes: npt.NDArray[np.float64]
    nbytes: npt.NDArray[np.float64]
    rows: int
    first_ms: int | None  # the traced time span, epoch ms
    last_ms: int | None


def _schema(kind: str) -> pa.Schema:
    from aaabus.analysis.schema import HOP_SCHEMA, TRAFFIC_SCHEMA

    return TRAFFIC_SCHEMA if kind == "traffic" else HOP_SCHEMA


def validate(location: str, master: str) -> Source:
    """Find the traffic dataset under ``location`` and check its footers; TraceError if bad."""
    opened = open_traces(location, master, "traffic/ or hops/")
    if isinstance(opened, str):
        return Source(None, notes=[opened])
    fs, root = opened
    for kind in KINDS:
        files = parquet_files(fs, root.rstrip("/") + "/" + kind)
        if not files:
            continue
        rows = sum(check_footer(fs, f, kind, _schema(kind)) for f in files)
        if rows == 0:
            raise TraceError(
                f"no traffic: the {len(files)} file(s) under {location}/{kind} are empty"
            )
        return Source(kind, len(files), rows)
    raise TraceError(
        f"no traffic traces under {location}: it holds no traffic/ (or hops/) Parquet files; "
        "record some (property aaabus.traffic) or, in a checkout of aaabus, write synthetic "
        "ones (python -m perf synth-traffic)"
    )


def _pairs(frame: DataFrame, kind: str) -> DataFrame:
    """The rows as (window_start, window_end, src, dst, notes, bytes)."""
    from pyspark.sql import functions as F

    if kind == "traffic":
        return frame.select(
            F.col("window_start"),
            (F.col("window_start") + F.col("window_ms")).alias("window_end"),
            "src",
            "dst",
            "notes",
            "bytes",
        )
    sends = frame.where(F.col("event") == "send")
    ms = F.unix_millis(F.col("ts"))
    return sends.select(
        ms.alias("window_start"),
        ms.alias("window_end"),
        F.col("server_id").alias("src"),
        F.col("peer").alias("dst"),
        F.lit(1).cast("bigint").alias("notes"),
        F.coalesce(F.col("stamp_bytes").cast("bigint"), F.lit(0).cast("bigint")).alias("bytes"),
    )


def aggregate(
    spark: SparkSession,
    traces: str,
    source: Source,
    log_path: Path | None,
    extra_ids: list[int] | None = None,
) -> TrafficMatrix:
    """Sum notifications and bytes per (src, dst) over every row; return the dense matrix over
    the servers seen (and ``extra_ids``). One Spark job; the driver receives one row per pair."""
    import numpy as np
    import pyarrow.compute as pc
    from pyspark.sql import functions as F

    location = spark_location(traces, spark)
    found: tuple[str, DataFrame] | None = None
    with spark_errors(f"cannot read the traces under {traces}", log_path):
        for candidate in [source.kind] if source.kind else list(KINDS):
            frame = read_dataset(spark, location, candidate, _schema(candidate))
            if frame is not None:
                found = (candidate, frame)
                break
    if found is None:
        raise TraceError(f"no traffic traces under {traces}: no traffic/ or hops/ directory")
    kind, frame = found
    with spark_errors(f"aggregation of {traces} failed", log_path):
        pairs = (
            _pairs(frame, kind)
            .groupBy("src", "dst")
            .agg(
                F.sum("notes").alias("notes"),
                F.sum("bytes").alias("bytes"),
                F.count(F.lit(1)).alias("rows"),
                F.count_if(F.col("notes").isNull() | F.col("bytes").isNull()).alias("nulls"),
                F.min("notes").alias("min_notes"),
                F.min("window_start").alias("first_ms"),
                F.max("window_end").alias("last_ms"),
            )
        )
        table = pairs.toArrow()
    rows = pc.sum(table["rows"]).as_py() or 0
    if rows == 0:
        raise TraceError(f"no traffic rows under {traces}/{kind}")
    # Null keys group together: their rows are counted like the null counts.
    null_keys = pc.or_(pc.is_null(table["src"]), pc.is_null(table["dst"]))
    nulls = (pc.sum(pc.filter(table["rows"], null_keys)).as_py() or 0) + (
        pc.sum(table["nulls"]).as_py() or 0
    )
    if nulls:
        raise TraceError(
            f"{traces}/{kind}: {nulls} row(s) with required columns missing or null "
            "(src, dst, notes, bytes): not traffic traces of this schema"
        )
    src_ids = table["src"].to_numpy()
    dst_ids = table["dst"].to_numpy()
    bad = (table["min_notes"].to_numpy() < 0) | (src_ids < 0) | (dst_ids < 0)
    if bad.any():
        at = int(np.argmax(bad))
        raise TraceError(
            f"{traces}/{kind}: negative server id or count (src {src_ids[at]}, dst "
            f"{dst_ids[at]}): corrupted traces"
        )
    ids = np.unique(np.concatenate([src_ids, dst_ids, np.array(extra_ids or [], np.int64)]))
    if len(ids) > MAX_SERVERS:
        raise TraceError(
            f"{traces}/{kind} names {len(ids):,} servers; the planner holds dense servers x "
            f"servers matrices and stops at {MAX_SERVERS:,}"
        )
    src = np.searchsorted(ids, src_ids)
    dst = np.searchsorted(ids, dst_ids)
    notes = np.zeros((len(ids), len(ids)))
    nbytes = np.zeros((len(ids), len(ids)))
    np.add.at(notes, (src, dst), table["notes"].to_numpy().astype(np.float64))
    np.add.at(nbytes, (src, dst), table["bytes"].to_numpy().astype(np.float64))
    first = pc.min(table["first_ms"]).as_py()
    last = pc.max(table["last_ms"]).as_py()
    return TrafficMatrix(
        kind=kind,
        ids=[int(i) for i in ids],
        notes=notes,
        nbytes=nbytes,
        rows=rows,
        first_ms=first,
        last_ms=last,
    )
