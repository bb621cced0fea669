"""``perf peers`` without brokers: unreachable peers are skipped, aaabus is still measured, and the
JSON line carries null ratios. No RabbitMQ, Mosquitto, pika or paho-mqtt is needed here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aaabus.config.topology import generate
from perf.peers import PEERS, ratios
from tests.support.harness import REPO_ROOT, contiguous_free_base, free_ports


@pytest.mark.slow
def test_unreachable_brokers_are_skipped_and_aaabus_is_measured(tmp_path: Path) -> None:
    # Own ports for the bus: other suites may be using domains/flat-2.xml's fixed ones.
    config = tmp_path / "flat-2.xml"
    config.write_text(generate("flat", 2, base_port=contiguous_free_base(2)))
    rabbit_port, mqtt_port = free_ports(2)  # nothing listens there
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "perf",
            "peers",
            "--config",
            str(config),
            "--repetitions",
            "1",
            "--rounds",
            "5",
            "--warmup",
            "1",
            "--count",
            "50",
            "--rabbitmq",
            f"127.0.0.1:{rabbit_port}",
            "--mosquitto",
            f"127.0.0.1:{mqtt_port}",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipping rabbitmq" in proc.stderr and "skipping mosquitto" in proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["skipped"]) == set(PEERS)
    assert out["failed"] == {}
    ours = out["systems"]["aaabus"]
    assert ours["pingpong_ms"]["p50"] > 0 and ours["stream_msgs_per_s"] > 0
    assert len(out["runs"]["aaabus"]) == 1 and out["runs"]["aaabus"][0]["pingpong"]["rounds"] == 5
    assert all(out["systems"][peer] is None for peer in PEERS)
    # The floor (two processes, a sync per hop, no bus) ran beside it and its ratio is given.
    floor = out["runs"]["floor"][0]["pingpong"]
    assert floor["rounds"] == 5 and floor["rtt_ms"]["p50"] > 0
    assert out["ratios"]["pingpong_vs_floor"] == pytest.approx(
        ours["pingpong_ms"]["p50"] / out["systems"]["floor"]["pingpong_ms"]["p50"]
    )
    for key in ("pingpong_vs_rabbitmq", "stream_vs_rabbitmq", "pingpong_vs_mosquitto_qos2"):
        assert out["ratios"][key] is None
    # The driver's server measured its own CPU over the measured rounds; set against the floor.
    cpu = out["runs"]["aaabus"][0]["pingpong"]["driver_cpu_us_per_round"]
    # (The kernel splits a short window's CPU between user and system by its ticks: only the
    # sum is sure to grow.)
    assert cpu["user"] >= 0 and cpu["system"] >= 0 and cpu["user"] + cpu["system"] > 0
    assert ours["pingpong_driver_cpu_us"] == pytest.approx(cpu["user"] + cpu["system"])
    assert out["ratios"]["driver_cpu_vs_floor"] == pytest.approx(
        ours["pingpong_driver_cpu_us"] / (out["systems"]["floor"]["pingpong_ms"]["p50"] * 1000)
    )


def test_ratios_divide_times_and_rates_the_documented_way() -> None:
    ours: dict[str, Any] = {"pingpong_ms": {"p50": 4.0}, "stream_msgs_per_s": 3000.0}
    systems: dict[str, dict[str, Any] | None] = {
        "aaabus": ours,
        "rabbitmq": {"pingpong_ms": {"p50": 2.0}, "stream_msgs_per_s": 1000.0},
        "mosquitto_qos2": None,
        "mosquitto_qos0": {"pingpong_ms": {"p50": 8.0}, "stream_msgs_per_s": 6000.0},
    }
    got = ratios(systems)
    assert got["pingpong_vs_floor"] is None and got["floor_vs_rabbitmq"] is None
    assert got["driver_cpu_vs_floor"] is None
    systems["floor"] = {"pingpong_ms": {"p50": 1.0}, "stream_msgs_per_s": None}
    ours["pingpong_driver_cpu_us"] = 1500.0
    got = ratios(systems)
    assert got["pingpong_vs_floor"] == 4.0 and got["floor_vs_rabbitmq"] == 0.5
    assert got["driver_cpu_vs_floor"] == 1.5  # µs of CPU against the floor's ms
    assert got["pingpong_vs_rabbitmq"] == 2.0 and got["stream_vs_rabbitmq"] == 3.0
    assert got["pingpong_vs_mosquitto_qos2"] is None and got["stream_vs_mosquitto_qos2"] is None
    assert got["pingpong_vs_mosquitto_qos0"] == 0.5 and got["stream_vs_mosquitto_qos0"] == 0.5
