"""Helpers shared by the tests (the fixtures that use them are in ``tests/conftest.py``)."""

from __future__ import annotations

import os
import queue
import random
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aaabus import AgentServer, Notification
from aaabus.config.admin_port import ADMIN_PORT_OFFSET
from aaabus.config.reader import BusConfig
from aaabus.errors import LaunchError
from aaabus.model.ids import AgentId
from aaabus.tools.client import Client
from aaabus.tools.launch import PORT_RANGE_ENV, default_port_range, free_port_base, ports_free

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
#: What the servers of test buses trust (aaabus.trust): the suite's, the agents' and examples'.
TEST_TRUST = "tests,agents,examples,perf"


def aaabus_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``python -m aaabus ARGS`` from the repository's root, its output captured as text (a
    tool's exit status and its one-line errors are what the tests read)."""
    return subprocess.run(
        [sys.executable, "-m", "aaabus", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO_ROOT,
    )


def published_before(
    config: Path, last: Callable[[bytes], bool], timeout: float = 30.0
) -> list[bytes]:
    """The payloads server 0 of ``config`` published on ``retx/#`` (read through the durable
    subscription ``watch``) before the first for which ``last`` holds, in order; AssertionError
    if none came within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    out: list[bytes] = []
    with Client(config, 0) as client, client.subscribe("retx/#", name="watch") as watch:
        while (left := deadline - time.monotonic()) > 0:
            item = watch.get(timeout=left)
            if item is None:
                break
            if last(item.payload):
                return out
            out.append(item.payload)
    raise AssertionError(f"the last one not published in {timeout} s; before it: {out}")


#: The widest run ``contiguous_free_base`` is asked for (a few servers, three ports each).
_LARGEST_RUN = 64


@dataclass(frozen=True)
class WorkerPorts:
    """The ports one pytest(-xdist) worker may use, disjoint from every other worker's.

    ``runs`` (inclusive) is what ``free_port_base`` draws from (exported to every process the
    worker starts as ``$AAABUS_PORT_RANGE``), admin ports (+``ADMIN_PORT_OFFSET``) included;
    ``singles`` is what ``free_ports`` draws from, apart so that a port a test takes on its own
    can never fall inside the run it takes next.
    """

    runs: tuple[int, int]
    singles: tuple[int, int]


def worker_ports(environ: Mapping[str, str]) -> WorkerPorts:
    """This worker's slice of the default port range, from the variables pytest-xdist sets
    (``PYTEST_XDIST_WORKER`` ``gw<i>``, ``PYTEST_XDIST_WORKER_COUNT``); the whole range without
    xdist. A pure function of those and the kernel's ephemeral range, so the controller and each
    worker agree on it. LaunchError when the workers are too many for the range."""
    workers = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    lo, hi = default_port_range(_LARGEST_RUN)
    width = (hi - lo + 1) // workers
    start = lo + index * width
    end = start + width - 1
    singles = width // 4
    if width - singles < ADMIN_PORT_OFFSET + _LARGEST_RUN:
        raise LaunchError(f"{workers} test workers are too many for ports {lo}-{hi}: use fewer")
    return WorkerPorts(runs=(start, end - singles), singles=(end - singles + 1, end))


def claim_worker_ports() -> None:
    """Export this worker's run range to ``free_port_base`` here and in every process started
    from here (called once per process from ``pytest_configure``; replaces any inherited value,
    as the controller's would otherwise reach its workers)."""
    lo, hi = worker_ports(os.environ).runs
    os.environ[PORT_RANGE_ENV] = f"{lo}-{hi}"


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports of this worker's ``singles``, free on 127.0.0.1 right now."""
    lo, hi = worker_ports(os.environ).singles
    rng = random.Random()
    for _ in range(200):
        ports = rng.sample(range(lo, hi + 1), count)
        if ports_free("127.0.0.1", ports):
            return ports
    raise LaunchError(f"no {count} free ports found on 127.0.0.1 in {lo}-{hi}")


def contiguous_free_base(count: int) -> int:
    """A base port such that base .. base+count-1 are all free now (generated configs need it),
    in this worker's ``runs`` (through ``$AAABUS_PORT_RANGE``)."""
    if count > _LARGEST_RUN:
        raise ValueError(f"a run of {count} ports: raise _LARGEST_RUN ({_LARGEST_RUN})")
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
