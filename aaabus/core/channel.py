"""The channel: what happens to messages between servers, on the engine thread.

The rules themselves (stamps, acks, resends, hold-back) are the sans-IO
:class:`~aaabus.core.protocol.LinkProtocol`, and the frames are :mod:`aaabus.wire.linkframes`;
this class carries their events out. Everything here runs inside the engine's current group (one
ZODB transaction), so that stamping, queueing, acknowledging and delivering are atomic with the
reactions around them:

* **send**: a message for another server is held until the end of the event that sent it (a
  reaction, or an input such as a router's forwarding); then :meth:`Channel.seal` counts all the
  event's sends in the clock of their first hop's domain before stamping each (a reaction is one
  clock event) and appends them to their hops' persistent outgoing queues (``qout``), in the
  transaction of that event. Once the commit is durable the frames are handed to the network
  (:meth:`~aaabus.core.effects.TransactionEffects.when_durable_once`) -- or, with early frames
  (:mod:`aaabus.core.early`, the default), they leave marked tentative as the commit starts,
  and a durability notice follows once it is durable.
* **receive**: a frame from a peer is tested against the domain's clock. DELIVER merges the stamp
  and queues the message for a local agent — or, on a router, re-stamps it for the next domain and
  queues it for the next hop — then retries the held-back messages of that domain. WAIT stores it
  (persistently) with the held-back messages. DUPLICATE (a resend) does nothing. In all three
  cases the sender is acknowledged *after* the commit. A group that applied a tentative frame
  commits only once its sender said the frame is durable.
* **ack**: acknowledgements are cumulative per link: "I have stored everything up to seq n". The
  sender then drops those messages from its ``qout``.
* **resend**: when a connection comes up, everything still in that peer's ``qout`` is sent again,
  in order; the receiver's clock absorbs the duplicates.

A *link* is a (peer, domain) pair, and its sequence number is the sender's own count of messages
to that peer in that domain: the clock entry ``H[me][peer]``, already persisted and bumped by
every stamp. It keys the message in the link's ``qout`` and names it uniquely across restarts of
either side, which is what makes held-back messages and acknowledgements idempotent, at no extra
storage cost.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from aaabus.core.clock import DomainClock
from aaabus.core.early import Dependency, EarlyLinks, EarlyVote, Incoming, Item
from aaabus.core.protocol import Deliver, LinkProtocol
from aaabus.errors import StoreError
from aaabus.wire.linkframes import (
    DATA,
    DURABLE_FRAME,
    STATE,
    TENTATIVE_FRAME,
    decode_ack,
    decode_state,
    encode_ack,
)
from aaabus.wire.message import Message

if TYPE_CHECKING:
    from aaabus.config.domains import Hop, Topology
    from aaabus.config.reader import BusConfig
    from aaabus.core.engine import Engine
    from aaabus.core.trace import Tracer
    from aaabus.core.traffic import TrafficRecorder
    from aaabus.core.turn import Turn

log = logging.getLogger("aaabus.channel")


class Transport(Protocol):
    """The part of :class:`aaabus.io.network.Network` the channel uses (any thread-safe sender)."""

    def send_many(self, peer: int, payloads: list[bytes]) -> None: ...

    def reset(self, peer: int, reason: str) -> None:
        """Close the connection with ``peer`` (it is dialled again as after any loss)."""

    #: ``perf_counter_ns`` when the I/O thread's latest socket read returned (read it on the
    #: I/O thread, in ``on_read``: the start of a hop's breakdown).
    read_ns: int


class Channel:
    """Stamps, outgoing queues, acknowledgements, hold-back and routing of one server."""

    def __init__(
        self,
        engine: Engine,
        config: BusConfig,
        topology: Topology,
        *,
        tracer: Tracer | None = None,
        max_frame: int = 16 << 20,
        early: bool = True,
        notice_wait_s: float = 0.1,
        notice_spin_us: int = 0,
    ) -> None:
        """``early``: send frames before their group is durable, marked tentative (property
        ``aaabus.link.early``, see :mod:`aaabus.core.early`); ``notice_wait_s``: how long a
        group that applied tentative frames waits for their sender's durability notice before
        it is replayed with them parked apart (``aaabus.link.notice_wait_ms``), after polling
        for it for ``notice_spin_us`` (``aaabus.link.notice_spin_us``)."""
        self.engine = engine
        self.tracer = tracer
        self.max_frame = max_frame
        self.store = engine.store
        self.me = engine.server_id
        self.topology = topology
        self.routes: dict[int, Hop] = topology.routes_from(self.me)
        self.transport: Transport | None = None
        #: Counts what this server's agents send, per destination server (aaabus.traffic).
        self.traffic: TrafficRecorder | None = None
        self.clocks: dict[str, DomainClock] = {}
        # Work for the end of the current group: frames to send per peer, acks to give per link.
        # Staged in memory, so every change is recorded in the engine's transaction effects,
        # which take it back if the group (or the reaction or input that staged it) rolls back.
        self._frames: dict[int, list[bytes]] = {}
        # Sends of the current event, counted and stamped together by seal() at its end.
        self._pending: list[tuple[Hop, Message, bool]] = []
        self._acks: dict[tuple[int, str], int] = {}
        # Sends to count in the traffic recorder, once the group is durable.
        self._counted: list[tuple[int, int]] = []
        self._effects = engine.effects
        self._failpoints = engine.failpoints
        self.early = early
        self.notice_wait_s = notice_wait_s
        self.notice_spin_ns = notice_spin_us * 1000
        #: Connections as their frames are read (I/O thread) and waited on (engine thread).
        self.links = EarlyLinks(self._release)
        #: Links whose peer's store and ours disagree on what was sent, acknowledged or
        #: delivered (:meth:`compare_state`): (peer, domain) -> the facts, for status views.
        #: Engine thread only (written by compare_state, read by depths).
        self.diverged: dict[tuple[int, str], list[str]] = {}
        # The open transaction's dependencies (connection -> last tentative position applied)
        # and the peers its frames already left for; both settled by the transaction's end.
        self._deps: dict[Incoming, int] = {}
        self._sent_early: list[int] = []
        self._vote = EarlyVote(
            engine.store.tm,
            vote=self._vote_early,
            aborted=self._vote_aborted,
            finished=self._vote_finished,
        )
        self.protocol = self._open(config, tracer)

    # -- set-up ----------------------------------------------------------------------------------

    def _open(self, config: BusConfig, tracer: Tracer | None) -> LinkProtocol:
        """Find or create this server's clocks and queues (call inside a transaction)."""
        links = self.store.links
        if config.setting(self.me, "aaabus.domains.rebuild"):
            self._forget_changed_domains(config)
        members_of: dict[str, tuple[int, ...]] = {}
        waiting: dict[str, Any] = {}
        qout: dict[tuple[int, str], Any] = {}
        for domain in self.topology.domains_of(self.me):
            members = self.topology.domains[domain]
            members_of[domain] = members
            me = members.index(self.me)
            spec = config.domains[domain]
            clock = links.clock(domain)
            if clock is None:
                clock = links.new_clock(domain, len(members), me, spec.stamps, spec.order)
            elif (clock.size, clock.me, clock.stamps, clock.order) != (
                len(members),
                me,
                spec.stamps,
                spec.order,
            ):
                raise StoreError(
                    f"domain {domain} in {config.path} no longer matches the clock stored by "
                    f"server {self.me} (members, stamps or order changed); such a change needs "
                    "every server of the domain drained and restarted with fresh stores "
                    "(see docs/operations.md)"
                )
            self.clocks[domain] = clock
            waiting[domain] = links.waiting(domain)
            for peer in members:
                if peer != self.me:
                    qout[peer, domain] = links.outgoing(peer, domain)
        return LinkProtocol(
            self.me,
            members_of,
            self.clocks,
            waiting,
            qout,
            max_frame=self.max_frame,
            failpoints=self._failpoints,
            tracer=tracer,
            undo=self._effects.undo,
        )

    def _forget_changed_domains(self, config: BusConfig) -> None:
        """Drop the stored clock and queues of every domain that changed (or went away).

        Only safe on a drained bus whose every member of such a domain does the same at this
        boot: sequence numbers and clocks then restart at zero on all sides. A domain that still
        holds a held-back or unacknowledged message is refused (StoreError), since dropping it
        would lose that message; the agents, their state and the input queue are never touched.
        """
        links = self.store.links
        wanted: dict[str, tuple[int, int, str, str]] = {}
        for domain in self.topology.domains_of(self.me):
            members = self.topology.domains[domain]
            spec = config.domains[domain]
            wanted[domain] = (len(members), members.index(self.me), spec.stamps, spec.order)
        stale = sorted(
            domain
            for domain, clock in links.domains()
            if wanted.get(domain) != (clock.size, clock.me, clock.stamps, clock.order)
        )
        pending = sum(links.pending(domain) for domain in stale)
        if pending:
            raise StoreError(
                f"server {self.me} cannot rebuild domain(s) {', '.join(stale)}: they "
                f"still hold {pending} message(s) held back or not acknowledged; boot under the "
                "old configuration, drain the bus (docs/operations.md), then try again"
            )
        for domain in stale:
            links.drop(domain)
        if stale:
            log.warning("server %s: domain(s) %s rebuilt afresh", self.me, ", ".join(stale))

    def knows(self, server: int) -> bool:
        return server in self.routes

    # -- sending -----------------------------------------------------------------------------------

    def send(self, message: Message) -> None:
        """Hold ``message`` for the seal of the current event (engine thread, in the group).

        Nothing is counted or stamped yet: :meth:`seal` does it for all the event's sends at
        once. The size limit is checked here, with room for the largest stamp, so that the
        sending reaction hears of an oversized notification as it sends it.
        """
        hop = self.routes[message.target.server]
        self.protocol.check_size(hop.domain, message)
        # Counted by the traffic recorder at the seal, where its frame size is known; only what
        # leaves its sender (routers re-stamp what they forward through _hold too, and the
        # planner wants end-to-end counts).
        self._hold(hop, message, counted=True)

    def _hold(self, hop: Hop, message: Message, counted: bool = False) -> None:
        self._pending.append((hop, message, counted))
        self._effects.undo(self._pending.pop)

    def seal(self) -> None:
        """End of an event (a reaction, an input): count and stamp all its sends as one.

        Engine thread, in the group, before the commit. The protocol counts every send of the
        event in its domain's clock before stamping any (:meth:`LinkProtocol.stamp_event`), so
        each message carries the knowledge of all its siblings: whatever a receiver of one sends
        afterwards is causally after all of them. The frames are then staged for the network,
        in the order the messages were sent.
        """
        pending = self._pending
        if not pending:
            return
        self._pending = []
        self._effects.undo(setattr, self, "_pending", pending)
        frames = self.protocol.stamp_event([(h.server, h.domain, m) for h, m, _ in pending])
        failpoints = self._failpoints
        traffic = self.traffic
        for (_hop, message, counted), (peer, frame) in zip(pending, frames, strict=True):
            self._stage(peer, frame)
            if traffic is not None and counted:
                # Counted once the group is durable (_flush): a replayed group sends again.
                self._counted.append((message.target.server, len(frame)))
                self._effects.undo(self._counted.pop)
            if failpoints.armed:
                failpoints.hit("channel.send")

    def _stage(self, peer: int, frame: bytes) -> None:
        frames = self._frames.get(peer)
        if frames is None:
            frames = self._frames[peer] = []
        frames.append(frame)
        self._effects.undo(frames.pop)
        self._effects.when_durable_once(self._flush)
        if self.early:
            self._vote.join()

    def before_commit(self, turn: Turn) -> Iterator[_NoticeWait]:
        """The group is about to commit (the engine's thread, or the network's I/O thread
        running a group of the frames it just read: see :meth:`on_read`), on ``turn``.

        First, wait until every tentative frame the group applied is durable at its sender
        (raises :class:`DependencyLost`: the group is replayed without the lost frames, with the
        late ones parked until their notice). When its turn may set it aside (the network's
        I/O thread took it in :meth:`on_read`) the group does not wait: it yields, and is set
        aside (transaction open, turn held) for the network's loop, which reads the notice, to
        resume; on any other turn it waits for the I/O thread to read the notice. Then, with
        early frames, the group's frames leave, each batch behind a
        TENTATIVE frame, while ZODB prepares and the store writes and syncs: they hang on this
        group's durability alone, of which its notice will tell.
        """
        deps = self._deps
        tracer = self.tracer
        transport = self.transport
        if deps:
            if turn.may_set_aside:
                budget = self.notice_wait_s
                deadline = time.monotonic() + budget
                waiting: _NoticeWait | None = None
                while not self.links.ready(deps, deadline, budget):
                    # Polled for again after each read that did not bring it, as a sleeping
                    # thread would wake tens of µs after it.
                    spin_until = time.perf_counter_ns() + self.notice_spin_ns
                    if waiting is None:
                        waiting = _NoticeWait(self.engine, deadline, spin_until)
                    else:
                        waiting.spin_until_ns = spin_until
                    yield waiting
            else:
                self.links.wait(deps, self.notice_wait_s, self.notice_spin_ns)
            if tracer is not None:
                tracer.mark("notified")
        if not self.early or not self._frames or transport is None:
            return
        frames, self._frames = self._frames, {}
        for peer, batch in frames.items():
            if batch:
                self._sent_early.append(peer)
                self._send(transport, peer, [TENTATIVE_FRAME, *batch])
        if tracer is not None:
            tracer.mark("sent_early")

    def _vote_early(self) -> None:
        """First vote of the transaction: ZODB prepared the records, the store has not written
        them yet."""
        if self.tracer is not None:
            self.tracer.mark("prepared")
        if self._sent_early and self._failpoints.armed:
            self._failpoints.hit("channel.sent_early")

    def _vote_aborted(self) -> None:
        """The transaction ended without committing: frames that left early must not be used."""
        self._deps.clear()
        sent, self._sent_early = self._sent_early, []
        for peer in dict.fromkeys(sent):
            self._reset(peer, "a group whose frames left early did not commit")

    def _vote_finished(self) -> None:
        self._deps.clear()

    def _flush(self) -> None:
        """Once the group is durable: hand its frames and acks to the network (engine thread).

        A hand-off that fails (the transport raised) closes the connection and is retried as a
        link coming back up would be (:meth:`_send`).
        """
        frames, self._frames = self._frames, {}
        acks, self._acks = self._acks, {}
        sent_early, self._sent_early = self._sent_early, []
        if self._counted:
            counted, self._counted = self._counted, []
            traffic = self.traffic
            if traffic is not None:
                for server, size in counted:
                    traffic.record(server, size)
        transport = self.transport
        if transport is None:
            return
        for (peer, domain), upto in acks.items():
            batch = frames.setdefault(peer, [])
            # After the link states a resend opened the batch with (:meth:`resend`): a state
            # says what this store had delivered when the resend ran, and the peer compares
            # it with the acknowledgements it read before it, which must not include this
            # group's later deliveries.
            batch.insert(_after_states(batch), encode_ack(domain, upto))
        # The notice goes first: the peer's group waiting on it commits sooner.
        for peer in dict.fromkeys(sent_early):
            frames.setdefault(peer, []).insert(0, DURABLE_FRAME)
        tracer = self.tracer
        if tracer is not None:
            tracer.mark("flush")
        for peer, batch in frames.items():
            if batch:
                self._send(transport, peer, batch)
        if tracer is not None:
            tracer.mark("sent")

    def _send(self, transport: Transport, peer: int, batch: list[bytes]) -> None:
        """Hand ``batch`` to the network. If that fails, the connection is closed: what the
        peer got of the stream is unknown (part of a batch, a TENTATIVE frame whose notice will
        never follow), so both sides start again from a clean connection, where everything
        unacknowledged is sent again (:meth:`resend`)."""
        failpoints = self._failpoints
        try:
            if failpoints.armed:
                failpoints.hit("channel.flush")
            transport.send_many(peer, batch)
            if failpoints.armed:
                failpoints.hit("channel.flushed")
        except Exception as exc:
            log.error(
                "server %s: handing %d frame(s) for server %s to the network failed "
                "(%s: %s); closing the connection and sending again what it has not "
                "acknowledged",
                self.me,
                len(batch),
                peer,
                type(exc).__name__,
                exc,
            )
            transport.reset(peer, "a batch of frames could not be handed over")
            # Also at once, if the connection was not up (no new one will announce itself).
            self.engine.submit(self._resend_input(peer))

    # -- receiving ---------------------------------------------------------------------------------

    def on_read(self, peer: int, payloads: list[bytes]) -> _NoticeWait | None:
        """The network's I/O thread: hand the authenticated frames of one read to the engine,
        in order (acknowledgements as lazy work), with one hand-off for them all; when the
        engine is idle, this thread runs their group itself. Returns the group set aside, if
        it waits for a durability notice not yet read: the loop resumes it after each read
        (and once a connection went down, or at its ``deadline``) until it returns None.
        """
        tracer = self.tracer
        if tracer is None:
            times = None
        else:
            transport = self.transport
            handed = time.perf_counter_ns()
            times = (transport.read_ns if transport is not None else handed, handed)
        inputs: list[Callable[[Engine], None]] = []
        acks = []
        links = self.links
        conn = links.connection(peer)
        for payload in payloads:
            kind = payload[:1]
            if kind == DATA:
                conn.received += 1
                # One input per frame, so that a frame that fails is dropped alone (Engine.submit).
                item = _FrameInput(
                    self, peer, payload, times, (conn, conn.received), conn.tentative
                )
                # (hold's own first test, inlined: nothing of this connection is parked.)
                held = False if conn.parked is None else links.hold(conn, item, len(payload))
                if held is None:
                    self._reset(peer, "it parked more frames than allowed, waiting for a notice")
                elif not held:
                    inputs.append(item)
            elif payload == DURABLE_FRAME:
                links.durable(conn)
            elif payload == TENTATIVE_FRAME:
                conn.tentative = True
            elif kind == STATE:
                # Applied with the acknowledgements, in the order read: lazy work runs before
                # the group's other inputs, so an acknowledgement read after the state would
                # otherwise be applied before it and make this side's count of what the peer
                # acknowledged larger than the state it is compared with. Still before the
                # frames that follow it (a resend) can move this side's counts.
                state = decode_state(payload)
                if state is not None:
                    acks.append(self._state_input(peer, *state))
            else:
                ack = decode_ack(payload)
                if ack is not None:
                    domain, upto = ack
                    acks.append(self._ack_input(peer, domain, upto))
                else:  # garbage: refused by receive(), in its own input
                    inputs.append(_FrameInput(self, peer, payload, times, None, False))
        # A group of these frames runs on the I/O thread even if it must wait for their
        # notice: it is then set aside until the loop has read it, which saves handing the
        # frames to the engine thread and the notice after them.
        waiting = self.engine.submit_many(inputs, acks, run_here=True, set_aside=True)
        assert waiting is None or isinstance(waiting, _NoticeWait)
        return waiting

    # Built here rather than by a lambda in on_read's loop, which would see the loop's last
    # values when it runs.
    def _ack_input(self, peer: int, domain: str, upto: int) -> Callable[[Engine], None]:
        return lambda _engine: self.acknowledged(peer, domain, upto)

    def _state_input(
        self, peer: int, domain: str, sent: int, acked: int, received: int
    ) -> Callable[[Engine], None]:
        return lambda _engine: self.compare_state(peer, domain, sent, acked, received)

    def compare_state(self, peer: int, domain: str, sent: int, acked: int, received: int) -> None:
        """``peer`` announced its state of our link in ``domain`` (engine thread): a store on
        either side older than the other remembers is said in one error line per fact, once
        per process and link, and kept for the status view (:attr:`diverged`); the link is
        left as it is (what was lost cannot be made up here, and refusing the link would stop
        what still flows)."""
        facts = self.protocol.check_state(peer, domain, sent, acked, received)
        link = (peer, domain)
        if not facts:
            self.diverged.pop(link, None)
            return
        if self.diverged.get(link) != facts:
            for fact in facts:
                log.error("server %s: %s", self.me, fact)
        self.diverged[link] = facts

    def _release(self, items: list[Item]) -> None:
        """Parked frames whose notice came, or whose connection closed (I/O thread)."""
        self.engine.submit_many(items)

    def _reset(self, peer: int, reason: str) -> None:
        log.warning("server %s: closing the connection from server %s: %s", self.me, peer, reason)
        if self.transport is not None:
            self.transport.reset(peer, reason)

    def receive_frame(self, frame: _FrameInput) -> None:
        """Apply one data frame read from a peer (engine thread, in the group), unless it must
        wait for its sender's durability notice (parked) or never will be vouched for."""
        dep = frame.dep
        if dep is not None and (frame.tentative or dep[0].parked is not None):
            # (A connection's parked list is only ever created on this thread: when it is None
            # here, nothing of that connection waits, and a frame that was durable goes on.)
            verdict = self.links.admit(dep, frame.tentative, frame, len(frame.payload))
            if verdict == "park":
                return
            if verdict == "drop":
                log.info(
                    "server %s: dropping a frame from server %s never made durable",
                    self.me,
                    frame.peer,
                )
                self.links.dropped += 1
                return
            if verdict == "reset":
                self._reset(frame.peer, "it parked more frames than allowed")
                return
            conn, position = dep
            if frame.tentative and self._deps.get(conn, 0) < position:
                self._deps[conn] = position
                self._vote.join()
        self.receive(frame.peer, frame.payload, frame.times)

    def acknowledged(self, peer: int, domain: str, upto: int) -> None:
        """``peer`` has stored all we sent it in ``domain`` up to ``upto`` (engine thread)."""
        self.protocol.acknowledged(peer, domain, upto)

    def receive(self, peer: int, payload: bytes, times: tuple[int, int] | None = None) -> None:
        """Handle one authenticated data frame from ``peer`` (engine thread, in the group).

        ``times``: when the frame was read and handed over (with a tracer, for the breakdown)."""
        tracer = self.tracer
        if tracer is not None and times is not None:
            tracer.arrived(*times)
        for event in self.protocol.receive(peer, payload):
            if isinstance(event, Deliver):
                self._arrived(event.message)
            else:
                self._ack((event.peer, event.domain), event.upto)
        if tracer is not None:
            tracer.mark("tested")

    def _ack(self, link: tuple[int, str], upto: int) -> None:
        acks = self._acks
        old = acks.get(link, 0)
        if upto > old:
            acks[link] = upto
            self._effects.undo(acks.__setitem__, link, old)
            self._effects.when_durable_once(self._flush)

    def _arrived(self, message: Message) -> None:
        """A message is causally deliverable here: to a local agent, or on to the next domain."""
        failpoints = self._failpoints
        if failpoints.armed:
            failpoints.hit("channel.deliver")
        if message.target.server == self.me:
            self.engine.deliver(message)
        else:
            hop = self.routes.get(message.target.server)
            if hop is None:
                raise ValueError(f"no route from server {self.me} to {message.target}")
            # A router: re-stamped in the next domain, in this same transaction, with the
            # other sends of the input that delivered it (sealed as one event).
            if failpoints.armed:
                failpoints.hit("channel.restamp")
            self._hold(hop, message)

    # -- links ------------------------------------------------------------------------------------

    def _resend_input(self, peer: int) -> Callable[[Engine], None]:
        return lambda _engine: self.resend(peer)

    def resend(self, peer: int) -> None:
        """The link to ``peer`` is (back) up: send the state of each link with it, then
        everything it has not acknowledged, in order.

        Also acknowledges again what this server delivered from ``peer``: acknowledgements are
        cumulative and idempotent, and one lost with a connection would otherwise keep the
        peer's queue full until the next message comes.
        """
        frames, acks = self.protocol.resend(peer)
        # The state of each link first: the peer compares it with its store before the
        # resent frames can move its counts (compare_state).
        frames = self.protocol.link_states(peer) + frames
        # The queues include what this group staged for the peer: send it once, in order.
        old = self._frames.get(peer)
        self._frames[peer] = frames
        if old is None:
            self._effects.undo(self._frames.pop, peer, None)
        else:
            self._effects.undo(self._frames.__setitem__, peer, old)
        self._effects.when_durable_once(self._flush)
        if self.early:
            self._vote.join()  # they leave early too: an abort must close the connection
        for ack in acks:
            self._ack((ack.peer, ack.domain), ack.upto)

    def depths(self) -> dict[str, Any]:
        """Queue depths for status views (engine thread)."""
        outgoing, held_back = self.protocol.depths()
        diverged = [fact for facts in self.diverged.values() for fact in facts]
        return {"outgoing": outgoing, "held_back": held_back, "diverged": diverged}


def _after_states(batch: list[bytes]) -> int:
    """Where the link states at the head of ``batch`` end."""
    at = 0
    while at < len(batch) and batch[at][:1] == STATE:
        at += 1
    return at


class _FrameInput:
    """One data frame read from a peer, as an engine input (see :meth:`Channel.receive_frame`);
    a parked frame is the same input, handed to the engine again once its notice came."""

    __slots__ = ("channel", "dep", "payload", "peer", "tentative", "times")

    def __init__(
        self,
        channel: Channel,
        peer: int,
        payload: bytes,
        times: tuple[int, int] | None,
        dep: Dependency | None,
        tentative: bool,
    ) -> None:
        self.channel = channel
        self.peer = peer
        self.payload = payload
        self.times = times
        self.dep = dep
        self.tentative = tentative

    def __call__(self, _engine: Engine) -> None:
        self.channel.receive_frame(self)


class _NoticeWait:
    """A group set aside on the network's I/O thread until the durability notices it depends
    on are read (see :meth:`Channel.before_commit`): what the loop keeps, and resumes."""

    __slots__ = ("deadline", "engine", "spin_until_ns")

    def __init__(self, engine: Engine, deadline: float, spin_until_ns: int) -> None:
        self.engine = engine
        #: ``time.monotonic()`` past which the group gives up (resume it then at the latest).
        self.deadline = deadline
        #: ``perf_counter_ns`` until which the loop polls rather than sleeps: the notice
        #: usually comes within a sync's time, and a sleeping thread wakes tens of µs late.
        self.spin_until_ns = spin_until_ns

    def resume(self) -> _NoticeWait | None:
        """Go on with the group: itself again if it must still wait, else None (committed, or
        replayed without what it lost)."""
        waiting = self.engine.resume()
        assert waiting is None or isinstance(waiting, _NoticeWait)
        return waiting

    def cancel(self, reason: str) -> None:
        """Give the group up (the network stops): it is aborted and replayed."""
        self.engine.cancel(reason)
