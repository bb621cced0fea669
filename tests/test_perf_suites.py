"""The perf suites themselves, on tiny runs: they launch real servers, produce the documented
JSON, write traces of the documented schema, resume, and clean up."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from aaabus.analysis.schema import HOP_SCHEMA, RTT_SCHEMA, SCHEMA_VERSION
from aaabus.config.topology import generate
from aaabus.core.trace import REPLICA_STAGES, STAGES
from aaabus.tools.launch import free_port_base
from tests.support.commands import cli
from tests.support.harness import REPO_ROOT

# Real server processes, subprocesses or Spark: not in the fast lane (make check).
pytestmark = pytest.mark.slow


def shipped(tmp_path: Path, kind: str, servers: int, domain_size: int = 10) -> str:
    """The topology of a config in domains/, on ports free now (the shipped ones are fixed)."""
    path = tmp_path / f"{kind}-{servers}.xml"
    base = free_port_base(3 * servers + 3)
    path.write_text(generate(kind, servers, domain_size=domain_size, base_port=base))
    return str(path)


def perf(*args: str, timeout: float = 300) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "perf", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pingpong_local_json_shape(tmp_path: Path) -> None:
    config = shipped(tmp_path, "flat", 1)
    out = perf("pingpong", "--config", config, "--test", "local", "--rounds", "50", "--json")
    assert out["test"] == "local" and out["servers"] == 1 and out["rounds"] == 50
    assert out["hops"] == 0
    rtt = out["rtt_ms"]
    assert 0 < rtt["p50"] <= rtt["p90"] <= rtt["p99"] and rtt["mean"] > 0


def test_pingpong_through_routers_reports_hops(tmp_path: Path) -> None:
    # bus-10: D0 = s0..s3, D1 = s3..s6, D2 = s6..s9, so s0 -> s9 crosses two routers.
    out = perf(
        "pingpong",
        "--config",
        shipped(tmp_path, "bus", 10, domain_size=4),
        "--test",
        "remote",
        "--rounds",
        "20",
        "--warmup",
        "5",
        "--json",
    )
    assert out["servers"] == 10 and out["hops"] == 3 and out["rounds"] == 20


def test_pingpong_with_a_sync_replica_per_server(tmp_path: Path) -> None:
    """``--replicas 1``: every server gets a replica process (issue 42), whose store then holds
    the run's commits (kept with --workdir)."""
    work = tmp_path / "work"
    out = perf(
        *("pingpong", "--config", shipped(tmp_path, "flat", 2), "--test", "remote"),
        *("--rounds", "30", "--warmup", "5", "--replicas", "1", "--workdir", str(work), "--json"),
    )
    assert out["replicas"] == 1 and out["rounds"] == 30 and out["rtt_ms"]["p50"] > 0
    for sid in (0, 1):
        assert any((work / "store" / f"s{sid}r1" / "log").glob("*.seg")), sid


def test_pingpong_compares_store_kinds_interleaved(tmp_path: Path) -> None:
    config = shipped(tmp_path, "flat", 1)
    args = ["--config", config, "--rounds", "20", "--warmup", "5", "--repeat", "1", "--json"]
    out = perf("pingpong", "--stores", "log,file", *args)
    assert set(out["p50_ms"]) == {"log", "file"} and out["repeat"] == 1
    ratio = out["p50_ms"]["log"] / out["p50_ms"]["file"]  # of rounded p50s: close, not equal
    assert abs(out["log_vs_file"] - ratio) < 0.01 * ratio
    bad = subprocess.run(
        [sys.executable, "-m", "perf", "pingpong", "--stores", "log,disk", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "perf pingpong: error: --stores log,disk: expected two or more of log, file, memory"
    ]


def test_stream_counts_every_notification_in_order(tmp_path: Path) -> None:
    config = shipped(tmp_path, "flat", 2)
    out = perf("stream", "--config", config, "--count", "3000", "--json")
    assert out["count"] == 3000 and out["out_of_order"] == 0 and out["msgs_per_s"] > 0
    # Two log stores, each at least its head segment (4 MiB), neither anywhere near 1 GB.
    assert set(out["store_bytes"]) == {"0", "1"}
    assert all(4 << 20 <= size < 1 << 30 for size in out["store_bytes"].values())


def test_windowed_stream_is_complete_and_sampled(tmp_path: Path) -> None:
    # A window smaller than a burst: the producer stalls and restarts on credits many times.
    config = shipped(tmp_path, "flat", 2)
    samples = tmp_path / "samples.jsonl"
    args = ["--count", "3000", "--window", "100", "--burst", "200"]
    sampling = ["--sample-every", "0.2", "--samples", str(samples), "--json"]
    out = perf("stream", "--config", config, *args, *sampling)
    assert out["count"] == 3000 and out["out_of_order"] == 0
    lines = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(lines) == out["samples"]["count"] >= 1
    assert all(line["rss_bytes"]["0"] > 0 and line["rss_bytes"]["1"] > 0 for line in lines)
    assert out["samples"]["store_bytes_max"]["0"] >= lines[-1]["store_bytes"]["0"] > 0


def test_pingpong_breakdown_splits_one_hop(tmp_path: Path) -> None:
    config = shipped(tmp_path, "flat", 2)
    args = ["--test", "remote", "--rounds", "30", "--warmup", "5", "--breakdown", "--json"]
    out = perf("pingpong", "--config", config, *args)
    parts = out["breakdown_us"]
    assert parts["hop"] == round(out["rtt_ms"]["p50"] * 500, 1)
    assert parts["commit"] > 0 and parts["clock_stamp"] > 0 and parts["group_hops"] >= 1
    # The default log store reports its write and sync apart: every stage of a hop was passed.
    stages = [stage for _mark, stage in STAGES]
    assert all(parts[stage] >= 0 for stage in stages), parts
    assert parts["sync"] > 0 and parts["commit_prepare"] > 0 and parts["reaction"] > 0
    assert "commit_io" not in parts
    assert "replica" not in parts  # no replicas, no replicated commits
    # Early frames (the default): the frame's path ends as its group's commit starts.
    assert parts["path"] == stages[: stages.index("send_early") + 1], parts
    total = sum(parts[stage] for stage in parts["path"]) + parts["wire"]
    assert abs(total - parts["hop"]) < 0.5 + 0.1 * len(stages)  # each p50 was rounded


def test_pingpong_breakdown_splits_a_replicated_commit(tmp_path: Path) -> None:
    config = shipped(tmp_path, "flat", 2)
    args = ["--test", "remote", "--rounds", "30", "--warmup", "5", "--breakdown", "--json"]
    out = perf("pingpong", "--config", config, *args, "--replicas", "1")
    parts = out["breakdown_us"]["replica"]
    # Both sides left their marks for the same commits, in order: the replica syncs after it
    # has the records and before its acknowledgement leaves; the primary reads it after that.
    assert [name for name in parts if name != "waited"] == [s for _m, s in REPLICA_STAGES]
    assert all(value >= 0 for value in parts.values()), parts
    assert parts["replica_sync"] > 0 and parts["ship"] > 0 and parts["ack_back"] > 0
    # The commit's wait starts after the primary's own sync, so it is shorter than the path.
    assert parts["waited"] < sum(value for name, value in parts.items() if name != "waited")


def test_sweep_writes_traces_and_resumes(tmp_path: Path) -> None:
    args = [
        "sweep",
        "--topologies",
        "flat,star",
        "--sizes",
        "3",
        "--domain-size",
        "2",
        "--tests",
        "local,remote",
        "--clock-modes",
        "delta,full",
        "--rounds",
        "5",
        "--warmup",
        "2",
        "--out",
        str(tmp_path),
    ]
    first = perf(*args)
    assert first == {"points": 4, "ran": 4, "rows": 4 * 2 * 5, "out": str(tmp_path), "failed": []}
    # Real processes run on the bus's default store, as an operator's bus would.
    base = (tmp_path / "work" / "flat-3-delta" / "base.xml").read_text()
    assert '<property name="aaabus.store" value="log"/>' in base
    rtt = pq.read_table(tmp_path / "rtt")
    assert set(RTT_SCHEMA.names) <= set(rtt.column_names) and rtt.num_rows == 40
    assert set(rtt.column("schema_version").to_pylist()) == {SCHEMA_VERSION}
    assert set(rtt.column("clock_mode").to_pylist()) == {"delta", "full"}
    assert set(rtt.column("topology").to_pylist()) == {"flat", "star"}
    hops = pq.read_table(tmp_path / "hops")
    assert set(HOP_SCHEMA.names) <= set(hops.column_names) and hops.num_rows > 0
    sends = [
        b
        for e, b in zip(
            hops.column("event").to_pylist(), hops.column("stamp_bytes").to_pylist(), strict=True
        )
        if e == "send"
    ]
    assert sends and all(b > 0 for b in sends)
    again = perf(*args)
    assert again["ran"] == 0 and again["points"] == 4
    assert not list((tmp_path / "work").glob("*/store")), "finished points keep no stores"


def test_sweep_in_process(tmp_path: Path) -> None:
    out = perf(
        "sweep",
        "--topologies",
        "tree",
        "--sizes",
        "7",
        "--domain-size",
        "3",
        "--tests",
        "broadcast",
        "--clock-modes",
        "delta",
        "--rounds",
        "5",
        "--warmup",
        "1",
        "--inprocess",
        "--out",
        str(tmp_path),
    )
    assert out["points"] == 1 and out["rows"] == 5
    rtt = pq.read_table(tmp_path / "rtt")
    assert set(rtt.column("process_mode").to_pylist()) == {"inprocess"}
    assert set(rtt.column("hops").to_pylist()) == {2}  # a tree of domains of 3: s0 -> leaf


def test_a_failed_point_is_reported_and_the_sweep_goes_on(tmp_path: Path) -> None:
    # A timeout far too short for a million rounds: each point fails alone, in one line, and
    # is not recorded as done, so that the same command retries it. The stores are on disk
    # (`--store log`), as a real sweep's are: a failed point must leave none behind, or its
    # retry would deliver the failed attempt's pings and time them as round trips.
    args = ["sweep", "--topologies", "flat,tree", "--sizes", "3", "--domain-size", "2",
            "--tests", "local", "--clock-modes", "delta", "--rounds", "1000000", "--inprocess",
            "--store", "log", "--timeout", "0.001", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "perf", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    failures = [line for line in proc.stderr.splitlines() if "failed (TimeoutError" in line]
    assert [line.split()[3] for line in failures] == ["flat-3-delta", "tree-3-delta"]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["failed"] == ["flat-3-delta", "tree-3-delta"] and last["rows"] == 0
    assert not (tmp_path / "points.jsonl").exists()
    assert (tmp_path / "work" / "flat-3-delta" / "base.xml").exists()  # the point did start
    assert not list((tmp_path / "work").glob("*/store")), "a failed point keeps no stores"


def test_analyze_end_to_end_on_a_tiny_real_sweep(tmp_path: Path) -> None:
    traces, report = tmp_path / "traces", tmp_path / "report"
    sweep = perf(
        "sweep", "--topologies", "flat,star", "--sizes", "3,5,7", "--domain-size", "3",
        "--tests", "remote", "--clock-modes", "delta", "--rounds", "8", "--warmup", "2",
        "--inprocess", "--out", str(traces),
    )  # fmt: skip
    assert sweep["points"] == 6 and sweep["rows"] == 48
    out = perf("analyze", str(traces), "--out", str(report), "--master", "local[2]")
    assert out["rows"] == 48 and out["series"] == 2
    text = (report / "report.md").read_text()
    assert "flat" in text and "star" in text and str(traces) in text
    assert (report / "rtt_remote.png").stat().st_size > 0
    assert (report / "points.csv").exists()


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (read from /proc: no extra dependency)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def test_sigterm_stops_the_sweep_and_every_server_it_started(tmp_path: Path) -> None:
    args = ["sweep", "--topologies", "flat", "--sizes", "2", "--tests", "remote",
            "--clock-modes", "delta", "--rounds", "1000000", "--out", str(tmp_path)]  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-m", "perf", *args],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        servers: list[int] = []
        while len(servers) < 2:  # both server processes of the point exist
            assert proc.poll() is None and time.monotonic() < deadline, "servers never started"
            servers = _children(proc.pid)
            threading.Event().wait(0.1)  # another process's state: nothing to block on
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted; every server started was stopped" in err and "Traceback" not in err
    assert not [pid for pid in servers if Path(f"/proc/{pid}").exists()]


def test_codecs_suite_reports_each_candidate_per_notification(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from perf.__main__ import main

    assert main(["codecs", "--number", "200", "--repeat", "1"]) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["codecs"]
    assert rows[0]["notification"] == "ping-pong ball" and len(rows) == 4
    candidates = ("aaabus", "msgpack", "cbor2", "pickle", "restricted")
    for row in rows:
        assert row["aaabus_bytes"] > 0 and all(row[f"{c}_us"] > 0 for c in candidates)


def test_topics_suite_reports_one_remote_fanout_and_stream() -> None:
    out = perf(
        "topics",
        "--count",
        "200",
        "--fanout-count",
        "20",
        "--subscribers",
        "6",
        "--servers",
        "3",
        "--rounds",
        "20",
        "--peers",
        "mosquitto",
        "--json",
    )
    assert out["one_remote"]["deliveries"] == 200 and out["one_remote"]["out_of_order"] == 0
    assert out["fanout"]["deliveries"] == 20 * 6 and out["fanout"]["out_of_order"] == 0
    assert out["msgs_per_s"] == out["one_remote"]["msgs_per_s"] > 0
    for lat in (out["latency_ms"], out["fanout"]["latency_ms"], out["fanout"]["latency_ms_loaded"]):
        assert 0 < lat["p50"] <= lat["p99"]
    assert out["stream"]["count"] == 200 and out["ratio_to_stream"] > 0
    # The peer ran the same two fan-outs with MQTT subscribers (or says why it could not).
    if "mosquitto" in out["skipped"]:
        assert "not installed" in out["skipped"]["mosquitto"]
    else:
        peer = out["peers"]["mosquitto"]
        assert peer["one_remote"]["deliveries"] == 200 and peer["one_remote"]["missing"] == 0
        assert peer["fanout"]["deliveries"] == 20 * 6 and peer["fanout"]["missing"] == 0
        assert out["ratios"]["one_remote_vs_mosquitto"] > 0
        assert out["ratios"]["fanout_vs_mosquitto"] > 0


def test_topics_suite_refuses_an_unknown_peer_in_one_line() -> None:
    done = cli("perf", "topics", "--peers", "nats", timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0 and "unknown peer" in done.stderr
