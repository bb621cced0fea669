"""Topic crash schedules: the causal topic contract judged on a bus whose servers and routers die.

The topic counterpart of :mod:`aaabus.testing.torture`, on the same machinery
(:mod:`aaabus.testing.crash`: layouts of domains with routers, seeded faults, real server
processes, the end read back exactly in-process). One schedule is fixed by its seed: the layout,
the faults, and the filters of every peer; process timing is not reproducible, so which
publications a kill catches in flight varies from run to run.

The workload
    :class:`~aaabus.testing.topicload.CausalPeer` agents, ``per_server`` on every server, each
    subscribed to one or two filters drawn from the overlapping wildcards of
    :data:`~aaabus.testing.topicload.FILTERS`. A ``Start`` makes a peer publish ``burst``
    publications on random topics; every delivery is republished, on a random topic, with
    probability ``echo`` while its ``ttl`` lasts, so causal chains cross topics, publishers,
    servers and domains. The harness sends one ``Start`` to the peers in turn every
    ``interval`` seconds from the first fault to the last, through a server that is up (the
    peer's own if it is), so there is fresh traffic whenever a server or router dies.

What is owed (the contract under kills)
    A publication is owed to a subscription whose filter matches its topic and whose interest
    had reached the publisher's server before it was published (docs/architecture.md,
    "Topics"). Here every subscription is made, and its interest is known at every server
    (each representative's status shows exactly the filters the schedule gave the other
    servers), before the first ``Start`` is sent, and none is changed afterwards. Interest is
    kept in the stores, so no kill can take it back: **every publication is owed to every peer
    with a matching filter**, its own publisher included. Retained publications are not used
    (they are state, outside the order).

The judge
    After the last fault the processes are stopped (each must exit 0 on SIGTERM) and the stores
    reopened in-process, which finish whatever was in flight. The run is complete when every
    peer has handled every ``Start`` the harness got committed and every subscriber has
    delivered every publication it is owed (nothing else can still be in flight: a publication
    is recorded in the reaction that sends it). The independent checker
    (:func:`~aaabus.testing.topicload.check_topics`, one subscriber at a time) then counts lost
    (owed, never delivered), duplicated, misdelivered (delivered without being owed) and causal
    and FIFO violations. A peer that handled more or fewer ``Start`` orders than were sent is a
    problem too (a lost or duplicated plain message).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aaabus.model.ids import AgentId
from aaabus.model.topicnames import matches
from aaabus.node.inprocess import InProcessBus
from aaabus.testing.crash import (
    LAYOUTS,
    CrashOutcome,
    Fault,
    OnLayout,
    drain_in_process,
    draw_layout_and_faults,
    pause,
    run_under_faults,
    servers_of,
    write_bus_config,
)
from aaabus.testing.topicload import (
    FILTERS,
    TOPICS,
    CausalPeer,
    History,
    Start,
    check_topics,
    history_of,
)
from aaabus.tools.client import Client
from aaabus.tools.launch import Bus

__all__ = [
    "PeerState",
    "TopicOutcome",
    "TopicSchedule",
    "TopicTraffic",
    "judge_topics",
    "make_topic_schedule",
    "run_topic_schedule",
]


@dataclass(frozen=True)
class TopicSchedule(OnLayout):
    """One topic schedule: ``filters[i]`` are the filters of the ``i``-th peer of
    :attr:`peers` (``per_server`` peers per server, servers in order)."""

    seed: int
    layout: str
    per_server: int
    filters: tuple[tuple[str, ...], ...]
    echo: float
    ttl: int
    burst: int
    interval: float
    faults: tuple[Fault, ...]

    @property
    def peers(self) -> list[tuple[str, int, tuple[str, ...]]]:
        """``(label, server, filters)`` of every peer."""
        places = [(sid, k) for sid in self.servers for k in range(self.per_server)]
        return [(f"p{sid}.{k}", sid, fs) for (sid, k), fs in zip(places, self.filters, strict=True)]


def make_topic_schedule(
    seed: int,
    *,
    kills: int = 5,
    span: float = 4.0,
    per_server: int = 2,
    branching: float = 1.0,
    ttl: int = 8,
    burst: int = 2,
    interval: float = 0.1,
) -> TopicSchedule:
    """The schedule of ``seed``: the layout and faults of
    :func:`~aaabus.testing.crash.draw_layout_and_faults`, then one or two filters per peer.

    ``branching``: the mean number of republications one publication causes. The peers'
    ``echo`` is set to it over the mean number of subscribers of a topic, which the filters
    drawn make vary several times over between seeds: with one fixed ``echo`` some schedules'
    chains would die at once and others would grow geometrically up to ``ttl``. Near 1, a
    ``Start`` makes chains about ``ttl`` long and about ``burst * (ttl + 1)`` publications.
    """
    rng = random.Random(seed)
    layout, faults = draw_layout_and_faults(rng, kills, span)
    peers = len(servers_of(LAYOUTS[layout])) * per_server
    filters = tuple(tuple(rng.sample(FILTERS, rng.randint(1, 2))) for _ in range(peers))
    subscribers = sum(any(matches(f, t) for f in fs) for t in TOPICS for fs in filters)
    echo = round(min(1.0, branching * len(TOPICS) / max(1, subscribers)), 4)
    return TopicSchedule(seed, layout, per_server, filters, echo, ttl, burst, interval, faults)


# -- the traffic, on the live bus ----------------------------------------------------------------


class TopicTraffic:
    """Deploys the peers, waits until every subscription is known everywhere, then sends the
    ``Start`` orders (see the module docstring). Runs on the thread applying the faults: every
    request goes to a server that is up and ready, so no kill lands in the middle of one.

    ``sent`` counts, per peer, the ``Start`` orders the servers acknowledged as committed. A
    request that gets no answer raises :class:`~aaabus.errors.ServerUnreachable` and fails the
    schedule (a live, ready server that does not answer within the timeout is a finding).
    """

    def __init__(self, schedule: TopicSchedule, config: Path, timeout: float = 60.0) -> None:
        self.schedule = schedule
        self.config = config
        self.timeout = timeout
        self.interval = schedule.interval
        self.ids: dict[str, AgentId] = {}
        self.sent: dict[str, int] = {label: 0 for label, _sid, _fs in schedule.peers}
        self._clients: dict[int, Client] = {}
        self._turn = 0

    def _client(self, sid: int) -> Client:
        if sid not in self._clients:
            self._clients[sid] = Client(self.config, sid, timeout=self.timeout)
        return self._clients[sid]

    def begin(self, bus: Bus) -> None:
        for label, sid, filters in self.schedule.peers:
            peer = CausalPeer(label, self.schedule.seed, filters, TOPICS, self.schedule.echo)
            self.ids[label] = self._client(sid).deploy(peer)
        self._wait_interest()
        for label, _sid, _fs in self.schedule.peers:
            self._start(label, self._client(self.ids[label].server))

    def _expected_figures(self, sid: int) -> dict[str, int]:
        local: dict[int, set[str]] = {}
        for _label, where, filters in self.schedule.peers:
            local.setdefault(where, set()).update(filters)
        return {
            "filters": len(local.get(sid, set())),
            "remote_subscriptions": sum(len(fs) for s, fs in local.items() if s != sid),
        }

    def _wait_interest(self) -> None:
        """Until every representative holds exactly the schedule's subscriptions: its own
        filters, and each filter of every other server (``remote_subscriptions`` counts
        filter-server pairs; nothing else subscribes, so equal counts mean equal sets)."""
        deadline = time.monotonic() + self.timeout
        for sid in self.schedule.servers:
            want = self._expected_figures(sid)
            while True:
                figures = self._client(sid).status()["topics"]
                got = {key: figures[key] for key in want}
                if got == want:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"interest at server {sid}: {got}, wanted {want}")
                # Another process's state, read through its admin port: poll it.
                pause(0.05)

    def _start(self, label: str, client: Client) -> None:
        client.send(self.ids[label], Start(self.schedule.burst, self.schedule.ttl))
        self.sent[label] += 1

    def tick(self, bus: Bus) -> None:
        """One ``Start`` to the next peer in turn, through its own server when that is ready,
        else through the first ready one (store and forward takes it on)."""
        peers = self.schedule.peers
        label, sid, _fs = peers[self._turn % len(peers)]
        self._turn += 1
        ready = [s for s in self.schedule.servers if bus[s].is_ready()]
        if ready:
            self._start(label, self._client(sid if sid in ready else ready[0]))

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()


# -- reading and judging the end of a run ----------------------------------------------------------


@dataclass
class PeerState:
    """A peer's committed history and how many ``Start`` orders it handled."""

    history: History
    starts: int

    @property
    def label(self) -> str:
        return self.history[0]


def read_peers(bus: InProcessBus) -> list[PeerState]:
    """Every peer of the bus, read on its server's engine thread (committed state)."""
    out: list[PeerState] = []
    for server in bus.servers.values():

        def read(server: Any = server) -> list[PeerState]:
            agents = server.store.agents.values()
            return [PeerState(history_of(a), a.starts) for a in agents if isinstance(a, CausalPeer)]

        out.extend(server.call(read))
    return out


def _owed(peers: list[PeerState]) -> dict[str, set[str]]:
    """Subscriber label -> the mids owed to it (every publication matching one of its filters:
    all subscriptions precede all traffic, see the module docstring)."""
    published = [(mid, topic) for p in peers for mid, topic, _vc in p.history[2]]
    return {
        p.label: {mid for mid, topic in published if any(matches(f, topic) for f in p.history[1])}
        for p in peers
    }


def complete(peers: list[PeerState], sent: dict[str, int]) -> bool:
    """Every ``Start`` handled and every owed publication delivered (see the module docstring)."""
    if len(peers) != len(sent) or any(p.starts < sent.get(p.label, 0) for p in peers):
        return False
    owed = _owed(peers)
    return all(owed[p.label] <= set(p.history[3]) for p in peers)


@dataclass
class TopicOutcome(CrashOutcome):
    """What one topic schedule did and what the checker said."""

    peers: int = 0
    starts: int = 0
    publications: int = 0
    owed: int = 0
    deliveries: int = 0


def judge_topics(peers: list[PeerState], sent: dict[str, int], outcome: TopicOutcome) -> None:
    """Fill ``outcome`` with the checker's verdict on the final histories; ``sent``: the
    ``Start`` orders sent to each peer deployed."""
    histories = [p.history for p in peers]
    owed = _owed(peers)
    outcome.peers = len(peers)
    outcome.starts = sum(sent.values())
    outcome.publications = sum(len(h[2]) for h in histories)
    outcome.owed = sum(len(mids) for mids in owed.values())
    outcome.deliveries = sum(len(h[3]) for h in histories)
    for label, report in sorted(check_topics(histories).items()):
        outcome.checked(report, f", subscriber {label}")
    found = sorted(p.label for p in peers)
    if found != sorted(sent):
        outcome.problems.append(f"peers found {found}, deployed {sorted(sent)}")
    handled = {p.label: p.starts for p in peers}
    wrong = {label: (handled.get(label), n) for label, n in sent.items() if handled.get(label) != n}
    if wrong:
        outcome.problems.append(f"Start orders (handled, sent) differ: {wrong}")


def write_topic_config(schedule: TopicSchedule, directory: Path) -> Path:
    # Small groups, as in the bank schedules: a kill crosses more commit boundaries. The peers
    # are deployed by a client, so their module must be trusted by name.
    props = {"aaabus.engine.max_batch": "8", "aaabus.trust": "aaabus.testing.topicload"}
    return write_bus_config(directory, schedule.domains, props)


def run_topic_schedule(
    schedule: TopicSchedule,
    workdir: Path,
    *,
    log: Callable[[str], None] | None = None,
    drain_timeout: float = 60.0,
) -> TopicOutcome:
    """Run one schedule in ``workdir`` (kept: the stores are the evidence when it fails)."""
    t_start = time.monotonic()
    outcome = TopicOutcome(schedule.seed, schedule.layout)
    config = write_topic_config(schedule, workdir)
    storage = workdir / "stores"
    traffic = TopicTraffic(schedule, config)
    try:
        faulted = run_under_faults(config, schedule.servers, storage, schedule.faults, traffic)
    finally:
        traffic.close()
    first, peers = drain_in_process(
        config,
        storage,
        read_peers,
        lambda ps: complete(ps, traffic.sent),
        drain_timeout,
        faulted.hear,
    )
    outcome.took(faulted, schedule.routers, workdir)
    outcome.delivered_at_stop = sum(len(p.history[3]) for p in first)
    judge_topics(peers, traffic.sent, outcome)
    outcome.finished_in_process = outcome.deliveries - outcome.delivered_at_stop
    outcome.seconds = round(time.monotonic() - t_start, 3)
    if log is not None:
        log(
            f"topics schedule seed={schedule.seed} layout={schedule.layout} "
            f"kills={outcome.kills} (routers {outcome.router_kills}) "
            f"publications={outcome.publications} deliveries={outcome.deliveries} "
            f"(at stop {outcome.delivered_at_stop}) "
            f"{'ok' if outcome.ok else 'FAILED: ' + '; '.join(outcome.problems)} "
            f"{outcome.seconds:.1f}s"
        )
    return outcome
