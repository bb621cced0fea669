"""MQTT 5.0's connection-level rules in process (aaabus.mqtt.terms): what a CONNECT settles,
topic aliases and our Receive Maximum. The same rules against server processes and real
clients: tests/test_mqtt5.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from aaabus.errors import MqttProtocolError
from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq
from aaabus.mqtt.terms import (
    InboundWindow,
    OutboundAliases,
    TopicAliases,
    disconnect_expiry,
    negotiate,
)


@dataclass
class Limits:
    inflight: int = 10
    max_packet: int = 4096
    topic_aliases: int = 4
    max_keepalive: int = 60
    keepalive_0: bool = False
    session_expiry_s: float = 100


def connect(version: int = mq.V5, clean: bool = True, keep_alive: int = 30) -> Any:
    return mc.Connect(version, "c", clean, keep_alive, None, None, None, {})


def test_3_1_1_clean_session_is_clean_start_and_expiry_0_persistent_the_server_expiry() -> None:
    clean = negotiate(connect(mq.V311, clean=True), Limits(), None)
    assert (clean.clean_start, clean.expiry, clean.ends, clean.connack) == (True, 0, True, {})
    kept = negotiate(connect(mq.V311, clean=False), Limits(), None)
    assert (kept.clean_start, kept.expiry, kept.ends) == (False, None, False)
    assert kept.window == 10 and kept.max_out == 0


@pytest.mark.parametrize("keep_alive", [0, 61])
def test_3_1_1_keep_alive_out_of_bounds_is_refused_5_0_gets_the_server_keep_alive(
    keep_alive: int,
) -> None:
    with pytest.raises(MqttProtocolError) as refused:
        negotiate(connect(mq.V311, keep_alive=keep_alive), Limits(), None)
    assert refused.value.code == mq.CLIENT_ID_NOT_VALID  # said as 3.1.1's 0x02
    terms = negotiate(connect(keep_alive=keep_alive), Limits(), None)
    assert terms.keep_alive == 60 and terms.connack[mq.SERVER_KEEP_ALIVE] == 60
    # keepalive_0 lets 3.1.1 in; 5.0 is told the server's keep-alive either way.
    allowed = negotiate(connect(mq.V311, keep_alive=0), Limits(keepalive_0=True), None)
    assert allowed.keep_alive == 0
    told = negotiate(connect(keep_alive=0), Limits(keepalive_0=True), None)
    assert told.keep_alive == 60 and told.connack[mq.SERVER_KEEP_ALIVE] == 60


def test_5_0_expiry_is_capped_and_said_only_when_capped() -> None:
    assert negotiate(connect(), Limits(), None).expiry == 0
    asked = connect(clean=False)
    asked.properties[mq.SESSION_EXPIRY] = 50
    terms = negotiate(asked, Limits(), None)
    assert (terms.clean_start, terms.expiry, terms.ends) == (False, 50, False)
    assert mq.SESSION_EXPIRY not in terms.connack
    asked.properties[mq.SESSION_EXPIRY] = 0xFFFFFFFF
    terms = negotiate(asked, Limits(), None)
    assert terms.expiry == 100 and terms.connack[mq.SESSION_EXPIRY] == 100


def test_5_0_connack_properties_and_the_device_limits() -> None:
    packet = connect()
    packet.properties.update({mq.RECEIVE_MAXIMUM: 3, mq.MAXIMUM_PACKET_SIZE: 500})
    terms = negotiate(packet, Limits(), "auto-1")
    assert (terms.window, terms.max_out) == (3, 500)
    assert terms.connack == {
        mq.RECEIVE_MAXIMUM: 10,
        mq.MAXIMUM_PACKET_SIZE: 4096,
        mq.TOPIC_ALIAS_MAXIMUM: 4,
        mq.RETAIN_AVAILABLE: 1,
        mq.WILDCARD_SUB_AVAILABLE: 1,
        mq.SUBSCRIPTION_ID_AVAILABLE: 1,
        mq.SHARED_SUB_AVAILABLE: 1,
        mq.ASSIGNED_CLIENT_ID: "auto-1",
    }
    # Ours is the bound: a device asking for more gets our window.
    packet.properties[mq.RECEIVE_MAXIMUM] = 1000
    assert negotiate(packet, Limits(), None).window == 10
    assert mq.TOPIC_ALIAS_MAXIMUM not in negotiate(packet, Limits(topic_aliases=0), None).connack


def test_an_authentication_method_is_refused_0x8c() -> None:
    packet = connect()
    packet.properties[mq.AUTH_METHOD] = "SCRAM-SHA-256"
    with pytest.raises(MqttProtocolError) as refused:
        negotiate(packet, Limits(), None)
    assert refused.value.code == mq.BAD_AUTH_METHOD


def test_disconnect_may_change_the_expiry_but_not_from_0() -> None:
    asked = connect(clean=False)
    asked.properties[mq.SESSION_EXPIRY] = 50
    terms = negotiate(asked, Limits(), None)
    assert disconnect_expiry(terms, mc.Disconnect(0, {}), Limits()) is None
    assert disconnect_expiry(terms, mc.Disconnect(0, {mq.SESSION_EXPIRY: 0}), Limits()) == 0
    assert disconnect_expiry(terms, mc.Disconnect(0, {mq.SESSION_EXPIRY: 500}), Limits()) == 100
    none = negotiate(connect(), Limits(), None)
    assert disconnect_expiry(none, mc.Disconnect(0, {mq.SESSION_EXPIRY: 0}), Limits()) == 0
    with pytest.raises(MqttProtocolError) as refused:
        disconnect_expiry(none, mc.Disconnect(0, {mq.SESSION_EXPIRY: 5}), Limits())
    assert refused.value.code == mq.PROTOCOL_ERROR


def publish(topic: str, alias: int | None = None, qos: int = 0, pid: int | None = None) -> Any:
    props = {mq.TOPIC_ALIAS: alias} if alias is not None else {}
    return mc.Publish(topic, b"", qos, False, False, pid, props)


def test_topic_aliases_set_use_and_refuse() -> None:
    aliases = TopicAliases(4)
    assert aliases.resolve(publish("plain")) == "plain"
    assert aliases.resolve(publish("a/b", 1)) == "a/b"
    assert aliases.resolve(publish("", 1)) == "a/b"
    assert aliases.resolve(publish("c/d", 1)) == "c/d"  # set again: replaced
    assert aliases.resolve(publish("", 1)) == "c/d"
    for bad in (publish("x", 5), publish("", 2)):
        with pytest.raises(MqttProtocolError) as refused:
            aliases.resolve(bad)
        assert refused.value.code == mq.TOPIC_ALIAS_INVALID
    with pytest.raises(MqttProtocolError) as refused:
        TopicAliases(0).resolve(publish("x", 1))  # aliases disabled
    assert refused.value.code == mq.TOPIC_ALIAS_INVALID


def test_the_inbound_window_counts_qos_1_and_2_flows_until_they_end() -> None:
    window = InboundWindow(2)
    window.received(0, None)  # QoS 0 never counts
    window.received(1, 1)
    window.received(2, 2)
    window.received(2, 2)  # a retransmission is not another flow
    with pytest.raises(MqttProtocolError) as refused:
        window.received(1, 3)
    assert refused.value.code == mq.RECEIVE_MAXIMUM_EXCEEDED
    window.finished(2, 2)
    window.received(2, 4)
    window.finished(1, 1)
    window.received(1, 5)
    with pytest.raises(MqttProtocolError):
        window.received(2, 6)


def test_outbound_aliases_only_as_many_as_both_sides_allow() -> None:
    asked = connect()
    assert negotiate(asked, Limits(), None).aliases_out == 0  # the device allows none
    asked.properties[mq.TOPIC_ALIAS_MAXIMUM] = 1000
    assert negotiate(asked, Limits(), None).aliases_out == 4  # capped by ours
    asked.properties[mq.TOPIC_ALIAS_MAXIMUM] = 2
    assert negotiate(asked, Limits(), None).aliases_out == 2


def test_outbound_aliases_go_to_the_topics_sent_most_recently() -> None:
    aliases = OutboundAliases(2)
    props = {mq.CONTENT_TYPE: "t"}
    assert aliases.apply("a", props) == ("a", {mq.CONTENT_TYPE: "t", mq.TOPIC_ALIAS: 1})
    assert aliases.apply("a", None) == ("", {mq.TOPIC_ALIAS: 1})
    assert aliases.apply("b", None) == ("b", {mq.TOPIC_ALIAS: 2})
    assert aliases.apply("a", None) == ("", {mq.TOPIC_ALIAS: 1})  # a is now the more recent
    assert aliases.apply("c", None) == ("c", {mq.TOPIC_ALIAS: 2})  # b's alias, reset
    # A PUBLISH that is not sent after all (over the device's maximum packet size): the alias
    # it was to set is forgotten and given out again, never sent empty.
    assert aliases.apply("d", None) == ("d", {mq.TOPIC_ALIAS: 1})  # a's
    aliases.unsent("d", "d")
    assert aliases.apply("d", None) == ("d", {mq.TOPIC_ALIAS: 1})
    assert aliases.apply("e", None) == ("e", {mq.TOPIC_ALIAS: 2})  # c's
    # One the device knows, in a PUBLISH not sent: it still knows it.
    aliases.unsent("e", "")
    assert aliases.apply("e", None) == ("", {mq.TOPIC_ALIAS: 2})
