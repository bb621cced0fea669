"""Topics in causal order across domains, where the order of each topic alone is not enough.

    python -m examples.topics_causal

A shop on server 0 publishes ``orders/42``. The warehouse on server 2 subscribes to ``orders/#``
and, on reading the order, publishes ``shipments/42``. An auditor on server 3, in another domain
behind router 1, subscribes to both topics. The link from the shop's server to the router is
slow (a proxy delays it by 0.8 s), so the shipment reaches the router before the order.

* With ``order="fifo"`` domains each link keeps its order, and so does each topic (one publisher
  each, one path each): what MQTT and clustered brokers promise. The auditor reads the shipment
  of an order it has never seen.
* With ``order="causal"`` (the default) the shipment's stamp says that it depends on a message
  from server 0 that the router has not received: the router holds it back (``held_back`` in
  ``aaabus status``) and the auditor reads the order first, whatever the topics and domains.

The topic representatives do the forwarding: each publication goes from its publisher's server
to the subscribers' servers along the unique paths of the domain tree, once per link.
"""

from __future__ import annotations

import queue
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from aaabus import Agent, AgentId, Notification, Publication
from aaabus.config.reader import load_config
from aaabus.model.ids import TOPICS_STAMP
from aaabus.node.inprocess import InProcessBus
from aaabus.node.server import AgentServer
from aaabus.testing.proxy import FaultProxy
from examples._bus import wait_for, write_bus


@dataclass
class Order(Notification):
    """From the program to the shop: publish order 42."""


class Shop(Agent):
    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Order):
            self.publish("orders/42", "placed")
        else:
            super().react(sender, note)


class Warehouse(Agent):
    """Ships every order it reads."""

    subscriptions: ClassVar[tuple[str, ...]] = ("orders/#",)

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Publication):
            self.publish("shipments/" + note.topic.split("/")[1], "shipped")
        else:
            super().react(sender, note)


class Auditor(Agent):
    """Shows the program what it reads, through its server's ``#s.s.0``."""

    subscriptions: ClassVar[tuple[str, ...]] = ("orders/#", "shipments/#")

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Publication):
            self.send_to(AgentId.server_of(self.id.server), note)
        else:
            super().react(sender, note)


def known_filters(server: AgentServer) -> dict[str, list[int]]:
    """Which servers subscribe to what, as ``server``'s topic representative knows it."""

    def read() -> dict[str, list[int]]:
        assert server.store is not None
        rep = server.store.agents[(server.server_id, TOPICS_STAMP)]
        return {f: sorted(where) for f, where in rep.remote.items()}

    return server.call(read)


def run(order: str, root: Path) -> list[str]:
    """One order in domains with ``order``; returns what the auditor read, in order."""
    proxy = FaultProxy(("127.0.0.1", 0), name="s0-s1")
    # D0 = {0, 1, 2}, D1 = {1, 3}: server 1 is the router. Server 0 dials 1 through the proxy.
    path = write_bus(
        root / order,
        [[0, 1, 2], [1, 3]],
        order=order,
        server_properties={0: {"aaabus.dial.1": f"127.0.0.1:{proxy.port}"}},
    )
    config = load_config(path)
    proxy.target = ("127.0.0.1", config.servers[1].networks[0].port)
    try:
        with InProcessBus(config) as bus:
            audited: queue.Queue[Notification] = queue.Queue()
            bus[3].add_listener(lambda sender, note: audited.put(note))
            bus[3].deploy(Auditor("auditor"))
            bus[2].deploy(Warehouse("warehouse"))
            shop = bus[0].deploy(Shop("shop"))
            wait_for(
                lambda: known_filters(bus[0]) == {"orders/#": [2, 3], "shipments/#": [3]},
                10,
                "subscriptions known at the shop's server",
            )
            proxy.set_delay(0.8)
            bus[0].send(shop, Order())
            if order == "causal":
                held = wait_for(
                    lambda: bus[1].status()["queues"]["held_back"],
                    10,
                    "the shipment held back at the router",
                )
                print(f"  [{order}] the router holds back {held} message (the shipment)")
            lines: list[str] = []
            while len(lines) < 2:
                publication = audited.get(timeout=15)
                assert isinstance(publication, Publication)
                lines.append(f"{publication.topic} {publication.payload}")
                print(f"  [{order}] auditor reads: {lines[-1]}")
            return lines
    finally:
        proxy.stop()


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for order in ("fifo", "causal"):
            print(f'domain order="{order}":')
            lines = run(order, Path(tmp))
            order_first = lines[0].startswith("orders/")
            verdict = "makes sense" if order_first else "a shipment of an unknown order!"
            print(f"  -> the auditor's view {verdict}")
            if order_first != (order == "causal"):
                print("unexpected order", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    # Run the module the servers import (examples.topics_causal), not a copy named __main__:
    # classes of __main__ travel by value, as code, which servers load only when told to.
    from examples import topics_causal

    sys.exit(topics_causal.main())
