"""The failpoint walk at the process level: SIGKILL instead of an exception.

An exception at a step is undone by the transaction; a crash is undone by the store and by the
peers' resends, which is a different path. It differs only where durability changes hands:
just before the commit (``engine.commit``: the group is lost, its inputs are still stored),
after its frames left early but before it is durable (``channel.sent_early``: the peer may
be reacting to frames that no longer exist, and must drop them), before a batch is written to
the network (``channel.flush``: early frames not yet sent, or, after the commit, the durability
notice and acks) and after it is written but before any ack came back (``channel.flushed``: the
peer may have them; the restarted sender sends them again and the peer must drop the copies).
Each of these four is tried on every server a scenario crosses: the sender, a router, the
receiver (for the deploy scenario, the server creating the agent).

Real ``aaabus-server`` processes on 127.0.0.1 with log stores (the default) on disk; the test
arms a failpoint through the admin port (the servers are started with ``AAABUS_FAILPOINTS`` set,
their opt-in), waits for the victim to die by SIGKILL, restarts it, and waits until every queue
of the bus is empty. At the end the stores are opened in this process and the independent
checker judges every run; each run's outcome must equal that of a run without a crash.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aaabus import AgentId, Client
from aaabus.config.reader import load_config
from aaabus.config.secret import ensure_secret
from aaabus.config.topology import render
from aaabus.errors import ServerUnreachable
from aaabus.node.inprocess import InProcessBus
from aaabus.testing.crash import stop_all
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, TEST_TRUST, contiguous_free_base
from tests.support.walk import Actor, Directory, Run, Scenario, scenarios, start_step

pytestmark = pytest.mark.slow

LAYOUT = [[0, 1, 2], [2, 3]]
HOME, PEER, ROUTER, FAR = 0, 1, 2, 3
BY_NAME = {s.name: s for s in scenarios(home=HOME, peer=PEER, router=ROUTER, far=FAR)}
#: The steps where a crash differs from an exception (see the module docstring).
CRASH_STEPS = ("engine.commit", "channel.sent_early", "channel.flush", "channel.flushed")
#: scenario -> the servers it crosses, each of which is crashed in turn.
VICTIMS = {"remote": (HOME, PEER), "router": (HOME, ROUTER, FAR), "deploy": (HOME, ROUTER, FAR)}
CASES = [
    (name, step, victim)
    for name, victims in VICTIMS.items()
    for step in CRASH_STEPS
    for victim in victims
]


@dataclass
class KillBus:
    bus: Bus
    config: Path
    stores: Path
    clients: dict[int, Client]


@pytest.fixture(scope="module")
def kill_bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KillBus]:
    tmp = tmp_path_factory.mktemp("kill-walk")
    properties = {
        "aaabus.secret": "bus.key",
        "aaabus.engine.max_group_ms": "50",
        "aaabus.trust": TEST_TRUST,
    }
    config = tmp / "a3.xml"
    config.write_text(render(LAYOUT, 4, base_port=contiguous_free_base(5), properties=properties))
    ensure_secret(tmp / "bus.key")
    env = dict(os.environ, AAABUS_FAILPOINTS="")  # set, empty: arming allowed, nothing armed
    bus = Bus(config, range(4), tmp / "stores", env=env, cwd=REPO_ROOT)
    clients = {sid: Client(config, sid, timeout=30) for sid in range(4)}
    try:
        bus.start(timeout=60)
        yield KillBus(bus, config, tmp / "stores", clients)
    finally:
        for client in clients.values():
            client.close()
        stop_all(bus)


def _snapshot(clients: dict[int, Client]) -> tuple[Any, ...]:
    """(queued messages, per-server counters) of the whole bus."""
    queued = 0
    counters = []
    for sid, client in sorted(clients.items()):
        status = client.status()
        queues = status["queues"]
        queued += queues["input"] + queues["held_back"] + sum(queues["outgoing"].values())
        counters.append((sid, status["messages"]["sent"], status["messages"]["delivered"]))
    return queued, tuple(counters)


def wait_quiet(clients: dict[int, Client], timeout: float = 60.0) -> None:
    """Wait until no queue of the bus holds a message, twice in a row with the same counters.

    Not the sent/delivered balance of the in-process walk: a restarted server's counters
    start again from zero. A message is always in some queue until its reaction commits (the
    sender's outgoing queue until the receiver's ack, the receiver's input queue until its
    reaction), so empty queues with counters that did not move mean nothing is under way.
    """
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    last: tuple[Any, ...] | None = None
    while True:
        now = _snapshot(clients)
        if now[0] == 0 and now == last:
            return
        last = now
        if time.monotonic() > deadline:
            raise AssertionError(f"bus not quiet after {timeout}s: {now}")
        pause.wait(0.05)  # the state polled lives in other processes


def setup_run(kb: KillBus, scenario: Scenario, prefix: str) -> AgentId:
    """Deploy the scenario's actors through the admin ports; the id of the first one."""
    ids = {
        f"{prefix}{name}": kb.clients[sid].deploy(Actor(f"{prefix}{name}"), sid)
        for name, sid in scenario.actors.items()
    }
    for aid in ids.values():
        kb.clients[aid.server].send(aid, Directory(ids))
    wait_quiet(kb.clients)
    return ids[f"{prefix}{scenario.start}"]


def wait_killed(kb: KillBus, victim: int, timeout: float = 20.0) -> int | None:
    proc = kb.bus[victim]
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while proc.running() and time.monotonic() < deadline:
        pause.wait(0.02)  # waiting for another process to die: nothing to wait on but time
    assert proc.proc is not None
    return proc.proc.poll()


def crash_run(kb: KillBus, scenario: Scenario, prefix: str, step: str, victim: int) -> None:
    first = setup_run(kb, scenario, prefix)
    kb.clients[victim].arm_failpoints(f"{step}:kill:0")
    start = start_step(scenario, prefix)
    request = f"{prefix}kick"
    # The kick itself may be what crashes the victim (its commit): the client then cannot know
    # whether it was accepted, and asks again with the same request id after the restart.
    kicker = Client(kb.config, first.server, timeout=2)
    try:
        kicked = True
        try:
            kicker.send(first, start, request_id=request)
        except ServerUnreachable:
            kicked = False
        code = wait_killed(kb, victim)
        assert code == -9, f"{step} on server {victim} did not kill it (exit {code})"
        kb.bus[victim].start().wait_ready(60)
        if not kicked:
            kb.clients[first.server].send(first, start, request_id=request)
    finally:
        kicker.close()
    wait_quiet(kb.clients)


def test_every_crash_step_on_every_server_a_scenario_crosses(kill_bus: KillBus) -> None:
    kb = kill_bus
    clean = {}
    for name in VICTIMS:
        prefix = f"clean.{name}."
        first = setup_run(kb, BY_NAME[name], prefix)
        kb.clients[first.server].send(first, start_step(BY_NAME[name], prefix))
        wait_quiet(kb.clients)
        clean[name] = prefix
    crashed = {}
    for name, step, victim in CASES:
        prefix = f"{name}.{step}.s{victim}."
        crash_run(kb, BY_NAME[name], prefix, step, victim)
        crashed[(name, step, victim)] = prefix
    codes = stop_all(kb.bus)
    assert all(code == 0 for code in codes.values()), codes

    # Post-mortem: the stores, opened in this process, are the evidence.
    config = load_config(kb.config)
    kind = config.setting(min(config.servers), "aaabus.store")  # what the processes used
    with InProcessBus(config, store_kind=kind, storage_root=kb.stores) as bus:
        expected = {}
        for name, prefix in clean.items():
            run = Run(bus.servers, BY_NAME[name], prefix)
            histories = run.histories()
            assert run.report(histories).ok, (name, run.report(histories).summary())
            expected[name] = run.outcome(histories)
        failures = []
        for (name, step, victim), prefix in crashed.items():
            run = Run(bus.servers, BY_NAME[name], prefix)
            histories = run.histories()
            report = run.report(histories)
            if not report.ok:
                failures.append(f"{name} × {step} on s{victim}: {report.summary()}")
            elif run.outcome(histories) != expected[name]:
                failures.append(
                    f"{name} × {step} on s{victim}: outcome {run.outcome(histories)} "
                    f"!= {expected[name]}"
                )
    assert not failures, "\n".join(failures)
    assert len(crashed) == len(CASES) == 32  # 4 steps x 8 (scenario, victim) pairs
