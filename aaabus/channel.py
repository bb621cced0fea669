"""The channel: what happens to messages between servers, on the engine thread.

Everything here runs inside the engine's current group (one ZODB transaction), so that stamping,
queueing, acknowledging and delivering are atomic with the reactions around them:

* **send**: a message for another server is held until the end of the event that sent it (a
  reaction, or an input such as a router's forwarding); then :meth:`Channel.seal` counts all the
  event's sends in the clock of their first hop's domain before stamping each (a reaction is one
  clock event) and appends them to their hops' persistent outgoing queues (``qout``), in the
  transaction of that event. After the commit the frames are handed to the network thread.
* **receive**: a frame from a peer is tested against the domain's clock. DELIVER merges the stamp
  and queues the message for a local agent — or, on a router, re-stamps it for the next domain and
  queues it for the next hop — then retries the held-back messages of that domain. WAIT stores it
  (persistently) with the held-back messages. DUPLICATE (a resend) does nothing. In all three
  cases the sender is acknowledged *after* the commit.
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
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from BTrees.OOBTree import OOBTree

from aaabus.clock import HEADER_SIZE, ClockError, DomainClock, Verdict
from aaabus.errors import StoreError
from aaabus.ids import AgentId
from aaabus.message import Message, vet_body
from aaabus.store import PersistentQueue

if TYPE_CHECKING:
    from aaabus.config import BusConfig
    from aaabus.domains import Hop, Topology
    from aaabus.engine import Engine
    from aaabus.trace import Tracer

log = logging.getLogger("aaabus.channel")

# First byte of every frame. Neither kind is pickled: a frame is checked and taken apart with
# fixed-size fields in time linear in its length, whatever its bytes, and only the notification
# body inside a data frame is ever unpickled (after :func:`aaabus.message.vet_body`).
DATA = b"D"
ACK = b"A"
# An acknowledgement, parsed on the network thread and handed to the engine as lazy work:
# kind, upto; followed by the domain name, UTF-8.
_ACK = struct.Struct(">cQ")
# A data frame: kind, link sequence number, sender id, target id (from, server, stamp each),
# lengths of the domain name and of the stamp; followed by the domain name (UTF-8), the stamp
# and the notification body, which runs to the end of the frame.
_DATA = struct.Struct(">cQIIQIIQHI")
# Bytes per matrix entry in the largest stamp (a delta stamp listing every entry: key, value).
_MAX_STAMP_ENTRY = 12


class Transport(Protocol):
    """The part of :class:`aaabus.network.Network` the channel uses (any thread-safe sender)."""

    def send_many(self, peer: int, payloads: list[bytes]) -> None: ...


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
    ) -> None:
        self.engine = engine
        self.max_frame = max_frame
        self.store = engine.store
        self.me = engine.server_id
        self.topology = topology
        self.routes: dict[int, Hop] = topology.routes_from(self.me)
        self.tracer = tracer
        self.transport: Transport | None = None
        self._index: dict[str, dict[int, int]] = {}
        self._members: dict[str, tuple[int, ...]] = {}
        self.clocks: dict[str, DomainClock] = {}
        self._waiting: dict[str, OOBTree] = {}
        self._qout: dict[tuple[int, str], PersistentQueue] = {}
        self._links_of: dict[int, list[str]] = {}
        # Work for the end of the current group: frames to send per peer, acks to give per link.
        # Staged in memory, so every change is recorded in the engine's transaction effects,
        # which take it back if the group (or the reaction or input that staged it) rolls back.
        self._frames: dict[int, list[bytes]] = {}
        # Sends of the current event, counted and stamped together by seal() at its end.
        self._pending: list[tuple[Hop, Message]] = []
        self._acks: dict[tuple[int, str], int] = {}
        self._effects = engine.effects
        self._failpoints = engine.failpoints
        self._open(config)

    # -- set-up ----------------------------------------------------------------------------------

    def _open(self, config: BusConfig) -> None:
        """Find or create this server's clocks and queues (call inside a transaction)."""
        queues = self.store.queues
        for domain in self.topology.domains_of(self.me):
            members = self.topology.domains[domain]
            self._members[domain] = members
            self._index[domain] = {sid: i for i, sid in enumerate(members)}
            spec = config.domains[domain]
            key = ("clock", domain)
            clock = queues.get(key)
            if clock is None:
                clock = queues[key] = DomainClock(
                    len(members),
                    self._index[domain][self.me],
                    stamps=spec.stamps,
                    order=spec.order,
                )
            elif (clock.size, clock.me, clock.stamps, clock.order) != (
                len(members),
                self._index[domain][self.me],
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
            wait_key = ("wait", domain)
            if wait_key not in queues:
                queues[wait_key] = OOBTree()
            self._waiting[domain] = queues[wait_key]
            for peer in members:
                if peer == self.me:
                    continue
                out_key = ("out", peer, domain)
                if out_key not in queues:
                    queues[out_key] = PersistentQueue()
                self._qout[peer, domain] = queues[out_key]
                self._links_of.setdefault(peer, []).append(domain)

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
        self._check_size(hop, message)
        self._pending.append((hop, message))
        self._effects.undo(self._pending.pop)

    def _check_size(self, hop: Hop, message: Message) -> None:
        k = len(self._members[hop.domain])
        stamp = HEADER_SIZE + _MAX_STAMP_ENTRY * k * k
        room = 64 + _DATA.size + len(hop.domain.encode()) + stamp
        size = len(message.body) + room
        if size > self.max_frame:
            # Raised inside the sending reaction, which is rolled back: the sender hears of it.
            raise ValueError(
                f"notification to {message.target} is up to {size} bytes on the wire, over the "
                f"bus limit of {self.max_frame} (property aaabus.max_frame)"
            )

    def seal(self) -> None:
        """End of an event (a reaction, an input): count and stamp all its sends as one.

        Engine thread, in the group, before the commit. Per domain, every send of the event is
        counted in the clock before any is stamped (:meth:`DomainClock.prepare_sends`), so each
        message carries the knowledge of all its siblings: whatever a receiver of one sends
        afterwards is causally after all of them. The messages then go to their hops' ``qout``
        and are staged for the network, in the order they were sent.
        """
        pending = self._pending
        if not pending:
            return
        self._pending = []
        self._effects.undo(setattr, self, "_pending", pending)
        by_domain: dict[str, list[tuple[Hop, Message]]] = {}
        for hop, message in pending:
            by_domain.setdefault(hop.domain, []).append((hop, message))
        tracer = self.tracer
        for domain, sends in by_domain.items():
            clock = self.clocks[domain]
            index = self._index[domain]
            t0 = time.perf_counter_ns() if tracer is not None else 0
            stamped = clock.prepare_sends([index[hop.server] for hop, _ in sends])
            if tracer is not None:
                each = (time.perf_counter_ns() - t0) // len(sends)
                for (hop, _), (_, stamp) in zip(sends, stamped, strict=True):
                    tracer.stamped(domain, hop.server, len(stamp), each)
            for (hop, message), (seq, stamp) in zip(sends, stamped, strict=True):
                frame = encode_data(seq, domain, stamp, message)
                if len(frame) > self.max_frame - 64:  # room for the session's seq and MAC
                    # Only a router can get here (send() checked the sender's own domain): the
                    # input that delivered the message fails, as a frame the peer refuses would.
                    raise ValueError(
                        f"notification to {message.target} is {len(frame)} bytes on the wire "
                        f"in domain {domain}, over the bus limit of {self.max_frame}"
                    )
                self._qout[hop.server, domain][seq] = (stamp, message)
                self._stage(hop.server, frame)
                if self._failpoints.armed:
                    self._failpoints.hit("channel.send")

    def _stage(self, peer: int, frame: bytes) -> None:
        frames = self._frames.get(peer)
        if frames is None:
            frames = self._frames[peer] = []
        frames.append(frame)
        self._effects.undo(frames.pop)
        self._effects.after_commit_once(self._flush)

    def _flush(self) -> None:
        """After the commit: hand this group's frames and acks to the network.

        A hand-off that fails (the transport raised) is retried as a link coming back up
        would be: everything the peer has not acknowledged is staged again, in order, by an
        input of the next group, and the receiver's clock absorbs what it already has.
        """
        frames, self._frames = self._frames, {}
        acks, self._acks = self._acks, {}
        transport = self.transport
        if transport is None:
            return
        for (peer, domain), upto in acks.items():
            frames.setdefault(peer, []).insert(0, _ACK.pack(ACK, upto) + domain.encode())
        failpoints = self._failpoints
        for peer, batch in frames.items():
            if not batch:
                continue
            try:
                if failpoints.armed:
                    failpoints.hit("channel.flush")
                transport.send_many(peer, batch)
                if failpoints.armed:
                    failpoints.hit("channel.flushed")
            except Exception as exc:
                log.error(
                    "server %s: handing %d frame(s) for server %s to the network failed "
                    "(%s: %s); sending again what it has not acknowledged",
                    self.me,
                    len(batch),
                    peer,
                    type(exc).__name__,
                    exc,
                )
                self.engine.submit(self._resend_input(peer))

    # -- receiving ---------------------------------------------------------------------------------

    def on_frame(self, peer: int, payload: bytes) -> None:
        """Network thread: hand an authenticated frame to the engine (acks as lazy work)."""
        if payload[:1] == ACK and len(payload) > _ACK.size:
            upto = _ACK.unpack_from(payload)[1]
            domain = payload[_ACK.size :].decode("utf-8", "replace")
            self.engine.submit_lazy(lambda _engine: self.acknowledged(peer, domain, upto))
        else:
            self.engine.submit(lambda _engine: self.receive(peer, payload))

    def acknowledged(self, peer: int, domain: str, upto: int) -> None:
        """``peer`` has stored all we sent it in ``domain`` up to ``upto`` (engine thread)."""
        queue = self._qout.get((peer, domain))
        if queue is not None:
            queue.pop_through(upto)

    def receive(self, peer: int, payload: bytes) -> None:
        """Handle one authenticated data frame from ``peer`` (engine thread, in the group)."""
        try:
            seq, domain, stamp, message = decode_data(payload)
        except ValueError as exc:
            raise ValueError(f"bad frame from server {peer}: {exc}") from None
        clock = self.clocks.get(domain)
        index = self._index.get(domain, {})
        if clock is None or peer not in index:
            raise ValueError(f"server {peer} sent a message in domain {domain!r} it does not share")
        link = (peer, domain)
        src = index[peer]
        tracer = self.tracer
        failpoints = self._failpoints
        if failpoints.armed:
            failpoints.hit("channel.clock_test")
        t0 = time.perf_counter_ns() if tracer is not None else 0
        try:
            verdict = clock.receive(src, stamp)
        except ClockError as exc:
            raise ValueError(f"bad stamp from server {peer}: {exc}") from None
        if tracer is not None:
            tracer.tested(domain, peer, verdict.value, time.perf_counter_ns() - t0)
        if verdict is Verdict.WAIT:
            if failpoints.armed:
                failpoints.hit("channel.hold_back")
            waiting = self._waiting[domain]
            key = (peer, seq)
            if key not in waiting:
                waiting[key] = (src, stamp, message)
        elif verdict is Verdict.DELIVER:
            self._arrived(message)
            if self._waiting[domain]:
                self._retry(domain)
        # Acks are cumulative, so they may only cover an unbroken run: everything this link
        # delivered, which is H[peer][me]. A held-back frame is stored too, but a frame ahead of
        # a gap must not vouch for the gap (the sender would drop what we never got); it is
        # acknowledged once delivered, and meanwhile a resend of it is recognised and ignored.
        self._ack(link, clock.received_from(src))

    def _ack(self, link: tuple[int, str], upto: int) -> None:
        acks = self._acks
        old = acks.get(link, 0)
        if upto > old:
            acks[link] = upto
            self._effects.undo(acks.__setitem__, link, old)
            self._effects.after_commit_once(self._flush)

    def _retry(self, domain: str) -> None:
        """Deliver every held-back message of ``domain`` that has become deliverable."""
        clock = self.clocks[domain]
        waiting = self._waiting[domain]
        progress = True
        while progress and waiting:
            progress = False
            for key, (src, stamp, message) in list(waiting.items()):
                verdict = clock.receive(src, stamp)
                if verdict is Verdict.WAIT:
                    continue
                del waiting[key]
                if verdict is Verdict.DELIVER:
                    self._arrived(message)
                    self._ack((key[0], domain), clock.received_from(src))
                    progress = True

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
            self._pending.append((hop, message))
            self._effects.undo(self._pending.pop)

    # -- links ------------------------------------------------------------------------------------

    def _resend_input(self, peer: int) -> Callable[[Engine], None]:
        return lambda _engine: self.resend(peer)

    def resend(self, peer: int) -> None:
        """The link to ``peer`` is (back) up: send everything it has not acknowledged, in order.

        Also acknowledges again what this server delivered from ``peer``: acknowledgements are
        cumulative and idempotent, and one lost with a connection would otherwise keep the
        peer's queue full until the next message comes.
        """
        frames = [
            encode_data(seq, domain, stamp, message)
            for domain in self._links_of.get(peer, ())
            for seq, (stamp, message) in self._qout[peer, domain].items()
        ]
        # The queues include what this group staged for the peer: send it once, in order.
        old = self._frames.get(peer)
        self._frames[peer] = frames
        if old is None:
            self._effects.undo(self._frames.pop, peer, None)
        else:
            self._effects.undo(self._frames.__setitem__, peer, old)
        self._effects.after_commit_once(self._flush)
        for domain in self._links_of.get(peer, ()):
            delivered = self.clocks[domain].received_from(self._index[domain][peer])
            if delivered:
                self._ack((peer, domain), delivered)

    def depths(self) -> dict[str, Any]:
        """Queue depths for status views (engine thread)."""
        outgoing: dict[int, int] = {}
        for (peer, _domain), queue in self._qout.items():
            outgoing[peer] = outgoing.get(peer, 0) + len(queue)
        return {
            "outgoing": outgoing,
            "held_back": sum(len(w) for w in self._waiting.values()),
        }


def encode_data(seq: int, domain: str, stamp: bytes, message: Message) -> bytes:
    """The data frame carrying ``message`` as number ``seq`` of its link in ``domain``."""
    name = domain.encode()
    sender, target = message.sender, message.target
    head = _DATA.pack(DATA, seq, *sender, *target, len(name), len(stamp))
    return b"".join((head, name, stamp, message.body))


def decode_data(payload: bytes) -> tuple[int, str, bytes, Message]:
    """Take a data frame apart: ``(seq, domain, stamp, message)``; ``ValueError`` if malformed.

    The body is vetted here, on the server that received it, so that whatever later unpickles
    it (this server's engine, or the next hop's) only ever sees bytes that passed the check.
    """
    if len(payload) < _DATA.size or payload[:1] != DATA:
        raise ValueError(f"not a data frame ({len(payload)} bytes, kind {payload[:1]!r})")
    _kind, seq, *ids, name_len, stamp_len = _DATA.unpack_from(payload)
    start = _DATA.size
    body_at = start + name_len + stamp_len
    if body_at >= len(payload):
        raise ValueError(f"data frame of {len(payload)} bytes is shorter than its fields")
    domain = payload[start : start + name_len].decode("utf-8")  # UnicodeError is a ValueError
    body = payload[body_at:]
    vet_body(body)
    message = Message(AgentId(*ids[:3]), AgentId(*ids[3:]), body)
    return seq, domain, payload[start + name_len : body_at], message
