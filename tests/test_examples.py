"""Every example runs in one command, on its own bus, and exits 0 having done what it says."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.harness import REPO_ROOT

# Real server processes, subprocesses or Spark: not in the fast lane (make check).
pytestmark = pytest.mark.slow

EXPECTED = {
    "hello": ["deployed a Greeter on server 1", "hello #1, world", "hello #2, again"],
    "chat": [
        "[fifo] Carol reads: Bob: At the station",
        "the answer came before the question!",
        "[causal] Carol's server holds back 1 message",
        "Carol's view makes sense",
    ],
    "firewall": [
        "monitor got 50 lines from firewall s4",
        "ALERT: 10.0.0.66 refused by firewalls [1, 2, 3, 4]",
        "all servers stopped",
    ],
    "topics_causal": [
        "[fifo] auditor reads: shipments/42 shipped",
        "a shipment of an unknown order!",
        "[causal] the router holds back 1 message",
        "[causal] auditor reads: orders/42 placed",
        "the auditor's view makes sense",
    ],
    "bank": [
        "SIGKILL the router (s1)",
        "South received 2000 credits (0 out of order)",
        "total 20000 (opened with 20000): conserved",
    ],
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", f"examples.{name}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    for line in EXPECTED[name]:
        assert line in run.stdout, run.stdout
