"""``aaabus analyze`` and ``aaabus plan`` on a real Spark standalone cluster (a master and a
worker started from the installed pyspark, on 127.0.0.1): the results equal those of
``local[2]``. The local runs go through the checkout's ``python -m perf`` names, the cluster's
through ``aaabus``: the same code, the same JSON.

Slow (about 100 s on the 2-core machine): four drivers and a cluster start.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from perf.cluster import standalone_cluster
from perf.synth import Law, write_traces
from perf.synth_traffic import write_traffic

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

LAWS = [
    Law("flat", "full", "remote", 0.003, 0.02, 1.0),
    Law("star", "full", "remote", 0.0, 0.04, 2.0),
]


def cli(tool: str, env: dict[str, str], *args: str) -> dict[str, Any]:
    """The JSON line of ``python -m TOOL ARGS`` (``aaabus`` or ``perf``), which must succeed."""
    proc = subprocess.run(
        [sys.executable, "-m", tool, *args],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def same_rows(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.keys() == y.keys()
        for key, value in x.items():
            if isinstance(value, float) and not math.isnan(value):
                assert y[key] == pytest.approx(value, rel=1e-9), key
            elif isinstance(value, float):
                assert math.isnan(y[key]), key
            else:
                assert y[key] == value, key


def pids_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def test_analyze_and_plan_on_a_standalone_cluster_equal_local(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    write_traces(sweep, LAWS, range(10, 61, 10), rows=1500, seed=3, noise=0.08)
    traffic = tmp_path / "traffic"
    write_traffic(traffic, 40_000, servers=40, groups=4, seed=8)
    local = cli("perf", {}, "analyze", str(sweep), "--out", str(tmp_path / "rep-local"),
                "--master", "local[2]")  # fmt: skip
    plan_local = cli("perf", {}, "plan", str(traffic), "--max-domain-size", "12",
                     "--out", str(tmp_path / "local.xml"), "--json")  # fmt: skip
    pids: list[int] = []
    with standalone_cluster(tmp_path / "cluster") as cluster:
        pids = list(cluster.pids)
        assert len(pids_alive(pids)) == 2
        remote = cli("aaabus", cluster.env, "analyze", str(sweep), "--out",
                     str(tmp_path / "rep-cl"), "--master", cluster.url)  # fmt: skip
        plan_remote = cli("aaabus", cluster.env, "plan", str(traffic), "--max-domain-size", "12",
                          "--out", str(tmp_path / "cluster.xml"), "--master", cluster.url,
                          "--json")  # fmt: skip
        apps = cluster.status()["completedapps"]
    assert pids_alive(pids) == []  # both JVMs stopped, by PID
    # The jobs ran on the cluster: the master saw both applications finish, and the worker
    # launched executor JVMs for them (their logs are in its work directory).
    assert sorted(a["name"] for a in apps) == ["aaabus-analyze", "aaabus-plan"]
    assert all(a["state"] == "FINISHED" and a["cores"] >= 1 for a in apps)
    assert len(list((tmp_path / "cluster" / "work").glob("app-*/*/stderr"))) >= 2
    # Same results, whatever the master.
    assert {k: remote[k] for k in ("rows", "hop_rows", "points", "series")} == {
        k: local[k] for k in ("rows", "hop_rows", "points", "series")
    }
    for table in ("points", "fits", "ratios"):
        same_rows(
            pq.read_table(tmp_path / "rep-local" / f"{table}.parquet").to_pylist(),
            pq.read_table(tmp_path / "rep-cl" / f"{table}.parquet").to_pylist(),
        )
    assert (tmp_path / "local.xml").read_text() == (tmp_path / "cluster.xml").read_text()
    for key in ("rows", "servers", "notes", "predicted", "layouts", "tree"):
        assert plan_remote[key] == plan_local[key], key
    assert plan_remote["master"] == cluster.url


def test_cluster_jvms_are_stopped_when_the_block_fails(tmp_path: Path) -> None:
    pids: list[int] = []
    with pytest.raises(RuntimeError, match="a failing test"), standalone_cluster(tmp_path) as c:
        pids = list(c.pids)
        assert c.status()["aliveworkers"] == 1
        raise RuntimeError("a failing test")
    assert len(pids) == 2 and pids_alive(pids) == []
