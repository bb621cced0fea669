"""An independent checker of recorded bus histories: exactly-once and causal delivery.

Test agents record what they did: every send (message id, sender, destination and the sender's
vector clock at the event that sent it, after counting that event) and every delivery, in the
order each agent saw them. :func:`check` judges such a history and says what went wrong:

* ``lost``: sent, never delivered at its destination;
* ``duplicated``: delivered more than once at its destination;
* ``misdelivered``: delivered to an agent that is not its destination, or never sent at all;
* ``causal_violations``: ``(agent, earlier, later)`` where ``later`` happened-before ``earlier``
  but the agent delivered it after ``earlier``;
* ``fifo_violations``: the same, restricted to two messages of one sender (FIFO is implied by
  causal order; reporting it apart tells a per-channel reordering from a cross-agent one).

This module deliberately imports nothing from ``aaabus``: a checker sharing code with the
implementation it checks would inherit its bugs. It relies only on the textbook vector clock
rules, with one event per reaction, that the recording agents follow: a reaction ticks once
(``vc = max(vc, msg.vc)`` if it delivered a message, then ``vc[self] += 1``) and every message it
sends carries a copy of that clock. The sends of one reaction are thus one event: none of them
happened-before another, and all of them happened-before whatever a receiver of any of them
does next. That is the bus's contract (a reaction's sends are stamped together).

Choices worth knowing:

* A message that happened-before another but was never delivered is reported as ``lost`` only,
  not also as a causal violation: the violation list is about the *order* of deliveries that did
  happen, and "the earlier one never came" is already fully described by ``lost``.
* Only the first delivery of a message at its destination takes part in the order checks. A
  duplicate is reported as such; letting it also count as "delivered late" would bury the one
  real problem under a pile of derived ones.
* A delivery at the wrong agent takes no part in that agent's order checks (causal order is
  defined between messages addressed to the same destination). If the message never reached
  its real destination it is also ``lost``.
* Sends of one event share their clock, so FIFO between two messages of one reaction to the
  same destination is not judged here (the bus keeps it; :mod:`aaabus.core.clock` tests it).
* Pair lists can be quadratic in the history length when an implementation is badly broken, so
  they stop growing at ``limit`` pairs each and :attr:`Report.truncated` is set.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = [
    "Delivery",
    "Report",
    "Send",
    "check",
    "check_fifo",
    "happened_before",
]

# How many examples of each problem kind :meth:`Report.summary` shows.
_EXAMPLES = 5


@dataclass(frozen=True)
class Send:
    """One send: ``vc`` is the sender's vector clock at the event (reaction) that sent it, after
    counting that event; the sends of one event share it."""

    mid: str
    sender: str
    dest: str
    vc: Mapping[str, int]

    def __post_init__(self) -> None:
        # Recorders are tempted to pass the agent's live clock dict; freezing a private copy
        # keeps a later tick of that clock from silently rewriting history.
        object.__setattr__(self, "vc", MappingProxyType(dict(self.vc)))

    def __hash__(self) -> int:
        # The generated hash would choke on the mapping; hash its sorted items instead.
        return hash((self.mid, self.sender, self.dest, tuple(sorted(self.vc.items()))))


@dataclass(frozen=True)
class Delivery:
    """One delivery event: ``agent`` delivered message ``mid``."""

    agent: str
    mid: str


Pair = tuple[str, str, str]


@dataclass
class Report:
    """What :func:`check` found. Pairs are ``(agent, earlier_mid, later_mid)`` in delivery order:
    ``later_mid`` should have been delivered first."""

    lost: list[str] = field(default_factory=list)
    duplicated: list[str] = field(default_factory=list)
    misdelivered: list[str] = field(default_factory=list)
    causal_violations: list[Pair] = field(default_factory=list)
    fifo_violations: list[Pair] = field(default_factory=list)
    messages: int = 0
    deliveries: int = 0
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.duplicated
            or self.misdelivered
            or self.causal_violations
            or self.fifo_violations
        )

    def summary(self) -> str:
        """One line per kind of problem, with its count and a few examples."""
        if self.ok:
            return f"ok: {self.messages} messages, {self.deliveries} deliveries"
        lines: list[str] = []

        def mids(kind: str, items: list[str]) -> None:
            if items:
                shown = ", ".join(items[:_EXAMPLES])
                more = ", ..." if len(items) > _EXAMPLES else ""
                lines.append(f"{kind}: {len(items)} ({shown}{more})")

        def pairs(kind: str, items: list[Pair]) -> None:
            if items:
                shown = "; ".join(
                    f"{agent} delivered {later} after {earlier}"
                    for agent, earlier, later in items[:_EXAMPLES]
                )
                more = "; ..." if len(items) > _EXAMPLES else ""
                lines.append(f"{kind}: {len(items)} ({shown}{more})")

        mids("lost", self.lost)
        mids("duplicated", self.duplicated)
        mids("misdelivered", self.misdelivered)
        pairs("causal violations", self.causal_violations)
        pairs("fifo violations", self.fifo_violations)
        if self.truncated:
            lines.append("(violation lists truncated at the limit; there are more)")
        return "\n".join(lines)


def happened_before(vc1: Mapping[str, int], vc2: Mapping[str, int]) -> bool:
    """``vc1 -> vc2``: componentwise ``<=`` (missing entries are 0) and not equal."""
    for agent, v in vc1.items():
        if v > vc2.get(agent, 0):
            return False
    # vc1 <= vc2 holds; they differ iff some entry of vc2 exceeds vc1's (covers keys vc1 lacks).
    return any(v > vc1.get(agent, 0) for agent, v in vc2.items())


def _index_sends(sends: Iterable[Send]) -> dict[str, Send]:
    by_mid: dict[str, Send] = {}
    # (sender, vc[sender]) names one event: each event ticks the sender's own entry, and the
    # sends of one event carry the same clock. The order checks below rely on that, so a
    # recorder breaking it must fail loudly, not skew verdicts.
    events: dict[tuple[str, int], Send] = {}
    for s in sends:
        known = by_mid.get(s.mid)
        if known is not None:
            if known != s:
                raise ValueError(f"two different sends recorded for message {s.mid!r}")
            continue  # the same record twice: an idempotent recorder, harmless
        own = s.vc.get(s.sender, 0)
        if own < 1:
            raise ValueError(f"send {s.mid!r}: vc[{s.sender!r}] must count the send itself")
        other = events.setdefault((s.sender, own), s)
        if other.vc != s.vc:
            raise ValueError(
                f"sends {other.mid!r} and {s.mid!r} both carry vc[{s.sender!r}] = {own} with "
                "different clocks: the sender must tick its own entry on every event"
            )
        by_mid[s.mid] = s
    return by_mid


def _per_agent(
    deliveries: Mapping[str, Sequence[str]] | Iterable[Delivery],
) -> dict[str, list[str]]:
    # A Mapping is iterable too (over its keys), so it must be recognised first.
    if isinstance(deliveries, Mapping):
        return {agent: list(mids) for agent, mids in deliveries.items()}
    grouped: dict[str, list[str]] = defaultdict(list)
    for d in deliveries:
        grouped[d.agent].append(d.mid)
    return dict(grouped)


class _Pairs:
    """A pair list that stops at ``limit`` entries (``None``: no limit)."""

    def __init__(self, limit: int | None) -> None:
        self.items: list[Pair] = []
        self.limit = limit
        self.full = False

    def add(self, pair: Pair) -> None:
        if self.limit is not None and len(self.items) >= self.limit:
            self.full = True
        else:
            self.items.append(pair)


def _order_checks(agent: str, order: list[Send], causal: _Pairs, fifo: _Pairs | None) -> None:
    """Find the order violations among ``order``, the messages ``agent`` delivered (first
    deliveries of messages addressed to it), in delivery order.

    A pair (earlier m_i, later m_j) is a causal violation iff m_j -> m_i. The textbook vector
    clock fact used to avoid comparing all pairs: componentwise ``vc_j <= vc_i`` implies in
    particular ``vc_j[s_j] <= vc_i[s_j]`` with s_j the sender of m_j. So keeping ``high``, the
    componentwise max of the clocks delivered so far, m_j can only be late if
    ``vc_j[s_j] <= high[s_j]``; that is an O(1) test, and a necessary condition even for
    ill-formed clocks, so it never hides a violation. For well-formed clocks it is also
    sufficient (the entry s_j counts the events of s_j that m_j's send knows of), so in a clean
    history no pair is ever examined. Only when it fires do we scan the earlier deliveries, to
    name every offending m_i and confirm each one with the full componentwise definition.

    FIFO works the same way per sender: the largest ``vc[s][s]`` delivered so far from each
    sender s; a message from s with a smaller own entry was overtaken.
    """
    high: dict[str, int] = {}
    fifo_high: dict[str, int] = {}
    for j, m in enumerate(order):
        own = m.vc[m.sender]
        if not causal.full and own <= high.get(m.sender, 0):
            for earlier in order[:j]:
                # Cheap single-entry filter first; the full comparison only for survivors.
                if earlier.vc.get(m.sender, 0) >= own and happened_before(m.vc, earlier.vc):
                    causal.add((agent, earlier.mid, m.mid))
        if fifo is not None and not fifo.full:
            if own < fifo_high.get(m.sender, 0):
                for earlier in order[:j]:
                    if earlier.sender == m.sender and earlier.vc[m.sender] > own:
                        fifo.add((agent, earlier.mid, m.mid))
            else:
                fifo_high[m.sender] = own
        for a, v in m.vc.items():
            if v > high.get(a, 0):
                high[a] = v


def check(
    sends: Iterable[Send],
    deliveries: Mapping[str, Sequence[str]] | Iterable[Delivery],
    *,
    fifo: bool = True,
    limit: int | None = 1000,
) -> Report:
    """Judge a recorded history.

    ``deliveries`` is either ``agent -> mids in delivery order`` or a flat iterable of
    :class:`Delivery` in global order (grouped per agent, order kept). ``fifo=False`` skips the
    FIFO list; ``limit`` caps each pair list (see :attr:`Report.truncated`).

    Raises :class:`ValueError` for records no correct recorder produces (two different sends
    with one mid, a send not counting itself in its clock, two sends of one sender with the same
    own clock entry): those are bugs in the test, not in the bus.
    """
    by_mid = _index_sends(sends)
    per_agent = _per_agent(deliveries)

    report = Report(messages=len(by_mid))
    delivered: set[str] = set()
    duplicated: set[str] = set()
    misdelivered: set[str] = set()
    causal = _Pairs(limit)
    fifo_pairs = _Pairs(limit) if fifo else None

    for agent in sorted(per_agent):
        mids = per_agent[agent]
        report.deliveries += len(mids)
        order: list[Send] = []
        for mid in mids:
            send = by_mid.get(mid)
            if send is None or send.dest != agent:
                misdelivered.add(mid)
            elif mid in delivered:
                duplicated.add(mid)
            else:
                delivered.add(mid)
                order.append(send)
        _order_checks(agent, order, causal, fifo_pairs)

    report.lost = sorted(set(by_mid) - delivered)
    report.duplicated = sorted(duplicated)
    report.misdelivered = sorted(misdelivered)
    report.causal_violations = causal.items
    if fifo_pairs is not None:
        report.fifo_violations = fifo_pairs.items
    report.truncated = causal.full or (fifo_pairs is not None and fifo_pairs.full)
    return report


def check_fifo(
    sends: Iterable[Send],
    deliveries: Mapping[str, Sequence[str]] | Iterable[Delivery],
    *,
    limit: int | None = 1000,
) -> list[Pair]:
    """Only the FIFO violations of a history (``check(...).fifo_violations``)."""
    return check(sends, deliveries, fifo=True, limit=limit).fifo_violations
