"""Moving a drained bus to new domains (property aaabus.domains.rebuild): every agent and its state
is kept, the changed domains start afresh, and a domain still holding messages is refused."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from aaabus.config.reader import load_config
from aaabus.errors import StoreError
from aaabus.model.ids import AgentId
from aaabus.node.inprocess import InProcessBus
from aaabus.testing.workload import Bounce, Bouncer, Echo, More
from aaabus.tools.client import Client
from aaabus.tools.launch import Bus
from tests.support.bus import add_to_server, wait_json
from tests.support.harness import REPO_ROOT


def bouncer_of(bus: InProcessBus) -> Bouncer:
    """The one Bouncer stored on s0 (engine thread, through call)."""
    store = bus[0].store
    assert store is not None
    found = [a for a in store.agents.values() if isinstance(a, Bouncer)]
    assert len(found) == 1
    return found[0]


def pending(bus: InProcessBus) -> int:
    """Messages held back or not yet acknowledged, over every server of ``bus``."""
    total = 0
    for server in bus.servers.values():
        channel = server.channel
        assert channel is not None
        depths = server.call(channel.depths)
        total += depths["held_back"] + sum(depths["outgoing"].values())
    return total


def drain(bus: InProcessBus, timeout: float = 30.0) -> None:
    """Wait until ``bus`` is drained (the last acknowledgements ride on a timer, ~50 ms)."""
    deadline = time.monotonic() + timeout
    while pending(bus):
        assert time.monotonic() < deadline, f"{pending(bus)} message(s) still pending"
        time.sleep(0.05)


def test_a_drained_flat_bus_moves_to_two_domains_with_its_agents(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    done = tmp_path / "done.json"
    args = json.dumps({"echo": 2, "n": 30, "done": str(done)})
    service = f"<service class=\"aaabus.testing.workload:bounce_setup\" args='{args}'/>"
    flat = make_config(layout=[[0, 1, 2]], name="flat.xml")
    add_to_server(flat, 0, service)
    stores = tmp_path / "stores"
    with InProcessBus(load_config(flat), store_kind="log", storage_root=stores) as old:
        assert wait_json(done, [], 60) == {"count": 30, "errors": 0}
        drain(old)
    # The same servers and stores, now s0 - s1 - s2 through the router s1.
    split = make_config(
        layout=[[0, 1], [1, 2]], name="split.xml", properties={"aaabus.domains.rebuild": "true"}
    )
    add_to_server(split, 0, service)
    with InProcessBus(load_config(split), store_kind="log", storage_root=stores) as bus:
        before = bus[0].call(lambda: (bouncer_of(bus).count, bouncer_of(bus).errors))
        assert before == (30, 0)  # the agent and its state came through

        def longer() -> AgentId:
            bouncer = bouncer_of(bus)
            bouncer.n = 50
            return bouncer.id

        bouncer_id = bus[0].call(longer)
        done.unlink()
        bus[0].send(bouncer_id, Bounce(31))  # the bouncer takes it as the echo's answer
        # The Echo deployed on s2 before the move answers through the new router.
        assert wait_json(done, [], 60) == {"count": 50, "errors": 0}


def test_a_domain_that_still_holds_messages_is_refused(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    flat = make_config(layout=[[0, 1]], name="flat.xml")
    stores = tmp_path / "stores"
    with InProcessBus(load_config(flat), [0], store_kind="log", storage_root=stores) as bus:
        # s1 is not running: the creation of an agent there stays in s0's outgoing queue.
        bus[0].call(lambda: Echo().deploy(1))
    split = make_config(
        layout=[[0], [0, 1]], name="split.xml", properties={"aaabus.domains.rebuild": "true"}
    )
    refused = InProcessBus(load_config(split), [0], store_kind="log", storage_root=stores)
    with pytest.raises(StoreError, match="still hold 1 message"):
        refused.start()


def _holds(queues: dict[str, Any]) -> int:
    """Messages a server's status shows waiting: input, held back and outgoing."""
    return int(queues["input"] + queues["held_back"] + sum(queues["outgoing"].values()))


def _wait_drained(clients: dict[int, Client], timeout: float = 60.0) -> None:
    """The documented drain check: input, held and outgoing at 0 on every server, twice in a row
    some time apart (the last acknowledgements ride on a 50 ms timer)."""
    deadline = time.monotonic() + timeout
    quiet = 0
    pause = threading.Event()
    while quiet < 2:
        assert time.monotonic() < deadline, "the bus did not drain"
        depths = [c.status() for c in clients.values()]
        busy = [d["id"] for d in depths if _holds(d["queues"])]
        quiet = 0 if busy else quiet + 1
        pause.wait(0.3)  # status is polled from another process: nothing to wait on but time


@pytest.mark.slow
def test_real_servers_move_to_new_domains_and_the_agents_go_on(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """The procedure of docs/operations.md with real processes: drain, stop, rebuild, start."""
    done = tmp_path / "done.json"
    flat = make_config(layout=[[0, 1, 2]], name="flat.xml")
    stores = tmp_path / "stores"
    with Bus(flat, [0, 1, 2], stores, cwd=REPO_ROOT) as bus:
        clients = {sid: Client(flat, sid, timeout=30) for sid in bus.servers}
        try:
            bouncer = clients[0].deploy(Bouncer(2, 30, str(done)), server=0)
            assert wait_json(done, bus.servers.values(), 60) == {"count": 30, "errors": 0}
            _wait_drained(clients)
        finally:
            for client in clients.values():
                client.close()
    # Same ids, stores and keys; now s0 - s1 - s2 through the router s1, on new ports.
    split = make_config(
        layout=[[0, 1], [1, 2]], name="split.xml", properties={"aaabus.domains.rebuild": "true"}
    )
    done.unlink()
    with Bus(split, [0, 1, 2], stores, cwd=REPO_ROOT) as bus:
        with Client(split, 0, timeout=30) as client:
            # The bouncer kept its count and its echo (deployed on s2 under the old domains):
            # twenty more bounces go through the new router and continue from 30 without error.
            client.send(bouncer, More(20))
            assert wait_json(done, bus.servers.values(), 60) == {"count": 50, "errors": 0}
            status = client.status()
        assert sorted(status["domains"]) == ["D0"]
