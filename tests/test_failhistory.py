"""The failover invariant checker's self-test (issue 42): a clean history passes, and each
mutation of it (two primaries accepted in one epoch, an epoch going back, a message lost, one
delivered twice, two delivered out of causal order) fails with that finding."""

from __future__ import annotations

import pytest

from aaabus.testing.failhistory import History, Verdict, judge_history


def clean_history() -> History:
    """Two takeovers of server 1 seen by a peer and a device; a ping-pong across them and a
    publication owed to two subscribers, every message delivered once in causal order."""
    h = History()
    h.accept(0.0, "s0", 1, 1, 0)
    h.accept(0.1, "device", 1, 1, 0)
    h.accept(2.0, "s0", 1, 2, 1)
    h.accept(2.2, "device", 1, 2, 1)
    h.accept(5.0, "s0", 1, 3, 2)
    h.accept(7.0, "device", 1, 4, 0)  # an observer may skip an epoch, never go back
    h.accept(7.1, "s0", 1, 4, 0)
    h.send("ping-0", "pinger", ["ponger"], {"pinger": 1})
    h.deliver("ponger", "ping-0")
    h.send("pong-0", "ponger", ["pinger"], {"pinger": 1, "ponger": 2})
    h.deliver("pinger", "pong-0")
    h.send("ping-1", "pinger", ["ponger"], {"pinger": 3, "ponger": 2})
    h.deliver("ponger", "ping-1")
    h.send("news", "ponger", ["a", "b"], {"pinger": 3, "ponger": 4})
    h.send("more", "ponger", ["a", "b"], {"pinger": 3, "ponger": 5})
    for sub in ("a", "b"):
        h.deliver(sub, "news")
        h.deliver(sub, "more")
    return h


def test_a_clean_history_passes() -> None:
    verdict = judge_history(clean_history())
    assert verdict.ok, verdict.problems()
    assert verdict.report.messages == 7 and verdict.report.deliveries == 7


def mutated(change: str) -> Verdict:
    h = clean_history()
    if change == "two primaries in one epoch":
        h.accept(2.5, "tool", 1, 2, 2)
    elif change == "an epoch accepted after a newer one":
        h.accept(6.0, "s0", 1, 2, 1)
    elif change == "a lost message":
        h.deliveries["b"].remove("more@b")
    elif change == "a duplicate":
        h.deliver("pinger", "pong-0")
    elif change == "a causal inversion":
        h.deliveries["a"].reverse()
    else:
        raise AssertionError(change)
    return judge_history(h)


@pytest.mark.parametrize(
    ("change", "finding"),
    [
        ("two primaries in one epoch", "server 1 epoch 2 accepted with members [1, 2]"),
        ("an epoch accepted after a newer one", "s0 accepted server 1 at epoch 2 after epoch 3"),
        ("a lost message", "lost: 1 (more@b)"),
        ("a duplicate", "duplicated: 1 (pong-0@pinger)"),
        ("a causal inversion", "causal violations: 1 (a delivered news@a after more@a)"),
    ],
)
def test_a_mutated_history_fails(change: str, finding: str) -> None:
    verdict = mutated(change)
    assert not verdict.ok
    assert finding in verdict.problems(), verdict.problems()


def test_counts_split_loss_and_duplication_apart() -> None:
    # The benchmark's JSON line reports lost and duplicated on their own: they are not also
    # counted as violations, and a split brain is one.
    assert mutated("a lost message").violations == 0
    assert mutated("a duplicate").violations == 0
    assert mutated("two primaries in one epoch").violations == 1
