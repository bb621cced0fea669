"""The history checker (aaabus/testing/checker.py), judged before it judges the bus.

Hand-made histories pin each verdict on a case small enough to verify by eye. The property
tests run a causal-delivery simulator written here that tracks causality as explicit sets of
messages (no vector clocks), so the checker's clock arithmetic is compared against plain set
membership: every simulated execution must check clean, and on any reordering of its
deliveries the checker must name exactly the pairs the sets say are out of order.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aaabus.testing.checker import (
    Delivery,
    Report,
    Send,
    check,
    check_fifo,
    happened_before,
)

Row = tuple[str, str, str, dict[str, int]]


def sends_of(rows: list[Row]) -> list[Send]:
    return [Send(mid, sender, dest, vc) for mid, sender, dest, vc in rows]


# A correct causal history among A, B, C, D, clocks worked out by hand. Comments give each
# agent's clock after the event on that line.
CLEAN_SENDS: list[Row] = [
    ("a1", "A", "B", {"A": 1}),  # A: A1
    # B delivers a1                                     B: A1 B1
    ("b1", "B", "C", {"A": 1, "B": 2}),  # B: A1 B2
    ("a2", "A", "C", {"A": 2}),  # A: A2 (concurrent with b1)
    # C delivers b1                                     C: A1 B2 C1
    # C delivers a2                                     C: A2 B2 C2
    ("c1", "C", "D", {"A": 2, "B": 2, "C": 3}),  # C: A2 B2 C3
    ("b2", "B", "D", {"A": 1, "B": 3}),  # B: A1 B3 (concurrent with c1)
    ("a3", "A", "D", {"A": 3}),  # A: A3 (concurrent with c1 and b2)
    # D delivers c1, b2, a3                              D: A3 B3 C3 D3
    ("d1", "D", "A", {"A": 3, "B": 3, "C": 3, "D": 4}),  # after everything above
]
CLEAN_DELIVERIES: dict[str, list[str]] = {
    "A": ["d1"],
    "B": ["a1"],
    "C": ["b1", "a2"],
    "D": ["c1", "b2", "a3"],
}

# Figure 13 of the report: A1 sends n1 to A3, then n2 to A2; A2, on n2, sends n3 to A3; so
# n1 -> n3, yet A3 delivers n3 first.
FIG13_SENDS: list[Row] = [
    ("n1", "A1", "A3", {"A1": 1}),
    ("n2", "A1", "A2", {"A1": 2}),
    # A2 delivers n2: A1 2, A2 1
    ("n3", "A2", "A3", {"A1": 2, "A2": 2}),
]
FIG13_DELIVERIES = {"A2": ["n2"], "A3": ["n3", "n1"]}


def clean_with(**changes: list[str]) -> Report:
    return check(sends_of(CLEAN_SENDS), {**CLEAN_DELIVERIES, **changes})


# -- hand-made histories -------------------------------------------------------------------


def test_correct_causal_history_is_clean() -> None:
    report = check(sends_of(CLEAN_SENDS), CLEAN_DELIVERIES)
    assert report.ok, report.summary()
    assert report == Report(messages=7, deliveries=7)
    assert report.summary() == "ok: 7 messages, 7 deliveries"


def test_lost_message() -> None:
    report = clean_with(D=["c1", "a3"])
    assert report.lost == ["b2"]
    assert not report.ok
    assert report == Report(lost=["b2"], messages=7, deliveries=6)
    assert report.summary() == "lost: 1 (b2)"


def test_never_delivered_predecessor_is_lost_not_a_violation() -> None:
    # n1 -> n3 and n3 arrived: n1 missing is one problem (lost), not two.
    report = check(sends_of(FIG13_SENDS), {"A2": ["n2"], "A3": ["n3"]})
    assert report.lost == ["n1"]
    assert report.causal_violations == []


def test_violation_through_a_relay_back_to_the_destination() -> None:
    # C delivers x, then its word travels C -> D -> C as y, z. z knows exactly as much of A as x
    # does (vc[A] = 1 in both): the late-delivery test must accept equality, not just "more".
    rows: list[Row] = [
        ("x", "A", "C", {"A": 1}),
        ("y", "C", "D", {"A": 1, "C": 2}),
        ("z", "D", "C", {"A": 1, "C": 2, "D": 2}),
    ]
    assert check(sends_of(rows), {"C": ["x", "z"], "D": ["y"]}).ok
    report = check(sends_of(rows), {"C": ["z", "x"], "D": ["y"]})
    assert report.causal_violations == [("C", "z", "x")]


def test_duplicate_is_reported_once_and_not_as_reordering() -> None:
    # The second c1 comes after b2 and a3; it is a duplicate, not a late delivery.
    report = clean_with(D=["c1", "b2", "a3", "c1", "c1"])
    assert report.duplicated == ["c1"]
    assert report.causal_violations == [] and report.fifo_violations == []
    assert report.lost == [] and report.misdelivered == []


def test_misdelivery() -> None:
    # a1 reaches B and also C; a2 reaches only B (so it is lost too); "zz" was never sent.
    report = clean_with(B=["a1", "a2"], C=["b1", "a1", "zz"])
    assert report.misdelivered == ["a1", "a2", "zz"]
    assert report.lost == ["a2"]
    assert report.duplicated == []
    assert report.causal_violations == []


def test_figure_13_violation_is_named() -> None:
    report = check(sends_of(FIG13_SENDS), FIG13_DELIVERIES)
    assert report.causal_violations == [("A3", "n3", "n1")]
    assert report.fifo_violations == []  # different senders: a causal, not a FIFO, problem
    assert report.lost == report.duplicated == report.misdelivered == []
    assert report.summary() == "causal violations: 1 (A3 delivered n1 after n3)"


def test_figure_13_in_causal_order_is_clean() -> None:
    assert check(sends_of(FIG13_SENDS), {"A2": ["n2"], "A3": ["n1", "n3"]}).ok


@pytest.mark.parametrize("c_order", [["b1", "a2"], ["a2", "b1"]])
@pytest.mark.parametrize(
    "d_order", [["c1", "b2", "a3"], ["a3", "b2", "c1"], ["b2", "a3", "c1"], ["a3", "c1", "b2"]]
)
def test_concurrent_messages_in_any_order_are_clean(c_order: list[str], d_order: list[str]) -> None:
    report = clean_with(C=c_order, D=d_order)
    assert report.ok, report.summary()


def test_fifo_violation() -> None:
    rows: list[Row] = [
        ("x1", "A", "B", {"A": 1}),
        ("x2", "A", "B", {"A": 2}),
        ("y1", "C", "B", {"C": 1}),
    ]
    deliveries = {"B": ["y1", "x2", "x1"]}
    report = check(sends_of(rows), deliveries)
    assert report.fifo_violations == [("B", "x2", "x1")]
    # FIFO order is part of causal order, so the causal list has it too.
    assert report.causal_violations == [("B", "x2", "x1")]
    assert check_fifo(sends_of(rows), deliveries) == [("B", "x2", "x1")]
    assert check(sends_of(rows), deliveries, fifo=False).fifo_violations == []
    assert "fifo violations: 1 (B delivered x1 after x2)" in report.summary().splitlines()


def test_flat_deliveries_are_grouped_per_agent_in_order() -> None:
    flat = [
        Delivery("B", "a1"),
        Delivery("C", "a2"),  # interleaving across agents is irrelevant...
        Delivery("D", "a3"),
        Delivery("C", "b1"),  # ...only each agent's own order counts
        Delivery("D", "b2"),
        Delivery("D", "c1"),
        Delivery("A", "d1"),
    ]
    assert check(sends_of(CLEAN_SENDS), flat).ok
    fig13 = [Delivery("A2", "n2"), Delivery("A3", "n3"), Delivery("A3", "n1")]
    assert check(sends_of(FIG13_SENDS), fig13).causal_violations == [("A3", "n3", "n1")]


def chain(hops: int) -> tuple[list[Send], list[str]]:
    """A token relayed A -> B -> C -> D -> A ...; at every hop the holder also tells E.

    Every message to E happened-before the next one, so E must deliver them in order.
    """
    ring = ["A", "B", "C", "D"]
    vcs = {a: {x: 0 for x in [*ring, "E"]} for a in ring}
    sends: list[Send] = []
    to_e: list[str] = []
    for hop in range(hops):
        holder, nxt = ring[hop % 4], ring[(hop + 1) % 4]
        vc = vcs[holder]
        vc[holder] += 1
        sends.append(Send(f"log{hop}", holder, "E", vc))
        to_e.append(f"log{hop}")
        vc[holder] += 1
        sends.append(Send(f"tok{hop}", holder, nxt, vc))
        # nxt delivers the token
        merged = {x: max(v, vc[x]) for x, v in vcs[nxt].items()}
        merged[nxt] += 1
        vcs[nxt] = merged
    return sends, to_e


def chain_deliveries(hops: int, to_e: list[str]) -> dict[str, list[str]]:
    ring = ["A", "B", "C", "D"]
    out: dict[str, list[str]] = {a: [] for a in ring}
    for hop in range(hops):
        out[ring[(hop + 1) % 4]].append(f"tok{hop}")
    out["E"] = to_e
    return out


def test_long_chain() -> None:
    hops = 200
    sends, to_e = chain(hops)
    assert check(sends, chain_deliveries(hops, to_e)).ok
    # Swapping two neighbours of the chain at E: exactly one pair out of order.
    swapped = [*to_e]
    swapped[50], swapped[51] = swapped[51], swapped[50]
    report = check(sends, chain_deliveries(hops, swapped))
    assert report.causal_violations == [("E", "log51", "log50")]
    assert report.fifo_violations == []  # log50 and log51 come from different holders
    # Reversed, every pair is out of order: n(n-1)/2 of them, found in full without a limit...
    backwards = chain_deliveries(hops, to_e[::-1])
    full = check(sends, backwards, limit=None)
    assert len(full.causal_violations) == hops * (hops - 1) // 2
    assert not full.truncated
    # ...and cut short, flagged as such, with the default limit.
    capped = check(sends, backwards)
    assert len(capped.causal_violations) == 1000 and capped.truncated
    assert "truncated" in capped.summary()


def test_happened_before() -> None:
    assert happened_before({"A": 1}, {"A": 1, "B": 1})  # missing entries count as 0
    assert happened_before({}, {"A": 1})
    assert not happened_before({"A": 1}, {"A": 1, "B": 0})  # equal once zeros are filled in
    assert not happened_before({"A": 2}, {"A": 1, "B": 5})
    assert not happened_before({"A": 1, "B": 1}, {"A": 1})


def test_send_keeps_a_copy_of_the_clock() -> None:
    live = {"A": 1}
    s = Send("m", "A", "B", live)
    live["A"] = 7  # the agent's clock moves on
    assert s.vc == {"A": 1}
    assert hash(s) == hash(Send("m", "A", "B", {"A": 1}))


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([("m", "A", "B", {"A": 1}), ("m", "A", "C", {"A": 1})], "two different sends"),
        ([("m", "A", "B", {"B": 1})], "count the send itself"),
        ([("m", "A", "B", {"A": 1}), ("k", "A", "C", {"A": 1, "C": 3})], "every event"),
    ],
)
def test_impossible_records_are_refused(rows: list[Row], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check(sends_of(rows), {})


def test_identical_send_recorded_twice_is_harmless() -> None:
    rows = [*FIG13_SENDS, FIG13_SENDS[0]]
    assert check(sends_of(rows), {"A2": ["n2"], "A3": ["n1", "n3"]}).ok


# -- a causal-delivery simulator, for property tests ------------------------------------------


@dataclass
class Msg:
    mid: str
    sender: str
    dest: str
    past: frozenset[str]  # every message sent before this one, in the causal sense


@dataclass
class Execution:
    """The ground truth (explicit causal pasts) and what the agents recorded (vector clocks)."""

    msgs: dict[str, Msg] = field(default_factory=dict)
    sends: list[Send] = field(default_factory=list)
    deliveries: dict[str, list[str]] = field(default_factory=dict)


def simulate(k: int, steps: list[tuple[int, int, int]]) -> Execution:
    """Run ``k`` agents; each step is (op, x, y): op 0 or 1 sends from agent x to agent y
    (possibly itself), op 2 delivers the x-th currently deliverable message. Pending messages are
    drained at the end. A message is held back until every message that happened-before it and
    goes to the same destination has been delivered there: causal delivery by definition."""
    names = [f"P{i}" for i in range(k)]
    known: dict[str, set[str]] = {a: set() for a in names}  # sends in each agent's past
    vcs: dict[str, dict[str, int]] = {a: {} for a in names}
    ex = Execution(deliveries={a: [] for a in names})
    done: set[str] = set()
    pending: list[Msg] = []

    def deliverable() -> list[Msg]:
        return [m for m in pending if all(p in done for p in m.past if ex.msgs[p].dest == m.dest)]

    def deliver(m: Msg) -> None:
        pending.remove(m)
        done.add(m.mid)
        ex.deliveries[m.dest].append(m.mid)
        known[m.dest] |= m.past | {m.mid}
        vc = vcs[m.dest]
        for a, v in ex.sends[int(m.mid[1:])].vc.items():
            vc[a] = max(vc.get(a, 0), v)
        vc[m.dest] = vc.get(m.dest, 0) + 1

    for op, x, y in steps:
        if op < 2:
            sender = names[x % k]
            dest = names[y % k]
            mid = f"m{len(ex.sends)}"
            m = Msg(mid, sender, dest, frozenset(known[sender]))
            known[sender].add(mid)
            vc = vcs[sender]
            vc[sender] = vc.get(sender, 0) + 1
            ex.msgs[mid] = m
            ex.sends.append(Send(mid, sender, dest, vc))
            pending.append(m)
        else:
            ready = deliverable()
            if ready:
                deliver(ready[x % len(ready)])
    while pending:
        # The causally first pending message is always deliverable, so this terminates.
        deliver(deliverable()[0])
    return ex


def oracle(ex: Execution, deliveries: Mapping[str, list[str]]) -> set[tuple[str, str, str]]:
    """Causal violations by brute force over explicit causal pasts."""
    bad = set()
    for agent, order in deliveries.items():
        for i, earlier in enumerate(order):
            for later in order[i + 1 :]:
                if later in ex.msgs[earlier].past:
                    bad.add((agent, earlier, later))
    return bad


def fifo_oracle(ex: Execution, deliveries: Mapping[str, list[str]]) -> set[tuple[str, str, str]]:
    bad = set()
    for agent, order in deliveries.items():
        for i, earlier in enumerate(order):
            for later in order[i + 1 :]:
                same_sender = ex.msgs[later].sender == ex.msgs[earlier].sender
                if same_sender and int(later[1:]) < int(earlier[1:]):  # mids count sends
                    bad.add((agent, earlier, later))
    return bad


step = st.tuples(st.integers(0, 2), st.integers(0, 1000), st.integers(0, 1000))
executions = st.builds(simulate, st.integers(2, 5), st.lists(step, max_size=60))


@settings(max_examples=200, deadline=None)
@given(executions)
def test_simulated_causal_executions_check_clean(ex: Execution) -> None:
    report = check(ex.sends, ex.deliveries)
    assert report.ok, report.summary()
    assert report.messages == len(ex.sends)


@settings(max_examples=200, deadline=None)
@given(executions, st.data())
def test_swapping_causally_ordered_deliveries_is_reported(
    ex: Execution, data: st.DataObject
) -> None:
    candidates = [
        (agent, i, j)
        for agent, order in ex.deliveries.items()
        for i in range(len(order))
        for j in range(i + 1, len(order))
        if order[i] in ex.msgs[order[j]].past
    ]
    if not candidates:
        return  # nothing causally ordered at one agent in this execution
    agent, i, j = data.draw(st.sampled_from(candidates))
    order = [*ex.deliveries[agent]]
    order[i], order[j] = order[j], order[i]
    swapped = {**ex.deliveries, agent: order}
    report = check(ex.sends, swapped, limit=None)
    assert (agent, order[i], order[j]) in report.causal_violations
    assert set(report.causal_violations) == oracle(ex, swapped)
    assert set(report.fifo_violations) == fifo_oracle(ex, swapped)
    assert report.lost == report.duplicated == report.misdelivered == []


@settings(max_examples=200, deadline=None)
@given(executions, st.randoms(use_true_random=False))
def test_any_reordering_matches_the_oracle(ex: Execution, rnd: random.Random) -> None:
    shuffled = {}
    for agent, order in ex.deliveries.items():
        shuffled[agent] = rnd.sample(order, len(order))
    report = check(ex.sends, shuffled, limit=None)
    assert set(report.causal_violations) == oracle(ex, shuffled)
    assert len(report.causal_violations) == len(set(report.causal_violations))
    assert set(report.fifo_violations) == fifo_oracle(ex, shuffled)


# -- size ---------------------------------------------------------------------------------------


def big_history(messages: int, agents: int, seed: int) -> tuple[list[Send], dict[str, list[str]]]:
    """Random traffic; each destination delivers its messages in global send order, which is a
    causal order (a message is always sent after everything that happened-before it)."""
    rnd = random.Random(seed)
    names = [f"G{i}" for i in range(agents)]
    vcs: dict[str, dict[str, int]] = {a: {} for a in names}
    inbox: dict[str, list[Send]] = {a: [] for a in names}
    sends: list[Send] = []
    deliveries: dict[str, list[str]] = {a: [] for a in names}
    while len(sends) < messages:
        if rnd.random() < 0.5:
            sender, dest = rnd.sample(names, 2)
            vc = vcs[sender]
            vc[sender] = vc.get(sender, 0) + 1
            s = Send(f"m{len(sends)}", sender, dest, vc)
            sends.append(s)
            inbox[dest].append(s)
        else:
            agent = rnd.choice(names)
            if inbox[agent]:
                # Deliver the whole inbox: few big batches keep the generator itself fast.
                vc = vcs[agent]
                for s in inbox[agent]:
                    for a, v in s.vc.items():
                        if v > vc.get(a, 0):
                            vc[a] = v
                    vc[agent] = vc.get(agent, 0) + 1
                    deliveries[agent].append(s.mid)
                inbox[agent] = []
    for agent, queued in inbox.items():
        deliveries[agent].extend(s.mid for s in queued)  # the tail: order matters, clocks not
    return sends, deliveries


def test_fifty_thousand_messages_check_quickly() -> None:
    sends, deliveries = big_history(50_000, 20, seed=13)
    report = check(sends, deliveries)
    assert report.ok, report.summary()
    assert report.messages == 50_000
    # One late message still costs only one scan of its destination's deliveries.
    agent = max(deliveries, key=lambda a: len(deliveries[a]))
    order = deliveries[agent]
    by_mid = {s.mid: s for s in sends}
    first = next(
        i
        for i in range(len(order) - 1)
        if happened_before(by_mid[order[i]].vc, by_mid[order[i + 1]].vc)
    )
    order[first], order[first + 1] = order[first + 1], order[first]
    report = check(sends, deliveries)
    assert (agent, order[first], order[first + 1]) in report.causal_violations


def test_sends_of_one_reaction_are_one_event() -> None:
    # A sends to B then to C in one reaction (one clock); B, on receipt, sends to C.
    sends = sends_of(
        [
            ("a1", "A", "B", {"A": 1}),
            ("a2", "A", "C", {"A": 1}),
            ("b1", "B", "C", {"A": 1, "B": 1}),
        ]
    )
    assert check(sends, {"B": ["a1"], "C": ["a2", "b1"]}).ok
    late = check(sends, {"B": ["a1"], "C": ["b1", "a2"]})
    assert late.causal_violations == [("C", "b1", "a2")]
    # Two siblings to one agent: neither is before the other, either order is causal.
    twins = sends_of([("x", "A", "B", {"A": 1}), ("y", "A", "B", {"A": 1})])
    assert check(twins, {"B": ["y", "x"]}).ok
