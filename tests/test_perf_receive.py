"""``python -m perf receive`` on tiny counts: the documented JSON, and what gathering is for."""

from __future__ import annotations

import json
import subprocess
import sys

from perf.receive import measure
from tests.support.commands import cli
from tests.support.harness import REPO_ROOT


def test_perf_receive_prints_the_documented_json() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "perf", "receive", "--json", "--count", "400", "--repeat", "1"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["count"] == 400 and result["group"] == 64
    assert set(result["us_per_msg"]) == {"1", "10", "100", "200"}
    assert all(us > 0 for us in result["us_per_msg"].values())


def test_every_message_of_every_burst_is_delivered_by_the_measured_path() -> None:
    # measure() raises unless each frame was delivered exactly once, in events of any size,
    # commits falling inside events as well as between them.
    for burst in (1, 3, 64, 65):
        assert measure(count=390, burst=burst, group=64) > 0


def test_bad_arguments_are_one_line() -> None:
    run = cli("perf", "receive", "--bursts", "1,x", timeout=60)
    assert run.returncode != 0
    assert run.stderr.strip().splitlines() == [
        "perf receive: error: --bursts takes integers, got '1,x'"
    ]
