"""Topic crash schedules (aaabus/testing/topictorture.py): the causal topic contract judged by the
independent checker while servers and routers of a tree of domains are SIGKILLed and restarted.

The slow tests run two small schedules, one through ``python -m perf torture --workload topics``;
the fast ones check that a schedule is fixed by its seed and that the judge can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from aaabus.model.topicnames import matches
from aaabus.testing.crash import schedule_seed
from aaabus.testing.topicload import TOPICS
from aaabus.testing.topictorture import (
    PeerState,
    TopicOutcome,
    complete,
    judge_topics,
    make_topic_schedule,
    run_topic_schedule,
)
from tests.support.commands import cli, the_json_line


@pytest.mark.slow
def test_a_topic_crash_schedule_loses_duplicates_and_reorders_nothing(tmp_path: Path) -> None:
    schedule = make_topic_schedule(schedule_seed(2026, 0), kills=3, span=2.5, ttl=6)
    outcome = run_topic_schedule(schedule, tmp_path, log=print)
    assert outcome.ok, outcome.problems
    assert outcome.kills >= len(schedule.faults) and outcome.router_kills >= 1
    # The harness kept sending Start orders while the faults ran, not only at the beginning.
    assert outcome.starts > len(schedule.peers)
    assert outcome.deliveries == outcome.owed > 200
    assert (outcome.lost, outcome.duplicated, outcome.causal_violations) == (0, 0, 0)


@pytest.mark.slow
def test_perf_torture_runs_the_topic_workload_and_prints_the_counts(tmp_path: Path) -> None:
    argv = ["--workload", "topics", "--schedules", "1", "--seed", "7", "--kills", "3"]
    argv += ["--span", "2.5", "--ttl", "6", "--json", "--workdir", str(tmp_path)]
    out = the_json_line(cli("perf", "torture", *argv, timeout=300))
    assert out["workload"] == "topics" and out["schedules"] == 1 and out["ok"]
    assert out["failed_seeds"] == [] and out["failures"] == {}  # reasons by seed when any
    assert out["kills"] >= 3 and out["router_kills"] >= 1
    assert out["deliveries"] == out["owed"] > 0 and out["publications"] > 0
    assert out["lost"] == out["duplicated"] == out["causal_violations"] == 0


def test_a_topic_schedule_is_fixed_by_its_seed_and_scales_echo_to_its_filters() -> None:
    a = make_topic_schedule(77)
    assert a == make_topic_schedule(77) and a != make_topic_schedule(78)
    assert set(a.faults[0].victims) & set(a.routers), "the first fault takes a router down"
    labels = [label for label, _sid, _fs in a.peers]
    assert len(labels) == len(set(labels)) == 2 * len(a.servers)
    assert all(1 <= len(fs) <= 2 for _label, _sid, fs in a.peers)
    # echo x the mean number of subscribers of a topic = the branching asked for.
    for seed in range(5):
        s = make_topic_schedule(seed, branching=0.5)
        subscribers = sum(any(matches(f, t) for f in fs) for t in TOPICS for fs in s.filters)
        assert s.echo * subscribers / len(TOPICS) == pytest.approx(0.5, rel=1e-3)


def _peer(
    label: str,
    filters: tuple[str, ...],
    published: list[tuple[str, str, dict[str, int]]],
    delivered: list[str],
) -> PeerState:
    return PeerState((label, filters, published, delivered), 1)


def _clean() -> list[PeerState]:
    # p0 publishes m0 on t/a; p1 (t/+) delivers it and republishes it as m1 on u/c; p2 (#)
    # delivers both, in causal order. p0's own filter (v) matches neither.
    return [
        _peer("p0", ("v",), [("p0#0", "t/a", {"p0": 1})], []),
        _peer("p1", ("t/+",), [("p1#0", "u/c", {"p0": 1, "p1": 2})], ["p0#0"]),
        _peer("p2", ("#",), [], ["p0#0", "p1#0"]),
    ]


def _judge(peers: list[PeerState], sent: dict[str, int] | None = None) -> TopicOutcome:
    outcome = TopicOutcome(seed=1, layout="line")
    judge_topics(peers, sent or {p.label: 1 for p in peers}, outcome)
    return outcome


def test_the_topic_judge_counts_a_lost_a_duplicated_and_a_reordered_publication() -> None:
    clean = _judge(_clean())
    assert (clean.publications, clean.owed, clean.deliveries) == (2, 3, 3)
    assert clean.ok and (clean.lost, clean.duplicated, clean.causal_violations) == (0, 0, 0)

    lost = _clean()
    lost[2] = _peer("p2", ("#",), [], ["p1#0"])
    assert _judge(lost).lost == 1

    dup = _clean()
    dup[2] = _peer("p2", ("#",), [], ["p0#0", "p1#0", "p0#0"])
    assert _judge(dup).duplicated == 1

    reordered = _clean()
    reordered[2] = _peer("p2", ("#",), [], ["p1#0", "p0#0"])
    outcome = _judge(reordered)
    assert outcome.causal_violations == 1 and outcome.lost == 0
    assert any("delivered p0#0 after p1#0" in p for p in outcome.problems)


def test_a_start_order_handled_twice_or_never_and_a_missing_peer_are_problems() -> None:
    outcome = _judge(_clean(), {"p0": 2, "p1": 1, "p2": 1})
    assert any("Start orders" in p and "'p0': (1, 2)" in p for p in outcome.problems)
    outcome = _judge(_clean(), {"p0": 1, "p1": 1, "p2": 1, "p3": 1})
    assert any("deployed" in p and "p3" in p for p in outcome.problems)


def test_a_run_is_complete_only_when_every_owed_publication_is_delivered() -> None:
    sent = {"p0": 1, "p1": 1, "p2": 1}
    assert complete(_clean(), sent)
    missing = _clean()
    missing[2] = _peer("p2", ("#",), [], ["p0#0"])
    assert not complete(missing, sent)
    assert not complete(_clean(), {**sent, "p0": 2}), "a Start still to be handled"
