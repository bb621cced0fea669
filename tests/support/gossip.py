"""Running gossip traffic over a bus and collecting its history for the causality checker."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from aaabus import AgentId, AgentServer
from aaabus.testing.checker import Report, Send, check
from aaabus.testing.workload import Gossiper, Kick, Peers


def deploy_gossipers(
    servers: dict[int, AgentServer], per_server: int, seed: int
) -> list[tuple[str, AgentId]]:
    """Deploy ``per_server`` gossipers on each server and tell each one about all the others."""
    agents: list[tuple[str, AgentId]] = []
    for sid, server in servers.items():
        for k in range(per_server):
            label = f"g{sid}.{k}"
            agents.append((label, server.deploy(Gossiper(label, seed))))
    for _label, aid in agents:
        servers[aid.server].send(aid, Peers(agents))
    return agents


def kick_all(
    servers: dict[int, AgentServer], agents: list[tuple[str, AgentId]], count: int, ttl: int
) -> int:
    """Start the traffic; returns how many messages it will make in all."""
    for _label, aid in agents:
        servers[aid.server].send(aid, Kick(count, ttl))
    return len(agents) * count * (ttl + 1)


def _histories(server: AgentServer) -> list[tuple[str, list, list]]:
    def read() -> list[tuple[str, list, list]]:
        assert server.store is not None
        return [
            (a.label, list(a.sent), list(a.delivered))
            for a in server.store.agents.values()
            if isinstance(a, Gossiper)
        ]

    return server.call(read)


def wait_and_check(servers: dict[int, AgentServer], expected: int, timeout: float = 60.0) -> Report:
    """Wait until ``expected`` deliveries happened and then until the bus is quiet (or the
    deadline), then check the history. Quiet, not just counted: a duplicate that arrives after
    the count was reached must be in the history the checker judges."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        histories = [h for server in servers.values() for h in _histories(server)]
        delivered = sum(len(d) for _, _, d in histories)
        if delivered >= expected or time.monotonic() > deadline:
            break
        pause.wait(0.05)  # the traffic runs on other threads; poll its progress until done
    before: tuple[int, ...] | None = None
    while time.monotonic() < deadline:
        now = quiet_counters(servers)
        if now is not None and now == before:
            break
        before = now
        pause.wait(0.05)  # as above: the servers' threads finish what is in flight
    return check_histories([h for server in servers.values() for h in _histories(server)])


def quiet_counters(servers: dict[int, AgentServer]) -> tuple[int, ...] | None:
    """Each server's messages sent and reactions run, or None while any server still has a
    message to react to, held back, parked or not acknowledged by its receiver. Two equal
    answers in a row: nothing moved in between, and nothing is left that could (a resend comes
    only from a message its receiver has not acknowledged)."""
    counters: list[int] = []
    for server in servers.values():
        status = server.status()
        queues = status["queues"]
        busy = queues["input"] or queues["held_back"] or queues["parked"]
        if busy or any(queues["outgoing"].values()):
            return None
        counters += [status["messages"]["sent"], status["reactions"]]
    return tuple(counters)


def check_histories(histories: list[tuple[str, list, list]]) -> Report:
    sends = [Send(mid, label, dest, vc) for label, sent, _ in histories for mid, dest, vc in sent]
    deliveries = {label: delivered for label, _, delivered in histories}
    return check(sends, deliveries)


Callback = Callable[[], None]
