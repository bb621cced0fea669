"""The programming model on one in-process server with a real FileStorage on disk."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from aaabus import (
    Agent,
    AgentCreateReply,
    AgentDeleteAck,
    AgentDeleteRequest,
    AgentId,
    AgentServer,
    ExceptionNotification,
    Notification,
    OutsideReactionError,
    UnknownAgent,
)
from aaabus.core.store import DEFAULT_STORE_KIND, STORE_KINDS, open_store
from tests.support.agents import (
    Boom,
    Counter,
    DeployThis,
    Faulty,
    Inc,
    Marker,
    Poke,
    Probe,
    Recorder,
    Seen,
    Silent,
    Weird,
)
from tests.support.harness import Inbox, SingleServer


def stored_agent(storage: Path, agent_id: AgentId) -> Agent | None:
    """Read an agent straight from a stopped server's store."""
    store = open_store(DEFAULT_STORE_KIND, storage, agent_id.server)
    try:
        agent: Agent | None = store.agents.get((agent_id.origin, agent_id.stamp))
        if agent is None:
            return None
        # Copy the state out: the stored object becomes unusable once the store is closed.
        agent._p_activate()
        cls: type[Agent] = type(agent)
        copy = cls.__new__(cls)
        state = cast("dict[str, Any]", agent.__getstate__())
        copy.__setstate__(dict(state))
        return copy
    finally:
        store.close()


def seen(inbox: Inbox, timeout: float = 10.0) -> Seen:
    note = inbox.get(timeout)
    assert isinstance(note, Seen), note
    return note


def test_ids_print_and_parse() -> None:
    aid = AgentId(3, 7, 42)
    assert str(aid) == "#3.7.42"
    assert AgentId.parse("#3.7.42") == aid
    assert hash(AgentId.parse(str(aid))) == hash(aid)
    assert str(AgentId.factory(5)) == "#5.5.1"
    assert AgentId.factory(5).is_system and not aid.is_system
    with pytest.raises(ValueError, match=r"expected #from\.to\.stamp"):
        AgentId.parse("3.7.42")


def test_send_outside_a_reaction_is_a_clear_error() -> None:
    with pytest.raises(OutsideReactionError, match="send_to\\(\\) called outside a reaction"):
        Agent().send_to(AgentId(0, 0, 16), Marker())


def test_failed_reaction_leaves_only_the_exception_notification(
    single_server: SingleServer, tmp_path: Path
) -> None:
    server, inbox, _ = single_server
    probe = server.deploy(Probe())
    recorder = server.deploy(Recorder())
    faulty = server.deploy(Faulty())
    server.send(probe, Poke(faulty, Boom(recorder)))
    report = seen(inbox)
    assert report.by == probe and report.sender == faulty
    exc = report.note
    assert isinstance(exc, ExceptionNotification)
    assert exc.target == faulty and isinstance(exc.notification, Boom)
    assert exc.error_type == "ValueError" and exc.error_message == "boom"
    # If any of the three sends had leaked, it would reach the recorder before this marker:
    # all of them are local and the input queue is FIFO.
    server.send(recorder, Marker("after"))
    after = seen(inbox)
    assert after.note == Marker("after"), after
    server.stop()
    state = stored_agent(tmp_path / "s0", faulty)
    assert state is not None and state.value == 0


def test_failure_inside_a_group_rolls_back_that_reaction_alone(
    single_server: SingleServer, tmp_path: Path
) -> None:
    server, inbox, _ = single_server
    engine = server.engine
    assert engine is not None
    probe = server.deploy(Probe())
    counter = server.deploy(Counter())
    faulty = server.deploy(Faulty())

    def burst() -> None:
        # Everything lands in the input queue together, so the engine runs it as one group.
        for i in range(1, 6):
            engine.sends.send(counter, Inc(i))
        engine.sends.send(probe, Poke(faulty, Boom(probe)))
        for i in range(6, 11):
            engine.sends.send(counter, Inc(i))
        engine.sends.send(probe, Poke(counter, Weird()))

    server.call(burst)
    first, second = seen(inbox), seen(inbox)
    assert isinstance(first.note, ExceptionNotification) and first.note.error_type == "ValueError"
    assert isinstance(second.note, ExceptionNotification)
    assert second.note.error_type == "UnknownNotificationError"
    assert engine.stats.aborts >= 1
    server.stop()
    state = stored_agent(tmp_path / "s0", counter)
    assert state is not None and (state.count, state.errors) == (10, 0)
    faulty_state = stored_agent(tmp_path / "s0", faulty)
    assert faulty_state is not None and faulty_state.value == 0


def test_unknown_agent_and_unknown_server(single_server: SingleServer) -> None:
    server, inbox, _ = single_server
    probe = server.deploy(Probe())
    ghost = AgentId(0, 0, 999)
    server.send(probe, Poke(ghost, Marker("to nobody")))
    report = seen(inbox)
    assert isinstance(report.note, UnknownAgent) and report.note.target == ghost
    assert report.note.notification == Marker("to nobody")
    elsewhere = AgentId(0, 42, 16)
    server.send(probe, Poke(elsewhere, Marker("far")))
    report = seen(inbox)
    assert isinstance(report.note, UnknownAgent) and report.note.target == elsewhere


def test_unknown_notification_gives_an_exception_notification(single_server: SingleServer) -> None:
    server, inbox, _ = single_server
    probe = server.deploy(Probe())
    silent = server.deploy(Silent())
    server.send(probe, Poke(silent, Weird()))
    exc = seen(inbox).note
    assert isinstance(exc, ExceptionNotification)
    assert exc.error_type == "UnknownNotificationError" and "Weird" in exc.error_message


def test_deploy_through_the_factory_with_reply_then_delete(single_server: SingleServer) -> None:
    server, inbox, _ = single_server
    probe = server.deploy(Probe())
    server.send(probe, DeployThis(Counter(), 0))
    reply = seen(inbox).note
    assert isinstance(reply, AgentCreateReply) and reply.ok and reply.error == ""
    counter = reply.agent_id
    assert counter.origin == 0 and counter.server == 0 and not counter.is_system
    server.send(probe, Poke(counter, AgentDeleteRequest()))
    ack = seen(inbox).note
    assert ack == AgentDeleteAck(counter)
    server.send(probe, Poke(counter, Inc(1)))
    gone = seen(inbox).note
    assert isinstance(gone, UnknownAgent) and gone.target == counter


class Broken(Agent):
    def on_init(self, first_time: bool) -> None:
        raise KeyError("no init")


def test_create_failure_is_reported(single_server: SingleServer) -> None:
    server, inbox, _ = single_server
    probe = server.deploy(Probe())
    server.send(probe, DeployThis(Broken(), 0))
    reply = seen(inbox).note
    assert isinstance(reply, AgentCreateReply) and not reply.ok
    assert "KeyError" in reply.error


@dataclass
class _Note(Notification):
    pass


def test_agent_of_a_local_class_travels_by_value_and_survives_restart(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    from aaabus.config.reader import load_config

    # A class by value is code: the server loads it only when told to (aaabus.trust.by_value).
    cfg = load_config(make_config(properties={"aaabus.trust.by_value": "true"}))

    class Local(Agent):  # defined in a function: no server could import it by name
        def __init__(self) -> None:
            super().__init__()
            self.hits = 0

        def react(self, sender: AgentId, note: Notification) -> None:
            self.hits += 1
            self.send_to(AgentId.server_of(0), Seen(self.id, sender, self.hits))

    def run_once(expect: int, agent_id: AgentId | None) -> AgentId:
        from tests.support.harness import Inbox

        server = AgentServer(cfg, 0, storage=tmp_path / "s0")
        server.start()
        try:
            inbox = Inbox()
            server.add_listener(inbox)
            if agent_id is None:
                agent_id = server.deploy(Local())
            server.send(agent_id, _Note())
            assert seen(inbox).note == expect
            return agent_id
        finally:
            server.stop()

    aid = run_once(1, None)
    run_once(2, aid)


def test_on_init_first_time_then_at_each_boot(
    tmp_path: Path, make_config: Callable[..., Path]
) -> None:
    from aaabus.config.reader import load_config

    cfg = load_config(make_config())
    storage = tmp_path / "s0"
    server = AgentServer(cfg, 0, storage=storage)
    server.start()
    counter = server.deploy(Counter())
    server.send(counter, Inc(1))
    server.stop()
    assert stored_agent(storage, counter).inits == 1  # type: ignore[union-attr]
    server = AgentServer(cfg, 0, storage=storage)
    server.start()
    server.send(counter, Inc(2))
    server.stop()
    state = stored_agent(storage, counter)
    assert state is not None and (state.inits, state.count) == (2, 2)


@pytest.mark.parametrize("kind", STORE_KINDS)
def test_an_agent_stays_in_the_object_cache_through_busy_groups(tmp_path: Path, kind: str) -> None:
    # As in a broadcast on a router: the agent reacts first, then the channel writes a thousand
    # queue entries in the same transaction, so at the commit the agent is the oldest object.
    # ZODB's default cache (400 objects, which memory stores had) then evicted it: unpickled
    # again at its next notification, it lost its volatile attributes (perf drivers keep their
    # timings there).
    from persistent.mapping import PersistentMapping

    store = open_store(kind, tmp_path / "s0", 0)
    try:
        root = store.conn.root()
        root["agent"] = agent = PersistentMapping()
        store.tm.commit()
        agent._v_mark = "still here"
        for group in range(20):
            agent["group"] = group
            root[f"queue{group}"] = queue = PersistentMapping()
            for i in range(500):
                queue[i] = PersistentMapping(i=i)
            store.tm.commit()
        assert getattr(agent, "_v_mark", None) == "still here", "the agent was evicted"
    finally:
        store.tm.abort()
        store.close()
