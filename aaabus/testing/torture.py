"""Crash schedules: the bank workload run across domains while servers and routers die.

Shared by ``tests/test_torture.py`` (a few small schedules) and ``python -m perf torture`` (the
long run), on the machinery of :mod:`aaabus.testing.crash` (layouts, faults, processes, the end
of a run read back in-process), which the topic schedules share. Its agents and services are in
the installed package (:mod:`aaabus.testing.bankload`), so the server processes it starts load
them wherever they run. One
schedule is fixed by its seed: the layout of the domains, the workload (which account pays
which, how much, along which chains) and the fault schedule (when, whom, how long down). Process
timing is not reproducible, so which messages a kill catches in flight varies from run to run;
what the seed fixes is everything we choose.

The workload
    Accounts on every server pay each other along causal chains
    (:mod:`aaabus.testing.bankload`), each recording the vector-clock history the independent
    checker (:mod:`aaabus.testing.checker`) judges. Two independent verdicts come out of one
    run:

    * money: the balances plus the credits still in flight equal the initial total, and at the
      end nothing is in flight (every credit delivered exactly once);
    * order: the checker finds no loss, no duplicate and no causal violation.

The end of a run
    After the last fault the real processes are stopped with SIGTERM (each must exit 0) and the
    stores are opened again by in-process servers (:class:`~aaabus.node.inprocess.InProcessBus`) on
    the same files and ports. Their engines answer :meth:`~aaabus.AgentServer.call` only with
    committed state, so "every credit delivered" is observed exactly, without guessing from
    side effects a killed reaction may have written before its commit was lost. Whatever was
    still in flight at the stop is finished there (counted in ``finished_in_process``).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aaabus.node.inprocess import InProcessBus
from aaabus.testing.bankload import Account
from aaabus.testing.checker import Send, check
from aaabus.testing.crash import (
    CrashOutcome,
    Fault,
    OnLayout,
    drain_in_process,
    draw_layout_and_faults,
    run_under_faults,
    write_bus_config,
)

# -- schedules ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule(OnLayout):
    seed: int
    layout: str
    per_server: int
    chains: int
    ttl: int
    balance: int
    faults: tuple[Fault, ...]

    @property
    def accounts(self) -> int:
        return len(self.servers) * self.per_server

    @property
    def messages(self) -> int:
        """Credits the workload makes in all (fixed: every chain has ``ttl + 1`` links)."""
        return self.accounts * self.chains * (self.ttl + 1)


def make_schedule(
    seed: int,
    *,
    kills: int = 4,
    span: float = 4.0,
    per_server: int = 2,
    chains: int = 3,
    ttl: int = 40,
) -> Schedule:
    """The schedule of ``seed``: a layout, a workload and ``kills`` faults within ``span`` s
    (see :func:`~aaabus.testing.crash.draw_layout_and_faults`)."""
    layout, faults = draw_layout_and_faults(random.Random(seed), kills, span)
    return Schedule(
        seed=seed,
        layout=layout,
        per_server=per_server,
        chains=chains,
        ttl=ttl,
        balance=1000,
        faults=faults,
    )


# -- running one schedule ----------------------------------------------------------------------


@dataclass
class Outcome(CrashOutcome):
    """What one schedule did and what the two judges said: the checker's and the money's."""

    messages: int = 0
    expected_messages: int = 0
    total_expected: int = 0
    total_found: int = 0
    in_flight: int = 0
    invariant_ok: bool = False


def write_config(schedule: Schedule, directory: Path) -> Path:
    """The a3.xml of ``schedule`` in ``directory``, on free ports, with the bank on server 0."""
    spec = {
        "servers": schedule.servers,
        "per_server": schedule.per_server,
        "seed": schedule.seed,
        "balance": schedule.balance,
        "chains": schedule.chains,
        "ttl": schedule.ttl,
    }
    service = f"<service class=\"aaabus.testing.bankload:bank_setup\" args='{json.dumps(spec)}'/>"
    # Small groups: a kill then catches fewer reactions in one uncommitted group, so more
    # distinct commit boundaries are crossed by the faults.
    props = {"aaabus.engine.max_batch": "8"}
    return write_bus_config(directory, schedule.domains, props, (0, service))


@dataclass
class AccountState:
    label: str
    opening: int
    balance: int
    sent: list[tuple[str, str, dict[str, int], int]]
    received: list[tuple[str, int]]


def _read_accounts(server: Any) -> list[AccountState]:
    def read() -> list[AccountState]:
        return [
            AccountState(
                a.label,
                a.opening,
                a.balance,
                [(m, d, dict(vc), amt) for m, d, vc, amt in a.sent],
                list(a.received),
            )
            for a in server.store.agents.values()
            if isinstance(a, Account)
        ]

    result: list[AccountState] = server.call(read)
    return result


def judge(schedule: Schedule, accounts: list[AccountState], outcome: Outcome) -> None:
    """Fill ``outcome`` with both verdicts on the final account states."""
    sends = [Send(m, a.label, d, vc) for a in accounts for m, d, vc, _amt in a.sent]
    deliveries = {a.label: [m for m, _amt in a.received] for a in accounts}
    report = check(sends, deliveries)
    outcome.messages = len(sends)
    outcome.checked(report)
    amounts = {m: amt for a in accounts for m, _d, _vc, amt in a.sent}
    received = {m for a in accounts for m, _amt in a.received}
    in_flight = sum(amt for m, amt in amounts.items() if m not in received)
    outcome.in_flight = in_flight
    outcome.total_expected = schedule.accounts * schedule.balance
    outcome.total_found = sum(a.balance for a in accounts)
    if len(accounts) != schedule.accounts:
        outcome.problems.append(f"{len(accounts)} accounts found, {schedule.accounts} opened")
    # Money is conserved at every instant (balances + in flight); at the end nothing is in flight.
    outcome.invariant_ok = (
        outcome.total_found + in_flight == outcome.total_expected
        and in_flight == 0
        and all(a.opening == schedule.balance for a in accounts)
    )
    if not outcome.invariant_ok:
        outcome.problems.append(
            f"money: balances {outcome.total_found} + in flight {in_flight} "
            f"!= opened {outcome.total_expected}"
        )
    if outcome.messages != schedule.messages:
        outcome.problems.append(f"{outcome.messages} credits sent, {schedule.messages} expected")


def finish_in_process(
    config: Path,
    storage_root: Path,
    schedule: Schedule,
    timeout: float,
    hear: Callable[[str], None] | None = None,
) -> tuple[list[AccountState], int]:
    """Resume the stopped bus in this process and wait until every credit is delivered.

    Returns the final accounts and how many deliveries had been committed when the processes
    were stopped. Stops at the deadline even if credits are missing: the judges then say what.
    ``hear``: each line the servers' channels log (see :func:`drain_in_process`).
    """

    def read(bus: InProcessBus) -> list[AccountState]:
        return [a for server in bus.servers.values() for a in _read_accounts(server)]

    def complete(accounts: list[AccountState]) -> bool:
        delivered = sum(len(a.received) for a in accounts)
        sent = sum(len(a.sent) for a in accounts)
        return delivered >= schedule.messages and sent >= schedule.messages

    first, accounts = drain_in_process(config, storage_root, read, complete, timeout, hear)
    return accounts, sum(len(a.received) for a in first)


def run_schedule(
    schedule: Schedule,
    workdir: Path,
    *,
    log: Callable[[str], None] | None = None,
    drain_timeout: float = 60.0,
) -> Outcome:
    """Run one schedule in ``workdir`` (kept: the stores are the evidence when it fails)."""
    t_start = time.monotonic()
    outcome = Outcome(schedule.seed, schedule.layout, expected_messages=schedule.messages)
    config = write_config(schedule, workdir)
    storage = workdir / "stores"
    faulted = run_under_faults(config, schedule.servers, storage, schedule.faults)
    accounts, outcome.delivered_at_stop = finish_in_process(
        config, storage, schedule, drain_timeout, faulted.hear
    )
    outcome.took(faulted, schedule.routers, workdir)
    delivered = sum(len(a.received) for a in accounts)
    outcome.finished_in_process = delivered - outcome.delivered_at_stop
    judge(schedule, accounts, outcome)
    outcome.seconds = round(time.monotonic() - t_start, 3)
    if log is not None:
        log(
            f"schedule seed={schedule.seed} layout={schedule.layout} kills={outcome.kills} "
            f"credits={outcome.messages} (at stop {outcome.delivered_at_stop}) "
            f"{'ok' if outcome.ok else 'FAILED: ' + '; '.join(outcome.problems)} "
            f"{outcome.seconds:.1f}s"
        )
    return outcome


__all__ = [
    "Outcome",
    "Schedule",
    "make_schedule",
    "run_schedule",
]
