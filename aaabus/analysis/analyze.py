"""``aaabus analyze TRACES --out REPORT``: timing traces to tables, growth fits and plots (also
``python -m perf analyze`` in a checkout: the same code).

A PySpark job (``local[*]`` unless ``--master`` says otherwise). Its stages:

1. *Validation before Spark* (pyarrow, footers only): the directory exists, ``rtt/`` holds Parquet
   files, every file has the columns and types of :mod:`aaabus.analysis.schema`, the schema
   version its metadata and statistics claim is ours. Bad input costs one line and no JVM start.
2. *Per-point aggregates* per (topology, clock_mode, test, servers), one pass over ``rtt/`` and
   one over ``hops/``: rtt count, mean and percentiles; stamp bytes, clock bytes persisted and
   clock CPU per message. The same pass gathers the provenance (time span, run ids) and the
   checks Spark must make itself (``schema_version`` range; nulls in required columns when the
   footers could not be checked first), so that traces the driver cannot see are checked too.
3. *Ratios*: each domained topology's mean rtt over flat's at the same point.
4. *Growth fits* per series (topology x clock_mode x test) and metric over the servers count:
   linear, quadratic and log-log least squares, solved from per-series sums that Spark computes.
5. *Report*: the small results only (one row per point or series) reach the driver, which writes
   Parquet, CSV, PNG plots and ``report.md`` (see :mod:`aaabus.analysis.report`).

pyarrow, pyspark and matplotlib (the ``spark`` extra) are imported inside functions: the other
commands must stay fast, and this one must be able to say which extra is missing. Bad input
raises an :class:`~aaabus.errors.AaabusError`, one line for the command line to print.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aaabus.analysis.sparkjob import (
    add_spark_arguments,
    check_footer,
    command_session,
    local_path,
    open_traces,
    parquet_files,
    read_dataset,
    spark_errors,
    spark_location,
)
from aaabus.errors import TraceError
from aaabus.extras import require

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

KEYS = ["topology", "clock_mode", "test", "servers"]
SERIES = ["topology", "clock_mode", "test"]
#: Metrics fitted against the servers count; ``rtt_mean_ms`` is the one the verdict is about.
FIT_METRICS = ["rtt_mean_ms", "rtt_p50_ms", "stamp_bytes_mean", "clock_bytes_per_msg"]
FIT_METRICS += ["clock_cpu_us_per_msg"]
#: Per-point columns that are not numbers to fit or compare.
_NOT_METRICS = {*KEYS, "run_ids", "ts_first", "ts_last", "domain_size"}
_NOT_METRICS |= {"mixed_domain_size", "mixed_payload", "mixed_process_mode"}
#: percentile_approx accuracy: rank error at most rows/ACCURACY within each point.
PERCENTILE_ACCURACY = 10_000
#: A trend must move the series by this fraction of its mean level across the measured range.
PRACTICAL = 0.10
#: A quadratic must halve the linear fit's residual sum of squares ("clearly better R²").
QUAD_SSE_RATIO = 0.5
#: Two-sided 95 % Student t quantiles by degrees of freedom (no scipy in the dependencies).
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179]
_T975 += [2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064]
_T975 += [2.060, 2.056, 2.052, 2.048, 2.045, 2.042]
#: What the command imports from the ``spark`` extra: footers and results (pyarrow), the job
#: (pyspark), the plots (matplotlib).
NEEDS = ("pyarrow", "pyspark", "matplotlib")


# --------------------------------------------------------------------------------------------
# Validation with pyarrow, before any JVM exists.


@dataclass
class Inventory:
    """What the footers told us: files and rows per dataset (``None``: not checked here)."""

    rtt_files: int | None = None
    hop_files: int | None = None
    rtt_rows: int | None = None
    hop_rows: int | None = None
    hops_present: bool = True
    notes: list[str] = field(default_factory=list)


def validate_traces(location: str, master: str) -> Inventory:
    """Check the traces with pyarrow where the driver can see them; raise TraceError if bad.

    On a cluster, a path without a scheme means Spark's default filesystem (HDFS, say): it is only
    checked here if it also exists locally; Spark's own checks cover the rest.
    """
    from aaabus.analysis.schema import HOP_SCHEMA, RTT_SCHEMA

    inv = Inventory()
    opened = open_traces(location, master, "rtt/ and hops/")
    if isinstance(opened, str):
        inv.notes.append(opened)
        return inv
    fs, root = opened
    rtt_files = parquet_files(fs, root.rstrip("/") + "/rtt")
    if rtt_files is None:
        raise TraceError(f"{location} has no rtt/ directory: not a traces directory")
    if not rtt_files:
        raise TraceError(f"no rtt traces: {location}/rtt holds no .parquet file")
    inv.rtt_files = len(rtt_files)
    inv.rtt_rows = sum(check_footer(fs, f, "rtt", RTT_SCHEMA) for f in rtt_files)
    if inv.rtt_rows == 0:
        raise TraceError(
            f"no rtt rows: the {len(rtt_files)} file(s) under {location}/rtt are empty"
        )
    hop_files = parquet_files(fs, root.rstrip("/") + "/hops") or []
    inv.hop_files = len(hop_files)
    inv.hop_rows = sum(check_footer(fs, f, "hops", HOP_SCHEMA) for f in hop_files)
    inv.hops_present = inv.hop_rows > 0
    return inv


def _checks(schema: pa.Schema, prefix: str, nulls: bool) -> list[Any]:
    """Aggregates that let the driver check a dataset without a pass of its own.

    Per point: the schema_version range and the nulls in each required column (a file lacking
    a column reads as nulls under the explicit schema). Summed over the points by
    :func:`check_points`. The null counts read every column: they are left out (``nulls``
    False) when pyarrow has already checked every file's columns.
    """
    from pyspark.sql import functions as F

    required = [f.name for f in schema if not f.nullable] if nulls else []
    return [
        F.min("schema_version").alias(f"{prefix}v_min"),
        F.max("schema_version").alias(f"{prefix}v_max"),
        *[F.count_if(F.col(c).isNull()).alias(f"{prefix}null_{c}") for c in required],
    ]


def check_points(points: pa.Table, location: str) -> pa.Table:
    """Raise TraceError if the per-point check columns show bad rows; return the table without."""
    import pyarrow.compute as pc

    from aaabus.analysis.schema import SCHEMA_VERSION

    if points.num_rows == 0 or pc.sum(points["count"]).as_py() in (None, 0):
        raise TraceError(f"no rtt rows under {location}/rtt")
    for kind, prefix in (("rtt", "_rtt_"), ("hops", "_hop_")):
        if f"{prefix}v_min" not in points.column_names:
            continue
        lo = pc.min(points[f"{prefix}v_min"]).as_py()
        hi = pc.max(points[f"{prefix}v_max"]).as_py()
        nulls = {
            name[len(prefix) + 5 :]: pc.sum(points[name]).as_py() or 0
            for name in points.column_names
            if name.startswith(f"{prefix}null_")
        }
        bad = [v for v in (lo, hi) if v is not None and v != SCHEMA_VERSION]
        if bad or nulls.get("schema_version"):
            what = f"schema version {bad[0]}" if bad else "no schema version"
            raise TraceError(
                f"{location}/{kind} has rows of trace {what}; this analyzer reads version "
                f"{SCHEMA_VERSION} only"
            )
        missing = {c: n for c, n in nulls.items() if n}
        if missing:
            cols = ", ".join(f"{c} ({n} rows)" for c, n in sorted(missing.items()))
            raise TraceError(f"{location}/{kind}: required columns missing or null: {cols}")
    internal = [c for c in points.column_names if c.startswith("_")]
    return points.drop_columns(internal)


def points_frame(
    rtt: DataFrame, hops: DataFrame | None, exact: bool, null_checks: bool = True
) -> DataFrame:
    """One row per (topology, clock_mode, test, servers): rtt statistics and clock costs.

    One pass over each dataset: the checks and the report's provenance (time span, run ids) are
    aggregated here too, per point, rather than in passes of their own.
    """
    from pyspark.sql import functions as F

    from aaabus.analysis.schema import HOP_SCHEMA, RTT_SCHEMA

    probs = F.array(F.lit(0.5), F.lit(0.9), F.lit(0.99))
    q = (
        F.percentile("rtt_ns", probs)
        if exact
        else F.percentile_approx("rtt_ns", probs, PERCENTILE_ACCURACY)
    )
    pts = rtt.groupBy(*KEYS).agg(
        F.count(F.lit(1)).alias("count"),
        F.array_sort(F.collect_set("run_id")).alias("run_ids"),
        (F.avg("rtt_ns") / 1e6).alias("rtt_mean_ms"),
        (F.stddev_samp("rtt_ns") / 1e6).alias("rtt_std_ms"),
        q.alias("q"),
        F.avg("hops").alias("hops"),
        F.min("domain_size").alias("domain_size"),
        (F.max("domain_size") != F.min("domain_size")).alias("mixed_domain_size"),
        (F.max("payload_bytes") != F.min("payload_bytes")).alias("mixed_payload"),
        (F.max("process_mode") != F.min("process_mode")).alias("mixed_process_mode"),
        F.min("ts").alias("ts_first"),
        F.max("ts").alias("ts_last"),
        *_checks(RTT_SCHEMA, "_rtt_", null_checks),
    )
    pts = pts.select(
        *KEYS,
        "count",
        F.size("run_ids").alias("runs"),
        "rtt_mean_ms",
        (F.col("q")[0] / 1e6).alias("rtt_p50_ms"),
        (F.col("q")[1] / 1e6).alias("rtt_p90_ms"),
        (F.col("q")[2] / 1e6).alias("rtt_p99_ms"),
        "rtt_std_ms",
        "hops",
        "domain_size",
        "mixed_domain_size",
        "mixed_payload",
        "mixed_process_mode",
        "ts_first",
        "ts_last",
        "run_ids",
        *[c for c in pts.columns if c.startswith("_")],
    )
    cost_cols = {
        "hop_rows": "bigint",
        "stamp_bytes_mean": "double",
        "clock_bytes_per_msg": "double",
        "clock_cpu_us_per_msg": "double",
        "commit_us_per_msg": "double",
    }
    if hops is None:
        return pts.select("*", *[F.lit(None).cast(t).alias(c) for c, t in cost_cols.items()])
    # clock_bytes and commit_ns belong to a commit shared by group_hops hops: each hop row gets
    # its share. try_divide keeps a zero group_hops from failing the job under ANSI mode.
    cost = hops.groupBy(*KEYS).agg(
        F.count(F.lit(1)).alias("hop_rows"),
        F.avg(F.when(F.col("event") == "send", F.col("stamp_bytes"))).alias("stamp_bytes_mean"),
        F.avg(F.try_divide("clock_bytes", "group_hops")).alias("clock_bytes_per_msg"),
        (F.avg("clock_ns") / 1e3).alias("clock_cpu_us_per_msg"),
        (F.avg(F.try_divide("commit_ns", "group_hops")) / 1e3).alias("commit_us_per_msg"),
        *_checks(HOP_SCHEMA, "_hop_", null_checks),
    )
    # Full outer: hop rows of a point without round trips still count (and still get checked).
    return pts.join(cost, KEYS, "full")


def ratios_frame(points: DataFrame) -> DataFrame:
    """Each domained topology's mean and p50 rtt divided by flat's at the same point."""
    from pyspark.sql import functions as F

    flat = points.where(F.col("topology") == "flat").select(
        "clock_mode",
        "test",
        "servers",
        F.col("rtt_mean_ms").alias("flat_rtt_mean_ms"),
        F.col("rtt_p50_ms").alias("flat_rtt_p50_ms"),
    )
    dom = points.where(F.col("topology") != "flat")
    return dom.join(flat, ["clock_mode", "test", "servers"]).select(
        *KEYS,
        "rtt_mean_ms",
        "flat_rtt_mean_ms",
        F.try_divide("rtt_mean_ms", "flat_rtt_mean_ms").alias("ratio_mean"),
        F.try_divide("rtt_p50_ms", "flat_rtt_p50_ms").alias("ratio_p50"),
    )


def fit_sums_frame(long: DataFrame) -> DataFrame:
    """Least-squares sums per (series, metric) of ``long`` = (series..., metric, n, y).

    n and y are centred (and n scaled) per series first: the normal equations of a quadratic in
    raw n (sums of n⁴ against sums of n) are badly conditioned; in standard units they are not.
    """
    from pyspark.sql import functions as F

    group = [*SERIES, "metric"]
    stats = long.groupBy(*group).agg(
        F.avg("n").alias("mu"),
        F.coalesce(F.nullif(F.stddev_pop("n"), F.lit(0.0)), F.lit(1.0)).alias("sd"),
        F.avg("y").alias("ybar"),
    )
    x = (F.col("n") - F.col("mu")) / F.col("sd")
    dy = F.col("y") - F.col("ybar")
    std = long.join(F.broadcast(stats), group).select(
        *group, "n", "y", "mu", "sd", "ybar", x.alias("x"), dy.alias("dy")
    )
    pos = (F.col("n") > 0) & (F.col("y") > 0)
    lx, ly = F.log(F.col("n")), F.log(F.col("y"))

    def s(e: Any) -> Any:
        return F.sum(e)

    def sp(e: Any) -> Any:  # sums over the points a log-log fit can use
        return F.sum(F.when(pos, e))

    return std.groupBy(*group).agg(
        F.count(F.lit(1)).alias("m"),
        F.size(F.collect_set("n")).alias("distinct_n"),
        F.min("n").alias("n_min"),
        F.max("n").alias("n_max"),
        F.first("mu").alias("mu"),
        F.first("sd").alias("sd"),
        F.first("ybar").alias("ybar"),
        s(F.col("x")).alias("sx"),
        s(F.col("x") ** 2).alias("sx2"),
        s(F.col("x") ** 3).alias("sx3"),
        s(F.col("x") ** 4).alias("sx4"),
        s(F.col("dy")).alias("sy"),
        s(F.col("x") * F.col("dy")).alias("sxy"),
        s(F.col("x") ** 2 * F.col("dy")).alias("sx2y"),
        s(F.col("dy") ** 2).alias("syy"),
        F.count_if(pos).alias("lm"),
        sp(lx).alias("lsx"),
        sp(lx * lx).alias("lsxx"),
        sp(ly).alias("lsy"),
        sp(lx * ly).alias("lsxy"),
        sp(ly * ly).alias("lsyy"),
    )


# --------------------------------------------------------------------------------------------
# Solving the fits from the sums (driver side: a few numbers per series).


def _t975(dof: int) -> float:
    return _T975[dof - 1] if dof <= len(_T975) else 1.96


def _solve(matrix: list[list[float]], rhs: list[float]) -> tuple[list[float], list[float]] | None:
    """Solve ``matrix · v = rhs`` and give the inverse's diagonal; None if singular."""
    size = len(rhs)
    aug = [
        [*row, *(1.0 if i == j else 0.0 for j in range(size)), r]
        for i, (row, r) in enumerate(zip(matrix, rhs, strict=True))
    ]
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(aug[r][col]))
        if abs(aug[pivot][col]) < 1e-12 * max(1.0, max(abs(v) for v in matrix[col])):
            return None
        aug[col], aug[pivot] = aug[pivot], aug[col]
        p = aug[col][col]
        aug[col] = [v / p for v in aug[col]]
        for r in range(size):
            if r != col and aug[r][col] != 0.0:
                f = aug[r][col]
                aug[r] = [v - f * w for v, w in zip(aug[r], aug[col], strict=True)]
    solution = [aug[i][-1] for i in range(size)]
    inv_diag = [aug[i][size + i] for i in range(size)]
    return solution, inv_diag


def solve_fit(s: dict[str, Any]) -> dict[str, Any]:
    """Linear, quadratic and log-log fits of one series from its sums, and the verdict."""
    m, mu, sd, ybar = int(s["m"]), s["mu"], s["sd"], s["ybar"]
    out: dict[str, Any] = {
        k: s[k] for k in (*SERIES, "metric", "m", "distinct_n", "n_min", "n_max")
    }
    out["y_mean"] = ybar
    syy = s["syy"]
    sst = syy - s["sy"] ** 2 / m  # y is centred: sy is ~0, kept for exactness

    def r2(sse: float) -> float | None:
        if sst <= 1e-12 * max(1.0, syy):
            return None  # y does not vary: R² undefined
        return max(0.0, 1.0 - sse / sst)

    lin_keys = ["lin_slope", "lin_intercept", "lin_r2", "lin_t"]
    quad_keys = ["quad_a", "quad_b", "quad_c", "quad_r2", "quad_t"]
    out.update(dict.fromkeys([*lin_keys, *quad_keys, "exponent", "loglog_r2"]))
    # Linear: dy = B x + C.
    lin = _solve([[s["sx2"], s["sx"]], [s["sx"], m]], [s["sxy"], s["sy"]])
    sse_l = None
    if lin is not None and s["distinct_n"] >= 2:
        (big_b, big_c), inv = lin
        sse_l = max(0.0, syy - big_b * s["sxy"] - big_c * s["sy"])
        out["lin_slope"] = big_b / sd
        out["lin_intercept"] = big_c + ybar - big_b * mu / sd
        out["lin_r2"] = r2(sse_l)
        if m > 2:
            se = math.sqrt(sse_l / (m - 2) * inv[0])
            out["lin_t"] = big_b / se if se > 0 else None  # exact fit: t undefined
    # Quadratic: dy = A x² + B x + C.
    quad = _solve(
        [[s["sx4"], s["sx3"], s["sx2"]], [s["sx3"], s["sx2"], s["sx"]], [s["sx2"], s["sx"], m]],
        [s["sx2y"], s["sxy"], s["sy"]],
    )
    sse_q = None
    if quad is not None and s["distinct_n"] >= 3:
        (big_a, big_b, big_c), inv = quad
        sse_q = max(0.0, syy - big_a * s["sx2y"] - big_b * s["sxy"] - big_c * s["sy"])
        out["quad_a"] = big_a / sd**2
        out["quad_b"] = big_b / sd - 2 * big_a * mu / sd**2
        out["quad_c"] = big_a * mu**2 / sd**2 - big_b * mu / sd + big_c + ybar
        out["quad_r2"] = r2(sse_q)
        if m > 3:
            se = math.sqrt(sse_q / (m - 3) * inv[0])
            out["quad_t"] = big_a / se if se > 0 else None
    # Log-log: ln y = k ln n + c, over the points where both are positive.
    lm = int(s["lm"] or 0)
    if lm >= 2:
        den = lm * s["lsxx"] - s["lsx"] ** 2
        if den > 1e-12:
            k = (lm * s["lsxy"] - s["lsx"] * s["lsy"]) / den
            out["exponent"] = k
            vy = lm * s["lsyy"] - s["lsy"] ** 2
            cov = lm * s["lsxy"] - s["lsx"] * s["lsy"]
            out["loglog_r2"] = cov * cov / (den * vy) if vy > 1e-12 else None
    out["verdict"] = verdict(out, sse_l, sse_q)
    return out


def verdict(fit: dict[str, Any], sse_l: float | None, sse_q: float | None) -> str:
    """Which growth law the series supports.

    * quadratic: at least 4 servers counts, a > 0 with |t| above the 95 % Student quantile, the
      quadratic halves the linear residuals (R² clearly better), and the curvature matters: the
      parabola departs from the straight line through its ends by >= PRACTICAL/2 of the mean
      level (a·w²/4 for a range of width w);
    * linear / decreasing: at least 3 servers counts, slope significant (95 %) and the line moves
      by >= PRACTICAL of the mean level across the range;
    * uncertain: the line moves by that much but the slope is not significant (too few points or
      too much noise): calling it constant would claim more than the data shows;
    * constant: neither;
    * insufficient data: fewer than 3 servers counts.
    """
    m, distinct = fit["m"], fit["distinct_n"]
    if distinct < 3:
        return "insufficient data"
    level = abs(fit["y_mean"]) or 1e-300
    width = fit["n_max"] - fit["n_min"]
    a, tq = fit["quad_a"], fit["quad_t"]
    # t is None after an exact fit (no residual at all): then only the size tests decide.
    if (
        distinct >= 4
        and a is not None
        and a > 0
        and (tq is None or tq >= _t975(m - 3))
        and sse_l is not None
        and sse_q is not None
        and sse_q <= QUAD_SSE_RATIO * sse_l
        and a * width * width / 4 >= PRACTICAL / 2 * level
    ):
        return "quadratic"
    slope, tl = fit["lin_slope"], fit["lin_t"]
    if (
        slope is not None
        and (tl is None or abs(tl) >= _t975(m - 2))
        and abs(slope) * width >= PRACTICAL * level
    ):
        return "linear" if slope > 0 else "decreasing"
    if slope is not None and abs(slope) * width >= PRACTICAL * level:
        return "uncertain"
    return "constant"


def fits_frame_input(points: DataFrame, rtt: DataFrame, hops: DataFrame | None, on: str) -> Any:
    """The long (series..., metric, n, y) table the fits are computed on.

    ``means``: one value per servers count (the per-point aggregates; every point weighs the
    same whatever its row count). ``rows``: every raw row (rtt in ms, clock costs per hop row).
    """
    from pyspark.sql import functions as F

    if on == "means":
        parts = [
            points.select(
                *SERIES,
                F.lit(metric).alias("metric"),
                F.col("servers").cast("double").alias("n"),
                F.col(metric).cast("double").alias("y"),
            )
            for metric in FIT_METRICS
        ]
    else:
        base: list[Any] = [*SERIES, F.col("servers").cast("double").alias("n")]
        parts = [
            rtt.select(
                *base, F.lit("rtt_mean_ms").alias("metric"), (F.col("rtt_ns") / 1e6).alias("y")
            )
        ]
        if hops is not None:
            parts += [
                hops.select(
                    *base,
                    F.lit("clock_bytes_per_msg").alias("metric"),
                    F.try_divide("clock_bytes", "group_hops").cast("double").alias("y"),
                ),
                hops.select(
                    *base,
                    F.lit("clock_cpu_us_per_msg").alias("metric"),
                    (F.col("clock_ns") / 1e3).alias("y"),
                ),
            ]
    long = parts[0]
    for part in parts[1:]:
        long = long.unionByName(part)
    return long.where(F.col("y").isNotNull() & ~F.isnan("y"))


# --------------------------------------------------------------------------------------------
# The whole analysis.


def _rows(table: pa.Table) -> list[dict[str, Any]]:
    return table.to_pylist()


def _write_table(table: pa.Table, out: Path, name: str) -> list[str]:
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    pq.write_table(table, out / f"{name}.parquet")
    pacsv.write_csv(table, out / f"{name}.csv")
    return [f"{name}.parquet", f"{name}.csv"]


def analyze(
    spark: SparkSession,
    traces: str,
    out: Path,
    *,
    fit_on: str = "means",
    exact: bool = False,
    inventory: Inventory | None = None,
    log_path: Path | None = None,
) -> dict[str, Any]:
    """Run the job on ``traces``; write tables, plots and report.md to ``out``; return a summary."""
    import pyarrow as pa

    from aaabus.analysis import report
    from aaabus.analysis.schema import HOP_SCHEMA, RTT_SCHEMA

    inventory = inventory or Inventory()
    out.mkdir(parents=True, exist_ok=True)
    location = spark_location(traces, spark)
    with spark_errors(f"cannot read the traces under {traces}", log_path):
        rtt = read_dataset(spark, location, "rtt", RTT_SCHEMA)
        if rtt is None:
            raise TraceError(f"traces directory {traces}/rtt does not exist")
        hops = read_dataset(spark, location, "hops", HOP_SCHEMA) if inventory.hops_present else None
    with spark_errors(f"analysis of {traces} failed", log_path):
        # The per-point table is the small result everything else is built from: computed once,
        # checked, then handed back to Spark for the ratios and fits (no cache needed).
        validated = inventory.rtt_files is not None  # pyarrow read every footer
        pts_df = points_frame(rtt, hops, exact, null_checks=not validated)
        points = check_points(pts_df.toArrow(), traces)
        metrics = [*KEYS, *(c for c in points.column_names if c not in _NOT_METRICS)]
        pts_small = spark.createDataFrame(points.select(metrics))
        ratios = ratios_frame(pts_small).orderBy(*KEYS).toArrow()
        long = fits_frame_input(pts_small, rtt, hops, fit_on)
        sums = [r.asDict() for r in fit_sums_frame(long).collect()]
    points = points.sort_by([(k, "ascending") for k in KEYS])
    fits = sorted(
        (solve_fit(s) for s in sums),
        key=lambda f: (FIT_METRICS.index(f["metric"]), f["test"], f["topology"], f["clock_mode"]),
    )
    rows = _rows(points)
    run_ids = sorted({r for p in rows for r in p["run_ids"] or ()})
    # CSV has no list type: the run ids of a point are written space-separated.
    written = points.set_column(
        points.column_names.index("run_ids"),
        "run_ids",
        pa.array([" ".join(p["run_ids"] or ()) for p in rows], pa.string()),
    )
    files = _write_table(written, out, "points")
    files += _write_table(ratios, out, "ratios")
    files += _write_table(pa.Table.from_pylist(fits, schema=_fits_schema()), out, "fits")

    rtt_rows = sum(p["count"] or 0 for p in rows)
    hop_rows = sum(p["hop_rows"] or 0 for p in rows)
    firsts = [p["ts_first"] for p in rows if p["ts_first"] is not None]
    lasts = [p["ts_last"] for p in rows if p["ts_last"] is not None]
    meta = {
        "traces": traces,
        "master": spark.sparkContext.master,
        "rtt_rows": rtt_rows,
        "hop_rows": hop_rows,
        "runs": len(run_ids),
        "run_ids": run_ids,
        "ts_min": min(firsts, default=None),
        "ts_max": max(lasts, default=None),
        "rtt_files": inventory.rtt_files,
        "hop_files": inventory.hop_files,
        "percentiles": (
            "exact (Spark SQL percentile)"
            if exact
            else f"approximate (percentile_approx, accuracy {PERCENTILE_ACCURACY})"
        ),
        "fit_on": fit_on,
        "notes": inventory.notes,
        "tables": files,
    }
    report_path = report.write_report(out, meta, rows, fits, _rows(ratios))
    series = {(p["topology"], p["clock_mode"], p["test"]) for p in rows if p["count"]}
    return {
        "rows": rtt_rows,
        "hop_rows": hop_rows,
        "points": points.num_rows,
        "series": len(series),
        "report": str(report_path),
    }


def _fits_schema() -> pa.Schema:
    import pyarrow as pa

    strings = [*SERIES, "metric"]
    ints = ["m", "distinct_n"]
    floats = ["n_min", "n_max", "y_mean", "lin_slope", "lin_intercept", "lin_r2", "lin_t"]
    floats += ["quad_a", "quad_b", "quad_c", "quad_r2", "quad_t", "exponent", "loglog_r2"]
    return pa.schema(
        [pa.field(c, pa.string()) for c in strings]
        + [pa.field(c, pa.int64()) for c in ints]
        + [pa.field(c, pa.float64()) for c in floats]
        + [pa.field("verdict", pa.string())]
    )


# --------------------------------------------------------------------------------------------
# Command line.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``aaabus analyze``."""
    parser.add_argument("traces", help="traces directory holding rtt/ (and hops/) Parquet files")
    parser.add_argument("--out", required=True, help="report directory (written by the driver)")
    add_spark_arguments(parser, default_master="local[*]", log="OUT/spark.log")
    parser.add_argument(
        "--fit-on",
        choices=["means", "rows"],
        default="means",
        help="fit growth laws on per-point means (default) or on every raw row",
    )
    parser.add_argument(
        "--exact-percentiles", action="store_true", help="exact percentiles instead of approx"
    )


def run(args: argparse.Namespace) -> int:
    """The command: the report written, then the JSON line; exit status 0."""
    require("the analysis of traces", "spark", *NEEDS)
    t0 = time.monotonic()
    out = local_path(args.out)
    try:
        if out is None:
            raise TraceError(f"--out must be a local directory, got {args.out}")
        inventory = validate_traces(args.traces, args.master)
        out.mkdir(parents=True, exist_ok=True)
        log_path = out / "spark.log"
        with command_session(args, log_path, "aaabus-analyze") as spark:
            result = analyze(
                spark,
                args.traces,
                out,
                fit_on=args.fit_on,
                exact=args.exact_percentiles,
                inventory=inventory,
                log_path=log_path,
            )
    except OSError as exc:  # the report directory cannot be written, say
        raise TraceError(str(exc)) from None
    result["seconds"] = round(time.monotonic() - t0, 3)
    print(json.dumps(result))
    return 0
