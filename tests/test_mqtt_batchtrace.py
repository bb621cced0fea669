"""The MQTT listener's batch trace (``aaabus.mqtt.batchtrace``, ``perf mqtt --breakdown``): the
stages it derives from a batch's marks, and the records it writes."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
import transaction

from aaabus.mqtt.batchtrace import MARKS, BatchTrace, stages
from aaabus.mqtt.port import EnginePort
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, free_ports
from tests.support.mqtt import Device


def test_each_stage_is_the_time_from_the_mark_before_it() -> None:
    marks, at = {"read": 0}, 0
    for n, (mark, _stage) in enumerate(MARKS, start=1):
        at += n  # stage n takes n ns
        marks[mark] = at
    got = stages(marks)
    assert list(got) == [stage for _mark, stage in MARKS]
    assert list(got.values()) == list(range(1, len(MARKS) + 1))


def test_a_store_that_reports_no_vote_gives_one_commit_stage() -> None:
    marks = {"read": 0, "queued": 5, "handed": 7, "applied": 10, "ops_done": 20, "commit": 30}
    marks |= {"durable": 230, "loop": 240, "answered": 250}
    got = stages(marks)
    assert got["commit_prepare"] == 200  # commit → durable: preparation, write and sync at once
    assert "write" not in got and "sync" not in got
    assert sum(got.values()) == 250


def test_a_batch_is_written_with_the_delivery_that_followed_it(tmp_path: Path) -> None:
    trace = BatchTrace(tmp_path, 3)
    trace.reading()
    first = trace.opened()
    trace.answered(first, at_loop=first["queued"])
    trace.pushed()  # the subscriber's PUBLISH after the first batch's PUBACK
    trace.pushed()  # a later push belongs to no batch
    second = trace.opened()
    trace.answered(second, at_loop=second["queued"])  # no push followed: written at close
    trace.close()
    records = [json.loads(line) for line in trace.path.read_text().splitlines()]
    assert trace.path.name == "mqtt-s3.jsonl"
    assert len(records) == 2
    assert records[0]["read"] <= records[0]["queued"] <= records[0]["delivered"]
    assert records[0]["answered"] <= records[0]["delivered"]
    assert "delivered" not in records[1]


def test_a_batch_the_loop_ran_is_delivered_before_it_is_answered(tmp_path: Path) -> None:
    trace = BatchTrace(tmp_path, 4)
    trace.reading()
    marks = trace.opened()
    trace.current = marks  # the loop runs this batch: its push comes during the commit
    trace.pushed()
    trace.current = None
    trace.answered(marks, at_loop=time.perf_counter_ns())
    delivered = marks["delivered"]
    trace.pushed()  # a later push belongs to no batch: this one was complete at its answer
    trace.close()
    records = [json.loads(line) for line in trace.path.read_text().splitlines()]
    assert len(records) == 1
    assert records[0]["delivered"] == delivered
    assert records[0]["delivered"] <= records[0]["loop"] <= records[0]["answered"]


def test_stages_follow_the_marks_in_time_whichever_order_they_came_in() -> None:
    base = {"read": 0, "queued": 1, "handed": 2, "applied": 3, "ops_done": 4, "commit": 5}
    base |= {"vote": 6, "written": 7, "synced": 8, "durable": 9}
    pushed_first = stages(base | {"delivered": 10, "loop": 12, "answered": 15})
    assert (pushed_first["delivery"], pushed_first["loop_delay"], pushed_first["answer"]) == (
        1,
        2,
        3,
    )
    answered_first = stages(base | {"loop": 10, "answered": 12, "delivered": 20})
    assert (answered_first["loop_delay"], answered_first["answer"]) == (1, 2)
    assert answered_first["delivery"] == 8  # from the answer, the mark before it in time
    assert sum(answered_first.values()) == 20


def test_acknowledgements_at_the_groups_head_are_their_own_stage() -> None:
    base = {"read": 0, "queued": 5, "handed": 7, "applied": 40, "ops_done": 50, "commit": 60}
    riding = stages(base | {"acked": 30})
    assert (riding["handoff"], riding["acks"]) == (23, 10)
    alone = stages(base)  # none rode along (or a trace written before the stage existed)
    assert alone["handoff"] == 33 and "acks" not in alone
    assert sum(riding.values()) == sum(alone.values()) == 60


def test_a_batch_is_marked_acked_where_the_first_acknowledgements_after_it_was_handed_start(
    tmp_path: Path,
) -> None:
    """A lazy batch's head mark (``before_acks``) is read by the first operation of the batch
    the same group runs next (``around``): acknowledgements applied before the batch was handed
    (a group of their own) mark nothing; of several lazy batches at a group's head, the first
    starts ``acks``."""
    trace = BatchTrace(tmp_path, 5)
    tm = transaction.TransactionManager()
    engine = cast(EnginePort, SimpleNamespace(store=SimpleNamespace(tm=tm)))
    applied: list[str] = []

    def run(ops: list[Any]) -> list[Any]:
        return [op() for op in ops]

    assert len(run(trace.before_acks([lambda: applied.append("old")]))) == 2  # mark, ack
    marks = trace.opened()
    marks["handed"] = time.perf_counter_ns()
    tm.begin()
    run(trace.around(marks, [lambda: applied.append("op")], engine))
    tm.abort()
    assert "acked" not in marks  # the acknowledgement ran before the batch was handed

    second = trace.opened()
    second["handed"] = time.perf_counter_ns()
    batch = trace.around(second, [], engine)  # handed, then the group runs: lazy ones first
    tm.begin()
    run(trace.before_acks([lambda: applied.append("ack 1")]))
    between = time.perf_counter_ns()
    run([*trace.before_acks([lambda: applied.append("ack 2")]), *batch])
    tm.abort()
    assert applied == ["old", "op", "ack 1", "ack 2"]
    assert second["handed"] <= second["acked"] <= between  # the first lazy batch's start
    assert second["acked"] <= second["applied"] <= second["ops_done"]
    assert stages(second | {"commit": second["ops_done"]})["acks"] > 0
    trace.close()


@pytest.mark.slow  # a server process
def test_a_traced_listener_marks_the_acknowledgements_and_commits_every_one(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """With ``aaabus.trace``, the subscriber's PUBACKs ride along with the next publication's
    group behind a marking operation (``acks``); the acknowledgements still complete and
    commit: a subscriber that reconnects gets nothing older than its last message again."""
    (port,) = free_ports(1)
    props = {"aaabus.mqtt.port": str(port), "aaabus.mqtt.anonymous": "true"}
    config = make_config(properties={**props, "aaabus.trace": str(tmp_path / "trace")})
    bus = Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT).start()
    try:
        subscriber = Device(port, "sub", clean=False)
        subscriber.connect()
        subscriber.subscribe("t/#", 1)
        publisher = Device(port, "pub")
        publisher.connect()
        for n in range(20):  # one at a time: each PUBACK rides with a later publication
            publisher.publish("t/x", b"%d" % n, 1)
            assert subscriber.receive(1)[0][1] == b"%d" % n
        subscriber.close()
        again = Device(port, "sub", clean=False)
        assert again.connect() == (0, True)
        publisher.publish("t/x", b"marker", 1)
        got = [again.receive(1)[0][1]]
        while got[-1] != b"marker" and len(got) <= 21:
            got.append(again.receive(1)[0][1])
        # Every PUBACK was committed; paho may send its DISCONNECT before the last one (it
        # acknowledges after on_message returns), which is then resent: once, nothing older.
        assert got in ([b"marker"], [b"19", b"marker"]), got
        again.close()
        publisher.close()
    finally:
        bus.stop()  # its log read to the end
    failed = [line for line in bus.servers[0].lines if "completion failed" in line]
    assert not failed, failed  # a marking operation's outcome taken for an acknowledgement's
    lines = (tmp_path / "trace" / "mqtt-s0.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    acked = [m for m in records if "acked" in m]
    assert len(acked) >= 5, records
    assert all(m["handed"] <= m["acked"] <= m["applied"] for m in acked)
