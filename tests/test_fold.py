"""One fold mechanism (aaabus.core.sends): a note to this server's topic representative is
handed to it inside the sending reaction or operation by the same path, whoever sends it -- an
agent's ``publish`` (a reaction's ``send_to``) or the MQTT listener's operation as ``#s.s.0``
(``MqttSessions.publish_now``) -- and the representative reacts as itself in both."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aaabus import Agent, AgentId, Notification, Publication
from aaabus.topics.representative import TopicRepresentative
from tests.support.topics import agent_attr, inprocess, wait_until

TOPIC = "fold/t"


@dataclass
class SubscribeAndPublish(Notification):
    payload: str


class Heard(Agent):
    """Subscribes and publishes when told; records each publication with its sender."""

    def __init__(self) -> None:
        super().__init__("heard")
        self.heard: list[tuple[str, object]] = []

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, SubscribeAndPublish):
            self.subscribe(TOPIC)
            self.publish(TOPIC, note.payload)
        elif isinstance(note, Publication):
            self.heard = [*self.heard, (str(sender), note.payload)]
        else:
            super().react(sender, note)


def test_an_agents_publication_and_a_devices_take_the_one_fold_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folded: list[tuple[str, str]] = []
    entry = TopicRepresentative.folded

    def recorded(rep: TopicRepresentative, sender: AgentId, note: Any) -> bool:
        folded.append((str(sender), type(note).__name__))
        return entry(rep, sender, note)

    # Before the servers start: they register the entry of the fold then.
    monkeypatch.setattr(TopicRepresentative, "folded", recorded)
    with inprocess(tmp_path, [[0]]) as bus:
        server = bus[0]
        heard = server.deploy(Heard())
        server.send(heard, SubscribeAndPublish("from an agent"))
        wait_until("the agent's own publication", lambda: agent_attr(server, heard, "heard"))
        matched = server.call(
            lambda: server.mqtt_sessions.publish_now(
                "device", TOPIC, b"from a device", False, 0, user="someone"
            )
        )
        assert matched is True  # what the representative's routing found
        got = wait_until(
            "both publications",
            lambda: (lambda h: h if len(h) == 2 else None)(agent_attr(server, heard, "heard")),
        )
        rep, me = str(AgentId.topics_of(0)), str(AgentId.server_of(0))
        # Both delivered by the representative itself, reacting as itself in both cases.
        assert got == [(rep, "from an agent"), (rep, b"from a device")]
        # Both went through the fold's entry: the agent's notes from the agent, the device's
        # from the server.
        assert folded == [
            (str(heard), "Subscribe"),
            (str(heard), "Publish"),
            (me, "Publish"),
        ]
