"""Moving a drained bus to new domains (property aaabus.domains.rebuild): every agent and its state
is kept, the changed domains start afresh, and a domain still holding messages is refused."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from aaabus.config.reader import load_config
from aaabus.errors import StoreError
from aaabus.model.ids import AgentId
from aaabus.node.inprocess import InProcessBus
from aaabus.testing.workload import Bounce, Bouncer, Echo
from tests.support.bus import add_to_server, wait_json


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
