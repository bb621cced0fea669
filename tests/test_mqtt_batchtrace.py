"""The MQTT listener's batch trace (``aaabus.mqtt.batchtrace``, ``perf mqtt --breakdown``): the
stages it derives from a batch's marks, and the records it writes."""

from __future__ import annotations

import json
import time
from pathlib import Path

from aaabus.mqtt.batchtrace import MARKS, BatchTrace, stages


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
