"""aaabus in ``perf mqtt`` and ``perf edge`` (through its MQTT listener): tiny runs, the JSON
shape the issue asks for, and the edge scenario's verdict for aaabus (0 violations)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.harness import REPO_ROOT

# Server processes and proxies: not in the fast lane.
pytestmark = pytest.mark.slow


def perf(*args: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-m", "perf", *args, "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_perf_mqtt_measures_aaabus_with_the_paho_programs() -> None:
    result = perf(
        *("mqtt", "--systems", "aaabus", "--repetitions", "1", "--rounds", "20"),
        *("--warmup", "2", "--count", "200", "--window", "20"),
    )
    systems = result["systems"]
    assert isinstance(systems, dict)
    for qos in ("qos1", "qos2"):
        assert systems["aaabus"][qos]["msgs_per_s"] > 0
        assert systems["aaabus"][qos]["latency_ms"]["p50"] > 0
    # Without RabbitMQ in the run the ratios are null, but they are there, flat.
    assert set(result["ratios"]) >= {  # type: ignore[call-overload]
        "latency_qos1_vs_rabbitmq",
        "latency_qos2_vs_rabbitmq",
        "throughput_qos1_vs_rabbitmq",
        "throughput_qos2_vs_rabbitmq",
    }


def test_perf_edge_counts_no_violation_for_aaabus() -> None:
    result = perf("edge", "--systems", "aaabus", "--trials", "10", "--wan-ms", "5")
    assert result["trials"] == 10
    assert result["violations"] == {"aaabus": 0}
    assert result["lost"] == {"aaabus": 0}
