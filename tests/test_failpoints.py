"""Every failure point of a group, tried against every scenario.

Each step the engine and the channel take on the way to a commit, or to the network after it,
is a named failpoint (aaabus.core.failpoints.STEPS). A clean run of each scenario first counts which
failpoints it goes through, on which server; then, for every (scenario, server, failpoint)
reached, the scenario runs again with that failpoint raising once, at its first hit and at a
hit in the middle. The independent checker must find the history exact (no phantom, nothing
lost, nothing twice, causal order), the bus's counters must balance (every committed send
delivered once), and the outcome must equal the clean run's: a step that failed once is retried
as if the failure never happened (a failure that repeats is the documented error path of a
reaction, covered by tests/test_engine.py and tests/test_atomicity.py).

One bus (four servers, two domains, server 2 routing between them, FileStorage on disk) serves
the whole walk: every run deploys fresh actors, so a fault that left anything behind would also
show in the runs after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aaabus import AgentServer
from aaabus.config.reader import load_config, parse_config
from aaabus.config.secret import ensure_secret
from aaabus.config.topology import render
from aaabus.core.failpoints import STEPS, Failpoints
from aaabus.errors import FailpointError
from aaabus.node.inprocess import InProcessBus
from aaabus.testing.proxy import FaultProxy
from tests.support.harness import TEST_TRUST, contiguous_free_base
from tests.support.walk import Run, Scenario, scenarios, wait_idle

LAYOUT = [[0, 1, 2], [2, 3]]
SCENARIOS = scenarios(home=0, peer=1, router=2, far=3)
#: Delay on the link from server 0 to server 2 during the holdback scenario.
SLOW_LINK_S = 0.1


@dataclass
class WalkBus:
    bus: InProcessBus
    slow: FaultProxy


@pytest.fixture(scope="module", params=["log", "file"])
def walk_bus(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WalkBus]:
    """The walk's bus, on each kind of store: the log store's queues are its journal's side
    records, the file store's are ZODB objects."""
    tmp = tmp_path_factory.mktemp("walk")
    properties = {
        "aaabus.secret": "bus.key",
        "aaabus.engine.max_group_ms": "50",
        "aaabus.trust": TEST_TRUST,
    }
    text = render(LAYOUT, 4, base_port=contiguous_free_base(5), properties=properties)
    router_port = parse_config(text).servers[2].port_in("D0")
    slow = FaultProxy(("127.0.0.1", router_port), "walk-slow-link")
    try:
        # Server 0 dials server 2 through the proxy (the holdback scenario delays it).
        at = text.index('<server id="0"')
        at = text.index("</server>", at)
        dial = f'  <property name="aaabus.dial.2" value="127.0.0.1:{slow.port}"/>\n  '
        text = text[:at] + dial + text[at:]
        path = tmp / "a3.xml"
        path.write_text(text)
        ensure_secret(tmp / "bus.key")
        config = parse_config(text, str(path))
        with InProcessBus(config, store_kind=request.param, storage_root=tmp) as bus:
            # Links up before the walk: a run must not depend on when a link comes up.
            for name in ("router", "holdback"):
                run = Run(bus.servers, next(s for s in SCENARIOS if s.name == name), f"{name}.")
                run.setup()
                run.kick()
                wait_idle(bus.servers)
            yield WalkBus(bus, slow)
    finally:
        slow.stop()


class Walk:
    def __init__(self, walk_bus: WalkBus) -> None:
        self.bus = walk_bus.bus
        self.slow = walk_bus.slow
        self.runs = 0

    def run(
        self, scenario: Scenario, arm: tuple[int, str, int] | None, counting: bool = False
    ) -> tuple[Any, int]:
        """Run ``scenario``, with failpoint (server, name, skip) raising once; (outcome, fired)."""
        self.runs += 1
        run = Run(self.bus.servers, scenario, f"r{self.runs}.")
        run.setup()
        failpoints: Failpoints | None = None
        if arm is not None:
            sid, name, skip = arm
            engine = self.bus[sid].engine
            assert engine is not None
            failpoints = engine.failpoints
            failpoints.arm(name, "raise", skip=skip)
        if counting:
            for server in self.bus.servers.values():
                assert server.engine is not None
                server.engine.failpoints.arm_all("count")
        try:
            self.slow.set_delay(SLOW_LINK_S if scenario.slow_link else 0.0)
            run.kick()
            wait_idle(self.bus.servers)
        finally:
            self.slow.set_delay(0.0)
            fired = failpoints.fired(arm[1]) if failpoints is not None and arm else 0
            if failpoints is not None:
                failpoints.disarm()
        histories = run.histories()
        report = run.report(histories)
        assert report.ok, f"{scenario.name} {arm}: {report.summary()}"
        return run.outcome(histories), fired

    def count(self, scenario: Scenario) -> tuple[Any, dict[tuple[int, str], int]]:
        """A clean run counting failpoint hits per (server, failpoint)."""
        try:
            outcome, _ = self.run(scenario, None, counting=True)
            hits = {
                (sid, name): n
                for sid, server in self.bus.servers.items()
                if server.engine is not None
                for name, n in server.engine.failpoints.hits.items()
                if n
            }
        finally:
            for server in self.bus.servers.values():
                if server.engine is not None:
                    server.engine.failpoints.disarm()
        return outcome, hits


@pytest.mark.slow
def test_every_failpoint_fails_every_scenario_cleanly(walk_bus: WalkBus) -> None:
    walk = Walk(walk_bus)
    started = time.monotonic()
    reached: set[str] = set()
    tried = fired_total = 0
    for scenario in SCENARIOS:
        reference, hits = walk.count(scenario)
        assert hits, f"scenario {scenario.name} reached no failpoint"
        for (sid, name), n in sorted(hits.items()):
            reached.add(name)
            for skip in sorted({0, n // 2}):
                outcome, fired = walk.run(scenario, (sid, name, skip))
                tried += 1
                fired_total += fired
                if not fired:
                    continue  # timing moved the hits (an ack batched differently): nothing failed
                assert outcome == reference, f"{scenario.name} {(sid, name, skip)}"
    print(
        f"\nfailpoint walk: {len(SCENARIOS)} scenarios, {len(reached)} failpoints reached, "
        f"{tried} faulty runs ({fired_total} fired), {time.monotonic() - started:.1f} s"
    )
    assert reached == set(STEPS), f"never reached: {sorted(set(STEPS) - reached)}"
    # Almost every armed failpoint must really fire, or the walk tests nothing.
    assert fired_total >= 0.9 * tried


def test_failpoints_cost_one_test_when_off_and_refuse_unknown_names() -> None:
    points = Failpoints()
    assert not points.armed
    points.hit("engine.commit")  # unarmed: nothing happens
    with pytest.raises(ValueError, match=r"unknown failpoint 'engine\.nope'"):
        points.arm("engine.nope")
    points.arm("engine.commit", skip=1, times=2)
    points.hit("engine.commit")  # skipped
    for _ in range(2):
        with pytest.raises(FailpointError, match=r"failpoint engine\.commit"):
            points.hit("engine.commit")
    points.hit("engine.commit")  # times exhausted
    assert points.fired("engine.commit") == 2 and points.hits["engine.commit"] == 4
    points.disarm()
    assert not points.armed


def test_failpoints_from_the_environment_are_checked(tmp_path: Path) -> None:
    from aaabus.errors import ConfigError

    points = Failpoints()
    points.arm_from_text("channel.flush:raise:2:3, engine.commit:count")
    assert points.armed
    for bad in ("channel.flush", "channel.flush:explode", "channel.flush:raise:x", "x:raise"):
        with pytest.raises(ConfigError, match="AAABUS_FAILPOINTS: bad failpoint"):
            Failpoints().arm_from_text(bad)


def test_arming_a_running_server_needs_the_operators_opt_in(
    tmp_path: Path, make_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from aaabus.errors import ConfigError

    config = load_config(make_config())
    monkeypatch.delenv("AAABUS_FAILPOINTS", raising=False)
    closed = AgentServer(config, 0, storage=tmp_path / "closed")
    closed.start()
    try:
        with pytest.raises(ConfigError, match="failpoints are off"):
            closed.arm_failpoints("engine.commit:raise")
    finally:
        closed.stop()
    monkeypatch.setenv("AAABUS_FAILPOINTS", "")
    opened = AgentServer(config, 0, storage=tmp_path / "opened")
    opened.start()
    try:
        opened.arm_failpoints("engine.commit:raise")
        assert opened.call(lambda: "done") == "done"  # its group failed once, then replayed
        assert opened.engine is not None and opened.engine.failpoints.fired("engine.commit") == 1
    finally:
        opened.stop()
