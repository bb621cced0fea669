"""``aaabus plan`` and ``perf synth-traffic``: the Spark aggregation of traffic traces, the command
line end to end, and bad input (one line, exit status 2, no JVM started for what pyarrow sees).
``python -m perf plan`` is the same code under its old name.

One SparkSession serves the module; the command line runs in subprocesses where what the user's
terminal sees matters.
"""

from __future__ import annotations

import functools
import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from aaabus.analysis.schema import TRAFFIC_SCHEMA
from aaabus.analysis.sparkjob import spark_session
from aaabus.analysis.traffic_matrix import Source, aggregate, validate
from aaabus.config.domains import Topology
from aaabus.config.reader import load_config
from aaabus.config.topology import generate
from aaabus.core.traffic import TrafficRecorder
from aaabus.errors import TraceError
from perf.synth import Law, write_traces
from tests.support.commands import cli, one_clean_error
from tests.support.tables import table_of
from tests.test_planner import matrix_of


@pytest.fixture(scope="module")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    log = tmp_path_factory.mktemp("spark") / "spark.log"
    with spark_session("local[2]", 4, log) as session:
        yield session


@pytest.fixture(scope="module")
def six_groups(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("six")
    made = perf_cli("synth-traffic", "--rows", "120000", "--out", str(out), "--seed", "4")
    assert made.returncode == 0, made.stderr
    summary = json.loads(made.stdout.strip().splitlines()[-1])
    assert summary["rows"] == 120_000 and abs(summary["inside_share"] - 0.9) < 0.01
    return out


def perf_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return cli("perf", *args)


def plan_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return cli("aaabus", "plan", *args)


assert_one_clean_error = functools.partial(one_clean_error, prog="aaabus plan")


def traffic_table(rows: int = 4, **overrides: Any) -> pa.Table:
    cols: dict[str, Any] = {
        "window_start": 1_800_000_000_000,
        "window_ms": 1000,
        "src": 0,
        "dst": 1,
        "notes": 5,
        "bytes": 500,
    }
    cols.update(overrides)
    return table_of(TRAFFIC_SCHEMA, cols, rows)


# --------------------------------------------------------------------------------------------
# synth-traffic and the Spark aggregation.


def test_synth_traffic_writes_files_and_row_groups_of_the_schema(tmp_path: Path) -> None:
    from perf.synth_traffic import write_traffic

    made = write_traffic(tmp_path, 2_500_000, servers=30, groups=3, seed=1)
    files = sorted((tmp_path / "traffic").glob("*.parquet"))
    assert made["files"] == len(files) == 3
    meta = pq.read_metadata(files[0])
    assert meta.num_rows == 1_000_000 and meta.num_row_groups == 4
    assert pq.read_schema(files[0]).equals(TRAFFIC_SCHEMA, check_metadata=True)
    groups = json.loads((tmp_path / "synth_groups.json").read_text())["groups"]
    assert sorted(s for g in groups for s in g) == list(range(30))
    assert groups[0] != list(range(10))  # dealt in a shuffled order, not by id
    with pytest.raises(ValueError, match="2 servers or more"):
        write_traffic(tmp_path, 10, servers=5, groups=3)


@pytest.mark.slow  # Spark or a subprocess
def test_spark_sums_equal_pyarrow_sums(spark: Any, six_groups: Path) -> None:
    source = validate(str(six_groups), "local[2]")
    assert (source.kind, source.files, source.rows) == ("traffic", 1, 120_000)
    matrix = aggregate(spark, str(six_groups), source, None)
    ids, notes = matrix_of(six_groups)
    assert matrix.ids == ids == list(range(60))
    assert np.array_equal(matrix.notes, notes)
    table = ds.dataset(six_groups / "traffic").to_table()
    assert matrix.nbytes.sum() == pa.compute.sum(table["bytes"]).as_py()
    assert matrix.rows == 120_000
    assert matrix.first_ms == pa.compute.min(table["window_start"]).as_py()


@pytest.mark.slow  # Spark or a subprocess
def test_recorder_files_are_read_by_spark(spark: Any, tmp_path: Path) -> None:
    sent: Counter[tuple[int, int]] = Counter()
    for sid in (3, 8):  # two servers write into the same traces directory
        rec = TrafficRecorder(tmp_path, sid, window_ms=50, batch_windows=1)
        for i in range(300):
            dst = (sid + 1 + i % 4) % 10
            rec.record(dst, 64)
            sent[sid, dst] += 1
        rec.close()
    matrix = aggregate(spark, str(tmp_path), validate(str(tmp_path), "local[2]"), None)
    got = {
        (matrix.ids[i], matrix.ids[j]): int(matrix.notes[i, j])
        for i, j in zip(*np.nonzero(matrix.notes), strict=True)
    }
    assert got == dict(sent)
    assert matrix.nbytes.sum() == 64 * 600


@pytest.mark.slow  # Spark or a subprocess
def test_hop_traces_count_one_notification_per_send(spark: Any, tmp_path: Path) -> None:
    write_traces(tmp_path, [Law("flat", "full", "remote", 0, 0.01, 1.0)], [10, 20], 400, seed=2)
    source = validate(str(tmp_path), "local[2]")
    assert source.kind == "hops"
    matrix = aggregate(spark, str(tmp_path), source, None)
    hops = ds.dataset(tmp_path / "hops").to_table().to_pylist()
    sends = Counter((h["server_id"], h["peer"]) for h in hops if h["event"] == "send")
    assert matrix.kind == "hops" and matrix.notes.sum() == sum(sends.values())
    i, j = matrix.ids.index(3), matrix.ids.index(5)
    assert matrix.notes[i, j] == sends[3, 5]


@pytest.mark.slow  # Spark or a subprocess
def test_spark_side_checks_when_the_driver_cannot_see_the_files(spark: Any, tmp_path: Path) -> None:
    """Traces on a cluster path: no footer check, so Spark's aggregate refuses nulls and
    negative counts itself."""
    (tmp_path / "n" / "traffic").mkdir(parents=True)
    pq.write_table(
        traffic_table(src=pa.array([0, None, 2, 3], pa.int32())), tmp_path / "n/traffic/a.parquet"
    )
    with pytest.raises(TraceError, match=r"1 row\(s\) with required columns missing or null"):
        aggregate(spark, str(tmp_path / "n"), Source(None), None)
    (tmp_path / "m" / "traffic").mkdir(parents=True)
    pq.write_table(traffic_table().drop_columns(["notes"]), tmp_path / "m/traffic/a.parquet")
    with pytest.raises(TraceError, match=r"4 row\(s\) with required columns missing"):
        aggregate(spark, str(tmp_path / "m"), Source(None), None)
    (tmp_path / "x" / "traffic").mkdir(parents=True)
    pq.write_table(traffic_table(notes=-3), tmp_path / "x/traffic/a.parquet")
    with pytest.raises(TraceError, match="negative server id or count"):
        aggregate(spark, str(tmp_path / "x"), Source(None), None)


# --------------------------------------------------------------------------------------------
# The command end to end.


@pytest.mark.slow  # ~14 s: a JVM of its own
def test_plan_cli_writes_a_checked_tree_and_the_json_line(six_groups: Path, tmp_path: Path) -> None:
    out = tmp_path / "plan" / "a3.xml"
    proc = plan_cli(str(six_groups), "--max-domain-size", "12", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""  # the JVM's chatter is in spark-plan.log
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["out"] == str(out) and result["rows"] == 120_000 and result["seconds"] > 0
    assert result["servers"] == 60 and result["domains"] == 6 and result["largest_domain"] <= 12
    predicted = result["predicted"]
    assert set(predicted) >= {"planned", "flat", "star", "tree"}
    assert all(predicted["planned"] < predicted[k] for k in ("flat", "star", "tree"))
    assert set(result["timings"]) == {"validate", "jvm_start", "aggregate", "plan"}
    assert lines[1].split() == [
        "layout",
        "domains",
        "largest",
        "routers",
        "links",
        "legs/note",
        "clock",
        "B/note",
        "ms/note",
        "x",
        "planned",
    ]
    assert (tmp_path / "plan" / "spark-plan.log").stat().st_size > 0
    topo = Topology.from_config(load_config(out))
    assert len(topo.domains) == 6 and max(len(m) for m in topo.domains.values()) <= 12
    check = cli("aaabus", "check", str(out))
    assert check.returncode == 0 and "a tree" in check.stdout, check.stdout + check.stderr


@pytest.mark.slow  # ~21 s: two JVMs of their own
def test_servers_from_keeps_names_hosts_and_idle_servers(six_groups: Path, tmp_path: Path) -> None:
    config = tmp_path / "bus.xml"
    text = generate("flat", 64, base_port=20000).replace('name="s63"', 'name="edge"')
    config.write_text(text.replace('hostname="127.0.0.1">', 'hostname="10.0.0.9">', 1))
    out = tmp_path / "a3.xml"
    proc = plan_cli(
        str(six_groups), "--max-domain-size", "12", "--out", str(out),
        "--servers-from", str(config), "--stamps", "full", "--base-port", "30000", "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1  # --json: the JSON line only
    plan = load_config(out)
    assert sorted(plan.servers) == list(range(64))  # 60..63 sent nothing but are laid out
    assert plan.servers[63].name == "edge" and plan.servers[0].hostname == "10.0.0.9"
    assert {d.stamps for d in plan.domains.values()} == {"full"}
    assert min(n.port for s in plan.servers.values() for n in s.networks) == 30000
    Topology.from_config(plan)
    small = tmp_path / "small.xml"
    small.write_text(generate("flat", 10, base_port=20000))
    proc = plan_cli(
        str(six_groups), "--max-domain-size", "12", "--out", str(out),
        "--servers-from", str(small),
    )  # fmt: skip
    assert_one_clean_error(proc, "server(s) 10, 11, 12", "does not declare")


@pytest.mark.slow  # Spark or a subprocess
def test_bad_inputs_give_one_line_and_status_2(tmp_path: Path) -> None:
    out = str(tmp_path / "a3.xml")
    missing = plan_cli(str(tmp_path / "nowhere"), "--max-domain-size", "5", "--out", out)
    assert_one_clean_error(missing, "does not exist")
    # The checkout's old name runs the same code.
    alias = perf_cli("plan", str(tmp_path / "nowhere"), "--max-domain-size", "5", "--out", out)
    assert_one_clean_error(alias, "does not exist", prog="perf plan")
    assert alias.stderr.replace("perf plan:", "aaabus plan:", 1) == missing.stderr
    small_k = plan_cli(str(tmp_path), "--max-domain-size", "1", "--out", out)
    assert_one_clean_error(small_k, "--max-domain-size 1", "use 2 or more")
    empty = plan_cli(str(tmp_path), "--max-domain-size", "5", "--out", out)
    assert_one_clean_error(empty, "no traffic traces", "synth-traffic")
    (tmp_path / "traffic").mkdir()
    pq.write_table(traffic_table().drop_columns(["dst"]), tmp_path / "traffic" / "a.parquet")
    no_dst = plan_cli(str(tmp_path), "--max-domain-size", "5", "--out", out)
    assert_one_clean_error(no_dst, "lacks column(s) dst")
    pq.write_table(traffic_table(src=pa.array([1] * 4, pa.int64())), tmp_path / "traffic/a.parquet")
    wide_src = plan_cli(str(tmp_path), "--max-domain-size", "5", "--out", out)
    assert_one_clean_error(wide_src, "column src is int64, expected int32")
    table = traffic_table().replace_schema_metadata({"aaabus.schema_version": "9"})
    pq.write_table(table, tmp_path / "traffic" / "a.parquet")
    version = plan_cli(str(tmp_path), "--max-domain-size", "5", "--out", out)
    assert_one_clean_error(version, "schema version 9")
    busy_full = plan_cli(
        str(tmp_path), "--max-domain-size", "5", "--out", out, "--load", "busy", "--stamps", "full"
    )
    assert_one_clean_error(busy_full, "--load busy", "use --stamps delta")
    assert not (tmp_path / "spark-plan.log").exists()  # all refused before any JVM started
