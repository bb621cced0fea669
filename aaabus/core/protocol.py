"""The channel's protocol rules, sans-IO: stamping, acknowledgements, resends, hold-back.

In the manner of h11, :class:`LinkProtocol` owns the state of this server's links (the matrix
clock of each domain, each link's outgoing queue, the held-back messages) and turns what happens
into what to do: a message to send becomes a frame, a received frame becomes a sequence of
:class:`Deliver` and :class:`SendAck` events, a link coming up becomes the frames to send again.
It opens no socket, starts no thread, knows no engine and commits nothing: the caller
(:class:`aaabus.core.channel.Channel`, on the engine thread, inside a ZODB transaction) carries
the events out and the transaction makes them atomic. Its state objects are persistent (they live
in the store), but they work the same detached, which is how the tests drive it.

The rules:

* a link is a (peer, domain) pair; its sequence number is the clock entry ``H[me][peer]``, bumped
  by every stamp, which names a message uniquely across restarts of either side;
* the messages one event (a reaction, an input) sends are stamped together: counted in the clock
  before any is stamped, so that each carries its siblings (a reaction is one clock event);
* a received frame is tested against the domain's clock: DELIVER (then the held-back messages
  that became deliverable, in turn), WAIT (held back, once, keyed by (peer, seq)) or DUPLICATE
  (ignored: a resend of something delivered);
* the messages of one event on one link are delivered together, in order, with nothing in
  between: a deliverable one whose event sent more to this server (the stamp's link counter,
  :meth:`DomainClock.event_end`, is beyond its seq) is held until the rest has come. Delivered
  alone, it could be acted on (by an agent here, or by this server as a router forwarding it
  into another domain) before the rest arrives, and that act would overtake them although
  they were sent in the same event as the message it follows;
* while such an event arrives in order on its link (the usual case: a reaction's burst, sent in
  one write), its messages are gathered in memory, not in the persistent held-back set, and
  delivered with one clock merge when the last one comes. Nothing gathered is acknowledged,
  so nothing is lost with memory: a crash, or a frame that breaks the order, sends the link
  back to the held-back set and the sender's resends (the gathered messages move there first);
* acknowledgements are cumulative and cover only the unbroken run delivered from that peer,
  ``H[peer][me]``: a frame ahead of a gap never vouches for the gap;
* an acknowledgement up to ``n`` drops the link's queued messages through ``n``;
* when a link comes (back) up, everything still queued for the peer is sent again, in order, and
  what was delivered from it is acknowledged again (both idempotent).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

from aaabus.core.clock import DomainClock, Verdict
from aaabus.errors import ClockError
from aaabus.wire.linkframes import (
    data_frame_overhead,
    data_frame_size,
    decode_data,
    encode_data,
    encode_state,
)
from aaabus.wire.message import Message

if TYPE_CHECKING:
    from BTrees.OOBTree import OOBTree

    from aaabus.core.failpoints import Failpoints
    from aaabus.core.store import PersistentQueue
    from aaabus.core.trace import Tracer

__all__ = ["Deliver", "LinkProtocol", "SendAck"]

# Bytes of a frame's session envelope (sequence number and MAC) on top of the data frame.
_SESSION_ROOM = 64


# Named tuples rather than frozen dataclasses: one of each is made per message received, and a
# frozen dataclass's __init__ (one object.__setattr__ per field) costs twice as much.
class Deliver(NamedTuple):
    """``message`` is causally deliverable here (to a local agent, or on to its next hop)."""

    message: Message


class SendAck(NamedTuple):
    """Tell ``peer`` that everything of its link in ``domain`` up to ``upto`` is stored here."""

    peer: int
    domain: str
    upto: int


# What a named tuple's own __new__ ends in, called directly on the paths taken once per message
# received (see aaabus.wire.linkframes.decode_data).
_new = tuple.__new__


@dataclass
class _Gathering:
    """The messages of one event received so far, in order, on one link (see the rules)."""

    src: int  # the peer's index in the domain's clock
    stamp: bytes  # the event's stamp, shared by its siblings on the link
    first: int  # seq of the first message gathered
    end: int  # seq of the event's last message on the link (its stamp's link counter)
    messages: list[Message] = field(default_factory=list)

    @property
    def next(self) -> int:
        return self.first + len(self.messages)


class LinkProtocol:
    """The link state of one server and the rules above (one thread at a time: the engine's)."""

    def __init__(
        self,
        me: int,
        members: Mapping[str, tuple[int, ...]],
        clocks: Mapping[str, DomainClock],
        waiting: Mapping[str, OOBTree],
        qout: Mapping[tuple[int, str], PersistentQueue],
        *,
        max_frame: int = 16 << 20,
        failpoints: Failpoints | None = None,
        tracer: Tracer | None = None,
        undo: Callable[..., Any] | None = None,
    ) -> None:
        """``members``: the servers of each domain of ``me``, in clock order; ``clocks``,
        ``waiting`` (held-back messages) and ``qout`` (per (peer, domain)): the link state.

        ``undo(fn, *args)`` records how to take back a change of the protocol's only volatile
        state (events being gathered) if the caller's transaction rolls back
        (:meth:`aaabus.core.effects.TransactionEffects.undo`); None: nothing rolls back."""
        self.me = me
        self.max_frame = max_frame
        self.clocks = clocks
        self._index = {d: {sid: i for i, sid in enumerate(ms)} for d, ms in members.items()}
        self._waiting = waiting
        self._qout = qout
        self._links_of: dict[int, list[str]] = {}
        for peer, domain in qout:
            self._links_of.setdefault(peer, []).append(domain)
        self._failpoints = failpoints
        self.tracer = tracer
        self._undo = undo
        #: Per domain, the largest body a frame can carry whatever its stamp (check_size).
        self._body_room: dict[str, int] = {}
        #: Events being gathered in memory, per link (peer, domain).
        self._gathering: dict[tuple[int, str], _Gathering] = {}

    def _hit(self, step: str) -> None:
        if self._failpoints is not None and self._failpoints.armed:
            self._failpoints.hit(step)

    # -- sending ---------------------------------------------------------------------------------

    def check_size(self, domain: str, message: Message) -> None:
        """Raise ``ValueError`` if ``message`` might not fit a frame in ``domain``.

        Called when a reaction sends, before anything is counted, so that the sending reaction
        fails and its sender hears of it: the bound allows for the largest stamp the domain's
        clock can make, since the actual stamp is only made when the event is sealed.
        """
        room = self._body_room.get(domain)
        if room is None:
            # The largest stamp a clock can make depends on its mode and size only, both fixed.
            largest = self.clocks[domain].max_stamp_size()
            room = self._body_room[domain] = (
                self.max_frame - _SESSION_ROOM - data_frame_overhead(domain, largest)
            )
        if len(message.body) > room:
            size = data_frame_size(domain, self.clocks[domain].max_stamp_size(), message)
            raise ValueError(
                f"notification to {message.target} is up to {size} bytes on the wire, over the "
                f"bus limit of {self.max_frame} (property aaabus.max_frame)"
            )

    def stamp_event(self, sends: list[tuple[int, str, Message]]) -> list[tuple[int, bytes]]:
        """Stamp the messages one event sends, ``(peer, domain, message)`` each, as one clock
        event; queue each on its link; ``(peer, frame)`` per message, in the order of ``sends``.

        Per domain, every message is counted in the clock before any is stamped
        (:meth:`DomainClock.prepare_sends`), so each stamp carries its siblings: whatever a
        receiver of one sends afterwards is causally after all of them. Raises ``ValueError``
        when a frame exceeds the bus limit (only a router re-stamping into a larger domain can
        get past :meth:`check_size`); the clock has then counted the event, so the caller's
        transaction must roll back (the input that delivered the message fails).
        """
        by_domain: dict[str, list[int]] = {}
        for i, (_peer, domain, _message) in enumerate(sends):
            by_domain.setdefault(domain, []).append(i)
        frames: list[tuple[int, bytes]] = [(0, b"")] * len(sends)
        tracer = self.tracer
        for domain, positions in by_domain.items():
            index = self._index[domain]
            t0 = time.perf_counter_ns() if tracer is not None else 0
            stamped = self.clocks[domain].prepare_sends([index[sends[i][0]] for i in positions])
            if tracer is not None:
                each = (time.perf_counter_ns() - t0) // len(positions)
                for i, (_seq, stamp) in zip(positions, stamped, strict=True):
                    tracer.stamped(domain, sends[i][0], len(stamp), each)
            for i, (seq, stamp) in zip(positions, stamped, strict=True):
                peer, _domain, message = sends[i]
                frame = encode_data(seq, domain, stamp, message)
                if len(frame) > self.max_frame - _SESSION_ROOM:
                    raise ValueError(
                        f"notification to {message.target} is {len(frame)} bytes on the wire "
                        f"in domain {domain}, over the bus limit of {self.max_frame} "
                        "(property aaabus.max_frame)"
                    )
                # Kept as the frame itself: one bytes object to pickle at the commit (a tuple
                # of stamp and message costs ZODB a callback per part) and a resend that sends
                # it as it is.
                self._qout[peer, domain][seq] = frame
                frames[i] = (peer, frame)
        return frames

    def stamp(self, peer: int, domain: str, message: Message) -> bytes:
        """Stamp ``message`` alone (an event that sends only it), queue it; its frame.

        Same failure rule as :meth:`stamp_event`, after the early :meth:`check_size`.
        """
        self.check_size(domain, message)
        return self.stamp_event([(peer, domain, message)])[0][1]

    def acknowledged(self, peer: int, domain: str, upto: int) -> None:
        """``peer`` has stored all we sent it in ``domain`` up to ``upto``: forget those."""
        queue = self._qout.get((peer, domain))
        if queue is not None:
            queue.pop_through(upto)

    # -- receiving -------------------------------------------------------------------------------

    def receive(self, peer: int, payload: bytes) -> Iterator[Deliver | SendAck]:
        """The events of one data frame from ``peer``, in the order they must be carried out.

        A generator: each event is computed after the previous one was handled, so a caller
        that re-stamps a delivered message (a router) sees the clocks as the rules left them.
        Raises ``ValueError`` for a malformed frame, a domain not shared or a refused stamp.
        """
        try:
            seq, domain, stamp, message = decode_data(payload)
        except ValueError as exc:
            raise ValueError(f"bad frame from server {peer}: {exc}") from None
        clock = self.clocks.get(domain)
        index = self._index.get(domain, {})
        if clock is None or peer not in index:
            raise ValueError(f"server {peer} sent a message in domain {domain!r} it does not share")
        src = index[peer]
        tracer = self.tracer
        failpoints = self._failpoints
        armed = failpoints is not None and failpoints.armed
        if armed:
            self._hit("channel.clock_test")
        t0 = time.perf_counter_ns() if tracer is not None else 0
        link = (peer, domain)
        gathering = self._gathering.get(link)
        if gathering is not None:
            if seq == gathering.next and stamp == gathering.stamp:
                # The next sibling, in order: the clock was tested on the first (it can only
                # have moved forward since, within this transaction or a later one).
                if tracer is not None:
                    tracer.tested(domain, peer, Verdict.WAIT.value, time.perf_counter_ns() - t0)
                if armed:
                    self._hit("channel.hold_back")
                yield from self._gather(link, gathering, message)
                return
            self._spill(link, gathering)  # out of order: the held-back set takes over
        waiting = self._waiting[domain]
        run: list[tuple[int, bytes, Message]] | None = None
        gather = 0  # the end of an event to gather, starting with this message
        try:
            end = clock.event_end(src, stamp)
            if end == seq:  # the usual case: its event sent nothing else here; test and merge
                verdict = clock.receive(src, stamp, seq)
            else:
                verdict = clock.check(src, stamp, seq)
                if verdict is Verdict.DELIVER:
                    run = self._run(domain, peer, src, seq, stamp)
                    if run is None:
                        verdict = Verdict.WAIT  # the rest of its event here is still to come
                        gather = end
        except ClockError as exc:
            raise ValueError(f"bad stamp from server {peer}: {exc}") from None
        if tracer is not None:
            tracer.tested(domain, peer, verdict.value, time.perf_counter_ns() - t0)
        if gather:
            # The first of its event, deliverable but for its siblings: gather them as they
            # come, in memory (a sibling already held back joins when its turn comes).
            self._hit("channel.hold_back")
            started = _Gathering(src, bytes(stamp), seq, gather)
            self._set_gathering(link, started)
            yield from self._gather(link, started, message)
            return
        if verdict is Verdict.DELIVER:
            if run is None:
                yield _new(Deliver, (message,))
            else:
                yield from self._deliver_run(domain, peer, src, [(seq, stamp, message), *run])
            if waiting:
                yield from self._retry(domain)
        elif verdict is Verdict.WAIT:
            self._hit("channel.hold_back")
            key = (peer, seq)
            if key not in waiting:
                waiting[key] = (src, stamp, message)
            # It may complete an event whose first message on the link is held for it. Looked
            # at only once the event's last message is here (in order, the one that completes
            # it): scanning on every arrival would make an event of n messages cost n² checks.
            first = clock.received_from(src) + 1
            head = waiting.get((peer, first)) if seq > first else None
            if head is not None:
                end = clock.event_end(src, head[1])
                if end >= seq and (peer, end) in waiting:
                    yield from self._complete(domain, peer, src, first, head)
        # Acks are cumulative, so they may only cover an unbroken run: everything this link
        # delivered, which is H[peer][me]. A held-back frame is stored too, but a frame ahead of
        # a gap must not vouch for the gap (the sender would drop what we never got); it is
        # acknowledged once delivered, and meanwhile a resend of it is recognised and ignored.
        yield _new(SendAck, (peer, domain, clock.received_from(src)))

    def _gather(
        self, link: tuple[int, str], gathering: _Gathering, message: Message
    ) -> Iterator[Deliver | SendAck]:
        """Add the next message of the event being gathered on ``link``; the last one delivers
        them all, with one clock merge, then whatever that unblocks."""
        messages = gathering.messages
        messages.append(message)
        if self._undo is not None:
            self._undo(messages.pop)
        peer, domain = link
        if gathering.first + len(messages) <= gathering.end:  # gathering.next, inlined
            # Nothing new on this link is delivered yet: the first sibling answers with what
            # was (idempotent); the next ones would only repeat it, once per message.
            if len(messages) == 1:
                yield _new(SendAck, (peer, domain, gathering.first - 1))
            return
        self._set_gathering(link, None)
        clock = self.clocks[domain]
        try:
            clock.deliver_event(gathering.src, gathering.stamp, gathering.first, gathering.end)
        except ClockError as exc:  # the first was deliverable, and clocks only move forward
            raise ValueError(f"gathered event from server {peer} refused: {exc}") from None
        for gathered in messages:
            yield _new(Deliver, (gathered,))
        waiting = self._waiting[domain]
        if waiting:
            for seq in range(gathering.first, gathering.end + 1):
                waiting.pop((peer, seq), None)  # copies held back before the gathering began
            yield from self._retry(domain)
        yield SendAck(peer, domain, clock.received_from(gathering.src))

    def _spill(self, link: tuple[int, str], gathering: _Gathering) -> None:
        """Move an event being gathered to the held-back set (a frame broke the order)."""
        self._set_gathering(link, None)
        peer, domain = link
        waiting = self._waiting[domain]
        for seq, message in enumerate(gathering.messages, gathering.first):
            if (peer, seq) not in waiting:
                waiting[peer, seq] = (gathering.src, gathering.stamp, message)

    def _set_gathering(self, link: tuple[int, str], gathering: _Gathering | None) -> None:
        old = self._gathering.pop(link, None)
        if gathering is not None:
            self._gathering[link] = gathering
        if self._undo is not None:
            self._undo(self._restore_gathering, link, old)

    def _restore_gathering(self, link: tuple[int, str], old: _Gathering | None) -> None:
        if old is None:
            self._gathering.pop(link, None)
        else:
            self._gathering[link] = old

    def _complete(
        self, domain: str, peer: int, src: int, first: int, head: tuple[int, bytes, Message]
    ) -> Iterator[Deliver | SendAck]:
        """Deliver the held event that starts at ``first`` on the link from ``peer`` if it is
        whole and deliverable, then whatever that unblocks."""
        _src, stamp, message = head
        if self.clocks[domain].check(src, stamp, first) is not Verdict.DELIVER:
            return  # it waits for something else too: a later delivery retries it
        run = self._run(domain, peer, src, first, stamp)
        if run is None:
            return
        yield from self._deliver_run(domain, peer, src, [(first, stamp, message), *run])
        if self._waiting[domain]:
            yield from self._retry(domain)

    def _run(
        self, domain: str, peer: int, src: int, seq: int, stamp: bytes
    ) -> list[tuple[int, bytes, Message]] | None:
        """The held messages that must be delivered right after message ``seq`` from ``peer``
        (deliverable): the rest of its event on this link, in order; None while one of them is
        missing. A reaction is one clock event: delivering part of it, then acting, would let
        that act overtake the rest (:meth:`DomainClock.prepare_sends`)."""
        end = self.clocks[domain].event_end(src, stamp)
        waiting = self._waiting[domain]
        run = []
        for later in range(seq + 1, end + 1):
            held = waiting.get((peer, later))
            if held is None:
                return None
            run.append((later, held[1], held[2]))
        return run

    def _deliver_run(
        self, domain: str, peer: int, src: int, run: list[tuple[int, bytes, Message]]
    ) -> Iterator[Deliver]:
        """Deliver one event's messages on one link, in order, with nothing in between."""
        clock = self.clocks[domain]
        waiting = self._waiting[domain]
        for seq, stamp, message in run:
            # Each is the next on its link, and its stamp is its first sibling's (or one that
            # knows no more): ClockError here would be a bug, and fails the input.
            clock.deliver(src, stamp, seq)
            waiting.pop((peer, seq), None)
            yield Deliver(message)

    def _retry(self, domain: str) -> Iterator[Deliver | SendAck]:
        """Deliver every held-back message of ``domain`` that has become deliverable."""
        clock = self.clocks[domain]
        waiting = self._waiting[domain]
        progress = True
        while progress and waiting:
            progress = False
            for key, (src, stamp, message) in list(waiting.items()):
                if key not in waiting:
                    continue  # delivered in this pass, as part of an earlier one's event
                peer, seq = key
                verdict = clock.check(src, stamp, seq)
                if verdict is Verdict.WAIT:
                    continue
                if verdict is Verdict.DUPLICATE:
                    del waiting[key]
                    continue
                run = self._run(domain, peer, src, seq, stamp)
                if run is None:
                    continue
                yield from self._deliver_run(domain, peer, src, [(seq, stamp, message), *run])
                yield SendAck(peer, domain, clock.received_from(src))
                progress = True

    # -- links -----------------------------------------------------------------------------------

    def resend(self, peer: int) -> tuple[list[bytes], list[SendAck]]:
        """The link to ``peer`` is (back) up: every frame it has not acknowledged, in order, and
        the acknowledgements of what was delivered from it (one lost with a connection would
        otherwise keep the peer's queue full until the next message comes)."""
        frames = [
            frame
            for domain in self._links_of.get(peer, ())
            for _seq, frame in self._qout[peer, domain].items()
        ]
        acks = []
        for domain in self._links_of.get(peer, ()):
            delivered = self.clocks[domain].received_from(self._index[domain][peer])
            if delivered:
                acks.append(SendAck(peer, domain, delivered))
        return frames, acks

    def link_states(self, peer: int) -> list[bytes]:
        """What this store holds of each link with ``peer``: the frames a connection to it
        opens with, so that each side can tell whether the other's store forgot what it
        acknowledged or sent (:meth:`check_state`)."""
        states = []
        for domain in self._links_of.get(peer, ()):
            states.append(encode_state(domain, *self._link_counts(peer, domain)))
        return states

    def _link_counts(self, peer: int, domain: str) -> tuple[int, int, int]:
        """``(sent, acked, received)`` of the link with ``peer`` in ``domain``: messages
        stamped for it, how many of those it acknowledged (all before the oldest still queued),
        messages delivered from it."""
        clock = self.clocks[domain]
        src = self._index[domain][peer]
        sent = clock.sent_to(src)
        acked = sent
        for seq, _frame in self._qout[peer, domain].items():
            acked = seq - 1
            break
        return sent, acked, clock.received_from(src)

    def check_state(
        self, peer: int, domain: str, sent: int, acked: int, received: int
    ) -> list[str]:
        """Compare ``peer``'s announced link state (:meth:`link_states`) with this store's;
        each fact that shows one of the two stores older than the other, as a sentence.

        Both stores only ever move forward, and a server acknowledges only what it committed:
        so ``peer`` can never have seen more acknowledged by this server than this server
        delivered, nor have delivered more from it than this server stamped (and the same the
        other way round). When that fails, one of the two restarted on a store older than what
        it had committed (lost, replaced, restored from a backup): messages were acknowledged
        and dropped by their sender but never delivered, or sequence numbers are being used a
        second time, and the link can never deliver in causal order again by itself. An empty
        list when the two agree (or the domain is not one this server shares with ``peer``).
        """
        if peer not in self._index.get(domain, {}) or (peer, domain) not in self._qout:
            return []
        my_sent, my_acked, my_received = self._link_counts(peer, domain)
        facts = []
        if acked > my_received:
            facts.append(
                f"server {self.me}'s store is older than server {peer} remembers in domain "
                f"{domain}: server {self.me} acknowledged {acked} message(s) from it but its "
                f"store has delivered {my_received}; {_span(my_received + 1, acked)} lost and "
                f"everything server {peer} sends after them is held back"
            )
        if my_acked > received:
            facts.append(
                f"server {peer}'s store is older than server {self.me} remembers in domain "
                f"{domain}: it acknowledged {my_acked} message(s) from server {self.me} but "
                f"now says it delivered {received}; {_span(received + 1, my_acked)} lost and "
                "what follows them is held back there"
            )
        if my_received > sent:
            facts.append(
                f"server {peer}'s store is older than server {self.me} remembers in domain "
                f"{domain}: server {self.me} delivered {my_received} message(s) from it but it "
                f"says it sent {sent}; its next messages reuse numbers already delivered and "
                "would be dropped as duplicates"
            )
        if received > my_sent:
            facts.append(
                f"server {self.me}'s store is older than server {peer} remembers in domain "
                f"{domain}: server {peer} delivered {received} message(s) from server "
                f"{self.me} but its store says it sent {my_sent}; its next messages reuse "
                "numbers already delivered and would be dropped as duplicates"
            )
        return facts

    def depths(self) -> tuple[dict[int, int], int]:
        """Messages queued per peer (not yet acknowledged) and messages held back."""
        outgoing: dict[int, int] = {}
        for (peer, _domain), queue in self._qout.items():
            outgoing[peer] = outgoing.get(peer, 0) + len(queue)
        gathered = sum(len(g.messages) for g in self._gathering.values())
        return outgoing, gathered + sum(len(w) for w in self._waiting.values())


def _span(first: int, last: int) -> str:
    """``message 3 is`` or ``messages 2-6 are``: link numbers in a sentence."""
    return f"message {first} is" if first == last else f"messages {first}-{last} are"
