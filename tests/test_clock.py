"""The matrix clock of a causality domain (aaabus.core.clock).

The property tests judge the clock against an oracle written here from first principles: every
message carries the explicit set of messages that happened before its send, so causal order is
a set-membership test, sharing nothing with the clock's matrices, epochs or stamps.
"""

from __future__ import annotations

import os
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import transaction
import ZODB
import ZODB.FileStorage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aaabus.core.clock import DomainClock, Verdict
from aaabus.errors import ClockError

ENCODINGS = ["delta", "full"]

# The wire format, restated independently of the module: header, then per encoding the body.
HEADER = struct.Struct("<BBHHH")  # version, kind, k, sender, receiver
ENTRY = struct.Struct("<Iq")  # delta: key a*k+b, value


def delta_entries(stamp: bytes, k: int) -> dict[tuple[int, int], int]:
    """The ``(a, b) -> value`` cells a delta stamp carries."""
    body = stamp[HEADER.size :]
    assert len(body) % ENTRY.size == 0
    return {(key // k, key % k): v for key, v in ENTRY.iter_unpack(body)}


def craft_delta(k: int, src: int, dest: int, cells: dict[tuple[int, int], int]) -> bytes:
    return HEADER.pack(1, 2, k, src, dest) + b"".join(
        ENTRY.pack(a * k + b, v) for (a, b), v in cells.items()
    )


def matrix(clock: DomainClock) -> list[list[int]]:
    k = clock.size
    return [[clock.entry(a, b) for b in range(k)] for a in range(k)]


# ------------------------------------------------------------------------------ the three verdicts


def three_servers(stamps: str, order: str = "causal") -> tuple[list[DomainClock], dict[str, bytes]]:
    """0 sends m1 to 2, then m2 to 1; 1 delivers m2 and sends m3 to 2. So m1 -> m3, both to 2."""
    clocks = [DomainClock(3, i, stamps=stamps, order=order) for i in range(3)]
    m1 = clocks[0].prepare_send(2)
    m2 = clocks[0].prepare_send(1)
    assert clocks[1].check(0, m2) is Verdict.DELIVER
    clocks[1].deliver(0, m2)
    m3 = clocks[1].prepare_send(2)
    return clocks, {"m1": m1, "m2": m2, "m3": m3}


@pytest.mark.parametrize("stamps", ENCODINGS)
def test_causal_verdicts(stamps: str) -> None:
    clocks, m = three_servers(stamps)
    c2 = clocks[2]
    assert c2.check(1, m["m3"]) is Verdict.WAIT  # m1 happened before it and is missing
    assert matrix(c2) == [[0] * 3] * 3  # check() is pure
    assert c2.check(0, m["m1"]) is Verdict.DELIVER
    c2.deliver(0, m["m1"])
    assert c2.check(0, m["m1"]) is Verdict.DUPLICATE
    assert c2.check(1, m["m3"]) is Verdict.DELIVER
    c2.deliver(1, m["m3"])
    assert c2.check(1, m["m3"]) is Verdict.DUPLICATE
    assert matrix(c2) == [[0, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert (c2.received_from(0), c2.received_from(1), c2.sent_to(0)) == (1, 1, 0)


@pytest.mark.parametrize("stamps", ENCODINGS)
def test_fifo_gap_waits_and_deliver_refuses_it(stamps: str) -> None:
    a, b = DomainClock(2, 0, stamps=stamps), DomainClock(2, 1, stamps=stamps)
    first, second = a.prepare_send(1), a.prepare_send(1)
    assert a.sent_to(1) == 2
    assert b.check(0, second) is Verdict.WAIT
    with pytest.raises(ClockError, match="WAIT"):
        b.deliver(0, second)  # merging a waiting message would break causality
    assert matrix(b) == [[0, 0], [0, 0]]
    assert b.receive(0, first) is Verdict.DELIVER
    assert b.receive(0, second) is Verdict.DELIVER
    assert b.receive(0, first) is Verdict.DUPLICATE
    with pytest.raises(ClockError, match="DUPLICATE"):
        b.deliver(0, first)
    assert b.received_from(0) == 2


def test_delta_stamp_wire_format() -> None:
    """A stamp built by hand from the documented format is understood, and vice versa."""
    c = DomainClock(3, 1)
    stamp = c.prepare_send(2)
    assert stamp == HEADER.pack(1, 2, 3, 1, 2) + ENTRY.pack(1 * 3 + 2, 1)
    assert len(stamp) == 20
    hand = craft_delta(3, 0, 1, {(0, 1): 1, (0, 2): 1})
    assert c.check(0, hand) is Verdict.DELIVER
    c.deliver(0, hand)
    assert matrix(c) == [[0, 1, 1], [0, 0, 1], [0, 0, 0]]
    full = DomainClock(2, 0, stamps="full").prepare_send(1)
    assert full == HEADER.pack(1, 1, 2, 0, 1) + struct.pack("<4q", 0, 1, 0, 0)
    fifo = DomainClock(2, 0, order="fifo").prepare_send(1)
    assert fifo == HEADER.pack(1, 3, 2, 0, 1) + struct.pack("<q", 1)


def test_delta_skips_what_the_destination_knows() -> None:
    """Cells learned from the destination, and the destination's own row, are not echoed."""
    c = [DomainClock(3, i) for i in range(3)]
    assert c[1].receive(2, c[2].prepare_send(1)) is Verdict.DELIVER  # 1 learns (2,1) = 1
    assert c[0].receive(1, c[1].prepare_send(0)) is Verdict.DELIVER  # 0 learns (2,1), (1,0)
    assert matrix(c[0]) == [[0, 0, 0], [1, 0, 0], [0, 1, 0]]
    # To 1: (2,1) came from 1 and (1,0) is 1's own row: only the link counter travels.
    to1 = c[0].prepare_send(1)
    assert delta_entries(to1, 3) == {(0, 1): 1}
    # To 2: (2,1) is 2's own row, but 2 has not heard of (1,0) nor (0,1).
    to2 = c[0].prepare_send(2)
    assert delta_entries(to2, 3) == {(0, 2): 1, (1, 0): 1, (0, 1): 1}
    assert c[1].receive(0, to1) is Verdict.DELIVER
    assert c[2].receive(0, to2) is Verdict.DELIVER


def test_delta_resends_a_cell_raised_since_the_destination_told_us() -> None:
    """Only the *last* source of a cell counts when deciding what the destination knows."""
    c = [DomainClock(3, i) for i in range(3)]
    first = c[2].prepare_send(1)
    assert c[1].receive(2, first) is Verdict.DELIVER
    assert c[0].receive(1, c[1].prepare_send(0)) is Verdict.DELIVER  # (2,1) = 1, told by 1
    second = c[2].prepare_send(1)  # (2,1) = 2: 1 has not got it yet
    assert c[0].receive(2, c[2].prepare_send(0)) is Verdict.DELIVER  # (2,1) = 2, told by 2
    to1 = c[0].prepare_send(1)
    assert delta_entries(to1, 3)[2, 1] == 2
    assert c[1].check(0, to1) is Verdict.WAIT  # must wait for `second`
    assert c[1].receive(2, second) is Verdict.DELIVER
    assert c[1].receive(0, to1) is Verdict.DELIVER


def test_long_run_to_one_destination_has_constant_stamps() -> None:
    k = 6
    c = [DomainClock(k, i) for i in range(k)]
    for other in (2, 3, 4):  # some knowledge to propagate on the first send
        assert c[0].receive(other, c[other].prepare_send(0)) is Verdict.DELIVER
    c[0].prepare_send(5)
    first = c[0].prepare_send(1)
    assert len(delta_entries(first, k)) == 5  # link + (0,5) + the three links into 0
    for _ in range(200):
        stamp = c[0].prepare_send(1)
        assert delta_entries(stamp, k) == {(0, 1): c[0].sent_to(1)}
        assert len(stamp) == HEADER.size + ENTRY.size
    assert c[0].receive(2, c[2].prepare_send(0)) is Verdict.DELIVER
    assert set(delta_entries(c[0].prepare_send(1), k)) == {(0, 1), (2, 0)}
    assert len(delta_entries(c[0].prepare_send(1), k)) == 1


# --------------------------------------------------------------------------------- bad stamps


def _mutations(k: int, src: int, me: int, good: bytes, stamps: str) -> list[tuple[str, bytes]]:
    version, kind, size, hsrc, hdest = HEADER.unpack_from(good)
    body = good[HEADER.size :]
    out = [
        ("empty", b""),
        ("short header", good[:5]),
        ("version", HEADER.pack(9, kind, size, hsrc, hdest) + body),
        ("kind", HEADER.pack(version, 3, size, hsrc, hdest) + body),
        ("unknown kind", HEADER.pack(version, 77, size, hsrc, hdest) + body),
        ("size", HEADER.pack(version, kind, size + 1, hsrc, hdest) + body),
        ("sender", HEADER.pack(version, kind, size, (hsrc + 1) % k, hdest) + body),
        ("receiver", HEADER.pack(version, kind, size, hsrc, (hdest + 1) % k) + body),
        ("truncated", good[:-1]),
        ("extra byte", good + b"\0"),
        ("no body", good[: HEADER.size]),
    ]
    if stamps == "delta":
        out += [
            ("key out of matrix", good + ENTRY.pack(k * k, 1)),
            ("no link counter", craft_delta(k, src, me, {(src, (me + 1) % k): 1})),
            # The receiver's own row claims sends it never made.
            ("ahead of me", good + ENTRY.pack(me * k + src, 99)),
        ]
    else:
        cells = list(struct.unpack(f"<{k * k}q", body))
        cells[me * k + src] = 99
        out.append(("ahead of me", good[: HEADER.size] + struct.pack(f"<{k * k}q", *cells)))
    return out


@pytest.mark.parametrize("stamps", ENCODINGS)
def test_malformed_stamps_raise_and_change_nothing(stamps: str) -> None:
    clocks, m = three_servers(stamps)
    twin, _ = three_servers(stamps)
    c2 = clocks[2]
    good = m["m1"]  # from 0, deliverable at 2
    for name, bad in _mutations(3, 0, 2, good, stamps):
        for call in (c2.check, c2.deliver, c2.receive):
            with pytest.raises(ClockError):
                call(0, bad)
                pytest.fail(f"{name} accepted by {call.__name__}")
    for src in (-1, 2, 3):  # out of range, or the receiver itself
        with pytest.raises(ClockError):
            c2.check(src, good)
    with pytest.raises(ClockError):
        c2.prepare_send(2)
    assert matrix(c2) == matrix(twin[2])
    # The delta bookkeeping is untouched too: the next stamps are byte for byte the twin's.
    assert c2.prepare_send(0) == twin[2].prepare_send(0)
    assert c2.receive(0, good) is Verdict.DELIVER


def test_constructor_rejects_bad_arguments() -> None:
    for args, kwargs in [
        ((0, 0), {}),
        ((3, 3), {}),
        ((3, -1), {}),
        ((3, 0), {"stamps": "diff"}),
        ((3, 0), {"order": "total"}),
    ]:
        with pytest.raises(ValueError):
            DomainClock(*args, **kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ property tests


@dataclass
class Msg:
    mid: int
    src: int
    dest: int
    stamp: bytes
    past: frozenset[int]  # ids of every message whose send happened before this one's
    link_seq: int  # rank of this message on its link src->dest
    # The messages sent in the same event (prepare_sends): not before this one, but known to
    # whoever delivers it, like its past.
    event: frozenset[int] = frozenset()


@dataclass
class Net:
    """k servers, their clocks in one in-memory ZODB, and the oracle's view of history."""

    k: int
    order: str
    clocks: list[DomainClock]
    past: list[set[int]]
    msgs: list[Msg] = field(default_factory=list)
    pool: list[Msg] = field(default_factory=list)  # copies in flight
    held: list[dict[int, Msg]] = field(default_factory=list)
    delivered: list[list[Msg]] = field(default_factory=list)
    links: dict[tuple[int, int], int] = field(default_factory=dict)

    def send(self, src: int, dest: int) -> None:
        stamp = self.clocks[src].prepare_send(dest)
        seq = self.links[src, dest] = self.links.get((src, dest), 0) + 1
        msg = Msg(len(self.msgs), src, dest, stamp, frozenset(self.past[src]), seq)
        self.past[src].add(msg.mid)
        self.msgs.append(msg)
        self.pool.append(msg)

    def send_event(self, src: int, dests: list[int]) -> None:
        """One event sending to every server of ``dests``: siblings are counted together."""
        stamped = self.clocks[src].prepare_sends(dests)
        base = frozenset(self.past[src])
        mids = frozenset(range(len(self.msgs), len(self.msgs) + len(dests)))
        for i, (dest, (seq, stamp)) in enumerate(zip(dests, stamped, strict=True)):
            link_seq = self.links[src, dest] = self.links.get((src, dest), 0) + 1
            assert seq == link_seq
            # Earlier siblings on the same link come first: the link counter orders them.
            same_link = {m.mid for m in self.msgs[len(self.msgs) - i :] if m.dest == dest}
            msg = Msg(len(self.msgs), src, dest, stamp, base | same_link, link_seq, mids)
            self.msgs.append(msg)
            self.pool.append(msg)
        self.past[src] |= mids

    def expected(self, msg: Msg) -> Verdict:
        r = msg.dest
        done = {m.mid for m in self.delivered[r]}
        if msg.mid in done:
            return Verdict.DUPLICATE
        if self.order == "fifo":
            missing = [m for m in self.msgs if (m.src, m.dest) == (msg.src, r)]
            missing = [m for m in missing if m.link_seq < msg.link_seq and m.mid not in done]
        else:
            missing = [m for m in self.msgs if m.dest == r and m.mid in msg.past]
            missing = [m for m in missing if m.mid not in done]
        return Verdict.WAIT if missing else Verdict.DELIVER

    def present(self, msg: Msg) -> None:
        r = msg.dest
        verdict = self.clocks[r].check(msg.src, msg.stamp, msg.link_seq)
        # Exact: WAIT exactly when a predecessor to the same receiver is still missing.
        assert verdict is self.expected(msg), (msg, verdict)
        if verdict is not Verdict.DUPLICATE:
            self.held[r][msg.mid] = msg
        self._deliver_ready(r)
        transaction.commit()

    def _deliver_ready(self, r: int) -> None:
        """Deliver held messages until none can go, each with the rest of its event on its link
        (the channel's rule): a message whose event sent later ones to ``r`` waits for them."""
        clock = self.clocks[r]
        retry = True
        while retry:
            retry = False
            for held in list(self.held[r].values()):
                if held.mid not in self.held[r]:
                    continue  # delivered in this pass with an earlier sibling
                v = clock.check(held.src, held.stamp, held.link_seq)
                assert v is self.expected(held), (held, v)
                if v is not Verdict.DELIVER:
                    continue
                end = clock.event_end(held.src, held.stamp)
                rest = {m.link_seq: m for m in self.held[r].values() if m.src == held.src}
                if any(seq not in rest for seq in range(held.link_seq + 1, end + 1)):
                    continue
                for seq in range(held.link_seq, end + 1):
                    self._deliver(rest[seq])
                retry = True

    def _deliver(self, msg: Msg) -> None:
        r = msg.dest
        self.clocks[r].deliver(msg.src, msg.stamp, msg.link_seq)
        self.held[r].pop(msg.mid, None)
        self.delivered[r].append(msg)
        self.past[r] |= msg.past | msg.event | {msg.mid}


def make_net(k: int, stamps: str, order: str) -> Net:
    db = ZODB.DB(None)
    root = db.open().root()
    clocks = [DomainClock(k, i, stamps=stamps, order=order) for i in range(k)]
    root["clocks"] = clocks  # a plain list is fine: nothing mutates it after this commit
    transaction.commit()
    return Net(
        k,
        order,
        clocks,
        [set() for _ in range(k)],
        held=[{} for _ in range(k)],
        delivered=[[] for _ in range(k)],
    )


# What a script does, step by step (see run()); repeated kinds are drawn more often.
KINDS = ["send", "forward", "forward", "event", "net", "newest", "newest", "dup", "aborted"]
actions = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        # 0..59 reduced modulo k (2..6) or k-1 is close to uniform.
        st.integers(0, 59),
        st.integers(0, 59),
    ),
    max_size=80,
)


def run(k: int, stamps: str, order: str, script: list[tuple[str, int, int]], seed: int) -> Net:
    net = make_net(k, stamps, order)
    last_receiver = 0
    for kind, x, y in script:
        # "forward": the server that delivered last sends on, which builds causal chains.
        src = last_receiver if kind == "forward" else x % k
        dest = (src + 1 + y % (k - 1)) % k
        if kind in ("send", "forward"):
            net.send(src, dest)
            transaction.commit()
        elif kind == "event":
            # One reaction sending to up to three servers (maybe twice to one), in any order.
            others = [(src + 1 + (x + y * i) % (k - 1)) % k for i in range(1 + x % 3)]
            net.send_event(src, [dest, *others])
            transaction.commit()
        elif kind == "aborted":
            # A reaction that stamped a message and then failed: nothing of it may remain.
            net.clocks[src].prepare_send(dest)
            transaction.abort()
        elif net.pool:
            # "newest" overtakes everything in flight: the reorderings causality must undo.
            msg = net.pool[-1 if kind == "newest" else x % len(net.pool)]
            if kind != "dup":  # a duplicated copy stays in flight: it will come again
                net.pool.remove(msg)
            net.present(msg)
            last_receiver = msg.dest
    # Every message eventually arrives (the copies left in flight, in a scrambled order).
    rest = net.pool[seed % (len(net.pool) or 1) :] + net.pool[: seed % (len(net.pool) or 1)]
    for msg in reversed(rest):
        net.present(msg)
    for clock in net.clocks:
        assert clock.dirty_bytes() == 0  # everything is committed
    return net


def assert_causal(net: Net) -> None:
    for r in range(net.k):
        got = net.delivered[r]
        assert sorted(m.mid for m in got) == [m.mid for m in net.msgs if m.dest == r]
        assert not net.held[r]
        for i, earlier in enumerate(got):
            for later in got[i + 1 :]:
                assert later.mid not in earlier.past, (later, earlier)


def assert_exact_rows(net: Net) -> None:
    """Row and column of ``me`` are exact: what each server sent, and delivered, per link."""
    for clock in net.clocks:
        for other in range(net.k):
            if other != clock.me:
                assert clock.sent_to(other) == net.links.get((clock.me, other), 0)
                assert clock.received_from(other) == net.links.get((other, clock.me), 0)


# Derandomized: the same examples on every run (a failure is reproducible by rerunning).
SETTINGS = settings(
    max_examples=400,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


@pytest.mark.parametrize("stamps", ENCODINGS)
@SETTINGS
@given(k=st.integers(2, 6), script=actions, seed=st.integers(0, 1000))
def test_causal_delivery_matches_the_oracle(
    stamps: str, k: int, script: list[tuple[str, int, int]], seed: int
) -> None:
    net = run(k, stamps, "causal", script, seed)
    assert_causal(net)
    assert_exact_rows(net)


@pytest.mark.parametrize("stamps", ENCODINGS)
def test_the_first_of_two_siblings_on_a_link_waits_for_the_second(stamps: str) -> None:
    """The event oracle's 1-in-90 failure, by hand: server 1 sends m0 and m1 to server 2 in one
    event. Delivered alone, m0 let 2 tell 3, whose answer reached 2 before m1 although m1 is
    in its past (one event: m1 was sent when m0 was). Now m0 waits for m1, then both go."""
    net = make_net(4, stamps, "causal")
    net.send_event(1, [2, 2])
    m0, m1 = net.pool
    net.pool.clear()
    assert net.clocks[2].check(1, m0.stamp, 1) is Verdict.DELIVER
    assert net.clocks[2].event_end(1, m0.stamp) == 2
    net.present(m0)
    assert net.delivered[2] == [] and list(net.held[2]) == [m0.mid]
    net.present(m1)
    assert net.delivered[2] == [m0, m1]
    net.send(2, 3)
    net.present(net.pool.pop())
    net.send(3, 2)
    answer = net.pool.pop()
    assert m1.mid in answer.past
    net.present(answer)
    assert net.delivered[2] == [m0, m1, answer]
    assert_causal(net)
    assert_exact_rows(net)


def seeded_script(seed: int) -> tuple[int, list[tuple[str, int, int]], int]:
    """``(k, script, tail seed)`` drawn from ``seed`` as the strategies above draw them."""
    rng = random.Random(seed)
    k = rng.randint(2, 6)
    steps = rng.randint(0, 80)
    script = [(rng.choice(KINDS), rng.randint(0, 59), rng.randint(0, 59)) for _ in range(steps)]
    return k, script, rng.randint(0, 1000)


@pytest.mark.slow
@pytest.mark.parametrize("stamps", ENCODINGS)
def test_causal_delivery_matches_the_oracle_over_many_seeds(stamps: str) -> None:
    """600 seeded scripts per encoding (about half a minute each). Before the channel delivered
    an event's messages on one link together, about one seed in 100 failed (seeds 0, 124, 403,
    550, 577 among the first 600, in both encodings)."""
    for seed in range(600):
        k, script, tail = seeded_script(seed)
        try:
            net = run(k, stamps, "causal", script, tail)
            assert_causal(net)
            assert_exact_rows(net)
        except AssertionError as exc:
            raise AssertionError(f"seed {seed} (k={k}, {len(script)} steps): {exc}") from exc


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(k=st.integers(19, 24), script=actions, seed=st.integers(0, 1000))
def test_causal_delivery_matches_the_oracle_across_pages(
    k: int, script: list[tuple[str, int, int]], seed: int
) -> None:
    """Past k = 18 the delta state spans several pages: same verdicts, same exact row and column."""
    net = run(k, "delta", "causal", script, seed)
    assert_causal(net)
    assert_exact_rows(net)


@pytest.mark.parametrize("stamps", ENCODINGS)
@settings(max_examples=100, deadline=None, derandomize=True, database=None)
@given(k=st.integers(2, 6), script=actions, seed=st.integers(0, 1000))
def test_fifo_order_is_per_link_and_exactly_once(
    stamps: str, k: int, script: list[tuple[str, int, int]], seed: int
) -> None:
    net = run(k, stamps, "fifo", script, seed)
    for r in range(net.k):
        got = net.delivered[r]
        assert sorted(m.mid for m in got) == [m.mid for m in net.msgs if m.dest == r]
        for src in range(net.k):
            assert [m.link_seq for m in got if m.src == src] == list(
                range(1, net.links.get((src, r), 0) + 1)
            )


@pytest.mark.parametrize("stamps", ENCODINGS)
def test_fifo_delivers_what_causal_holds_back(stamps: str) -> None:
    causal, mc = three_servers(stamps, "causal")
    fifo, mf = three_servers(stamps, "fifo")
    assert causal[2].check(1, mc["m3"]) is Verdict.WAIT
    assert fifo[2].check(1, mf["m3"]) is Verdict.DELIVER  # m3 overtakes m1, its cause
    fifo[2].deliver(1, mf["m3"])
    assert fifo[2].receive(0, mf["m1"]) is Verdict.DELIVER
    assert fifo[2].receive(0, mf["m1"]) is Verdict.DUPLICATE
    assert len(mf["m3"]) == HEADER.size + 8  # just the link counter


# ---------------------------------------------------------------------------------- persistence


def open_db(path: Path) -> ZODB.DB:
    return ZODB.DB(ZODB.FileStorage.FileStorage(str(path)))


def script_domain(clocks: list[DomainClock]) -> None:
    """A little traffic: causal chains through every server."""
    k = len(clocks)
    for step in range(3 * k):
        src, dest = step % k, (step * 7 + 1) % k
        if src == dest:
            dest = (dest + 1) % k
        assert clocks[dest].receive(src, clocks[src].prepare_send(dest)) is Verdict.DELIVER


@pytest.mark.parametrize("k", [4, 20])  # one page, several pages
@pytest.mark.parametrize("stamps", ENCODINGS)
def test_reopened_clock_is_identical(tmp_path: Path, stamps: str, k: int) -> None:
    twin = [DomainClock(k, i, stamps=stamps) for i in range(k)]
    script_domain(twin)
    db = open_db(tmp_path / "c.fs")
    conn = db.open()
    clocks = [DomainClock(k, i, stamps=stamps) for i in range(k)]
    conn.root()["clocks"] = clocks
    transaction.commit()
    script_domain(clocks)
    transaction.commit()
    db.close()
    db = open_db(tmp_path / "c.fs")
    try:
        again = db.open().root()["clocks"]
        for mine, theirs in zip(again, twin, strict=True):
            assert matrix(mine) == matrix(theirs)
            assert mine.dirty_bytes() == 0
            # The delta bookkeeping came back too: the next stamps are the same bytes.
            for dest in range(k):
                if dest != mine.me:
                    assert mine.prepare_send(dest) == theirs.prepare_send(dest)
        transaction.abort()
    finally:
        db.close()


def test_abort_rolls_back_the_count_and_the_delta_bookkeeping(tmp_path: Path) -> None:
    db = open_db(tmp_path / "c.fs")
    try:
        conn = db.open()
        c = [DomainClock(3, i) for i in range(3)]
        conn.root()["clocks"] = c
        transaction.commit()
        assert c[1].receive(0, c[0].prepare_send(1)) is Verdict.DELIVER
        assert c[0].receive(2, c[2].prepare_send(0)) is Verdict.DELIVER  # 0 learns (2,0)
        transaction.commit()
        lost = c[0].prepare_send(1)  # would carry (2,0) to 1...
        assert c[0].dirty_bytes() > 0
        transaction.abort()  # ...but the reaction failed
        assert c[0].sent_to(1) == 1
        assert c[0].dirty_bytes() == 0
        again = c[0].prepare_send(1)
        assert again == lost  # (2,0) was not marked as sent to 1
        assert delta_entries(again, 3) == {(0, 1): 2, (2, 0): 1}
        assert c[1].receive(0, again) is Verdict.DELIVER
        assert c[1].entry(2, 0) == 1
        transaction.commit()
    finally:
        db.close()


def test_a_stamp_seen_before_is_checked_again_against_the_rolled_back_clock(
    tmp_path: Path,
) -> None:
    db = open_db(tmp_path / "c.fs")
    try:
        conn = db.open()
        c0 = DomainClock(2, 0)
        conn.root()["clock"] = c0
        transaction.commit()
        c0.prepare_send(1)  # not committed
        # From 1: its first message, knowing of one message from 0 to 1.
        claim = craft_delta(2, 1, 0, {(1, 0): 1, (0, 1): 1})
        assert c0.check(1, claim) is Verdict.DELIVER
        transaction.abort()  # 0 never sent it: the same bytes now say 0's store is behind
        with pytest.raises(ClockError, match="behind"):
            c0.check(1, bytes(bytearray(claim)))
    finally:
        db.close()


def test_a_stamp_seen_before_is_refused_on_another_link() -> None:
    clocks, m = three_servers("delta")
    assert clocks[2].check(0, m["m1"]) is Verdict.DELIVER
    with pytest.raises(ClockError, match="link 0->2"):
        clocks[2].check(1, m["m1"])


def commit_bytes(db: ZODB.DB, path: Path) -> int:
    before = os.path.getsize(path)
    transaction.commit()
    return os.path.getsize(path) - before


def last_commit_records(db: ZODB.DB) -> list[int]:
    """The size of every record the last committed transaction wrote."""
    storage = db.storage
    records = storage.iterator(storage.lastTransaction())
    try:
        return [len(record.data) for txn in records for record in txn]
    finally:
        records.close()


def commit_records(db: ZODB.DB) -> list[int]:
    transaction.commit()
    return last_commit_records(db)


@pytest.mark.parametrize("stamps", ENCODINGS)
@pytest.mark.parametrize("order", ["causal", "fifo"])
@pytest.mark.parametrize("k", [2, 10, 16])
def test_small_domain_rewrites_one_record_per_transaction(
    tmp_path: Path, k: int, order: str, stamps: str
) -> None:
    """Each record costs ZODB a fixed overhead: a small domain's clock is one record per commit."""
    db = open_db(tmp_path / "c.fs")
    try:
        conn = db.open()
        clock = DomainClock(k, 0, stamps=stamps, order=order)
        peers = [DomainClock(k, i, stamps=stamps, order=order) for i in range(k)]
        conn.root()["clock"] = clock
        transaction.commit()
        # Only the clock changes in these transactions: every record written is one of its own.
        assert peers[1].receive(0, clock.prepare_send(1)) is Verdict.DELIVER
        assert len(commit_records(db)) == 1
        if k > 2:  # second-hand knowledge, so that the next stamp changes several entries
            assert peers[1].receive(2, peers[2].prepare_send(1)) is Verdict.DELIVER
        assert clock.receive(1, peers[1].prepare_send(0)) is Verdict.DELIVER
        assert len(commit_records(db)) == 1
        # A hop: deliveries and the sends they cause, all in one transaction.
        for _ in range(3):
            for src in range(1, k):
                assert clock.receive(src, peers[src].prepare_send(0)) is Verdict.DELIVER
                assert peers[src].receive(0, clock.prepare_send(src)) is Verdict.DELIVER
            assert len(commit_records(db)) == 1
            assert clock.dirty_bytes() == 0
    finally:
        db.close()


def test_delta_commits_a_small_fraction_of_the_full_matrix(tmp_path: Path) -> None:
    k = 150
    written: dict[str, int] = {}
    records: dict[str, int] = {}
    for stamps in ENCODINGS:
        path = tmp_path / f"{stamps}.fs"
        db = open_db(path)
        try:
            conn = db.open()
            clock = DomainClock(k, 0, stamps=stamps)
            peer = DomainClock(k, 1, stamps=stamps)
            conn.root()["clock"] = clock
            transaction.commit()
            assert clock.dirty_bytes() == 0
            clock.prepare_send(1)
            assert clock.dirty_bytes() > 0
            written[stamps] = commit_bytes(db, path)
            records[stamps] = len(last_commit_records(db))
            assert clock.dirty_bytes() == 0
            # Steady state: a receive then a send, each committed.
            assert clock.receive(1, peer.prepare_send(0)) is Verdict.DELIVER
            estimate = clock.dirty_bytes()
            actual = commit_bytes(db, path)
            records[f"{stamps} receive"] = len(last_commit_records(db))
            assert actual / 3 < estimate < actual * 2, (stamps, estimate, actual)
            clock.prepare_send(1)
            written[f"{stamps} again"] = commit_bytes(db, path)
            records[f"{stamps} again"] = len(last_commit_records(db))
        finally:
            db.close()
    assert written["full"] > 8 * k * k  # the whole matrix, every time
    assert written["delta"] < 0.05 * written["full"], written
    assert written["delta again"] < 0.05 * written["full"], written
    assert records["full"] == records["full receive"] == records["full again"] == 1
    # A page per changed place: the epoch's, and the entries' (the link and its list neighbour).
    assert records["delta"] <= 2, records
    assert records["delta receive"] <= 3, records
    assert records["delta again"] <= 3, records


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stamps=st.sampled_from(ENCODINGS),
    history=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=12),
    siblings=st.lists(st.integers(0, 3), min_size=2, max_size=6),
)
def test_delivering_an_event_at_once_leaves_the_clock_of_one_by_one(
    stamps: str, history: list[tuple[int, int]], siblings: list[int]
) -> None:
    """deliver_event(src, stamp, first, last) == deliver() of each sibling in turn: the same
    matrix, and the same stamps sent afterwards. (Causal order only: with fifo, siblings do not
    share a stamp, each is delivered alone.)"""
    k, order = 4, "causal"
    senders = [DomainClock(k, i, stamps=stamps, order=order) for i in range(k)]
    twins = [DomainClock(k, 3, stamps=stamps, order=order) for _ in range(2)]
    for src, dest in history:  # messages among 0..2 (delivered when deliverable), then to 3
        if src == dest or 3 in (src, dest):
            continue
        stamp = senders[src].prepare_send(dest)
        if senders[dest].check(src, stamp) is Verdict.DELIVER:
            senders[dest].deliver(src, stamp)
    # Server 0's event: to 3 once per sibling, with sends to others among them.
    dests = [3 if i % 2 == 0 else 1 + i % 2 for i in siblings] + [3]
    stamped = senders[0].prepare_sends(dests)
    mine = [(seq, stamp) for dest, (seq, stamp) in zip(dests, stamped, strict=True) if dest == 3]
    first, last = mine[0][0], mine[-1][0]
    stamp = mine[0][1]
    if twins[0].check(0, stamp, first) is not Verdict.DELIVER:
        return  # it waits for a message of 1 or 2 that never goes to 3 here: nothing to compare
    for seq, each in mine:
        twins[0].deliver(0, each, seq)
    twins[1].deliver_event(0, stamp, first, last)
    assert matrix(twins[0]) == matrix(twins[1])
    # A delta stamp lists cells in the order they changed, which one merge and several do not
    # share: the same cells, though.
    one_by_one, at_once = twins[0].prepare_sends([0, 1, 2]), twins[1].prepare_sends([0, 1, 2])
    assert [(seq, cells(st)) for seq, st in one_by_one] == [(q, cells(t)) for q, t in at_once]


def cells(stamp: bytes) -> bytes | frozenset[tuple[int, int]]:
    """A stamp as what it says: a delta stamp's set of (cell, value), other stamps as they are."""
    if stamp[1] != 2:
        return stamp
    body = stamp[HEADER.size :]
    return frozenset(ENTRY.unpack_from(body, i) for i in range(0, len(body), ENTRY.size))


def test_delivering_an_event_refuses_a_range_beyond_it_or_not_deliverable() -> None:
    sender, receiver = DomainClock(2, 0), DomainClock(2, 1)
    (s1, stamp), (s2, _same) = sender.prepare_sends([1, 1])
    with pytest.raises(ClockError, match="not within an event"):
        receiver.deliver_event(0, stamp, s1, s2 + 1)
    with pytest.raises(ClockError, match="verdict is WAIT"):
        receiver.deliver_event(0, stamp, s2, s2)  # message 1 is missing
    assert matrix(receiver) == [[0, 0], [0, 0]]
    receiver.deliver_event(0, stamp, s1, s2)
    assert receiver.received_from(0) == 2
