"""The order of a group's data managers in its two-phase commit (aaabus.core.commitorder).

Two real servers on log stores with early frames: server 0 deploys counters on server 1 and
sends them notifications, so that its groups join every data manager there is (the ZODB
connection for the stamps and agents, the journal for the queues, the early vote for the
frames, the effects for what waits for the commit). Each manager's class is wrapped so that it
records the phases it takes part in; every commit must call them in the documented order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ZODB.Connection import Connection

from aaabus.config.reader import load_config
from aaabus.core.commitorder import COMMIT_ORDER, sort_key
from aaabus.core.early import EarlyVote
from aaabus.core.effects import TransactionEffects
from aaabus.core.journal import Journal
from aaabus.node.inprocess import InProcessBus
from tests.support.agents import Counter, Inc
from tests.support.topics import wait_until

TIMEOUT = 10.0
PHASES = ("tpc_begin", "commit", "tpc_vote", "tpc_finish")
#: The order docs/architecture.md states ("The commit order of the data managers").
DOCUMENTED = ("early", "store", "journal", "effects")
MANAGERS: dict[type, str] = {
    EarlyVote: "early",
    Connection: "store",
    Journal: "journal",
    TransactionEffects: "effects",
}


class Recorder:
    """The phases each transaction's managers went through, in call order, per transaction."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Lock()
        self.calls: dict[int, list[tuple[str, str]]] = {}
        # Each transaction kept alive, so that its id is never another's.
        self._alive: list[Any] = []
        for cls, name in MANAGERS.items():
            for phase in PHASES:
                monkeypatch.setattr(cls, phase, self._wrap(getattr(cls, phase), name, phase))

    def _wrap(self, inner: Callable[..., Any], name: str, phase: str) -> Callable[..., Any]:
        def recorded(manager: Any, txn: Any) -> Any:
            with self.lock:
                calls = self.calls.get(id(txn))
                if calls is None:
                    calls = self.calls[id(txn)] = []
                    self._alive.append(txn)
                calls.append((phase, name))
            return inner(manager, txn)

        return recorded

    def commits(self) -> list[list[tuple[str, str]]]:
        with self.lock:
            return [list(calls) for calls in self.calls.values()]


def test_the_keys_sort_as_the_documented_order_around_any_storage_name() -> None:
    assert COMMIT_ORDER == DOCUMENTED
    for storage in ("/var/lib/aaabus/s0", "s0", "Data.fs", "~"):
        keys = [sort_key(name) if name != "store" else storage for name in DOCUMENTED]
        assert sorted(keys) == keys
    with pytest.raises(ValueError, match="storage's name"):
        sort_key("store")


def test_a_group_commit_calls_every_data_manager_in_the_documented_order(
    make_config: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = Recorder(monkeypatch)
    config = load_config(make_config(servers=2))
    with InProcessBus(config, store_kind="log", storage_root=tmp_path / "stores") as bus:
        wait_until(
            "link up", lambda: bus[0].network is not None and bus[0].network.is_up(1), TIMEOUT
        )
        counters = [bus[0].deploy(Counter(), 1) for _ in range(3)]
        for i in range(1, 6):
            for counter in counters:
                bus[0].send(counter, Inc(i))

        def counted() -> bool:
            stored = bus[1].call(
                lambda: [bus[1]._require_store().agents.get((c.origin, c.stamp)) for c in counters]
            )
            return all(agent is not None and agent.count == 5 for agent in stored)

        wait_until("every Inc counted", counted, TIMEOUT)
    commits = recorder.commits()
    rank = {name: i for i, name in enumerate(DOCUMENTED)}
    full = 0
    for calls in commits:
        for phase in PHASES:
            order = [name for p, name in calls if p == phase]
            assert order == sorted(order, key=rank.__getitem__), (phase, calls)
        voted = [name for p, name in calls if p == "tpc_vote"]
        if voted == list(DOCUMENTED):
            full += 1
            # Phase by phase: every manager begins, then each commits, votes, finishes.
            assert [p for p, _name in calls] == [p for p in PHASES for _ in DOCUMENTED]
    assert full > 0, f"no commit joined all of {DOCUMENTED}: {commits}"
