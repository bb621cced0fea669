"""System handlers (``Engine.handle``): a reserved id whose notifications a function of the
server handles inside the reaction, in its transaction (the moves of roaming MQTT sessions,
``#s.s.3``), on one in-process server."""

from __future__ import annotations

from typing import Any

import pytest

from aaabus import AgentId, ExceptionNotification, Notification
from aaabus.model.context import current_context
from tests.support.agents import Marker, Poke, Probe, Seen
from tests.support.harness import SingleServer

STAMP = 5


def test_a_handler_runs_as_a_reaction_of_its_id(single_server: SingleServer) -> None:
    server, inbox, _cfg = single_server
    assert server.engine is not None
    handled: list[tuple[AgentId, Any]] = []

    def handler(sender: AgentId, note: Notification) -> None:
        handled.append((sender, note))
        # Its sends have the handler's id as sender.
        current_context("test").send(AgentId.server_of(0), Marker("from the handler"))

    server.engine.handle(STAMP, handler)
    probe = server.deploy(Probe())
    server.send(probe, Poke(AgentId(0, 0, STAMP), Marker("hello")))
    note = inbox.get()
    assert note == Marker("from the handler")
    assert handled == [(probe, Marker("hello"))]


def test_a_handler_that_raises_is_rolled_back_and_its_sender_told(
    single_server: SingleServer,
) -> None:
    server, inbox, _cfg = single_server
    assert server.engine is not None

    def handler(_sender: AgentId, _note: Notification) -> None:
        current_context("test").send(AgentId.server_of(0), Marker("never"))
        raise ValueError("refused")

    server.engine.handle(STAMP, handler)
    probe = server.deploy(Probe())
    server.send(probe, Poke(AgentId(0, 0, STAMP), Marker("hello")))
    seen = inbox.get()
    assert isinstance(seen, Seen) and isinstance(seen.note, ExceptionNotification)
    assert seen.note.error_message == "refused"
    # The handler's send went with its reaction: the next the inbox gets is a marker sent
    # after it through the same engine, which delivers in order.
    server.send(AgentId.server_of(0), Marker("after"))
    assert inbox.get() == Marker("after")


def test_only_reserved_stamps_may_have_a_handler(single_server: SingleServer) -> None:
    server, _inbox, _cfg = single_server
    assert server.engine is not None
    for stamp in (0, 1, 16):
        with pytest.raises(ValueError, match="cannot have a system handler"):
            server.engine.handle(stamp, lambda _s, _n: None)
