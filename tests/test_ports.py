"""Port choice for test and benchmark buses: $AAABUS_PORT_RANGE, and one range per xdist worker."""

from __future__ import annotations

import itertools
import os

import pytest

from aaabus.config.admin_port import ADMIN_PORT_OFFSET
from aaabus.errors import LaunchError
from aaabus.tools.launch import PORT_RANGE_ENV, free_port_base, parse_port_range
from tests.support.harness import free_ports, worker_ports


def test_free_port_base_keeps_the_run_and_its_admin_ports_inside_the_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "21000-22100")
    for _ in range(20):
        base = free_port_base(6)
        assert base >= 21000 and base + 5 + ADMIN_PORT_OFFSET <= 22100


def test_a_range_too_narrow_for_the_admin_ports_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(PORT_RANGE_ENV, "21000-21500")
    with pytest.raises(LaunchError, match=f"widen {PORT_RANGE_ENV}"):
        free_port_base(3)


@pytest.mark.parametrize("spec", ["21000", "abc-def", "22000-21000", "80-9000", "21000-70000"])
def test_a_malformed_port_range_names_the_variable(spec: str) -> None:
    with pytest.raises(LaunchError, match=f"{PORT_RANGE_ENV}='{spec}'.*lo-hi"):
        parse_port_range(spec)


def test_each_xdist_worker_gets_disjoint_ports_admin_ports_included() -> None:
    workers = 4
    slices = [
        worker_ports({"PYTEST_XDIST_WORKER": f"gw{i}", "PYTEST_XDIST_WORKER_COUNT": str(workers)})
        for i in range(workers)
    ]
    spans = sorted(span for ports in slices for span in (ports.runs, ports.singles))
    for (_, hi), (next_lo, _) in itertools.pairwise(spans):
        assert hi < next_lo
    for ports in slices:
        lo, hi = ports.runs
        assert hi - lo + 1 > ADMIN_PORT_OFFSET + 64  # room for a run and its admin ports


def test_this_worker_exports_its_run_range_and_free_ports_come_from_its_singles() -> None:
    mine = worker_ports(os.environ)
    assert parse_port_range(os.environ[PORT_RANGE_ENV]) == mine.runs
    lo, hi = mine.singles
    ports = free_ports(3)
    assert len(set(ports)) == 3 and all(lo <= p <= hi for p in ports)
