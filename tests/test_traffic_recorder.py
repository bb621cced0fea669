"""The traffic recorder (aaabus.traffic): counts per window and destination, written off the engine
thread as Parquet files of the traffic schema. A test clock drives the windows."""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from aaabus.analysis.schema import TRAFFIC_SCHEMA
from aaabus.config.reader import load_config
from aaabus.core.traffic import TrafficError, TrafficRecorder
from aaabus.errors import ExtraMissing
from aaabus.node.inprocess import InProcessBus
from tests.support.bus import add_to_server, wait_json


class Clock:
    """Seconds since the epoch, moved by the test only."""

    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def read_rows(directory: Path) -> list[dict[str, int]]:
    table = ds.dataset(directory / "traffic", format="parquet").to_table()
    rows: list[dict[str, int]] = table.to_pylist()
    return rows


def test_rows_written_equal_counts_recorded(tmp_path: Path) -> None:
    clock = Clock()
    rec = TrafficRecorder(tmp_path, 7, window_ms=1000, batch_windows=2, clock=clock)
    expected_notes: Counter[tuple[int, int]] = Counter()
    expected_bytes: Counter[tuple[int, int]] = Counter()
    for step in range(5):  # five windows, three destinations with different loads
        for dst in (1, 2, 3):
            for i in range(dst * (step + 1)):
                rec.record(dst, 100 + i)
                window = int(clock.now * 1000) // 1000 * 1000
                expected_notes[window, dst] += 1
                expected_bytes[window, dst] += 100 + i
        clock.now += 1.0
    rec.close()
    rows = read_rows(tmp_path)
    got_notes = {(r["window_start"], r["dst"]): r["notes"] for r in rows}
    got_bytes = {(r["window_start"], r["dst"]): r["bytes"] for r in rows}
    assert len(rows) == 15  # one row per (window, destination): no duplicate, nothing lost
    assert got_notes == dict(expected_notes)
    assert got_bytes == dict(expected_bytes)
    assert {r["src"] for r in rows} == {7} and {r["window_ms"] for r in rows} == {1000}
    files = sorted((tmp_path / "traffic").iterdir())
    assert len(files) == 3  # windows 1-2, 3-4, then the fifth at close()
    for f in files:
        assert f.name.startswith("traffic-s7-") and f.suffix == ".parquet"
        assert pq.read_schema(f).equals(TRAFFIC_SCHEMA, check_metadata=True)
    assert rec.files_written == 3 and rec.dropped_rows == 0


def test_windows_align_on_the_epoch_and_the_next_record_hands_one_over(tmp_path: Path) -> None:
    clock = Clock(1_800_000_000.75)  # 750 ms into a 1 s window
    rec = TrafficRecorder(tmp_path, 1, window_ms=1000, batch_windows=1, clock=clock)
    rec.record(2, 10)
    clock.now += 0.5  # 250 ms into the next window
    rec.record(3, 20)  # the first window is over: handed to the writer
    rec.close()
    rows = sorted(read_rows(tmp_path), key=lambda r: r["window_start"])
    assert rows == [
        {
            "window_start": 1_800_000_000_000,
            "window_ms": 1000,
            "src": 1,
            "dst": 2,
            "notes": 1,
            "bytes": 10,
        },
        {
            "window_start": 1_800_000_001_000,
            "window_ms": 1000,
            "src": 1,
            "dst": 3,
            "notes": 1,
            "bytes": 20,
        },
    ]
    assert rec.files_written == 2


def test_writer_is_a_named_thread_and_close_is_idempotent(tmp_path: Path) -> None:
    rec = TrafficRecorder(tmp_path, 3, clock=Clock())
    assert "traffic-s3" in {t.name for t in threading.enumerate()}
    rec.record(4, 1)
    rec.close()
    rec.close()
    assert "traffic-s3" not in {t.name for t in threading.enumerate()}
    with pytest.raises(TrafficError, match="closed"):
        rec.record(4, 1)
    assert len(read_rows(tmp_path)) == 1


def test_a_failed_write_is_logged_and_counted_never_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    rec = TrafficRecorder(tmp_path, 5, window_ms=1000, batch_windows=1, clock=clock)
    (tmp_path / "traffic").rmdir()
    (tmp_path / "traffic").write_text("a file where the directory was")
    with caplog.at_level(logging.ERROR, logger="aaabus.traffic"):
        rec.record(6, 1)
        rec.record(7, 1)
        rec.close()
    assert rec.dropped_rows == 2 and rec.files_written == 0
    assert "cannot write" in caplog.text and "2 rows dropped" in caplog.text


def test_without_pyarrow_one_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # what an install without it looks like
    with pytest.raises(ExtraMissing, match=r"needs pyarrow, .*pip install 'aaabus\[traffic\]'"):
        TrafficRecorder(tmp_path, 0)
    assert not (tmp_path / "traffic").exists()


def test_bad_window_and_unwritable_directory(tmp_path: Path) -> None:
    with pytest.raises(TrafficError, match="must be >= 1"):
        TrafficRecorder(tmp_path, 0, window_ms=0)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(TrafficError, match="cannot create the traffic directory"):
        TrafficRecorder(blocker, 0)


def _bounce_counts(tmp_path: Path, make_config: Callable[..., Path]) -> tuple[Counter, int]:
    """s0 bounces 100 times with an echo on s2 through the router s1, all recording traffic:
    the notifications counted per (source, destination), and the aborts s2's engine made."""
    config = make_config(
        layout=[[0, 1], [1, 2]],
        properties={"aaabus.traffic": "traces", "aaabus.store": "memory"},
    )
    done = tmp_path / "done.json"
    args = json.dumps({"echo": 2, "n": 100, "done": str(done)})
    service = f"<service class=\"aaabus.testing.workload:bounce_setup\" args='{args}'/>"
    add_to_server(config, 0, service)
    with InProcessBus(load_config(config)) as bus:
        assert wait_json(done, [], 60) == {"count": 100, "errors": 0}
        aborts = bus[2]._require_engine().stats.aborts
    notes: Counter[tuple[int, int]] = Counter()
    for r in read_rows(tmp_path / "traces"):
        notes[r["src"], r["dst"]] += r["notes"]
        assert r["bytes"] > 0 and r["window_ms"] == 10_000
    return notes, aborts


def test_servers_with_the_property_record_end_to_end_counts(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    """s1 forwards both ways but sends nothing of its own, so the rows say s0 -> s2 and s2 -> s0
    only, in equal numbers."""
    notes, _aborts = _bounce_counts(tmp_path, make_config)
    assert {pair for pair in notes} == {(0, 2), (2, 0)}  # nothing from the router s1
    assert notes[2, 0] == 100  # one echo per bounce
    assert notes[0, 2] >= 100  # the bounces, plus the creation of the echo agent


def test_a_group_replayed_after_a_failure_counts_its_sends_once(
    tmp_path: Path, make_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every server's 31st commit fails once, after its reactions sent: the group is replayed.
    monkeypatch.setenv("AAABUS_FAILPOINTS", "engine.commit:raise:30:1")
    notes, aborts = _bounce_counts(tmp_path, make_config)
    assert aborts >= 1
    assert notes[2, 0] == 100
