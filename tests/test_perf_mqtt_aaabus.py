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
    assert result["protocols"] == ["3.1.1", "5.0"]  # both by default
    for figures in (systems["aaabus"], systems["aaabus"]["mqtt5"]):
        for qos in ("qos1", "qos2"):
            assert figures[qos]["msgs_per_s"] > 0
            assert figures[qos]["latency_ms"]["p50"] > 0
    # Without RabbitMQ in the run the ratios to it are null, but they are there, flat; what
    # 5.0 costs against 3.1.1 is measured in the same run.
    ratios = result["ratios"]
    assert isinstance(ratios, dict)
    assert set(ratios) >= {
        "latency_qos1_vs_rabbitmq",
        "latency_qos2_vs_rabbitmq",
        "throughput_qos1_vs_rabbitmq",
        "throughput_qos2_vs_rabbitmq",
    }
    for level in (1, 2):
        assert ratios[f"mqtt5_cost_qos{level}_vs_mqtt311"] > 0
        assert ratios[f"mqtt5_latency_qos{level}_vs_mqtt311"] > 0


def test_perf_mqtt_breakdown_accounts_for_the_server_side_of_a_round_trip() -> None:
    result = perf(
        *("mqtt", "--breakdown", "--systems", "aaabus"),
        *("--repetitions", "1", "--rounds", "30", "--warmup", "5"),
    )
    parts = result["breakdown_us"]
    assert isinstance(parts, dict)
    # Every stage of a QoS 1 publication was passed (the log store reports its write and sync;
    # the subscriber's PUBACK of the previous round rides along: ``acks``), each took time, and
    # together they are the server's part, within the round trip.
    stages = [
        *("parse", "batch_wait", "handoff", "acks", "ops", "reaction", "commit_prepare"),
        "write",
        *("sync", "commit_finish", "loop_delay", "answer", "delivery"),
    ]
    assert set(parts) == {*stages, "server", "clients_and_wire"}
    assert all(parts[stage] >= 0 for stage in stages)
    assert parts["sync"] > 0 and parts["write"] > 0
    assert 0 < parts["server"] < float(result["latency_ms_p50"]) * 1000  # type: ignore[arg-type]
    assert parts["clients_and_wire"] > 0
    # A batch the listener's loop runs itself writes the subscriber's PUBLISH before the
    # publisher's PUBACK (aaabus.mqtt.batches); with one message at a time, the loop runs most.
    batches = result["batches"]
    assert isinstance(batches, dict)
    assert 0 < batches["run_by_the_loop"] <= batches["traced"]
    assert batches["delivered_before_answered"] == batches["run_by_the_loop"]
    # The same run's floor: a durable write here, and the clients' part.
    floor = result["floor"]
    assert isinstance(floor, dict) and floor["write_sync_us_p50"] > 0
    assert floor["floor_ms"] * 1000 > parts["clients_and_wire"]
    assert floor["rabbitmq_mqtt_qos1_p50_ms"] is None  # not asked for
    assert result["ratios"]["qos1_p50_vs_floor"] > 0  # type: ignore[index]


def test_perf_mqtt_protocol_option_runs_one_version_and_refuses_others() -> None:
    result = perf(
        *("mqtt", "--systems", "aaabus", "--repetitions", "1", "--rounds", "5"),
        *("--warmup", "1", "--count", "50", "--window", "10", "--protocol", "5"),
    )
    systems = result["systems"]
    assert isinstance(systems, dict)
    assert result["protocols"] == ["5.0"]
    assert systems["aaabus"]["mqtt5"]["qos1"]["msgs_per_s"] > 0
    assert systems["aaabus"]["qos1"]["msgs_per_s"] is None  # 3.1.1 not run
    done = subprocess.run(
        [sys.executable, "-m", "perf", "mqtt", "--protocol", "4", "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert "--protocol '4'" in done.stderr


def test_perf_edge_counts_no_violation_for_aaabus() -> None:
    result = perf("edge", "--systems", "aaabus", "--trials", "10", "--wan-ms", "5")
    assert result["trials"] == 10
    assert result["violations"] == {"aaabus": 0}
    assert result["lost"] == {"aaabus": 0}
