"""``perf mqtt --devices``: a server that dies under the load client is reported in one line with
its own account (exit status, last output), not as what the client then saw of it (issue 43: a
``KeyError: 'rss_bytes'`` from the zombie's /proc entry)."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from perf import mqttload
from perf.mqtt import AaabusMqtt, ScaleSettings, ServerFailed


def _wait_exited(pid: int, timeout: float = 10.0) -> None:
    """Until ``pid`` is a zombie (its parent, this process, has not reaped it)."""
    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline, f"process {pid} still running after SIGKILL"
        time.sleep(0.01)


def test_a_server_killed_under_the_idle_scenario_is_reported_with_its_exit_status() -> None:
    settings = ScaleSettings(
        connections=100,
        window=10,
        backlog=1000,
        connect_ms=5000,
        per_address=None,
        max_waiting=None,
    )
    opts = mqttload.Options(devices=4, idle_seconds=0.2, timeout=10.0)
    with (
        tempfile.TemporaryDirectory() as work,
        pytest.raises(ServerFailed) as failed,
        AaabusMqtt().scale(Path(work), settings) as target,
    ):
        os.kill(target.holder, signal.SIGKILL)
        _wait_exited(target.holder)
        mqttload.run_scenarios(target, opts, ["idle"], processes=2)
    message = str(failed.value)
    assert message.startswith(f"server 0 exited with status {-signal.SIGKILL}: ")
    assert "has exited" in message  # what the load client saw, after the server's account
    assert "\n" not in message
