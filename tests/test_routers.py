"""Causality domains joined by routers, with real server processes."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aaabus.testing.proxy import FaultProxy
from aaabus.tools.launch import Bus
from tests.support.bus import add_to_server, wait_json
from tests.support.harness import REPO_ROOT

# Real server processes, subprocesses or Spark: not in the fast lane (make check).
pytestmark = pytest.mark.slow

# Three domains in a line: A1's server s0 in D0, A2's s2 in D1, A3's s4 in D2; s1 and s3 route.
#   D0 [s0 s1]   D1 [s1 s2 s3]   D2 [s3 s4]
LINE = [[0, 1], [1, 2, 3], [3, 4]]


def figure13_across_domains(
    tmp_path: Path, make_config: Callable[..., Path], order: str
) -> list[str]:
    config = make_config(layout=LINE, domain_attrs=f'order="{order}"')
    from aaabus.config.reader import load_config

    cfg = load_config(config)
    out = tmp_path / "order.json"
    # n1 travels s0 -> s1 -> s3 -> s4 and n3 travels s2 -> s3 -> s4: slow down the link between
    # the two routers, which only n1 crosses.
    proxy = FaultProxy(("127.0.0.1", cfg.servers[3].port_in("D1")), name="s1-s3")
    try:
        proxy.set_delay(0.3)
        add_to_server(config, 1, f'<property name="aaabus.dial.3" value="127.0.0.1:{proxy.port}"/>')
        args = json.dumps({"a2": 2, "a3": 4, "out": str(out)})
        service = f"<service class=\"tests.support.agents:fig13_setup\" args='{args}'/>"
        add_to_server(config, 0, service)
        with Bus(config, range(5), tmp_path / "store", cwd=REPO_ROOT) as bus:
            labels = wait_json(out, bus.servers.values(), 60)
        assert proxy.connections >= 1
        return labels
    finally:
        proxy.stop()


def test_figure13_across_three_domains(tmp_path: Path, make_config: Callable[..., Path]) -> None:
    assert figure13_across_domains(tmp_path, make_config, "causal") == ["n1", "n3"]


def test_figure13_across_domains_reorders_without_causal_order(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    assert figure13_across_domains(tmp_path, make_config, "fifo") == ["n3", "n1"]


def bouncing_through(
    tmp_path: Path,
    make_config: Callable[..., Path],
    layout: list[list[int]],
    driver: int,
    echo: int,
    router: int,
    seed: int,
) -> dict[str, Any]:
    done = tmp_path / "done.json"
    config = make_config(layout=layout)
    args = json.dumps({"echo": echo, "n": 1000, "done": str(done)})
    add_to_server(
        config, driver, f"<service class=\"aaabus.testing.workload:bounce_setup\" args='{args}'/>"
    )
    rng = random.Random(seed)
    servers = sorted({s for members in layout for s in members})
    kills = 0
    with Bus(config, servers, tmp_path / "store", cwd=REPO_ROOT) as bus:
        for _ in range(3):
            threading.Event().wait(rng.uniform(0.1, 0.5))  # a random moment: the fault schedule
            if done.exists():
                break
            bus[router].kill()
            kills += 1
            bus[router].start().wait_ready(30)
        result = wait_json(done, bus.servers.values(), 120)
    assert kills >= 1, "the run ended before any router was killed"
    return result


def test_chain_across_a_bus_of_four_domains_survives_router_kills(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    # s0 -> s2 -> s4 -> s6 -> s8: four domains, three routers; s4 is killed during the traffic.
    bus4 = [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 8]]
    result = bouncing_through(tmp_path, make_config, bus4, driver=0, echo=8, router=4, seed=11)
    assert result == {"count": 1000, "errors": 0}


def test_chain_across_a_star_survives_hub_kills(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    star = [[0, 1, 2], [0, 3, 4], [0, 5, 6]]
    result = bouncing_through(tmp_path, make_config, star, driver=1, echo=6, router=0, seed=12)
    assert result == {"count": 1000, "errors": 0}


@pytest.mark.parametrize(
    ("kind", "servers", "size"), [("flat", 4, 10), ("bus", 7, 3), ("star", 7, 3), ("tree", 13, 4)]
)
def test_check_accepts_generated_topologies(
    tmp_path: Path, kind: str, servers: int, size: int
) -> None:
    gen = subprocess.run(
        [
            sys.executable,
            "-m",
            "aaabus",
            "topology",
            kind,
            "--servers",
            str(servers),
            "--domain-size",
            str(size),
            "--base-port",
            "20000",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    path = tmp_path / "a3.xml"
    path.write_text(gen.stdout)
    check = subprocess.run(
        [sys.executable, "-m", "aaabus", "check", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr
    data = json.loads(check.stdout)
    assert data["tree"] is True
    assert {m["id"] for d in data["domains"] for m in d["members"]} == set(range(servers))


def test_check_refuses_a_cycle_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "a3.xml"
    path.write_text(
        """<config>
  <domain name="D1"/><domain name="D2"/>
  <server id="0"><network domain="D1" port="20001"/></server>
  <server id="2"><network domain="D1" port="20002"/><network domain="D2" port="20003"/></server>
  <server id="3"><network domain="D1" port="20004"/><network domain="D2" port="20005"/></server>
</config>
"""
    )
    check = subprocess.run(
        [sys.executable, "-m", "aaabus", "check", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 2
    lines = check.stderr.strip().splitlines()
    assert len(lines) == 1 and "cycle: D1 -s2- D2 -s3- D1" in lines[0], check.stderr
