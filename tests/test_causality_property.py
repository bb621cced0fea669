"""Random trees of domains, random gossip over an in-process bus of real servers (TCP on
127.0.0.1, in-memory stores): the independent checker must find nothing wrong."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aaabus.config.domains import Topology
from aaabus.config.reader import parse_config
from aaabus.config.topology import render
from aaabus.node.inprocess import InProcessBus
from tests.support.gossip import deploy_gossipers, kick_all, wait_and_check
from tests.support.harness import contiguous_free_base


@st.composite
def domain_trees(draw: st.DrawFn) -> list[list[int]]:
    """A random tree of 1-4 domains: each new domain hangs off one existing server (a router)."""
    layout: list[list[int]] = [list(range(draw(st.integers(1, 3))))]
    next_id = len(layout[0])
    for _ in range(draw(st.integers(0, 3))):
        servers = sorted({s for members in layout for s in members})
        router = draw(st.sampled_from(servers))
        own = draw(st.integers(1, 2))
        layout.append([router, *range(next_id, next_id + own)])
        next_id += own
    return layout


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(layout=domain_trees(), seed=st.integers(0, 1000), stamps=st.sampled_from(["delta", "full"]))
def test_random_domain_trees_keep_causal_order(
    layout: list[list[int]], seed: int, stamps: str
) -> None:
    servers = 1 + max(max(m) for m in layout)
    text = render(
        layout,
        servers,
        base_port=contiguous_free_base(sum(len(m) for m in layout)),
        properties={"aaabus.store": "memory", "aaabus.secret": "bus.key"},
    ).replace("<domain name=", f'<domain stamps="{stamps}" name=')
    import tempfile
    from pathlib import Path

    from aaabus.config.secret import ensure_secret

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "a3.xml"
        path.write_text(text)
        ensure_secret(Path(tmp) / "bus.key")
        config = parse_config(text, str(path))
        Topology.from_config(config)  # the strategy only makes trees
        with InProcessBus(config) as bus:
            agents = deploy_gossipers(bus.servers, per_server=2, seed=seed)
            expected = kick_all(bus.servers, agents, count=3, ttl=4)
            report = wait_and_check(bus.servers, expected)
    assert report.ok, report.summary()
