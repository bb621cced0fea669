"""The structured workload of ``python -m perf groups``: groups dealt as documented, and a small
real run whose counts are exact."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from perf.groups import active_of, groups_of
from tests.support.harness import REPO_ROOT


def test_groups_are_equal_shuffled_and_seeded() -> None:
    groups = groups_of(60, 6, seed=0)
    assert sorted(groups) == list(range(60))
    assert Counter(groups.values()) == {g: 10 for g in range(6)}
    # Shuffled: group mates are not runs of ids, which the generated layouts cut by.
    assert any(groups[i] != groups[i + 1] for i in range(0, 10))
    assert groups == groups_of(60, 6, seed=0)
    assert groups != groups_of(60, 6, seed=1)


def test_active_talkers_are_spread_over_the_groups() -> None:
    groups = groups_of(60, 6, seed=0)
    six = active_of(groups, 6)
    assert len(six) == 6 and {groups[s] for s in six} == set(range(6))
    assert active_of(groups, 0) == list(range(60))  # 0: everyone
    assert len(active_of(groups, 13)) == 13


@pytest.mark.slow
def test_a_small_run_counts_every_exchange_and_the_clock_bytes(tmp_path: Path) -> None:
    """8 real servers in 2 groups, flat and star (no observation, no Spark): every measured
    exchange is reported, most inside the groups, and each layout's clock bytes are counted."""
    argv = ["--servers", "8", "--groups", "2", "--count", "6", "--warmup", "2", "--observe", "0"]
    argv += ["--active", "0"]  # every talker drives: 8 x 6 exchanges
    argv += ["--layouts", "flat,star", "--max-domain-size", "4", "--workdir", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, "-m", "perf", "groups", *argv, "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in ("flat", "star"):
        layout = result["layouts"][name]
        assert layout["notes"] == 2 * 6 * 8  # a hello and its answer per measured exchange
        assert layout["inside_ms"]["n"] > layout["across_ms"]["n"]
        assert layout["latency_ms"]["p50"] > 0 and layout["clock_bytes_per_note"] > 0
        assert layout["cpu_us_per_note"] > 0
    assert result["predicted"] == {}  # no plan without an observation
    assert set(result["ranking"]["measured"]) == {"flat", "star"}


def test_bad_layout_is_one_line_and_status_2(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "perf", "groups", "--layouts", "flat,ring", "--json"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown layout(s) ring" in lines[0]
