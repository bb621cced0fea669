"""The Spark analysis of timing traces (``aaabus analyze``) and its synthetic traces (``perf
synth``). ``python -m perf analyze`` is the same code under its old name.

One SparkSession serves the whole module; the command line is exercised in subprocesses where
what matters is what the user's terminal sees (one stderr line, exit status, the JSON line).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from aaabus.analysis.analyze import analyze, validate_traces
from aaabus.analysis.schema import RTT_SCHEMA
from aaabus.analysis.sparkjob import spark_session
from aaabus.errors import TraceError
from perf.synth import Law, write_traces
from tests.support.commands import cli, one_clean_error
from tests.support.tables import table_of

# Real server processes, subprocesses or Spark: not in the fast lane (make check).
pytestmark = pytest.mark.slow

# Known laws (ms): a quadratic, two linear, a constant, each with 8 % log-normal noise.
LAWS = [
    Law("flat", "full", "remote", 0.003, 0.02, 1.0),
    Law("flat", "delta", "remote", 0.0, 0.08, 1.0),
    Law("star", "delta", "remote", 0.0, 0.04, 2.0),
    Law("tree", "delta", "local", 0.0, 0.0, 0.5),
]
SERVERS = range(10, 101, 10)


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("spark") / "spark.log"
    with spark_session("local[2]", 4, log) as session:
        yield session


@pytest.fixture(scope="module")
def known(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("known")
    write_traces(out, LAWS, SERVERS, rows=300 * len(LAWS) * len(SERVERS), seed=7, noise=0.08)
    return out


@pytest.fixture(scope="module")
def known_report(spark: Any, known: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One analysis of ``known`` (fits on means) shared by the tests that only read its output."""
    out = tmp_path_factory.mktemp("known_report")
    analyze(spark, str(known), out)
    return out


assert_one_clean_error = functools.partial(one_clean_error, prog="aaabus analyze")


def rtt_table(rows: int = 5, **overrides: Any) -> pa.Table:
    """A valid rtt table; ``overrides`` replace whole columns (by a constant or an array)."""
    cols: dict[str, Any] = {
        "schema_version": 1,
        "run_id": "r",
        "ts": 1_767_225_600_000_000,
        "topology": "flat",
        "servers": 10,
        "domain_size": 10,
        "clock_mode": "full",
        "test": "remote",
        "process_mode": "inprocess",
        "round": 0,
        "payload_bytes": 0,
        "rtt_ns": 1_000_000,
        "hops": 1,
    }
    cols.update(overrides)
    return table_of(RTT_SCHEMA, cols, rows)


# --------------------------------------------------------------------------------------------
# Fits and verdicts.


def fits_of(report_dir: Path, metric: str = "rtt_mean_ms") -> dict[tuple[str, str, str], Any]:
    rows = pq.read_table(report_dir / "fits.parquet").to_pylist()
    return {(r["topology"], r["clock_mode"], r["test"]): r for r in rows if r["metric"] == metric}


@pytest.mark.parametrize("fit_on", ["means", "rows"])
def test_fits_recover_known_laws(
    spark: Any, known: Path, known_report: Path, tmp_path: Path, fit_on: str
) -> None:
    if fit_on == "means":
        report = known_report
    else:
        report = tmp_path
        analyze(spark, str(known), report, fit_on=fit_on)
    fits = fits_of(report)
    assert len(fits) == len(LAWS)
    for law in LAWS:
        fit = fits[(law.topology, law.clock_mode, law.test)]
        assert fit["verdict"] == law.expected, (law, fit)
        assert fit["m"] == (len(SERVERS) if fit_on == "means" else 300 * len(SERVERS))
        if law.expected == "quadratic":
            assert fit["quad_a"] == pytest.approx(law.a, rel=0.05)
            # Raw rows carry each round trip's own noise: their R² is lower than the means'.
            assert fit["quad_r2"] > (0.99 if fit_on == "means" else 0.95)
            assert fit["quad_r2"] > fit["lin_r2"]
            assert 1.0 < fit["exponent"] < 2.0  # log-log slope of a*n²+b*n+c over 10..100
        elif law.expected == "linear":
            assert fit["lin_slope"] == pytest.approx(law.b, rel=0.05)
            assert fit["lin_intercept"] == pytest.approx(law.c, abs=0.15)
            assert fit["lin_r2"] > (0.95 if fit_on == "means" else 0.8)
        else:
            assert fit["y_mean"] == pytest.approx(law.c, rel=0.02)
            assert abs(fit["exponent"]) < 0.02
            assert abs(fit["lin_slope"]) * 90 < 0.05 * law.c


def test_fits_match_numpy_least_squares(known_report: Path) -> None:
    """The sums-based closed form agrees with numpy's polyfit on the per-point means."""
    import numpy as np

    points = pq.read_table(known_report / "points.parquet").to_pylist()
    for key, fit in fits_of(known_report).items():
        pts = sorted(
            (p["servers"], p["rtt_mean_ms"])
            for p in points
            if (p["topology"], p["clock_mode"], p["test"]) == key
        )
        n, y = np.array([p[0] for p in pts], float), np.array([p[1] for p in pts])
        a, b, c = np.polyfit(n, y, 2)
        slope, intercept = np.polyfit(n, y, 1)
        k, _ = np.polyfit(np.log(n), np.log(y), 1)
        assert fit["quad_a"] == pytest.approx(a, rel=1e-6, abs=1e-12)
        assert fit["quad_b"] == pytest.approx(b, rel=1e-6, abs=1e-10)
        assert fit["quad_c"] == pytest.approx(c, rel=1e-6, abs=1e-9)
        assert fit["lin_slope"] == pytest.approx(slope, rel=1e-6, abs=1e-12)
        assert fit["lin_intercept"] == pytest.approx(intercept, rel=1e-6)
        assert fit["exponent"] == pytest.approx(k, rel=1e-6, abs=1e-9)


def test_points_ratios_and_clock_costs(known_report: Path) -> None:
    points = pq.read_table(known_report / "points.parquet").to_pylist()
    assert len(points) == len(LAWS) * len(SERVERS)
    p = next(
        p
        for p in points
        if p["topology"] == "flat" and p["clock_mode"] == "full" and p["servers"] == 50
    )
    assert p["count"] == 300 and p["runs"] == 1
    assert p["rtt_p50_ms"] <= p["rtt_p90_ms"] <= p["rtt_p99_ms"]
    # synth: full clocks persist 8·k²+16 bytes per message, k = n on a flat bus.
    assert p["clock_bytes_per_msg"] == pytest.approx(8 * 50 * 50 + 16)
    assert p["stamp_bytes_mean"] == pytest.approx(8 * 50 * 50 + 8)
    # Ratios pair star/delta/remote with flat/delta/remote only: tree/delta/local has no flat
    # partner, flat/full no domained one.
    ratios = pq.read_table(known_report / "ratios.parquet").to_pylist()
    assert {(r["topology"], r["clock_mode"], r["test"]) for r in ratios} == {
        ("star", "delta", "remote")
    }
    r = next(r for r in ratios if r["servers"] == 100)
    assert r["ratio_mean"] == pytest.approx((0.04 * 100 + 2) / (0.08 * 100 + 1), rel=0.05)


def test_without_hops_clock_columns_are_null(spark: Any, known: Path, tmp_path: Path) -> None:
    traces = tmp_path / "traces"
    (traces / "rtt").mkdir(parents=True)
    for f in (known / "rtt").glob("*.parquet"):
        (traces / "rtt" / f.name).write_bytes(f.read_bytes())
    out = tmp_path / "report"
    result = analyze(spark, str(traces), out, inventory=validate_traces(str(traces), "local"))
    assert result["hop_rows"] == 0
    points = pq.read_table(out / "points.parquet")
    assert points["clock_bytes_per_msg"].null_count == points.num_rows
    assert "no hop traces" in (out / "report.md").read_text()


# --------------------------------------------------------------------------------------------
# Bad input: one line, exit status 2, no JVM noise.


def test_missing_directory_cli(tmp_path: Path) -> None:
    proc = cli("aaabus", "analyze", str(tmp_path / "nowhere"), "--out", str(tmp_path / "rep"))
    assert_one_clean_error(proc, "does not exist")
    # The checkout's old name runs the same code.
    alias = cli("perf", "analyze", str(tmp_path / "nowhere"), "--out", str(tmp_path / "rep"))
    assert_one_clean_error(alias, "does not exist", prog="perf analyze")
    assert alias.stderr.replace("perf analyze:", "aaabus analyze:", 1) == proc.stderr


def test_other_schema_version_cli(tmp_path: Path) -> None:
    (tmp_path / "t" / "rtt").mkdir(parents=True)
    table = rtt_table().replace_schema_metadata({"aaabus.schema_version": "2"})
    pq.write_table(table, tmp_path / "t" / "rtt" / "a.parquet")
    proc = cli("aaabus", "analyze", str(tmp_path / "t"), "--out", str(tmp_path / "rep"))
    assert_one_clean_error(proc, "schema version 2")


def test_corrupted_pages_fail_inside_spark(
    spark: Any, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A file whose footer is sound but whose pages are not gets past pyarrow: Spark fails, the
    error is one line naming the file, and the JVM's stack trace goes to the log, not stderr."""
    rtt = tmp_path / "t" / "rtt"
    rtt.mkdir(parents=True)
    path = rtt / "a.parquet"
    pq.write_table(rtt_table(2000, rtt_ns=pa.array(range(2000), pa.int64())), path)
    data = bytearray(path.read_bytes())
    for i in range(8, len(data) // 2):  # the pages come first, the footer last
        data[i] = 0xA5
    path.write_bytes(bytes(data))
    inventory = validate_traces(str(tmp_path / "t"), "local")  # the footer alone looks fine
    capfd.readouterr()
    with pytest.raises(TraceError) as info:
        analyze(spark, str(tmp_path / "t"), tmp_path / "rep", inventory=inventory)
    message = str(info.value)
    assert "\n" not in message and "FAILED_READ_FILE" in message and "a.parquet" in message
    assert "java." not in message and " at org." not in message
    assert capfd.readouterr().err == ""


def test_empty_and_absent_rtt(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no rtt/ directory"):
        validate_traces(str(tmp_path), "local")
    (tmp_path / "rtt").mkdir()
    with pytest.raises(TraceError, match=r"holds no \.parquet file"):
        validate_traces(str(tmp_path), "local")
    pq.write_table(rtt_table(0), tmp_path / "rtt" / "empty.parquet")
    with pytest.raises(TraceError, match="no rtt rows"):
        validate_traces(str(tmp_path), "local")
    with pytest.raises(TraceError, match="not a directory"):
        validate_traces(str(tmp_path / "rtt" / "empty.parquet"), "local")


def test_missing_columns_and_corrupted_footer(tmp_path: Path) -> None:
    (tmp_path / "rtt").mkdir()
    pq.write_table(rtt_table().drop_columns(["rtt_ns", "hops"]), tmp_path / "rtt" / "a.parquet")
    with pytest.raises(TraceError, match=r"lacks column.*rtt_ns, hops"):
        validate_traces(str(tmp_path), "local")
    pq.write_table(rtt_table(), tmp_path / "rtt" / "a.parquet")
    (tmp_path / "rtt" / "b.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(TraceError, match=r"corrupted trace file .*b\.parquet"):
        validate_traces(str(tmp_path), "local")


def test_schema_version_column_checked_by_statistics(tmp_path: Path) -> None:
    (tmp_path / "rtt").mkdir()
    table = rtt_table(schema_version=3).replace_schema_metadata(None)
    pq.write_table(table, tmp_path / "rtt" / "a.parquet")
    with pytest.raises(TraceError, match="schema version 3"):
        validate_traces(str(tmp_path), "local")


def test_spark_side_checks_without_pyarrow(spark: Any, tmp_path: Path) -> None:
    """Traces the driver cannot pre-check (a cluster path): Spark's pass finds the same faults."""
    bad_version = tmp_path / "v" / "rtt"
    bad_version.mkdir(parents=True)
    table = rtt_table(schema_version=2).replace_schema_metadata(None)
    pq.write_table(table, bad_version / "a.parquet", write_statistics=False)
    with pytest.raises(TraceError, match="schema version 2"):
        analyze(spark, str(tmp_path / "v"), tmp_path / "rep1")
    missing = tmp_path / "m" / "rtt"
    missing.mkdir(parents=True)
    pq.write_table(rtt_table().drop_columns(["rtt_ns"]), missing / "a.parquet")
    with pytest.raises(TraceError, match=r"required columns missing or null: rtt_ns \(5 rows\)"):
        analyze(spark, str(tmp_path / "m"), tmp_path / "rep2")
    with pytest.raises(TraceError, match="does not exist"):
        analyze(spark, str(tmp_path / "nowhere"), tmp_path / "rep3")


# --------------------------------------------------------------------------------------------
# The commands end to end.


def test_synth_cli(tmp_path: Path) -> None:
    synth = cli("perf", "synth", "--rows", "7200", "--out", str(tmp_path), "--seed", "3")
    assert synth.returncode == 0, synth.stderr
    made = json.loads(synth.stdout.strip().splitlines()[-1])
    assert made == {**made, "rows": 7200, "out": str(tmp_path), "series": 24}
    files = list((tmp_path / "rtt").glob("*.parquet"))
    assert len(files) == 360  # one per point, as a sweep writes them
    assert sum(pq.read_metadata(f).num_rows for f in files) == 7200
    assert pq.read_schema(files[0]).equals(RTT_SCHEMA, check_metadata=True)
    laws = json.loads((tmp_path / "synth_laws.json").read_text())["laws"]
    assert len(laws) == 24


def test_analyze_cli(known: Path, tmp_path: Path) -> None:
    rep = tmp_path / "rep"
    proc = cli("aaabus", "analyze", str(known), "--out", str(rep), "--master", "local[2]")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # the JVM's chatter is in spark.log
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["rows"] == 300 * len(LAWS) * len(SERVERS)
    assert result["series"] == len(LAWS) and result["seconds"] > 0
    assert result["report"] == str(rep / "report.md")
    text = (rep / "report.md").read_text()
    assert str(known) in text and "12,000 round trips" in text and "synth-flat-10-full" in text
    assert "growth cut from quadratic" not in text  # flat/full has no domained partner here
    pngs = ["rtt_local", "rtt_remote", "ratio_remote", "clock_bytes_local", "clock_bytes_remote"]
    for name in pngs:
        png = rep / f"{name}.png"
        assert png.stat().st_size > 1000, png
        assert f"]({png.name})" in text
    for name in ("points", "fits", "ratios"):
        assert pq.read_table(rep / f"{name}.parquet").num_rows > 0
        assert (rep / f"{name}.csv").read_text().count("\n") > 1
    assert (rep / "spark.log").stat().st_size > 0
