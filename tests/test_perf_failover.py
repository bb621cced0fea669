"""``python -m perf failover`` (issue 42): its recorder turns what the devices saw into the
history the checker judges; its schedules are fixed by their seeds; and, marked ``slow``, a
few real failovers and schedules on server processes."""

from __future__ import annotations

import argparse
import json
import queue
from pathlib import Path

import pytest

from aaabus.testing.failhistory import judge_history
from perf.failover import Recorder, add_arguments, read_book
from perf.failover_load import Delivered, Event, Sent
from perf.failover_schedules import KINDS, make_schedule


def recorder() -> Recorder:
    return Recorder(queue.SimpleQueue())


def ping(rec: Recorder, n: int, vc: dict[str, int]) -> None:
    rec.events.put(Sent(0.0, f"pinger-{n}", "pinger", ("ponger",), vc))


def pong(rec: Recorder, mid: str, ping_mid: str, vc: dict[str, int], at: float = 1.0) -> None:
    body = {"mid": mid, "from": "ponger", "vc": vc, "ping": ping_mid}
    rec.events.put(Delivered(at, "pinger", 0, 0, 0.0, body))


def test_a_ping_pong_seen_through_its_pongs_is_complete() -> None:
    rec = recorder()
    ping(rec, 1, {"pinger": 1})
    pong(rec, "ponger-1", "pinger-1", {"pinger": 1, "ponger": 1})
    ping(rec, 3, {"pinger": 3, "ponger": 1})
    pong(rec, "ponger-2", "pinger-3", {"pinger": 3, "ponger": 2})
    rec.drain()
    verdict = judge_history(rec.history)
    assert verdict.ok, verdict.problems()
    assert verdict.report.messages == 4 and rec.missing() == 0


def test_a_ping_answered_twice_is_a_duplicate_and_a_pong_seen_twice_too() -> None:
    rec = recorder()
    ping(rec, 1, {"pinger": 1})
    pong(rec, "ponger-1", "pinger-1", {"pinger": 1, "ponger": 1})
    pong(rec, "ponger-2", "pinger-1", {"pinger": 1, "ponger": 2})  # the ping delivered again
    pong(rec, "ponger-2", "pinger-1", {"pinger": 1, "ponger": 2})  # that pong delivered again
    rec.drain()
    report = judge_history(rec.history).report
    assert report.duplicated == ["pinger-1@ponger", "ponger-2@pinger"]


def test_a_ping_without_its_pong_is_lost() -> None:
    rec = recorder()
    ping(rec, 1, {"pinger": 1})
    rec.drain()
    assert judge_history(rec.history).report.lost == ["pinger-1@ponger"]
    assert rec.missing() == 1


def test_the_first_delivery_after_a_kill_is_one_by_the_failing_server_on_a_new_connection() -> None:
    rec = recorder()
    rec.watch(10.0)
    events: list[Event] = [
        Sent(9.0, "sa-1", "sa", ("ra",), {"sa": 1}),
        Sent(9.0, "sa-2", "sa", ("ra",), {"sa": 2}),
        Sent(9.0, "sb-1", "sb", ("rb",), {"sb": 1}),
        # On a connection to server 1 opened before the kill: the old primary's last bytes.
        Delivered(10.1, "ra", 1, 0, 9.0, {"mid": "sa-1", "from": "sa", "vc": {"sa": 1}}),
        # Server 0's device: not the new primary's delivery.
        Delivered(10.2, "rb", 0, 0, 1.0, {"mid": "sb-1", "from": "sb", "vc": {"sb": 1}}),
        Delivered(11.5, "ra", 1, 2, 11.4, {"mid": "sa-2", "from": "sa", "vc": {"sa": 2}}),
    ]
    for event in events:
        rec.events.put(event)
    rec.drain()
    assert rec.first is not None and (rec.first.at, rec.first.member) == (11.5, 2)


def test_probes_stay_out_of_the_history() -> None:
    rec = recorder()
    rec.events.put(Delivered(1.0, "ra", 1, -1, 0.0, {"probe": "sa"}))
    pong(rec, "ponger-1", "probe-3", {"ponger": 1})
    rec.drain()
    assert rec.probes == {"ra": {"sa"}, "pinger": {"ponger"}}
    assert not rec.history.sends and not rec.history.deliveries


def test_a_schedule_is_fixed_by_its_seed_and_draws_every_kind() -> None:
    assert make_schedule(7, 5) == make_schedule(7, 5)
    assert make_schedule(7, 5) != make_schedule(8, 5)
    kinds = {fault.kind for seed in range(40) for fault in make_schedule(seed, 5).faults}
    assert kinds == set(KINDS)


def options(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--json", *argv])


@pytest.mark.slow
@pytest.mark.bench
def test_three_failovers_lose_nothing() -> None:
    from perf.failover import run_failovers

    result = run_failovers(options("--failovers", "3", "--timeout", "240"), lambda _: None)
    assert result["failovers"] == 3, result["problems"]
    assert (result["lost"], result["duplicated"], result["violations"]) == (0, 0, 0), result
    assert result["sessions_lost"] == 0 and result["split_brain"] == 0, result


@pytest.mark.slow
@pytest.mark.bench
def test_three_schedules_keep_the_invariants() -> None:
    from perf.failover_schedules import run_schedules

    result = run_schedules(
        options("--schedules", "3", "--faults", "3", "--seed", "5", "--timeout", "240"),
        lambda _: None,
    )
    assert result["ok"], result["problems"]
    assert result["faults"] == 9 and result["accepted"] > 0


def test_a_peers_epoch_book_is_read_as_what_it_accepted(tmp_path: Path) -> None:
    book = tmp_path / "epochs"
    assert read_book(book, 1) is None  # no takeover known yet: no file
    book.write_text(json.dumps({"format": 1, "servers": {"1": {"known": [3, 2], "granted": None}}}))
    assert read_book(book, 1) == (3, 2)
    assert read_book(book, 4) is None
    book.write_text("{torn")
    assert read_book(book, 1) is None
