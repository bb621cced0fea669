"""Several servers in one process (the simulation mode), with per-hop tracing on."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, cast

from aaabus.config.reader import load_config
from aaabus.core.trace import TRACE_VERSION, Tracer, read_hops
from aaabus.node.inprocess import InProcessBus
from tests.support.bus import add_to_server, wait_json

if TYPE_CHECKING:
    from aaabus.core.effects import TransactionEffects


def test_in_process_bus_with_tracing(tmp_path: Path, make_config: Callable[..., Path]) -> None:
    config = make_config(
        layout=[[0, 1], [1, 2]],
        properties={"aaabus.trace": "traces", "aaabus.store": "memory"},
    )
    done = tmp_path / "done.json"
    args = json.dumps({"echo": 2, "n": 200, "done": str(done)})
    service = f"<service class=\"aaabus.testing.workload:bounce_setup\" args='{args}'/>"
    add_to_server(config, 0, service)
    with InProcessBus(load_config(config)):
        assert wait_json(done, [], 60) == {"count": 200, "errors": 0}
    hops = list(read_hops(tmp_path / "traces"))
    sends = [h for h in hops if h["event"] == "send"]
    receives = [h for h in hops if h["event"] == "receive"]
    # 200 bounces out and back over two hops each way (s0 - s1 - s2), plus the creation.
    assert len(sends) >= 4 * 200 and len(receives) >= 4 * 200
    assert {h["server"] for h in sends} == {0, 1, 2}
    assert all(h["v"] == TRACE_VERSION for h in hops)
    assert all(h["stamp_bytes"] > 0 and h["clock_ns"] > 0 for h in sends)
    assert all(h["commit_ns"] > 0 and h["group_hops"] >= 1 for h in hops)
    assert any(h["clock_bytes"] > 0 for h in hops)
    assert {h["verdict"] for h in receives} <= {"deliver", "wait", "duplicate"}
    # A group's first receive carries the stages of its hop: all passed in order, none
    # negative; a memory store does not split its write and sync (one commit_io stage).
    staged = [h["stages"] for h in receives if "stages" in h]
    assert len(staged) >= 200
    assert all(min(st.values()) >= 0 for st in staged)
    assert all("commit_io" in st and "sync" not in st for st in staged if "send" in st)
    assert any(
        {"decode_mac", "handoff", "clock_test", "reaction", "send"} <= set(st) for st in staged
    )
    # The router s1 receives in one domain and re-stamps in the other.
    assert {h["domain"] for h in sends if h["server"] == 1} == {"D0", "D1"}


class _NoUndo:
    def undo(self, *_args: object) -> None:
        pass


def test_only_a_delivered_message_gets_a_hop_breakdown(tmp_path: Path) -> None:
    """A group whose only frame was a duplicate (a resend when a link comes up) commits nothing
    and sends an acknowledgement: its marks are not a hop's, and would show as a stage no hop
    has (commit_io) in perf pingpong --breakdown."""
    tracer = Tracer(tmp_path, 1, cast("TransactionEffects", _NoUndo()))
    for verdict in ("duplicate", "deliver"):
        tracer.arrived(1_000, 2_000)
        tracer.tested("D0", 0, verdict, 500)
        tracer.mark("tested")
        tracer.mark("flush")
        tracer.mark("sent")
        tracer.committed(10_000, 0)
    tracer.close()
    records = list(read_hops(tmp_path))
    assert [r["verdict"] for r in records] == ["duplicate", "deliver"]
    assert "stages" not in records[0]
    assert set(records[1]["stages"]) == {"decode_mac", "handoff", "clock_test", "commit_io", "send"}
    assert all(ns >= 0 for ns in records[1]["stages"].values())
