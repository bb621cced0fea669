"""Crash schedules, the quick version of ``python -m perf torture`` (see aaabus/testing/torture.py).

Each schedule runs bank accounts that are also causal-chain recorders on a bus of real server
processes spread over several causality domains, while servers and routers are SIGKILLed and
restarted at moments fixed by the seed. At the end the money is conserved with nothing in
flight, and the independent checker finds no loss, no duplicate and no causal violation.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from aaabus.config.reader import load_config
from aaabus.model.ids import AgentId
from aaabus.node.inprocess import InProcessBus
from aaabus.testing.crash import Faulted, drain_in_process, schedule_seed, write_bus_config
from aaabus.testing.torture import (
    AccountState,
    Outcome,
    Schedule,
    judge,
    make_schedule,
    run_schedule,
)
from tests.support.agents import Inc
from tests.support.topics import wait_until

SEEDS = [schedule_seed(2024, i) for i in range(3)]
TIMEOUT = 30.0


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_crash_schedule(tmp_path: Path, seed: int) -> None:
    schedule = make_schedule(seed, kills=4, span=3.0, ttl=30)
    assert schedule.routers, "every layout has routers to kill"
    outcome = run_schedule(schedule, tmp_path, log=print)
    assert outcome.kills >= len(schedule.faults)
    assert outcome.ok, outcome.problems
    assert outcome.messages == schedule.messages
    assert (outcome.lost, outcome.duplicated, outcome.causal_violations) == (0, 0, 0)
    assert outcome.invariant_ok


def test_a_schedule_is_fixed_by_its_seed() -> None:
    a, b = make_schedule(77), make_schedule(77)
    assert a == b
    assert make_schedule(78) != a
    # The first fault always takes a router down.
    assert set(a.faults[0].victims) & set(a.routers)
    assert [f.at for f in a.faults] == sorted(f.at for f in a.faults)


def _accounts(per_server_schedule: Schedule) -> list[AccountState]:
    # One account per server of the "line" layout, paying the next one around a ring (amount
    # i + 1); every credit delivered: a clean, conserved history.
    n = per_server_schedule.accounts
    labels = [f"a{i}.0" for i in range(n)]
    return [
        AccountState(
            labels[i],
            100,
            100 - (i + 1) + ((i - 1) % n + 1),
            [(f"{labels[i]}#0", labels[(i + 1) % n], {labels[i]: 1}, i + 1)],
            [(f"{labels[(i - 1) % n]}#0", (i - 1) % n + 1)],
        )
        for i in range(n)
    ]


SMALL = dataclasses.replace(
    make_schedule(1), layout="line", per_server=1, chains=1, ttl=0, balance=100
)


def _judge(accounts: list[AccountState]) -> Outcome:
    outcome = Outcome(seed=1, layout="line")
    judge(SMALL, accounts, outcome)
    return outcome


def test_judges_see_a_lost_credit_a_duplicate_and_broken_money() -> None:
    # The judges must be able to fail: feed them damaged histories.
    clean = _judge(_accounts(SMALL))
    assert clean.ok and clean.invariant_ok, clean.problems
    assert clean.total_found == clean.total_expected == 500

    lost = _accounts(SMALL)
    lost[1] = dataclasses.replace(lost[1], received=[], balance=lost[1].balance - 1)
    outcome = _judge(lost)
    assert outcome.lost == 1 and outcome.in_flight == 1 and not outcome.invariant_ok
    assert outcome.total_found + outcome.in_flight == outcome.total_expected

    dup = _accounts(SMALL)
    dup[1] = dataclasses.replace(dup[1], received=dup[1].received * 2, balance=dup[1].balance + 1)
    outcome = _judge(dup)
    assert outcome.duplicated == 1 and not outcome.invariant_ok


def test_a_held_back_frame_does_not_acknowledge_the_gap_before_it(
    make_config: Callable[..., Path],
) -> None:
    from aaabus.config.reader import load_config
    from aaabus.core.clock import DomainClock
    from aaabus.model.ids import AgentId
    from aaabus.node.inprocess import InProcessBus
    from aaabus.testing.bankload import Start
    from aaabus.wire.codec import encode_note
    from aaabus.wire.linkframes import encode_data
    from aaabus.wire.message import Message

    config = load_config(make_config(servers=2, properties={"aaabus.store": "memory"}))
    # Server 0 is not started: the frames it "sent" are made here with a clock of its own.
    sender = DomainClock(2, 0)
    stamps = [sender.prepare_send(1), sender.prepare_send(1)]
    body = encode_note(Start(0, 0))
    second = encode_data(2, "D0", stamps[1], Message(AgentId(0, 0, 16), AgentId(1, 1, 999), body))
    with InProcessBus(config, server_ids=[1]) as bus:
        server = bus[1]

        def receive_second_only() -> int:
            channel = server.channel
            assert channel is not None
            channel.receive(0, second)
            return channel._acks.get((0, "D0"), 0)

        acked = server.call(receive_second_only)
    # Frame 1 never arrived: acknowledging 2 ("stored everything up to 2") would let server 0
    # drop frame 1 from its outgoing queue for good.
    assert acked < 1


def test_the_in_process_drain_hears_a_store_older_than_its_peers_remember(tmp_path: Path) -> None:
    """The drain that ends a schedule reports, through ``hear``, each line in which a server
    names a store older than its peers remember (``Faulted.hear`` then fails the schedule): a
    false alarm there went unseen, only the process phase's output was read. Here the alarm is
    real: server 1's store is deleted after server 0's messages to it were acknowledged."""
    config = write_bus_config(tmp_path / "bus", [[0, 1]], {"aaabus.store": "log"})
    stores = tmp_path / "stores"
    cfg = load_config(config)
    with InProcessBus(cfg, store_kind="log", storage_root=stores) as bus:
        for n in range(3):
            bus[0].send(AgentId.server_of(1), Inc(n), TIMEOUT)
        wait_until(
            "server 1 acknowledged all three",
            lambda: bus[0].status(TIMEOUT)["queues"]["outgoing"].get("1") == 0,
            TIMEOUT,
        )
    shutil.rmtree(stores / "s1")
    faulted = Faulted()

    def diverged(bus: InProcessBus) -> list[str]:
        return list(bus[0].status(TIMEOUT)["diverged"])

    drain_in_process(config, stores, diverged, bool, TIMEOUT, faulted.hear)
    assert faulted.diverged, "the drain heard no line naming server 1's store"
    assert all(
        "server 1's store is older than server 0 remembers" in line for line in faulted.diverged
    )
