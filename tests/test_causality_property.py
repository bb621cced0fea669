"""Random trees of domains, random gossip over an in-process bus of real servers (TCP on
127.0.0.1, in-memory stores), every link through a delaying proxy: the independent checker must
find nothing wrong.

Without delays TCP on one machine delivers in about the order things were sent, and a bus that
only kept each link's order (FIFO) would pass too. Each link here gets its own delay and jitter
(:class:`~aaabus.testing.proxy.FaultProxy`; jitter never reorders one link), so a message sent
on a slow link is overtaken by its causal successors relayed over fast ones, and only the
causal hold-back puts them back in order. The control runs the same traffic over domains that
ask for FIFO order only and must be caught by the checker: it shows the delays make the
overtaking happen (issue 48.3).
"""

from __future__ import annotations

import itertools
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aaabus.config.domains import Topology
from aaabus.config.reader import parse_config
from aaabus.config.secret import ensure_secret
from aaabus.config.topology import render
from aaabus.node.inprocess import InProcessBus
from aaabus.testing.checker import Report
from aaabus.testing.proxy import FaultProxy
from tests.support.gossip import deploy_gossipers, kick_all, wait_and_check
from tests.support.harness import contiguous_free_base

#: Link delays (seconds, and as much jitter again): a fast link and two slow ones.
DELAYS = (0.0, 0.02, 0.08)


@st.composite
def domain_trees(draw: st.DrawFn) -> list[list[int]]:
    """A random tree of 1-4 domains: each new domain hangs off one existing server (a router)."""
    layout: list[list[int]] = [list(range(draw(st.integers(2, 3))))]
    next_id = len(layout[0])
    for _ in range(draw(st.integers(0, 3))):
        servers = sorted({s for members in layout for s in members})
        router = draw(st.sampled_from(servers))
        own = draw(st.integers(1, 2))
        layout.append([router, *range(next_id, next_id + own)])
        next_id += own
    return layout


def pairs(layout: list[list[int]]) -> list[tuple[int, int]]:
    """The pairs of servers that share a domain (in a tree, exactly one)."""
    return sorted({(a, b) for members in layout for a, b in itertools.combinations(members, 2)})


@contextmanager
def delayed_bus(
    layout: list[list[int]], delays: dict[tuple[int, int], float], *, order: str, stamps: str
) -> Iterator[InProcessBus]:
    """An in-process bus of ``layout`` whose domains keep ``order`` with ``stamps``; servers
    ``a`` and ``b`` reach each other through proxies that delay by ``delays[a, b]`` plus as much
    jitter (each side dials through its own proxy: whichever dials, the link is delayed)."""
    servers = 1 + max(max(m) for m in layout)
    text = render(
        layout,
        servers,
        base_port=contiguous_free_base(sum(len(m) for m in layout)),
        properties={"aaabus.store": "memory", "aaabus.secret": "bus.key"},
    ).replace("<domain name=", f'<domain order="{order}" stamps="{stamps}" name=')
    plain = parse_config(text, "a3.xml")
    Topology.from_config(plain)  # the strategy only makes trees
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        used: dict[tuple[int, int], list[FaultProxy]] = {pair: [] for pair in delays}
        for (a, b), delay in delays.items():
            (domain,) = (d for d, m in zip(plain.domains, layout, strict=True) if {a, b} <= set(m))
            for me, peer in ((a, b), (b, a)):
                target = ("127.0.0.1", plain.servers[peer].port_in(domain))
                proxy = stack.enter_context(FaultProxy(target, name=f"s{me}-s{peer}", seed=me))
                proxy.set_delay(delay, jitter=delay)
                used[a, b].append(proxy)
                start = text.index(f'<server id="{me}"')
                end = text.index("</server>", start)
                dial = f'  <property name="aaabus.dial.{peer}" value="127.0.0.1:{proxy.port}"/>\n  '
                text = text[:end] + dial + text[end:]
        path = Path(tmp) / "a3.xml"
        path.write_text(text)
        ensure_secret(Path(tmp) / "bus.key")
        with InProcessBus(parse_config(text, str(path))) as bus:
            yield bus
        # The links really went through the proxies: the delays were applied.
        idle = [pair for pair, proxies in used.items() if not any(p.connections for p in proxies)]
        assert not idle, f"no connection through the proxies of {idle}"


def gossip(bus: InProcessBus, seed: int) -> Report:
    agents = deploy_gossipers(bus.servers, per_server=2, seed=seed)
    expected = kick_all(bus.servers, agents, count=3, ttl=4)
    return wait_and_check(bus.servers, expected)


@settings(
    max_examples=6,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    layout=domain_trees(),
    seed=st.integers(0, 1000),
    stamps=st.sampled_from(["delta", "full"]),
    data=st.data(),
)
def test_random_domain_trees_keep_causal_order_over_delayed_links(
    layout: list[list[int]], seed: int, stamps: str, data: st.DataObject
) -> None:
    delays = {
        pair: data.draw(st.sampled_from(DELAYS), label=f"delay {pair}") for pair in pairs(layout)
    }
    with delayed_bus(layout, delays, order="causal", stamps=stamps) as bus:
        report = gossip(bus, seed)
    assert report.ok, report.summary()


def test_the_control_fifo_order_over_the_same_links_is_caught() -> None:
    """One domain of three servers, one link slow: messages from s0 to s2 are overtaken by what
    they caused on s1. FIFO domains deliver them anyway, and the checker must say so."""
    layout = [[0, 1, 2]]
    delays = {(0, 1): 0.0, (1, 2): 0.0, (0, 2): DELAYS[-1]}
    with delayed_bus(layout, delays, order="fifo", stamps="delta") as bus:
        report = gossip(bus, seed=48)
    assert report.causal_violations, f"no causal violation under FIFO order: {report.summary()}"
    assert not (report.lost or report.duplicated or report.fifo_violations), report.summary()
