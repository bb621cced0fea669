"""``python -m perf roam``: its counting, its refusals, and a short run of each system (the device
moves, a site is SIGKILLed and restarted) with the JSON the issue asks for."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from perf.brokers import find_binary
from perf.roam import out_of_order
from tests.support.harness import REPO_ROOT

needs_mosquitto = pytest.mark.skipif(
    find_binary("mosquitto") is None, reason="mosquitto is not installed (`make peers`)"
)


def test_out_of_order_counts_first_arrivals_below_the_highest_seen() -> None:
    assert out_of_order([0, 1, 2, 3]) == 0
    assert out_of_order([0, 2, 1, 3]) == 1
    # A duplicate of something already there is a duplicate, not a violation.
    assert out_of_order([0, 1, 2, 1, 0, 3]) == 0
    assert out_of_order([3, 0, 1, 2]) == 3


def _roam(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "perf", "roam", "--json", *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_bad_options_are_refused_in_one_line() -> None:
    done = _roam("--systems", "nats")
    assert done.returncode != 0
    assert done.stderr.strip().count("\n") == 0 and "unknown system" in done.stderr
    done = _roam("--moves", "0")
    assert done.returncode != 0 and "--moves" in done.stderr


def _systems(done: subprocess.CompletedProcess[str]) -> dict[str, dict[str, int]]:
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["suite"] == "roam"
    systems: dict[str, dict[str, int]] = result["systems"]
    for figures in systems.values():
        assert {"moves", "messages", "lost", "duplicated", "violations"} <= set(figures)
    return systems


@pytest.mark.slow
def test_aaabus_delivers_every_message_once_in_order_across_moves_and_kills() -> None:
    done = _roam(
        "--systems", "aaabus", "--moves", "4", "--messages", "120", "--dwell", "0.5",
        "--kill-every", "2", "--quiet", "20",
    )  # fmt: skip
    figures = _systems(done)["aaabus"]
    assert figures["kills"] == 1
    assert (figures["lost"], figures["duplicated"], figures["violations"]) == (0, 0, 0), figures


@pytest.mark.slow
@needs_mosquitto
def test_mosquitto_bridges_run_the_same_scenario_and_are_counted() -> None:
    done = _roam(
        "--systems", "mosquitto_bridges", "--moves", "4", "--messages", "120", "--dwell", "0.5",
        "--kill-every", "2", "--quiet", "3",
    )  # fmt: skip
    figures = _systems(done)["mosquitto_bridges"]
    assert figures["moves"] == 4 and figures["messages"] == 120 and figures["kills"] == 1
    # The device went back to a broker that had queued for it meanwhile: that broker's session
    # delivers again what another broker already delivered.
    assert figures["duplicated"] > 0, figures
