"""The servers-domains graph (aaabus.config.domains): tree validation, clock indexes, routes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aaabus.config.domains import Hop, Topology
from aaabus.config.reader import load_config
from aaabus.errors import ConfigError


def make(
    tmp_path: Path,
    domains: list[str],
    servers: dict[int, list[str]],
    names: dict[int, str] | None = None,
) -> Path:
    """Write an a3.xml: one line per domain, then per server one line ``<server>`` and one line
    per ``<network>``; ports are numbered in document order."""
    lines = ["<config>"]
    lines += [f'  <domain name="{d}"/>' for d in domains]
    port = 20000
    for sid, member_of in servers.items():
        name = f' name="{names[sid]}"' if names and sid in names else ""
        lines.append(f'  <server id="{sid}"{name}>')
        for d in member_of:
            lines.append(f'    <network domain="{d}" port="{port}"/>')
            port += 1
        lines.append("  </server>")
    lines.append("</config>")
    path = tmp_path / "a3.xml"
    path.write_text("\n".join(lines) + "\n")
    return path


def refused(path: Path) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        Topology.from_config(load_config(path))
    assert "\n" not in str(info.value)
    return info.value


TWO_ROUTERS = (["D1", "D2"], {0: ["D1"], 2: ["D1", "D2"], 3: ["D1", "D2"], 4: ["D2"]})
TRIANGLE = (["D1", "D2", "D3"], {0: ["D1", "D2"], 1: ["D2", "D3"], 2: ["D3", "D1"], 3: ["D1"]})
SQUARE = (
    ["A", "B", "C", "D"],
    {1: ["A", "B"], 2: ["B", "C"], 3: ["C", "D"], 4: ["D", "A"], 5: ["C"]},
)


@pytest.mark.parametrize(
    ("shape", "cycle", "line"),
    [
        # lines: <config>=1, domains, then servers; the reported line is the cycle's last network
        (TWO_ROUTERS, "cycle: D1 -s2- D2 -s3- D1;", 13),
        (TRIANGLE, "cycle: D1 -s0- D2 -s1- D3 -s2- D1;", 15),
        (SQUARE, "cycle: A -s1- B -s2- C -s3- D -s4- A;", 20),
    ],
    ids=["two-domains-two-routers", "three-pairwise", "loop-of-four"],
)
def test_cycles_are_refused_and_named(
    tmp_path: Path, shape: tuple[list[str], dict[int, list[str]]], cycle: str, line: int
) -> None:
    path = make(tmp_path, *shape)
    err = refused(path)
    assert err.message.startswith(cycle), err.message
    assert "remove one <network> element" in err.message
    assert err.where == f"{path}:{line}"
    # The test-only switch lets the same graph through, with shortest-path routes.
    topo = Topology.from_config(load_config(path), allow_cycles=True)
    for src in topo.cfg.servers:
        for dst in topo.cfg.servers:
            hops = topo.route(src, dst)
            assert (hops[-1].server if hops else src) == dst
            here = src
            for hop in hops:
                assert hop.domain in topo.domains_of(here)
                assert hop.domain in topo.domains_of(hop.server)
                here = hop.server
    assert "cycles allowed" in topo.describe()


def test_cycle_uses_server_names(tmp_path: Path) -> None:
    path = make(tmp_path, *TWO_ROUTERS, names={2: "gw"})
    assert refused(path).message.startswith("cycle: D1 -gw- D2 -s3- D1;")


def test_cycle_named_from_first_domain_in_document_order(tmp_path: Path) -> None:
    path = make(tmp_path, ["Z", "A", "M"], {0: ["M", "A"], 1: ["A", "Z"], 2: ["Z", "M"]})
    assert refused(path).message.startswith("cycle: Z -s1- A -s0- M -s2- Z;")


def test_unreachable_server(tmp_path: Path) -> None:
    path = make(tmp_path, ["D1", "D2", "D3"], {0: ["D1"], 1: ["D1", "D2"], 2: ["D3"], 3: ["D3"]})
    err = refused(path)
    assert err.message.startswith(
        "server s2 (id 2) cannot reach server s0 (id 0): its domains D3 are cut off from "
        "domains D1, D2;"
    )
    assert err.where == f"{path}:12"


def test_empty_domain(tmp_path: Path) -> None:
    path = make(tmp_path, ["D1", "D2"], {0: ["D1"], 1: ["D1"]})
    err = refused(path)
    assert err.message.startswith("domain D2 has no member;")
    assert err.where == f"{path}:3"


def test_server_in_no_domain(tmp_path: Path) -> None:
    path = make(tmp_path, ["D1"], {0: ["D1"], 1: []})
    err = refused(path)
    assert err.message.startswith("server s1 (id 1) is in no domain;")
    assert err.where == f"{path}:6"


# A small tree:   [D1: s0 s1 (s2)] -s2- [D2: s2 s3 (s4)] -s4- [D3: s4 s5]
#                                        \-s3- [D4: s3 s6]
TREE = (
    ["D1", "D2", "D3", "D4"],
    {
        6: ["D4"],
        0: ["D1"],
        1: ["D1"],
        2: ["D1", "D2"],
        3: ["D2", "D4"],
        4: ["D2", "D3"],
        5: ["D3"],
    },
)


def test_tree_queries(tmp_path: Path) -> None:
    topo = Topology.from_config(load_config(make(tmp_path, *TREE)))
    assert dict(topo.domains) == {
        "D1": (0, 1, 2),
        "D2": (2, 3, 4),
        "D3": (4, 5),
        "D4": (3, 6),
    }
    assert topo.routers == (2, 3, 4)
    assert topo.domains_of(3) == ("D2", "D4")
    assert topo.is_router(4) and not topo.is_router(5)
    assert topo.domains["D2"].index(4) == 2  # a server's row in its domain's clock
    assert topo.domains["D4"].index(6) == 1
    assert topo.neighbours(2) == (0, 1, 3, 4)
    assert topo.neighbours(6) == (3,)
    assert topo.next_hop(0, 1) == Hop(1, "D1")
    assert topo.next_hop(0, 5) == Hop(2, "D1")
    assert topo.route(0, 5) == [Hop(2, "D1"), Hop(4, "D2"), Hop(5, "D3")]
    assert topo.route(5, 6) == [Hop(4, "D3"), Hop(3, "D2"), Hop(6, "D4")]
    assert topo.route(3, 3) == []
    with pytest.raises(ValueError):
        topo.next_hop(1, 1)
    table = topo.routes_from(6)
    assert list(table) == [0, 1, 2, 3, 4, 5]
    assert set(table.values()) == {Hop(3, "D4")}
    assert "s3 (3): D2, D4" in topo.describe()
    data = topo.to_json()
    assert json.loads(json.dumps(data)) == data
    assert data["routes"]["0"]["5"] == {"via": 2, "domain": "D1"}
    assert [r["id"] for r in data["routers"]] == [2, 3, 4]


def test_single_server(tmp_path: Path) -> None:
    topo = Topology.from_config(load_config(make(tmp_path, ["D0"], {0: ["D0"]})))
    assert topo.routes_from(0) == {}
    assert topo.routers == ()
    assert topo.neighbours(0) == ()
    assert "s0 (0)" in topo.describe()
