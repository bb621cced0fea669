"""Crash schedules: a bank-and-gossip workload run across domains while servers and routers die.

Shared by ``tests/test_torture.py`` (a few small schedules) and ``python -m perf torture`` (the
long run), on the machinery of :mod:`aaabus.testing.crash` (layouts, faults, processes, the end
of a run read back in-process), which the topic schedules share. Its agents and services are in
the installed package, so the server processes it starts load them wherever they run. One
schedule is fixed by its seed: the layout of the domains, the workload (which account pays
which, how much, along which chains) and the fault schedule (when, whom, how long down). Process
timing is not reproducible, so which messages a kill catches in flight varies from run to run;
what the seed fixes is everything we choose.

The workload
    :class:`Account` agents on every server hold a balance. A transfer debits the payer and sends
    a :class:`Credit` to the payee in the same reaction (one atomic transaction); the payee adds
    the amount and, while the credit's ``ttl`` lasts, pays someone else in turn. So every credit
    is also a link of a causal chain, and every account keeps the vector-clock history the
    independent checker (:mod:`aaabus.testing.checker`) judges: each send with its clock, each
    delivery in order. Two independent verdicts come out of one run:

    * money: the balances plus the credits still in flight equal the initial total, and at the
      end nothing is in flight (every credit delivered exactly once);
    * order: the checker finds no loss, no duplicate and no causal violation.

The end of a run
    After the last fault the real processes are stopped with SIGTERM (each must exit 0) and the
    stores are opened again by in-process servers (:class:`~aaabus.node.inprocess.InProcessBus`) on
    the same files and ports. Their engines answer :meth:`~aaabus.AgentServer.call` only with
    committed state, so "every credit delivered" is observed exactly, without guessing from
    side effects a killed reaction may have written before its commit was lost. Whatever was
    still in flight at the stop is finished there (counted in ``finished_in_process``).
"""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from BTrees.OOBTree import OOBTree
from persistent import Persistent

from aaabus import Agent, AgentId, BootContext, Notification, PersistentList
from aaabus.config.reader import load_config
from aaabus.config.secret import ensure_secret
from aaabus.config.topology import render
from aaabus.node.inprocess import InProcessBus
from aaabus.testing.checker import Send, check
from aaabus.testing.crash import (
    Fault,
    OnLayout,
    drain_in_process,
    draw_layout_and_faults,
    pause,
    run_under_faults,
    schedule_seed,
    stop_all,
    stuck_note,
    write_bus_config,
)
from aaabus.testing.workload import Gossiper, merge_and_tick
from aaabus.tools.launch import Bus, free_port_base

# -- the workload agents -----------------------------------------------------------------------


@dataclass
class Credit(Notification):
    """``amount`` paid to the receiver; ``vc`` is the payer's vector clock at the send."""

    mid: str
    vc: dict[str, int]
    ttl: int
    amount: int


@dataclass
class Roster(Notification):
    """Every account of the bus, by label: whom an account may pay."""

    accounts: list[tuple[str, AgentId]]


@dataclass
class Start(Notification):
    """Start ``chains`` chains of transfers of ``ttl + 1`` credits each."""

    chains: int
    ttl: int


class Account(Agent):
    """A bank account that is also a causal-history recorder (see the module docstring).

    The payee and the amount of the ``n``-th payment come from ``Random(f"{seed}:{label}:{n}")``,
    so they are fixed by the seed whatever the timing. The histories are persistent lists, appended
    in the reaction's transaction: they are exactly what the bus committed.
    """

    def __init__(self, label: str, seed: int, balance: int) -> None:
        super().__init__(label)
        self.label = label
        self.seed = seed
        self.opening = balance
        self.balance = balance
        self.vc: dict[str, int] = {}
        self.peers: list[tuple[str, AgentId]] = []
        self.sent: PersistentList = PersistentList()  # (mid, payee label, vc, amount)
        self.received: PersistentList = PersistentList()  # (mid, amount), in delivery order
        self.n = 0

    def _pay(self, ttl: int) -> None:
        rng = random.Random(f"{self.seed}:{self.label}:{self.n}")
        name, dest = self.peers[rng.randrange(len(self.peers))]
        amount = rng.randint(1, 50)
        vc = self.vc  # ticked once by the reaction: all its sends are one event
        mid = f"{self.label}#{self.n}"
        self.n += 1
        self.balance -= amount
        self.sent.append((mid, name, dict(vc), amount))
        self.send_to(dest, Credit(mid, dict(vc), ttl, amount))

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Roster):
            self.peers = [p for p in note.accounts if p[0] != self.label]
        elif isinstance(note, Start):
            vc = dict(self.vc)
            vc[self.label] = vc.get(self.label, 0) + 1
            self.vc = vc  # reassigned: a plain dict attribute is only saved when assigned
            for _ in range(note.chains):
                self._pay(note.ttl)
        elif isinstance(note, Credit):
            self.received.append((note.mid, note.amount))
            self.balance += note.amount
            self.vc = merge_and_tick(self.vc, note.vc, self.label)
            if note.ttl > 0:
                self._pay(note.ttl - 1)
        else:
            super().react(sender, note)


def bank_setup(ctx: BootContext, args: str, first_time: bool) -> None:
    """Boot service of one server: on its first boot, open every account of the bus and start the
    traffic. The roster and the start orders are sent after the creation requests, so causal
    order delivers them after the accounts exist, wherever they are."""
    if not first_time:
        return
    spec = json.loads(args)
    accounts: list[tuple[str, AgentId]] = []
    for sid in spec["servers"]:
        for k in range(spec["per_server"]):
            label = f"a{sid}.{k}"
            accounts.append((label, Account(label, spec["seed"], spec["balance"]).deploy(sid)))
    for _label, aid in accounts:
        ctx.send(aid, Roster(accounts))
    for _label, aid in accounts:
        ctx.send(aid, Start(spec["chains"], spec["ttl"]))


# -- schedules ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Schedule(OnLayout):
    seed: int
    layout: str
    per_server: int
    chains: int
    ttl: int
    balance: int
    faults: tuple[Fault, ...]

    @property
    def accounts(self) -> int:
        return len(self.servers) * self.per_server

    @property
    def messages(self) -> int:
        """Credits the workload makes in all (fixed: every chain has ``ttl + 1`` links)."""
        return self.accounts * self.chains * (self.ttl + 1)


def make_schedule(
    seed: int,
    *,
    kills: int = 4,
    span: float = 4.0,
    per_server: int = 2,
    chains: int = 3,
    ttl: int = 40,
) -> Schedule:
    """The schedule of ``seed``: a layout, a workload and ``kills`` faults within ``span`` s
    (see :func:`~aaabus.testing.crash.draw_layout_and_faults`)."""
    layout, faults = draw_layout_and_faults(random.Random(seed), kills, span)
    return Schedule(
        seed=seed,
        layout=layout,
        per_server=per_server,
        chains=chains,
        ttl=ttl,
        balance=1000,
        faults=faults,
    )


# -- running one schedule ----------------------------------------------------------------------


@dataclass
class Outcome:
    """What one schedule did and what the two judges said."""

    seed: int
    layout: str
    kills: int = 0
    router_kills: int = 0
    messages: int = 0
    expected_messages: int = 0
    delivered_at_stop: int = 0
    finished_in_process: int = 0
    lost: int = 0
    duplicated: int = 0
    misdelivered: int = 0
    causal_violations: int = 0
    fifo_violations: int = 0
    total_expected: int = 0
    total_found: int = 0
    in_flight: int = 0
    invariant_ok: bool = False
    exit_codes: dict[int, int | None] = field(default_factory=dict)
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def write_config(schedule: Schedule, directory: Path) -> Path:
    """The a3.xml of ``schedule`` in ``directory``, on free ports, with the bank on server 0."""
    spec = {
        "servers": schedule.servers,
        "per_server": schedule.per_server,
        "seed": schedule.seed,
        "balance": schedule.balance,
        "chains": schedule.chains,
        "ttl": schedule.ttl,
    }
    service = f"<service class=\"aaabus.testing.torture:bank_setup\" args='{json.dumps(spec)}'/>"
    # Small groups: a kill then catches fewer reactions in one uncommitted group, so more
    # distinct commit boundaries are crossed by the faults.
    props = {"aaabus.engine.max_batch": "8"}
    return write_bus_config(directory, schedule.domains, props, (0, service))


@dataclass
class AccountState:
    label: str
    opening: int
    balance: int
    sent: list[tuple[str, str, dict[str, int], int]]
    received: list[tuple[str, int]]


def _read_accounts(server: Any) -> list[AccountState]:
    def read() -> list[AccountState]:
        return [
            AccountState(
                a.label,
                a.opening,
                a.balance,
                [(m, d, dict(vc), amt) for m, d, vc, amt in a.sent],
                list(a.received),
            )
            for a in server.store.agents.values()
            if isinstance(a, Account)
        ]

    result: list[AccountState] = server.call(read)
    return result


def judge(schedule: Schedule, accounts: list[AccountState], outcome: Outcome) -> None:
    """Fill ``outcome`` with both verdicts on the final account states."""
    sends = [Send(m, a.label, d, vc) for a in accounts for m, d, vc, _amt in a.sent]
    deliveries = {a.label: [m for m, _amt in a.received] for a in accounts}
    report = check(sends, deliveries)
    outcome.messages = len(sends)
    outcome.lost = len(report.lost)
    outcome.duplicated = len(report.duplicated)
    outcome.misdelivered = len(report.misdelivered)
    outcome.causal_violations = len(report.causal_violations)
    outcome.fifo_violations = len(report.fifo_violations)
    if not report.ok:
        outcome.problems.append(f"checker: {report.summary()}")
    amounts = {m: amt for a in accounts for m, _d, _vc, amt in a.sent}
    received = {m for a in accounts for m, _amt in a.received}
    in_flight = sum(amt for m, amt in amounts.items() if m not in received)
    outcome.in_flight = in_flight
    outcome.total_expected = schedule.accounts * schedule.balance
    outcome.total_found = sum(a.balance for a in accounts)
    if len(accounts) != schedule.accounts:
        outcome.problems.append(f"{len(accounts)} accounts found, {schedule.accounts} opened")
    # Money is conserved at every instant (balances + in flight); at the end nothing is in flight.
    outcome.invariant_ok = (
        outcome.total_found + in_flight == outcome.total_expected
        and in_flight == 0
        and all(a.opening == schedule.balance for a in accounts)
    )
    if not outcome.invariant_ok:
        outcome.problems.append(
            f"money: balances {outcome.total_found} + in flight {in_flight} "
            f"!= opened {outcome.total_expected}"
        )
    if outcome.messages != schedule.messages:
        outcome.problems.append(f"{outcome.messages} credits sent, {schedule.messages} expected")


def finish_in_process(
    config: Path, storage_root: Path, schedule: Schedule, timeout: float
) -> tuple[list[AccountState], int]:
    """Resume the stopped bus in this process and wait until every credit is delivered.

    Returns the final accounts and how many deliveries had been committed when the processes
    were stopped. Stops at the deadline even if credits are missing: the judges then say what.
    """

    def read(bus: InProcessBus) -> list[AccountState]:
        return [a for server in bus.servers.values() for a in _read_accounts(server)]

    def complete(accounts: list[AccountState]) -> bool:
        delivered = sum(len(a.received) for a in accounts)
        sent = sum(len(a.sent) for a in accounts)
        return delivered >= schedule.messages and sent >= schedule.messages

    first, accounts = drain_in_process(config, storage_root, read, complete, timeout)
    return accounts, sum(len(a.received) for a in first)


def run_schedule(
    schedule: Schedule,
    workdir: Path,
    *,
    log: Callable[[str], None] | None = None,
    drain_timeout: float = 60.0,
) -> Outcome:
    """Run one schedule in ``workdir`` (kept: the stores are the evidence when it fails)."""
    t_start = time.monotonic()
    outcome = Outcome(schedule.seed, schedule.layout, expected_messages=schedule.messages)
    config = write_config(schedule, workdir)
    storage = workdir / "stores"
    faulted = run_under_faults(config, schedule.servers, storage, schedule.faults)
    outcome.exit_codes = faulted.exit_codes
    outcome.kills = len(faulted.killed)
    outcome.router_kills = sum(sid in schedule.routers for sid in faulted.killed)
    if faulted.bad_exits():
        stuck = stuck_note(faulted, workdir)
        outcome.problems.append(f"servers did not exit 0 on SIGTERM: {faulted.bad_exits()}{stuck}")
    accounts, outcome.delivered_at_stop = finish_in_process(
        config, storage, schedule, drain_timeout
    )
    delivered = sum(len(a.received) for a in accounts)
    outcome.finished_in_process = delivered - outcome.delivered_at_stop
    judge(schedule, accounts, outcome)
    outcome.seconds = round(time.monotonic() - t_start, 3)
    if log is not None:
        log(
            f"schedule seed={schedule.seed} layout={schedule.layout} kills={outcome.kills} "
            f"credits={outcome.messages} (at stop {outcome.delivered_at_stop}) "
            f"{'ok' if outcome.ok else 'FAILED: ' + '; '.join(outcome.problems)} "
            f"{outcome.seconds:.1f}s"
        )
    return outcome


__all__ = [
    "Account",
    "Credit",
    "Fault",
    "Outcome",
    "Schedule",
    "make_schedule",
    "run_schedule",
    "schedule_seed",
    "stop_all",
]


# -- wire fuzzing against a live server ------------------------------------------------------


def read_progress(path: Path) -> dict[str, int]:
    try:
        data: dict[str, int] = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"count": 0, "errors": 0}
    return data


def wait_progress(
    path: Path, at_least: int, procs: list[Any], timeout: float = 30.0
) -> dict[str, int]:
    """Wait until the rally's published count reaches ``at_least``; fail fast if a server died."""
    deadline = time.monotonic() + timeout
    while True:
        got = read_progress(path)
        if got["count"] >= at_least:
            return got
        for proc in procs:
            if not proc.running():
                tail = " | ".join(list(proc.lines)[-5:])
                raise AssertionError(f"server {proc.server_id} died: {tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"rally stuck at {got} (wanted {at_least}) after {timeout}s")
        pause(0.02)  # the file is written by another process: poll it


class FakePeer:
    """A client that authenticates to a live server as server ``me``, holding the bus secret.

    It then owns a real session: :meth:`send` MACs each payload with the session cipher, so the
    server's channel receives it exactly as if a real peer had sent it. A reader thread discards
    whatever the server sends back (acks, resends), so the server never blocks writing to us.
    """

    def __init__(self, addr: tuple[str, int], secret: bytes, me: int, peer: int) -> None:
        from aaabus.config.secret import link_key
        from aaabus.wire.frames import HANDSHAKE_MAX_FRAME, ConnectorHandshake, FrameDecoder

        self.sock = socket.create_connection(addr, timeout=5)
        decoder = FrameDecoder(HANDSHAKE_MAX_FRAME)
        # The key of the pair (me, peer), derived from the bus key as a real server does.
        handshake = ConnectorHandshake(link_key(secret, me, peer), me, peer)

        def next_message() -> bytes:
            while True:
                payload = decoder.pop()
                if payload is not None:
                    return payload
                data = self.sock.recv(4096)
                if not data:
                    raise ConnectionError("the server closed the connection in the handshake")
                decoder.push(data)

        self.sock.sendall(handshake.receive(next_message()))  # challenge -> answer
        handshake.receive(next_message())  # proof
        self.cipher = handshake.cipher()
        self.sock.settimeout(None)
        self._reader = threading.Thread(target=self._drain, daemon=True, name="fake-peer-drain")
        self._reader.start()

    def _drain(self) -> None:
        try:
            while self.sock.recv(65536):
                pass
        except OSError:
            pass

    def send(self, payload: bytes) -> None:
        self.sock.sendall(self.cipher.wrap_frame(payload))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._reader.join(5)


def raw_poke(addr: tuple[str, int], data: bytes) -> None:
    """Connect, send ``data`` unauthenticated, close: what an intruder or a port scanner does."""
    try:
        with socket.create_connection(addr, timeout=5) as sock:
            sock.sendall(data)
    except OSError:
        pass  # the server may refuse or reset us first: that is its right


def template_frames(domain: str, target: AgentId, sender: AgentId) -> list[bytes]:
    """Well-formed channel payloads to mutate: a data frame with a real stamp, and an ack."""
    from aaabus.core.clock import DomainClock
    from aaabus.wire.codec import Codec
    from aaabus.wire.linkframes import ACK, encode_data
    from aaabus.wire.message import Message

    clock = DomainClock(2, 0)
    stamp = clock.prepare_send(1)
    data = encode_data(1, domain, stamp, Message(sender, target, Codec().encode(Start(0, 0))))
    ack = ACK + (5).to_bytes(8, "big") + domain.encode()
    return [data, ack]


def mutate(rng: random.Random, data: bytes) -> bytes:
    """One to four random byte-level edits: flip, overwrite, insert, delete, truncate, splice."""
    buf = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        pos = rng.randrange(len(buf) + 1) if buf else 0
        if op == 0 and buf:
            buf[min(pos, len(buf) - 1)] ^= 1 << rng.randrange(8)
        elif op == 1 and buf:
            buf[min(pos, len(buf) - 1)] = rng.randrange(256)
        elif op == 2:
            buf[pos:pos] = rng.randbytes(rng.randint(1, 8))
        elif op == 3 and buf:
            del buf[pos : pos + rng.randint(1, 8)]
        elif op == 4:
            del buf[pos:]
        else:
            buf[pos:pos] = buf[rng.randrange(len(buf) + 1) :][: rng.randint(1, 32)]
    return bytes(buf)


class FuzzTarget:
    """Two real servers with a rally between them, and the means to throw garbage at them.

    Layout ``D0 [s0 s2]  D1 [s1 s2]``: s1 and s2 run and play the rally over D1; s0 is declared
    but never started, so a fuzzer that holds the bus secret can log in to s2 as s0 (s2 accepts
    its lower-id neighbours) without displacing a real connection. Whatever it sends then lands
    in s2's channel exactly like traffic from a real peer, in D0, while the rally uses D1.
    """

    def __init__(self, workdir: Path) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.progress = workdir / "rally.json"
        text = render([[0, 2], [1, 2]], 3, base_port=free_port_base(4))
        spec = {"echo": 2, "n": 10**9, "done": str(self.progress), "every": 10}
        args = json.dumps(spec)
        service = f"<service class=\"aaabus.testing.workload:bounce_setup\" args='{args}'/>"
        start = text.index('<server id="1"')
        end = text.index("</server>", start)
        text = text[:end] + "  " + service + "\n  " + text[end:]
        self.config = workdir / "a3.xml"
        self.config.write_text(text)
        ensure_secret(workdir / "bus.key")
        from aaabus.config.secret import load_secret

        self.secret = load_secret(workdir / "bus.key")
        cfg = load_config(self.config)
        self.s2_d0 = ("127.0.0.1", cfg.servers[2].port_in("D0"))
        self.s2_d1 = ("127.0.0.1", cfg.servers[2].port_in("D1"))
        self.s1_d1 = ("127.0.0.1", cfg.servers[1].port_in("D1"))
        self.dropped = 0  # log lines of the engine dropping a bad input or a dead letter
        self.drop_lines: list[str] = []  # those lines
        self._dropped_changed = threading.Condition()
        self.bus = Bus(self.config, [1, 2], workdir / "stores", sink=self._line)
        self._peer: FakePeer | None = None
        self.sessions = 0
        # The rally (a Bouncer and its Echo) plays Bounce; fuzzed frames carry Start to a
        # missing agent, a notification nobody handles, so a mutated frame that reaches a real
        # agent is an error report, never a counted bounce.
        self.templates = template_frames("D0", AgentId(2, 2, 999), AgentId(0, 0, 20))

    def _line(self, line: str) -> None:
        # An input refused where it arrives (a frame that fails the link's checks), or a body
        # the engine consumed unread (a dead letter: it does not decode).
        if "dropping an input" in line or "dead letter from" in line:
            with self._dropped_changed:
                self.dropped += 1
                self.drop_lines.append(line)
                self._dropped_changed.notify_all()

    def wait_dropped(self, at_least: int, timeout: float, containing: str = "") -> bool:
        """Wait until the servers have logged ``at_least`` dropped inputs in all (only those
        whose line holds ``containing``, when given: the drops of one sender's own frames)."""

        def count() -> int:
            if not containing:
                return self.dropped
            return sum(containing in line for line in self.drop_lines)

        with self._dropped_changed:
            return self._dropped_changed.wait_for(lambda: count() >= at_least, timeout)

    def __enter__(self) -> FuzzTarget:
        self.bus.start(timeout=60)
        wait_progress(self.progress, 20, self.procs)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._peer is not None:
            self._peer.close()
        self.codes = stop_all(self.bus)

    @property
    def procs(self) -> list[Any]:
        return list(self.bus.servers.values())

    def alive(self) -> bool:
        return all(p.running() for p in self.procs)

    def peer(self) -> FakePeer:
        """The authenticated session as s0, (re)opened when the server dropped the last one."""
        if self._peer is None:
            self._peer = FakePeer(self.s2_d0, self.secret, 0, 2)
            self.sessions += 1
        return self._peer

    def send_authenticated(self, payload: bytes, *, tamper: bool = False) -> None:
        """One payload in the session; ``tamper`` breaks its MAC (the server must cut us)."""
        for _attempt in range(3):
            peer = self.peer()
            try:
                if tamper:
                    frame = bytearray(peer.cipher.wrap_frame(payload))
                    frame[-1] ^= 0xFF
                    peer.send_raw(bytes(frame))
                    self.drop_session()
                else:
                    peer.send(payload)
                return
            except OSError:
                self.drop_session()  # cut by the server after an earlier bad frame: reconnect
        raise AssertionError("could not keep an authenticated session to s2")

    def drop_session(self) -> None:
        if self._peer is not None:
            self._peer.close()
            self._peer = None

    def send_raw(self, data: bytes, to_s1: bool = False) -> None:
        raw_poke(self.s1_d1 if to_s1 else self.s2_d1, data)

    def rally(self) -> dict[str, int]:
        return read_progress(self.progress)


def _random_object(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 2 else 5)
    if kind == 0:
        return rng.randint(-(2**70), 2**70)
    if kind == 1:
        return rng.randbytes(rng.randint(0, 40))
    if kind == 2:
        return rng.choice(["D0", "D1", "", "X", "D0" * 50])
    if kind == 3:
        return None
    if kind == 4:
        return rng.random()
    return tuple(_random_object(rng, depth + 1) for _ in range(rng.randint(0, 7)))


def _protected_mutation(rng: random.Random, data: bytes, body: bytes) -> bytes:
    """Mutate everything but the notification body (see ``tests/test_fuzz.py`` for why)."""
    assert data.endswith(body)
    return mutate(rng, data[: -len(body)]) + body


def random_authenticated_payload(rng: random.Random, templates: list[bytes]) -> bytes:
    """One garbage payload for an authenticated session (several shapes, chosen at random)."""
    import pickle

    from aaabus.wire.codec import Codec
    from aaabus.wire.linkframes import ACK, DATA

    data, ack = templates
    body = Codec().encode(Start(0, 0))
    kind = rng.randrange(7)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 300))
    if kind == 1:
        return _protected_mutation(rng, data, body)
    if kind == 2:
        return mutate(rng, ack)
    if kind == 3:  # a well-formed frame whose body is a mutated data body
        return data[: -len(body)] + mutate(rng, body)
    if kind == 4:
        return DATA + pickle.dumps(_random_object(rng), pickle.HIGHEST_PROTOCOL)
    if kind == 5:
        upto = rng.choice([0, 1, 2**63, 2**64 - 1, rng.randrange(2**64)])
        return ACK + upto.to_bytes(8, "big") + rng.choice([b"D0", b"D1", b"", b"\xff\xfe"])
    return rng.choice([DATA, ACK, b"", b"X"]) + rng.randbytes(rng.randint(0, 20))


def random_raw_bytes(rng: random.Random, secret: bytes) -> bytes:
    """Bytes for an unauthenticated connection: noise, bad frames, forged handshakes."""
    from aaabus.wire.frames import MAGIC, VERSION, encode_frame

    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 400))
    if kind == 1:  # a length prefix far over the pre-authentication limit
        return rng.randint(257, 2**32 - 1).to_bytes(4, "big") + rng.randbytes(20)
    if kind == 2:  # an ANSWER-shaped frame with a forged MAC
        answer = MAGIC + bytes([VERSION, 2]) + (0).to_bytes(4, "big") + (2).to_bytes(4, "big")
        return encode_frame(mutate(rng, answer + rng.randbytes(64)))
    if kind == 3:  # a well-framed garbage message
        return encode_frame(rng.randbytes(rng.randint(0, 256)))
    return encode_frame(MAGIC + bytes([VERSION, rng.randrange(256)]) + rng.randbytes(72))


def fuzz_live_server(
    workdir: Path, frames: int, *, seed: int = 1, log: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Send ``frames`` fuzzed frames to a live server, half unauthenticated, half inside an
    authenticated session; then check the servers live and the rally goes on, exactly."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    raw = authenticated = tampered = 0
    with FuzzTarget(workdir) as target:
        before = target.rally()
        for i in range(frames):
            if i % 2 == 0:
                target.send_raw(random_raw_bytes(rng, target.secret), to_s1=rng.random() < 0.2)
                raw += 1
            elif rng.random() < 0.002:
                target.send_authenticated(b"D", tamper=True)
                tampered += 1
            else:
                target.send_authenticated(random_authenticated_payload(rng, target.templates))
                authenticated += 1
            if i % 2000 == 1999:
                if not target.alive():
                    break
                if log is not None:
                    log(f"fuzz: {i + 1} frames, rally {target.rally()}, {target.dropped} dropped")
        alive = target.alive()
        after: dict[str, int] = target.rally()
        if alive:
            try:
                after = wait_progress(target.progress, before["count"] + 100, target.procs)
            except AssertionError as exc:
                after = {"count": -1, "errors": -1}
                if log is not None:
                    log(f"fuzz: {exc}")
        result: dict[str, Any] = {
            "frames": raw + authenticated + tampered,
            "raw": raw,
            "authenticated": authenticated,
            "tampered": tampered,
            "sessions": target.sessions,
            "dropped_inputs": target.dropped,
            "crashes": sum(not p.running() for p in target.procs),
            "rally_before": before["count"],
            "rally_after": after["count"],
            "rally_errors": after["errors"],
        }
    result["exit_codes"] = target.codes
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["ok"] = (
        result["crashes"] == 0
        and result["rally_errors"] == 0
        and result["rally_after"] >= result["rally_before"] + 100
        and all(code == 0 for code in target.codes.values())
    )
    return result


# -- a stream of bulky parcels, to fill a small disk ---------------------------------------------


@dataclass
class Parcel(Notification):
    i: int
    pad: bytes


@dataclass
class Ship(Notification):
    pass


class Kept(Persistent):
    """One hoarded parcel's padding: a record of its own."""

    def __init__(self, pad: bytes) -> None:
        self.pad = pad


class Depot(Agent):
    """Counts parcels, checking they come once each and in order; writes ``done`` at ``n``.
    ``hoard``: keep every parcel (each its own record), so that the live data grows: a store
    that reclaims superseded records (the log store) fills its disk only that way."""

    def __init__(self, n: int, done: str, hoard: bool = False) -> None:
        super().__init__("depot")
        self.n = n
        self.done = done
        self.count = 0
        self.errors = 0
        self.kept = b""
        self.hoard: OOBTree | None = OOBTree() if hoard else None

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Parcel):
            if note.i == self.count + 1:
                self.count += 1
            else:
                self.errors += 1
            # Keeping the parcel's padding makes every commit on this server write its size
            # again (FileStorage appends a new revision of the agent): the disk fills.
            self.kept = note.pad
            if self.hoard is not None:
                self.hoard[note.i] = Kept(note.pad)
            if self.count == self.n:
                target = Path(self.done)
                tmp = target.with_suffix(".tmp")
                tmp.write_text(json.dumps({"count": self.count, "errors": self.errors}))
                tmp.replace(target)
        else:
            super().react(sender, note)


class Shipper(Agent):
    """Sends ``Parcel(1..n)`` of ``size`` bytes each to ``depot``, ``burst`` per reaction."""

    def __init__(self, depot: AgentId, n: int, size: int, burst: int = 4) -> None:
        super().__init__("shipper")
        self.depot = depot
        self.n = n
        self.size = size
        self.burst = burst
        self.sent = 0

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Ship):
            for _ in range(self.burst):
                if self.sent < self.n:
                    self.sent += 1
                    self.send_to(self.depot, Parcel(self.sent, bytes(self.size)))
            if self.sent < self.n:
                self.send_to(self.id, Ship())
        else:
            super().react(sender, note)


def shipping_setup(ctx: BootContext, args: str, first_time: bool) -> None:
    """Boot service of the shipping server: a depot on ``depot_server`` and a shipper here."""
    if first_time:
        spec = json.loads(args)
        depot = Depot(spec["n"], spec["done"], spec.get("hoard", False)).deploy(
            spec["depot_server"]
        )
        shipper = Shipper(depot, spec["n"], spec["size"]).deploy()
        ctx.send(shipper, Ship())


# -- scripted causal chains, for the theorem tests ----------------------------------------------


@dataclass
class Chain(Notification):
    """A recorded message; on delivery the receiver passes a new one along ``then``."""

    mid: str
    vc: dict[str, int]
    then: list[tuple[str, AgentId]]


@dataclass
class Fire(Notification):
    """Send, in this order, one :class:`Chain` per ``(label, id, then)``."""

    plan: list[tuple[str, AgentId, list[tuple[str, AgentId]]]]


class Scribe(Gossiper):
    """A :class:`Gossiper` (same recorded history, same checker) whose sends follow a script
    instead of a random walk: the theorem needs one exact pattern of messages."""

    def _chain(self, name: str, dest: AgentId, then: list[tuple[str, AgentId]]) -> None:
        mid, vc = self._record_send(name)
        self.send_to(dest, Chain(mid, vc, then))

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Fire):
            self._tick()
            for name, dest, then in note.plan:
                self._chain(name, dest, then)
        elif isinstance(note, Chain):
            self.delivered.append(note.mid)
            self.vc = merge_and_tick(self.vc, note.vc, self.label)
            if note.then:
                name, dest = note.then[0]
                self._chain(name, dest, note.then[1:])
        else:
            super().react(sender, note)
