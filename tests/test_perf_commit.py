"""``python -m perf commit`` on tiny counts: it runs every contender and prints the documented
JSON (the speed itself is the suite's business, never a unit test's)."""

from __future__ import annotations

from pathlib import Path

from perf.commit import CONTENDERS
from tests.support.commands import cli, the_json_line


def test_perf_commit_prints_the_documented_json(tmp_path: Path) -> None:
    tiny = [
        "--rounds",
        "2",
        "--per-round",
        "5",
        "--warmup",
        "2",
        "--stream",
        "300",
        "--stream-segment",
        "16384",
    ]
    out = the_json_line(
        cli("perf", "commit", "--json", *tiny, "--workdir", str(tmp_path), timeout=300)
    )
    for name in CONTENDERS:
        for q in ("p50", "p90", "p99", "max"):
            assert out[f"{name}_{q}_us"] > 0
        assert out[f"{name}_p50_us"] <= out[f"{name}_p90_us"] <= out[f"{name}_p99_us"]
    # Ratios come from the unrounded figures: equal to the printed ones to rounding.
    assert abs(out["log_vs_floor"] - out["log_p50_us"] / out["floor_p50_us"]) < 0.01
    assert abs(out["file_vs_floor"] - out["file_p50_us"] / out["floor_p50_us"]) < 0.01
    assert "log_vs_zodb_floor" in out and "log_own_p50_us" in out
    got = out["log_storage_vs_floor"]
    assert abs(got - out["log_storage_p50_us"] / out["floor_p50_us"]) < 0.01
    stream = out["stream"]
    assert stream["commits"] == 300 and stream["compared_commits"] == 300
    assert stream["on"]["max"] >= stream["on"]["p50"] > 0
    assert 0 < stream["end_dir_bytes"] <= stream["peak_dir_bytes"]
