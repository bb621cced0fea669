"""The QoS 1/2 flows of one MQTT connection and the order of its answers, sans-IO.

:class:`QosFlows` knows nothing of sockets, threads, clocks or the store. Its owner (the
connection, :mod:`aaabus.mqtt.connection`) tells it what the device sent (a PUBLISH, PUBACK,
PUBREC, PUBREL, PUBCOMP), what the server sends (a delivery at QoS 0, 1 or 2, a PUBREL
resent after a reconnection) and when a commit it asked for is durable; it answers with a
:class:`Step`: what to commit to the store, if anything, and the bytes to write, in the
order MQTT requires.

Every change of a packet identifier's flow is in :data:`FLOWS`, keyed by the flow's state and
the event; the value is the next state and what the owner must :class:`Do`. The table is the
documentation: docs/mqtt.md shows it. Two directions, two sets of identifiers:

- **Inbound** (the device's packet ids). QoS 1: PUBLISH is committed, PUBACK answers it once
  durable. QoS 2: PUBLISH is committed, PUBREC answers it once durable, PUBREL is answered by
  PUBCOMP. A session that ends with its connection and resumed nothing (``volatile``) keeps its
  QoS 2 identifiers here (``RECEIVED`` until PUBREL: a retransmitted PUBLISH is answered, not
  published again); a stored session's identifiers are in the store (``STORED``: the store
  publishes a QoS 2 PUBLISH once per identifier and forgets it at PUBREL, whose PUBCOMP
  follows once that is durable). A PUBREL for an identifier not awaiting one is answered with
  PUBCOMP: the flow finished before (MQTT's receiver answers a retransmitted PUBREL so).
- **Outbound** (ours, fixed per backlog item). QoS 1: PUBLISH, PUBACK finishes it. QoS 2:
  PUBLISH, PUBREC is committed (the store then resends PUBREL, not the message), PUBREL once
  durable, PUBCOMP finishes it. A PUBREC with an error reason (5.0, >= 0x80) finishes it
  too. An acknowledgement for an identifier not in flight, or of the wrong kind, is ignored:
  a late duplicate (the flow finished) or a confused device; the delivery stays in flight and
  is sent again at the next connection.

**Answer order.** MQTT wants a connection's answers (PUBACK, PUBREC, PUBCOMP, SUBACK, UNSUBACK,
PINGRESP) in the order of the packets they answer, while the commits behind them may become
durable out of order. So each answer has a slot, reserved when its packet is taken
(:meth:`QosFlows.reserve`), filled when its answer is known, and only the filled prefix goes out
(:meth:`QosFlows.ready`). The server's own steps of an outbound flow (PUBREL) answer nothing of
the device's and go out at once.

**Windows.** Outbound: at most ``window`` deliveries in flight (the device's Receive Maximum,
or ``aaabus.mqtt.inflight``): :meth:`QosFlows.room`. Inbound (5.0): the device may leave at
most our Receive Maximum unacknowledged, one more is a protocol error (0x93,
:class:`~aaabus.mqtt.terms.InboundWindow`); a 5.0 PUBLISH's topic alias is resolved here too.
Backlog items finish out of order (QoS 0 at once, QoS 1/2 at their last acknowledgement): the
device has every item up to :attr:`QosFlows.acked`, the prefix of finished ones, which is what
the owner commits.

Violations raise :class:`~aaabus.errors.MqttProtocolError` (its ``code``: the 5.0 reason);
an event the table does not have for a server's own step is a bug of the owner
(:class:`RuntimeError`).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq
from aaabus.mqtt.protocol import MqttProtocol
from aaabus.mqtt.terms import InboundWindow, TopicAliases

__all__ = ["FLOWS", "Do", "Flow", "QosFlows", "Slot", "Step"]


class Flow(enum.Enum):
    """The state of one packet identifier's flow."""

    #: Not in use: no flow (inbound on a volatile session, or outbound).
    FREE = "free"
    #: Inbound QoS 2, volatile session: PUBLISH taken, PUBREC given or coming, PUBREL awaited.
    RECEIVED = "received"
    #: Inbound, stored session: the store holds the QoS 2 identifiers.
    STORED = "stored"
    #: Outbound QoS 1: PUBLISH sent, PUBACK awaited.
    AWAIT_PUBACK = "await-puback"
    #: Outbound QoS 2: PUBLISH sent, PUBREC awaited.
    AWAIT_PUBREC = "await-pubrec"
    #: Outbound QoS 2: PUBREC being committed; PUBREL once durable.
    RELEASING = "releasing"
    #: Outbound QoS 2: PUBREL sent, PUBCOMP awaited.
    AWAIT_PUBCOMP = "await-pubcomp"


class Do(enum.Enum):
    """What the owner does after an event."""

    NOTHING = "nothing"
    #: Commit the PUBLISH; its PUBACK/PUBREC fills the reserved slot once durable.
    PUBLISH = "publish"
    #: Commit the QoS 2 PUBLISH with its identifier (the store publishes it once per id).
    PUBLISH_ONCE = "publish-once"
    #: Answered already (a retransmitted QoS 2 PUBLISH's PUBREC, a volatile PUBREL's PUBCOMP).
    ANSWERED = "answered"
    #: Commit the PUBREL (the store forgets the identifier); PUBCOMP once durable.
    RELEASE = "release"
    #: Commit the device's PUBREC (the backlog item is the device's but for PUBREL).
    RECEIVE = "receive"
    #: Write the PUBREL in :attr:`Step.data`.
    SEND_PUBREL = "send-pubrel"
    #: The delivery is the device's: the cumulative acknowledgement may move.
    FINISH = "finish"
    #: Not this identifier's flow (unknown, finished, or a kind it does not await).
    IGNORE = "ignore"


_F, _RCV, _ST = Flow.FREE, Flow.RECEIVED, Flow.STORED
_PA, _PR, _RL, _PC = Flow.AWAIT_PUBACK, Flow.AWAIT_PUBREC, Flow.RELEASING, Flow.AWAIT_PUBCOMP

#: (state, event) -> (next state, what the owner does). Inbound events (the device's PUBLISH
#: at QoS 1 or 2, its PUBREL; ``refused``: our PUBREC carries an error, which ends the flow) on
#: the states FREE, RECEIVED, STORED; outbound events (``send1``, ``send2``: a delivery at that
#: QoS; ``resend-PUBREL``: an item the device had received before; the device's PUBACK, PUBREC,
#: ``PUBREC-error`` (>= 0x80), PUBCOMP; ``durable``: a PUBREC's commit) on FREE and the AWAIT
#: and RELEASING states. The only place a flow's state changes.
FLOWS: dict[tuple[Flow, str], tuple[Flow, Do]] = {
    # inbound, volatile session
    (_F, "PUBLISH1"): (_F, Do.PUBLISH),
    (_F, "PUBLISH2"): (_RCV, Do.PUBLISH),
    (_F, "PUBREL"): (_F, Do.ANSWERED),
    (_F, "refused"): (_F, Do.NOTHING),
    (_RCV, "PUBLISH1"): (_RCV, Do.PUBLISH),  # another flow's id reused: QoS 1 has no state
    (_RCV, "PUBLISH2"): (_RCV, Do.ANSWERED),
    (_RCV, "PUBREL"): (_F, Do.ANSWERED),
    (_RCV, "refused"): (_F, Do.NOTHING),
    # inbound, stored session
    (_ST, "PUBLISH1"): (_ST, Do.PUBLISH),
    (_ST, "PUBLISH2"): (_ST, Do.PUBLISH_ONCE),
    (_ST, "PUBREL"): (_ST, Do.RELEASE),
    (_ST, "refused"): (_ST, Do.NOTHING),
    # outbound
    (_F, "send1"): (_PA, Do.NOTHING),
    (_F, "send2"): (_PR, Do.NOTHING),
    (_F, "resend-PUBREL"): (_PC, Do.SEND_PUBREL),
    (_F, "PUBACK"): (_F, Do.IGNORE),
    (_F, "PUBREC"): (_F, Do.IGNORE),
    (_F, "PUBREC-error"): (_F, Do.IGNORE),
    (_F, "PUBCOMP"): (_F, Do.IGNORE),
    (_F, "durable"): (_F, Do.NOTHING),  # the flow ended while its PUBREC was committed
    (_PA, "PUBACK"): (_F, Do.FINISH),
    (_PA, "PUBREC"): (_PA, Do.IGNORE),
    (_PA, "PUBREC-error"): (_PA, Do.IGNORE),
    (_PA, "PUBCOMP"): (_PA, Do.IGNORE),
    (_PR, "PUBACK"): (_PR, Do.IGNORE),
    (_PR, "PUBREC"): (_RL, Do.RECEIVE),
    (_PR, "PUBREC-error"): (_F, Do.FINISH),
    (_PR, "PUBCOMP"): (_PR, Do.IGNORE),
    (_RL, "PUBACK"): (_RL, Do.IGNORE),
    (_RL, "PUBREC"): (_RL, Do.IGNORE),  # its PUBREL follows when the first one is durable
    (_RL, "PUBREC-error"): (_RL, Do.IGNORE),
    (_RL, "PUBCOMP"): (_RL, Do.IGNORE),
    (_RL, "durable"): (_PC, Do.SEND_PUBREL),
    (_PC, "PUBACK"): (_PC, Do.IGNORE),
    (_PC, "PUBREC"): (_PC, Do.SEND_PUBREL),  # the device missed our PUBREL
    (_PC, "PUBREC-error"): (_PC, Do.IGNORE),
    (_PC, "PUBCOMP"): (_F, Do.FINISH),
}

#: An answer's place in the connection's order: filled (bytes; b"" for none) when known.
Slot = list[bytes | None]


@dataclass(slots=True)
class Step:
    """What the owner does after an event: ``do``; ``slot``: where the answer goes once the
    commit is durable (PUBLISH, PUBLISH_ONCE, RELEASE); ``data``: bytes to write now
    (SEND_PUBREL); ``seq``: the backlog item of an outbound flow."""

    do: Do
    slot: Slot | None = None
    data: bytes = b""
    seq: int = 0


_ACKS = {mq.PUBACK: "PUBACK", mq.PUBREC: "PUBREC", mq.PUBCOMP: "PUBCOMP"}


def _move(state: Flow, event: str) -> tuple[Flow, Do]:
    found = FLOWS.get((state, event))
    if found is None:  # the table has every event of the device's: this is the owner's
        raise RuntimeError(f"MQTT flow event {event!r} while {state.value}")
    return found


class QosFlows:
    """The QoS flows and the answer order of one connection (see the module docstring).

    ``proto`` encodes the answers in the device's version; ``window``: deliveries in flight at
    once. :meth:`settle` sets what the CONNECT agreed; :attr:`volatile` is False for a session
    the store keeps (set when it is opened).
    """

    __slots__ = (
        "_aliases",
        "_done",
        "_in_window",
        "_inbound",
        "_outbound",
        "_outstanding",
        "_slots",
        "acked",
        "proto",
        "volatile",
        "window",
    )

    def __init__(self, proto: MqttProtocol, window: int) -> None:
        self.proto = proto
        self.window = window
        self.volatile = True
        self._aliases: TopicAliases | None = None  # 5.0 only, as the window below
        self._in_window: InboundWindow | None = None
        self._inbound: dict[int, Flow] = {}  # volatile session: id -> RECEIVED
        self._outbound: dict[int, tuple[Flow, int]] = {}  # id -> (state, backlog seq)
        self._slots: deque[Slot] = deque()
        self._outstanding: deque[int] = deque()  # backlog seqs handed out, in order
        self._done: set[int] = set()  # finished seqs beyond the finished prefix
        #: Every backlog item up to this one is the device's.
        self.acked = 0

    def settle(self, window: int, receive_maximum: int, topic_aliases: int) -> None:
        """What the CONNECT agreed: ``window`` deliveries in flight; a 5.0 device's own
        publications bounded by our ``receive_maximum``, with up to ``topic_aliases``."""
        self.window = window
        if self.proto.version == mq.V5:
            self._aliases = TopicAliases(topic_aliases)
            self._in_window = InboundWindow(receive_maximum)

    # -- answers in order ----------------------------------------------------------------------

    def reserve(self) -> Slot:
        """A place for the answer to the packet taken now, after every earlier one."""
        slot: Slot = [None]
        self._slots.append(slot)
        return slot

    def answer(self, data: bytes) -> None:
        """An answer known now: it goes out after the earlier ones."""
        self.reserve()[0] = data

    def ready(self) -> list[bytes]:
        """The answers that may go out now: the filled prefix, in order."""
        out: list[bytes] = []
        slots = self._slots
        while slots and slots[0][0] is not None:
            data = slots.popleft()[0]
            if data:
                out.append(data)
        return out

    # -- inbound: the device's PUBLISH and PUBREL -----------------------------------------------

    def arrive(self, packet: mc.Publish) -> str:
        """A PUBLISH arrived: its topic name (5.0: the alias resolved) after counting it in our
        Receive Maximum. Raises :class:`MqttProtocolError` (0x94, 0x93, 0x82)."""
        if self._aliases is None or self._in_window is None:
            return packet.topic
        topic = self._aliases.resolve(packet)
        self._in_window.received(packet.qos, packet.packet_id)
        return topic

    def refuse(self, packet: mc.Publish, code: int) -> None:
        """``packet`` is not published (an ACL, a bad payload): a QoS 1/2 one is answered now
        with 5.0 reason ``code`` (3.1.1 has none to say); its flow ends there."""
        if packet.qos:
            kind = mq.PUBACK if packet.qos == 1 else mq.PUBREC
            self.answer(self.proto.ack(kind, packet.packet_id or 0, code))
            self._inbound_over(packet.qos, packet.packet_id or 0)

    def publish(self, qos: int, packet_id: int) -> Step:
        """An accepted PUBLISH at ``qos`` 1 or 2: commit it (PUBLISH, PUBLISH_ONCE; then
        :meth:`published`) or nothing (ANSWERED: a QoS 2 retransmission, answered)."""
        state = self._in_state(packet_id)
        nxt, do = _move(state, f"PUBLISH{qos}")
        self._in_set(packet_id, nxt)
        if do is Do.ANSWERED:
            self.answer(self.proto.ack(mq.PUBREC, packet_id))
            return Step(do)
        return Step(do, self.reserve())

    def published(self, step: Step, qos: int, packet_id: int, code: int) -> None:
        """The PUBLISH of ``step`` is durable: its answer (5.0 reason ``code``) fills its slot.
        A QoS 1 flow ends here, a QoS 2 one too if ``code`` is an error."""
        assert step.slot is not None
        step.slot[0] = self.proto.ack(mq.PUBACK if qos == 1 else mq.PUBREC, packet_id, code)
        if qos == 2 and code >= 0x80:
            self._in_set(packet_id, _move(self._in_state(packet_id), "refused")[0])
        if qos == 1 or code >= 0x80:
            self._inbound_over(qos, packet_id)

    def release(self, packet_id: int) -> Step:
        """The device's PUBREL: answered now (ANSWERED) or once the store forgot the identifier
        (RELEASE; then :meth:`released`)."""
        self._inbound_over(2, packet_id)  # the PUBCOMP is produced now or when durable
        nxt, do = _move(self._in_state(packet_id), "PUBREL")
        self._in_set(packet_id, nxt)
        if do is Do.ANSWERED:
            self.answer(self.proto.ack(mq.PUBCOMP, packet_id))
            return Step(do)
        return Step(do, self.reserve())

    def released(self, step: Step, packet_id: int) -> None:
        """The PUBREL of ``step`` is durable: its PUBCOMP fills its slot."""
        assert step.slot is not None
        step.slot[0] = self.proto.ack(mq.PUBCOMP, packet_id)

    def _in_state(self, packet_id: int) -> Flow:
        return self._inbound.get(packet_id, _F) if self.volatile else _ST

    def _in_set(self, packet_id: int, state: Flow) -> None:
        if state is _RCV:
            self._inbound[packet_id] = state
        elif state is _F:
            self._inbound.pop(packet_id, None)

    def _inbound_over(self, qos: int, packet_id: int) -> None:
        if self._in_window is not None:
            self._in_window.finished(qos, packet_id)

    # -- outbound: deliveries and the device's acknowledgements --------------------------------

    @property
    def in_flight(self) -> int:
        """Deliveries sent at QoS 1/2 and not finished."""
        return len(self._outbound)

    def room(self) -> bool:
        """Whether one more delivery may go out at QoS 1/2."""
        return len(self._outbound) < self.window

    def handed(self, seq: int) -> None:
        """Backlog item ``seq`` is handed to the device (or skipped): it counts in
        :attr:`acked` once it and every earlier one are finished."""
        self._outstanding.append(seq)

    def sent(self, seq: int, packet_id: int, qos: int) -> Step:
        """Item ``seq`` went out as PUBLISH ``packet_id`` at ``qos`` 1 or 2."""
        return self._out_start(seq, packet_id, f"send{qos}")

    def resend_release(self, seq: int, packet_id: int) -> Step:
        """Item ``seq`` was received by the device at an earlier connection: its flow goes on
        with PUBREL (in :attr:`Step.data`, to write)."""
        return self._out_start(seq, packet_id, "resend-PUBREL")

    def _out_start(self, seq: int, packet_id: int, event: str) -> Step:
        # Ids are the seqs modulo 65535: one still in flight 65535 items later belongs to a
        # device that left it unacknowledged all along. Its flow is dropped (the item stays
        # unfinished, so the backlog keeps it for the next connection), as it always was.
        return self._out_move(packet_id, seq, _F, event)

    def acknowledged(self, packet: mc.Ack) -> Step:
        """The device's PUBACK, PUBREC or PUBCOMP: FINISH (then :meth:`finished`), RECEIVE
        (commit, then :meth:`received`), SEND_PUBREL, or IGNORE."""
        pid = packet.packet_id
        event = _ACKS[packet.kind]
        if packet.kind == mq.PUBREC and packet.code >= 0x80:  # 5.0: the flow ends
            event = "PUBREC-error"
        state, seq = self._outbound.get(pid, (_F, 0))
        return self._out_move(pid, seq, state, event)

    def received(self, seq: int, packet_id: int) -> Step:
        """The device's PUBREC for item ``seq`` is durable: SEND_PUBREL, or NOTHING if its flow
        ended meanwhile."""
        state, now = self._outbound.get(packet_id, (_F, 0))
        if state is not _RL or now != seq:  # the flow ended (and the id may be another's)
            return Step(_move(_F, "durable")[1], seq=seq)
        return self._out_move(packet_id, seq, state, "durable")

    def _out_move(self, packet_id: int, seq: int, state: Flow, event: str) -> Step:
        nxt, do = _move(state, event)
        if nxt is _F:
            self._outbound.pop(packet_id, None)
        else:
            self._outbound[packet_id] = (nxt, seq)
        if do is Do.SEND_PUBREL:
            return Step(do, data=self.proto.ack(mq.PUBREL, packet_id), seq=seq)
        return Step(do, seq=seq)

    def finished(self, seq: int) -> bool:
        """Item ``seq`` is the device's: True if :attr:`acked` moved (over the prefix of
        finished items: QoS 1/2 flows may finish out of order, QoS 0 at once)."""
        before = self.acked
        self._done.add(seq)
        outstanding, done = self._outstanding, self._done
        while outstanding and outstanding[0] in done:
            self.acked = outstanding.popleft()
            done.discard(self.acked)
        return self.acked != before

    def finished_set(self) -> frozenset[int]:
        """The items finished beyond :attr:`acked` (the connection's end hands them on)."""
        return frozenset(self._done)
