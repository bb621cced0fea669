"""``perf safety`` (issue 42): a real three-node RabbitMQ cluster beside aaabus with and without
a replica, tiny counts. RabbitMQ and pika are required here (``make peers`` installs them): their
absence fails the test with that sentence rather than skipping what it proves. Marked
``brokers``: `make test` leaves it out (CI has no brokers), `make peers` runs it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aaabus.config.topology import generate
from perf.brokers import find_binary
from tests.support.harness import REPO_ROOT, contiguous_free_base

pytestmark = [pytest.mark.slow, pytest.mark.brokers]


def _require_rabbitmq() -> None:
    if find_binary("rabbitmq-server") is None:
        pytest.fail("rabbitmq-server is not installed: `make peers` installs it")
    if importlib.util.find_spec("pika") is None:
        pytest.fail("pika is not installed: `make peers` installs it (extra 'peers')")


def _processes_naming(text: str) -> list[str]:
    """Command lines of live processes that contain ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if text in cmdline:
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


def test_safety_measures_both_and_leaves_no_node_behind(tmp_path: Path) -> None:
    _require_rabbitmq()
    config = tmp_path / "flat-2.xml"
    config.write_text(generate("flat", 2, base_port=contiguous_free_base(2)))
    tiny = ["--rounds", "10", "--warmup", "2", "--count", "200", "--kill-count", "60", "--json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "perf", "safety", "--config", str(config), *tiny],
        cwd=REPO_ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    for side in ("aaabus", "aaabus_replica"):
        assert out[side]["pingpong_ms"]["p50"] > 0 and out[side]["stream_msgs_per_s"] > 0
        assert out[side]["stream_out_of_order"] == 0
    theirs = out["rabbitmq_quorum"]
    assert theirs["nodes"] == [f"safety-{proc.pid}-{n}@localhost" for n in "abc"]
    assert theirs["pingpong_ms"]["p50"] > 0 and theirs["stream_msgs_per_s"] > 0
    kill = theirs["kill"]
    assert kill["killed"] in theirs["nodes"] and kill["messages"] == kill["confirmed"] == 60
    assert kill["recover_ms"] > 0 and kill["lost"] >= 0 and kill["duplicated"] >= 0
    assert kill["received"] == kill["confirmed"] - kill["lost"] + kill["duplicated"]
    # Not built yet: a null, never a figure.
    assert out["aaabus_failover"] is None and out["lost"]["aaabus_failover"] is None
    assert set(out["ratios"]) == {
        "pingpong_p50_replica_vs_without",
        "stream_replica_vs_without",
        "pingpong_p50_replica_vs_rabbitmq_quorum",
        "floor_p50_mirrored_vs_plain",
        "pingpong_p50_vs_floor",
        "pingpong_p50_replica_vs_mirrored_floor",
    }
    assert all(value is None or value > 0 for value in out["ratios"].values())
    assert out["ratios"]["stream_replica_vs_without"] == pytest.approx(
        out["aaabus_replica"]["stream_msgs_per_s"] / out["aaabus"]["stream_msgs_per_s"], rel=0.01
    )
    assert set(out["acceptance"]) >= {"pingpong_replica_le_1_5x", "stream_replica_ge_0_7x"}
    # Every process of the cluster (epmd and three nodes, each a process group) is gone.
    assert len(theirs["pids"]) == 4
    for pid in theirs["pids"]:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)
    assert _processes_naming(f"safety-{proc.pid}-") == []
