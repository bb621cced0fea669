"""The invariants of failover, judged over a recorded history (issue 42, point 5).

A failover run (``python -m perf failover``, its randomized schedules, ``tests/test_failover*``)
records two things as it goes, from outside the bus:

* **who was accepted as primary**: :class:`Accepted`, one record each time an observer (a peer
  server's epoch book, a tool that got an answer, a device whose CONNECT was accepted) accepted
  a member of a server as that server's primary at an epoch;
* **the traffic**: every message sent (with the vector clock of the event that sent it) and
  every delivery, in the order each receiver saw them, as :mod:`aaabus.testing.checker` takes
  them.

:func:`judge` says what went wrong:

* ``split_brain``: a (server id, epoch) accepted with two different members: two primaries of
  one epoch, which the vote exists to make impossible;
* ``regressions``: an observer that accepted an epoch of a server, then an older one of the same
  server (a fenced primary's frames accepted after its successor's);
* the checker's ``lost``, ``duplicated``, ``misdelivered`` and causal order violations.

Like the checker, this module imports nothing from the bus it judges (only the checker): a judge
sharing code with the implementation would inherit its bugs. Its self-test
(``tests/test_failhistory.py``) feeds it mutated histories (two primaries in one epoch, a message
lost, one delivered twice, an epoch going back) and sees each fail.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aaabus.testing.checker import Report, Send, check

__all__ = ["Accepted", "History", "Verdict", "judge"]


@dataclass(frozen=True)
class Accepted:
    """At ``at`` (seconds, one clock for the whole history), ``observer`` accepted ``member`` of
    server ``server`` as its primary at ``epoch``."""

    at: float
    observer: str
    server: int
    epoch: int
    member: int


@dataclass
class History:
    """What a run recorded (appended to by one thread at a time: the run's owner)."""

    accepted: list[Accepted] = field(default_factory=list)
    sends: list[Send] = field(default_factory=list)
    #: Receiver -> message ids in the order it received them.
    deliveries: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))

    def accept(self, at: float, observer: str, server: int, epoch: int, member: int) -> None:
        self.accepted.append(Accepted(at, observer, server, epoch, member))

    def send(self, mid: str, sender: str, dests: Iterable[str], vc: Mapping[str, int]) -> None:
        """One event of ``sender`` sending message ``mid`` to each of ``dests`` (a publication
        owed to several subscribers: one message id per subscriber, ``mid@dest``)."""
        for dest in dests:
            self.sends.append(Send(f"{mid}@{dest}", sender, dest, vc))

    def deliver(self, receiver: str, mid: str) -> None:
        self.deliveries[receiver].append(f"{mid}@{receiver}")

    def as_json(self) -> dict[str, Any]:
        """The history as plain data (kept beside a failed run as its evidence)."""
        return {
            "accepted": [a.__dict__ for a in self.accepted],
            "sends": [
                {"mid": s.mid, "sender": s.sender, "dest": s.dest, "vc": dict(s.vc)}
                for s in self.sends
            ],
            "deliveries": dict(self.deliveries),
        }


@dataclass
class Verdict:
    """What :func:`judge` found."""

    split_brain: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    regressions: list[tuple[str, int, int, int]] = field(default_factory=list)
    report: Report = field(default_factory=Report)

    @property
    def violations(self) -> int:
        """Invariant violations, loss and duplication apart (they have their own counts)."""
        r = self.report
        return (
            len(self.split_brain)
            + len(self.regressions)
            + len(r.misdelivered)
            + len(r.causal_violations)
            + len(r.fifo_violations)
        )

    @property
    def ok(self) -> bool:
        return self.violations == 0 and not self.report.lost and not self.report.duplicated

    def problems(self) -> list[str]:
        """One line per kind of problem found (empty when ok)."""
        lines = [
            f"server {server} epoch {epoch} accepted with members {list(members)}"
            for server, epoch, members in self.split_brain[:5]
        ]
        lines += [
            f"{observer} accepted server {server} at epoch {after} after epoch {before}"
            for observer, server, before, after in self.regressions[:5]
        ]
        if not self.report.ok:
            lines += self.report.summary().splitlines()
        return lines


def judge(
    accepted: Sequence[Accepted],
    sends: Iterable[Send],
    deliveries: Mapping[str, Sequence[str]],
) -> Verdict:
    """Judge a recorded history; see the module's docstring for the invariants."""
    verdict = Verdict()
    members: dict[tuple[int, int], set[int]] = defaultdict(set)
    highest: dict[tuple[str, int], int] = {}
    for record in sorted(accepted, key=lambda a: a.at):
        members[(record.server, record.epoch)].add(record.member)
        key = (record.observer, record.server)
        before = highest.get(key, 0)
        if record.epoch < before:
            verdict.regressions.append((record.observer, record.server, before, record.epoch))
        else:
            highest[key] = record.epoch
    verdict.split_brain = [
        (server, epoch, tuple(sorted(found)))
        for (server, epoch), found in sorted(members.items())
        if len(found) > 1
    ]
    verdict.report = check(sends, deliveries)
    return verdict


def judge_history(history: History) -> Verdict:
    """:func:`judge` of a :class:`History`."""
    return judge(history.accepted, history.sends, history.deliveries)
