"""Helpers shared by the tests (the fixtures that use them are in ``tests/conftest.py``)."""

from __future__ import annotations

import queue
import socket
from pathlib import Path
from typing import Any

from aaabus import AgentServer, Notification
from aaabus.config.reader import BusConfig
from aaabus.model.ids import AgentId
from aaabus.tools.launch import free_port_base

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
#: What the servers of test buses trust (aaabus.trust): the suite's, the agents' and examples'.
TEST_TRUST = "tests,agents,examples,perf"


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports free on 127.0.0.1 right now (held together while chosen)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def contiguous_free_base(count: int) -> int:
    """A base port such that base .. base+count-1 are all free now (generated configs need it)."""
    return free_port_base(count)


class Inbox:
    """What agents send to ``#s.s.0``, collected for the test (listener on the engine thread)."""

    def __init__(self) -> None:
        self.q: queue.Queue[tuple[AgentId, Any]] = queue.Queue()

    def __call__(self, sender: AgentId, note: Notification) -> None:
        self.q.put((sender, note))

    def get(self, timeout: float = 10.0) -> Any:
        try:
            return self.q.get(timeout=timeout)[1]
        except queue.Empty:
            raise AssertionError(f"nothing reached the server inbox within {timeout}s") from None

    def empty(self) -> bool:
        return self.q.empty()


#: What the ``single_server`` fixture gives: the server, its inbox listener, the config.
SingleServer = tuple[AgentServer, Inbox, BusConfig]
