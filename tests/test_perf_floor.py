"""The floor of a durable ping-pong (perf/floor.py), plain and with a mirror per side."""

from __future__ import annotations

from pathlib import Path

import pytest

from perf import floor
from perf.brokers import free_ports
from perf.peers import _child


@pytest.mark.parametrize("replicated", [False, True])
def test_the_floor_measures_every_round_and_a_mirror_writes_each_record(
    tmp_path: Path, replicated: bool
) -> None:
    rtts = floor.pingpong(
        _child, tmp_path, rounds=5, warmup=2, timeout=30.0, replicated=replicated, ports=free_ports
    )
    assert len(rtts) == 5 and all(rtt > 0 for rtt in rtts)
    mirrors = sorted(tmp_path.glob("mirror-*.journal"))
    if not replicated:
        assert mirrors == []
        return
    # One mirror per side, each having written (and synced) the 7 records of its side, in
    # place, from the start of its preallocated file.
    assert len(mirrors) == 2
    for path in mirrors:
        data = path.read_bytes()
        written = 7 * floor.RECORD_BYTES
        assert data[:written] == b"r" * written
        assert data[written : written + 1] == b"\0"
