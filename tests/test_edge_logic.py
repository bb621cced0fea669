"""``perf edge`` and ``perf mqtt`` without brokers: the violation verdicts, the WAN geometry, the
ratios, and bad flags (one clear line, non-zero exit). The broker runs themselves are `make peers`
runs (perf/README.md), since CI has no brokers."""

from __future__ import annotations

import pytest

from perf.__main__ import main
from perf.edge import ANSWER, QUESTION, Wan, classify
from perf.mqtt import ratios_vs, summary


def test_answer_read_after_its_question_is_ordered() -> None:
    arrivals = [(QUESTION, "t1"), (QUESTION, "t2"), (ANSWER, "t1")]
    assert classify(arrivals, "t1") == "ordered"


def test_answer_read_before_its_question_is_a_violation() -> None:
    arrivals = [(QUESTION, "t0"), (ANSWER, "t1"), (QUESTION, "t1")]
    assert classify(arrivals, "t1") == "violation"


def test_answer_without_its_question_is_a_violation() -> None:
    # Another trial's question does not count for this one.
    assert classify([(QUESTION, "t0"), (ANSWER, "t1")], "t1") == "violation"


def test_no_answer_is_lost_not_a_violation() -> None:
    assert classify([(QUESTION, "t1")], "t1") == "lost"
    assert classify([], "t1") == "lost"


def test_sites_lie_on_a_line() -> None:
    wan = Wan(delay=0.02, jitter=0.0)
    assert wan.link("A", "B") == wan.link("B", "C") == 0.02
    assert wan.link("A", "C") == pytest.approx(0.04)


def test_unknown_system_is_one_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    for suite in ("edge", "mqtt"):
        with pytest.raises(SystemExit) as exc:
            main([suite, "--systems", "nosuchbroker"])
        assert "unknown system" in str(exc.value) and "--systems" in str(exc.value)


def test_non_positive_trials_are_refused() -> None:
    with pytest.raises(SystemExit) as exc:
        main(["edge", "--trials", "0"])
    assert "--trials" in str(exc.value)


def _figures(p50: float, rate: float) -> dict[str, object]:
    return {
        "latency": {"latency_ms": {"p50": p50, "p90": p50, "p99": p50}},
        "throughput": {"msgs_per_s": rate},
    }


def test_mqtt_ratios_divide_times_and_rates_the_documented_way() -> None:
    ours = summary([{"qos1": _figures(2.0, 3000.0), "qos2": _figures(4.0, 1000.0)}])
    peer = summary([{"qos1": _figures(1.0, 1000.0), "qos2": _figures(2.0, 2000.0)}])
    got = ratios_vs(ours, peer, "rabbitmq")
    assert got == {
        "latency_qos1_vs_rabbitmq": 2.0,
        "throughput_qos1_vs_rabbitmq": 3.0,
        "latency_qos2_vs_rabbitmq": 2.0,
        "throughput_qos2_vs_rabbitmq": 0.5,
    }
    assert ratios_vs(ours, None, "rabbitmq")["latency_qos1_vs_rabbitmq"] is None


def test_mqtt_summary_takes_medians_over_repetitions() -> None:
    runs = [
        {"qos1": _figures(p, r), "qos2": _figures(p, r)} for p, r in ((1, 10), (3, 30), (2, 20))
    ]
    got = summary(runs)["qos1"]
    assert got["latency_ms"]["p50"] == 2 and got["msgs_per_s"] == 20
