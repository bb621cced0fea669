"""The QoS flows of one MQTT connection, sans-IO (aaabus.mqtt.flows), driven without a socket:
the device's bytes go through the protocol (aaabus.mqtt.protocol), the flows say what to commit
and what to write, the test completes the commits in the order it chooses and reads the bytes
that would leave, for every QoS 1/2 flow in both directions, in 3.1.1 and 5.0."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest

from aaabus.errors import MqttProtocolError
from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq
from aaabus.mqtt.flows import FLOWS, Do, Flow, QosFlows, Step
from aaabus.mqtt.protocol import MqttProtocol
from tests.support.mqtt import connect_packet

WINDOW = 4
DOCS = Path(__file__).resolve().parent.parent / "docs" / "mqtt.md"
INBOUND = (Flow.FREE, Flow.RECEIVED, Flow.STORED)
OUTBOUND = (Flow.FREE, Flow.AWAIT_PUBACK, Flow.AWAIT_PUBREC, Flow.RELEASING, Flow.AWAIT_PUBCOMP)
ACKS = ("PUBACK", "PUBREC", "PUBREC-error", "PUBCOMP")


class Device:
    """One connection's protocol and flows, accepted, fed with the bytes a device sends."""

    def __init__(self, version: int = mq.V311, *, volatile: bool = True) -> None:
        self.proto = MqttProtocol(1 << 16)
        self.proto.receive(connect_packet(level=version, props=b"\x00" if version == 5 else b""))
        assert isinstance(self.proto.next_packet(), mc.Connect)
        self.proto.accept(False)
        self.flows = QosFlows(self.proto, WINDOW)
        self.flows.settle(WINDOW, WINDOW, 8)
        self.flows.volatile = volatile
        self.version = version

    def send(self, data: bytes) -> mc.Publish | mc.Ack:
        """The packet the device's ``data`` is, as the connection hands it to the flows."""
        self.proto.receive(data)
        packet = self.proto.next_packet()
        assert isinstance(packet, mc.Publish | mc.Ack)
        return packet

    def arrive(self, topic: str, qos: int, pid: int | None, alias: int = 0) -> mc.Publish:
        """The device's PUBLISH, its topic resolved and counted by the flows."""
        props = {mq.TOPIC_ALIAS: alias} if alias else None
        data = mc.encode_publish(topic, b"x", qos, False, False, pid, self.version, props)
        packet = self.send(data)
        assert isinstance(packet, mc.Publish)
        packet.topic = self.flows.arrive(packet)
        return packet

    def publish(self, pid: int, qos: int) -> Step:
        """The device's PUBLISH ``pid`` at ``qos`` 1 or 2, accepted: what the flows say."""
        self.arrive("t", qos, pid)
        return self.flows.publish(qos, pid)

    def ack(self, kind: int, pid: int, code: int = 0) -> Step:
        """The device's PUBACK, PUBREC, PUBREL or PUBCOMP ``pid``."""
        packet = self.send(mc.encode_ack(kind, pid, self.version, code))
        assert isinstance(packet, mc.Ack)
        if packet.kind == mq.PUBREL:
            return self.flows.release(pid)
        return self.flows.acknowledged(packet)

    def out(self) -> list[bytes]:
        return self.flows.ready()

    def answer(self, kind: int, pid: int, code: int = 0) -> bytes:
        return mc.encode_ack(kind, pid, self.version, code)


# -- the table -------------------------------------------------------------------------------


def test_the_table_has_every_event_of_every_state_and_reaches_every_state() -> None:
    for state in INBOUND:
        for event in ("PUBLISH1", "PUBLISH2", "PUBREL", "refused"):
            assert (state, event) in FLOWS, (state, event)
    for state in OUTBOUND:
        for event in ACKS:
            assert (state, event) in FLOWS, (state, event)
    reached = {nxt for nxt, _do in FLOWS.values()}
    assert reached == set(Flow)
    # Only the outbound table's send events leave FREE towards a flow awaiting the device.
    starts = {event for (state, event), (nxt, _do) in FLOWS.items() if state is Flow.FREE}
    assert {"send1", "send2", "resend-PUBREL"} <= starts


def test_the_table_in_the_docs_is_the_table_of_the_code() -> None:
    section = DOCS.read_text(encoding="utf-8").split("## The QoS flows, sans-IO", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \| `([\w-]+)` \| `(\w+)` \| `(\w+)` \|$", section, re.M)
    documented = {(Flow[s], e): (Flow[n], Do[d]) for s, e, n, d in rows}
    assert documented == FLOWS


def test_the_flows_reach_no_socket_loop_thread_or_store() -> None:
    import grimp

    graph = grimp.build_graph("aaabus", include_external_packages=True)
    below = graph.find_upstream_modules("aaabus.mqtt.flows")
    forbidden = {"asyncio", "socket", "ssl", "selectors", "threading", "ZODB", "transaction"}
    assert below & forbidden == set()
    assert [m for m in below if m.startswith(("aaabus.core", "aaabus.node"))] == []
    assert {"aaabus.mqtt.protocol", "aaabus.mqtt.codec"} <= below  # the graph was read


def test_an_event_the_table_lacks_is_the_owners_bug() -> None:
    dev = Device()
    dev.flows.volatile = False
    with pytest.raises(RuntimeError, match="'PUBLISH3' while stored"):
        dev.flows.publish(3, 9)


# -- inbound: the device publishes -------------------------------------------------------------


@pytest.mark.parametrize("version", [mq.V311, mq.V5])
def test_qos1_is_answered_puback_once_durable(version: int) -> None:
    dev = Device(version)
    step = dev.publish(5, 1)
    assert step.do is Do.PUBLISH
    assert dev.out() == []  # not durable yet: nothing leaves
    dev.flows.published(step, 1, 5, mq.NO_MATCHING_SUBSCRIBERS)
    # 5.0 says "no matching subscribers" (a success); 3.1.1 has no reason code.
    code = mq.NO_MATCHING_SUBSCRIBERS if version == mq.V5 else 0
    assert dev.out() == [dev.answer(mq.PUBACK, 5, code)]
    assert dev.out() == []


def test_a_qos2_publish_retransmitted_before_pubrel_is_answered_not_published_again() -> None:
    dev = Device()
    first = dev.publish(9, 2)
    assert first.do is Do.PUBLISH
    again = dev.publish(9, 2)
    assert again.do is Do.ANSWERED  # the retransmission is not committed
    assert dev.out() == []  # its PUBREC waits for the first one's
    dev.flows.published(first, 2, 9, 0)
    assert dev.out() == [dev.answer(mq.PUBREC, 9)] * 2
    assert dev.ack(mq.PUBREL, 9).do is Do.ANSWERED
    assert dev.out() == [dev.answer(mq.PUBCOMP, 9)]
    # After PUBREL the identifier is free: the same id is a new message.
    after = dev.publish(9, 2)
    assert after.do is Do.PUBLISH


def test_pubrel_for_an_unknown_id_is_answered_pubcomp() -> None:
    dev = Device(mq.V5)
    assert dev.ack(mq.PUBREL, 77).do is Do.ANSWERED
    assert dev.out() == [dev.answer(mq.PUBCOMP, 77)]


def test_a_stored_session_leaves_qos2_ids_to_the_store_and_answers_pubcomp_once_durable() -> None:
    dev = Device(volatile=False)
    step = dev.publish(3, 2)
    assert step.do is Do.PUBLISH_ONCE  # the store publishes it once per id
    again = dev.publish(3, 2)
    assert again.do is Do.PUBLISH_ONCE  # the store, not memory, knows it is a retransmission
    dev.flows.published(again, 2, 3, 0)
    assert dev.out() == []  # in order: the first PUBREC is not known yet
    dev.flows.published(step, 2, 3, 0)
    assert dev.out() == [dev.answer(mq.PUBREC, 3)] * 2
    release = dev.ack(mq.PUBREL, 3)
    assert release.do is Do.RELEASE
    assert dev.out() == []
    dev.flows.released(release, 3)
    assert dev.out() == [dev.answer(mq.PUBCOMP, 3)]


def test_a_refused_qos2_publish_ends_its_flow_at_pubrec() -> None:
    dev = Device(mq.V5)
    step = dev.publish(4, 2)
    dev.flows.published(step, 2, 4, mq.QUOTA_EXCEEDED)
    assert dev.out() == [dev.answer(mq.PUBREC, 4, mq.QUOTA_EXCEEDED)]
    # Nothing awaits a PUBREL: the id is free, the next PUBLISH with it is published.
    again = dev.publish(4, 2)
    assert again.do is Do.PUBLISH


@pytest.mark.parametrize("version", [mq.V311, mq.V5])
def test_a_publish_refused_before_commit_is_told_its_reason_in_5_0_only(version: int) -> None:
    dev = Device(version)
    packet = dev.arrive("t", 1, 6)
    dev.flows.refuse(packet, mq.NOT_AUTHORIZED)
    code = mq.NOT_AUTHORIZED if version == mq.V5 else 0
    assert dev.out() == [dev.answer(mq.PUBACK, 6, code)]


def test_answers_leave_in_packet_order_when_commits_complete_out_of_order() -> None:
    dev = Device()
    steps = [dev.publish(pid, 1) for pid in (1, 2, 3)]
    dev.flows.answer(b"\xd0\x00")  # a PINGRESP, known at once, after the three
    dev.flows.published(steps[2], 1, 3, 0)
    assert dev.out() == []
    dev.flows.published(steps[0], 1, 1, 0)
    assert dev.out() == [dev.answer(mq.PUBACK, 1)]
    dev.flows.published(steps[1], 1, 2, 0)
    assert dev.out() == [dev.answer(mq.PUBACK, 2), dev.answer(mq.PUBACK, 3), b"\xd0\x00"]


def test_a_failed_commit_leaves_no_answer_and_lets_the_next_ones_go() -> None:
    dev = Device()
    first = dev.publish(1, 1)
    second = dev.publish(2, 1)
    dev.flows.published(second, 1, 2, 0)
    assert first.slot is not None
    first.slot[0] = b""  # what the connection does before it ends on a failed commit
    assert dev.out() == [dev.answer(mq.PUBACK, 2)]


def test_answers_stay_in_order_whatever_the_order_of_commits() -> None:
    rng = random.Random(45)
    for _round in range(50):
        dev = Device(mq.V5, volatile=rng.random() < 0.5)
        pending: list[tuple[Step, int, int]] = []
        expected: list[bytes] = []
        for pid in range(1, rng.randint(2, WINDOW) + 1):
            qos = rng.choice((1, 2))
            pending.append((dev.publish(pid, qos), qos, pid))
            expected.append(dev.answer(mq.PUBACK if qos == 1 else mq.PUBREC, pid))
        rng.shuffle(pending)
        seen: list[bytes] = []
        for step, qos, pid in pending:
            dev.flows.published(step, qos, pid, 0)
            seen += dev.out()
        assert seen == expected


# -- inbound: 5.0's Receive Maximum and topic aliases -------------------------------------------


def test_a_5_0_device_over_our_receive_maximum_is_a_protocol_error() -> None:
    dev = Device(mq.V5)
    steps = [dev.publish(pid, 2) for pid in range(1, WINDOW + 1)]
    dev.publish(1, 2)  # a retransmission is not one more
    with pytest.raises(MqttProtocolError, match="Receive Maximum") as over:
        dev.publish(WINDOW + 1, 1)
    assert over.value.code == mq.RECEIVE_MAXIMUM_EXCEEDED
    dev.flows.published(steps[0], 2, 1, 0)
    dev.ack(mq.PUBREL, 1)  # its PUBCOMP frees a place
    assert dev.publish(WINDOW + 1, 1).do is Do.PUBLISH


def test_a_3_1_1_device_has_no_receive_maximum() -> None:
    dev = Device()
    for pid in range(1, 3 * WINDOW):
        assert dev.publish(pid, 1).do is Do.PUBLISH


def test_a_5_0_topic_alias_is_resolved_and_a_bad_one_refused() -> None:
    dev = Device(mq.V5)
    assert dev.arrive("a/b", 0, None, alias=2).topic == "a/b"  # sets alias 2
    assert dev.arrive("", 1, 1, alias=2).topic == "a/b"
    with pytest.raises(MqttProtocolError) as bad:
        dev.arrive("", 0, None, alias=3)  # never set
    assert bad.value.code == mq.TOPIC_ALIAS_INVALID


# -- outbound: deliveries ----------------------------------------------------------------------


def test_qos1_delivery_finishes_at_puback_and_an_unknown_puback_is_ignored() -> None:
    dev = Device()
    dev.flows.handed(1)
    dev.flows.sent(1, 1, 1)
    assert dev.flows.in_flight == 1
    assert dev.ack(mq.PUBACK, 2).do is Do.IGNORE  # not in flight
    done = dev.ack(mq.PUBACK, 1)
    assert (done.do, done.seq) == (Do.FINISH, 1)
    assert dev.flows.finished(1) and dev.flows.acked == 1
    assert dev.ack(mq.PUBACK, 1).do is Do.IGNORE  # a late duplicate
    assert dev.flows.in_flight == 0


@pytest.mark.parametrize("version", [mq.V311, mq.V5])
def test_qos2_delivery_pubrec_committed_then_pubrel_then_pubcomp(version: int) -> None:
    dev = Device(version)
    dev.flows.sent(10, 10, 2)
    assert dev.ack(mq.PUBACK, 10).do is Do.IGNORE  # not the kind it awaits
    assert dev.ack(mq.PUBCOMP, 10).do is Do.IGNORE
    receive = dev.ack(mq.PUBREC, 10)
    assert (receive.do, receive.seq) == (Do.RECEIVE, 10)
    assert dev.ack(mq.PUBREC, 10).do is Do.IGNORE  # one PUBREL follows the first's commit
    release = dev.flows.received(10, 10)
    assert (release.do, release.data) == (Do.SEND_PUBREL, dev.answer(mq.PUBREL, 10))
    again = dev.ack(mq.PUBREC, 10)  # the device missed our PUBREL
    assert (again.do, again.data) == (Do.SEND_PUBREL, dev.answer(mq.PUBREL, 10))
    assert dev.ack(mq.PUBCOMP, 10).do is Do.FINISH
    assert dev.flows.in_flight == 0


def test_a_5_0_pubrec_with_an_error_ends_the_delivery() -> None:
    dev = Device(mq.V5)
    dev.flows.sent(3, 3, 2)
    assert dev.ack(mq.PUBREC, 3, mq.UNSPECIFIED).do is Do.FINISH
    assert dev.flows.in_flight == 0


def test_a_pubrec_durable_after_its_flow_ended_sends_nothing() -> None:
    dev = Device()
    dev.flows.sent(2, 2, 2)
    assert dev.ack(mq.PUBREC, 2).do is Do.RECEIVE
    dev.flows.sent(3, 3, 1)
    # The flow of seq 2 is not RELEASING under another seq: nothing, and 3 stays in flight.
    assert dev.flows.received(5, 2).do is Do.NOTHING
    assert dev.flows.received(3, 3).do is Do.NOTHING
    assert dev.flows.in_flight == 2


def test_an_item_pubrecd_at_an_earlier_connection_is_resent_as_pubrel() -> None:
    dev = Device()
    step = dev.flows.resend_release(8, 8)
    assert (step.do, step.data) == (Do.SEND_PUBREL, dev.answer(mq.PUBREL, 8))
    assert dev.ack(mq.PUBCOMP, 8).do is Do.FINISH


def test_an_id_reused_while_in_flight_drops_the_old_flow_unfinished() -> None:
    dev = Device()
    for seq in (1, 65536):
        dev.flows.handed(seq)
    dev.flows.sent(1, 1, 1)
    dev.flows.sent(65536, 1, 2)  # the same packet id, 65535 items later
    assert dev.flows.in_flight == 1
    assert dev.ack(mq.PUBACK, 1).do is Do.IGNORE  # the id now awaits a PUBREC
    assert dev.ack(mq.PUBREC, 1).seq == 65536
    assert dev.flows.acked == 0  # item 1 never finished: the store keeps it


def test_the_window_is_full_at_its_size_and_a_finished_flow_makes_room() -> None:
    dev = Device()
    for seq in range(1, WINDOW + 1):
        assert dev.flows.room()
        dev.flows.sent(seq, seq, 1 if seq % 2 else 2)
    assert not dev.flows.room()
    assert dev.ack(mq.PUBREC, 2).do is Do.RECEIVE
    assert not dev.flows.room()  # a QoS 2 flow is in flight until PUBCOMP
    assert dev.ack(mq.PUBACK, 1).do is Do.FINISH
    assert dev.flows.room()


def test_the_cumulative_acknowledgement_is_the_prefix_of_finished_items() -> None:
    dev = Device()
    for seq in (1, 2, 3, 4):
        dev.flows.handed(seq)
    assert not dev.flows.finished(2)
    assert not dev.flows.finished(4)
    assert dev.flows.acked == 0 and dev.flows.finished_set() == {2, 4}
    assert dev.flows.finished(1) and dev.flows.acked == 2
    assert dev.flows.finished(3) and dev.flows.acked == 4
    assert dev.flows.finished_set() == frozenset()
