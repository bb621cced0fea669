"""The engine's entry points for front ends (the MQTT listener): ``Engine.run_batch`` (many small
operations, one input, answers once durable) and in-memory observers (``Engine.observe`` and
``ReactionContext.notify``), on one in-process server with a real store on disk."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from aaabus import Agent, AgentId, Notification
from aaabus.core.engine import Engine
from aaabus.model.context import current_context
from tests.support.harness import SingleServer
from tests.support.topics import agent_attr, wait_until


@dataclass
class Shout(Notification):
    """Makes a :class:`Herald` notify ``word`` under key "herald" (and raise if told to)."""

    word: str
    fail: bool = False


class Herald(Agent):
    def __init__(self) -> None:
        super().__init__("herald")
        self.heard: list[str] = []

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Shout):
            self.heard = [*self.heard, note.word]
            current_context("test").notify("herald", note.word)
            if note.fail:
                raise RuntimeError("rolled back with its notification")
        else:
            super().react(sender, note)


def run(engine: Engine, ops: list[Any], **kwargs: Any) -> list[Any]:
    """``engine.run_batch(ops)``'s outcomes, waited for; also which thread delivered them."""
    done = threading.Event()
    result: list[Any] = []

    def finished(outcomes: list[Any]) -> None:
        result.extend(outcomes)
        result.append(threading.current_thread().name)
        done.set()

    engine.run_batch(ops, finished, **kwargs)
    assert done.wait(10), "the batch never became durable"
    return result


def test_a_batch_answers_each_operation_in_order_once_durable(
    single_server: SingleServer,
) -> None:
    server, _inbox, _cfg = single_server
    engine = server.engine
    assert engine is not None
    root = server.call(lambda: engine.store.conn.root())
    commits = engine.stats.commits

    def put(key: str, value: int) -> int:
        root[key] = value
        return value

    outcomes = run(engine, [lambda: put("a", 1), lambda: put("b", 2), lambda: 3])
    assert outcomes[:3] == [1, 2, 3]
    assert engine.stats.commits == commits + 1  # three operations, one commit
    assert server.call(lambda: (root["a"], root["b"])) == (1, 2)


def test_an_operation_that_raises_is_rolled_back_alone(single_server: SingleServer) -> None:
    server, _inbox, _cfg = single_server
    engine = server.engine
    assert engine is not None
    root = server.call(lambda: engine.store.conn.root())

    def bad() -> None:
        root["bad"] = True
        raise ValueError("no")

    def good() -> str:
        root["good"] = True
        return "kept"

    outcomes = run(engine, [good, bad, good])
    assert outcomes[0] == outcomes[2] == "kept"
    assert isinstance(outcomes[1], ValueError)
    assert server.call(lambda: ("good" in root, "bad" in root)) == (True, False)


def test_a_batch_run_here_is_answered_on_the_calling_thread(single_server: SingleServer) -> None:
    server, _inbox, _cfg = single_server
    engine = server.engine
    assert engine is not None
    server.call(lambda: None)  # the engine is idle after this
    outcomes = run(engine, [lambda: "x"], run_here=True)
    assert outcomes == ["x", threading.current_thread().name]


def test_a_lazy_batch_rides_along_with_the_next_group(single_server: SingleServer) -> None:
    server, _inbox, _cfg = single_server
    engine = server.engine
    assert engine is not None
    engine.lazy_delay_s = 30.0  # only another group can carry it within the test
    done = threading.Event()
    engine.run_batch([lambda: None], lambda _outcomes: done.set(), lazy=True)
    assert not done.is_set()
    commits = engine.stats.commits
    server.call(lambda: None)
    assert done.wait(10)
    assert engine.stats.commits == commits + 1


def test_observers_get_what_durable_reactions_notified_and_nothing_rolled_back(
    single_server: SingleServer,
) -> None:
    server, _inbox, _cfg = single_server
    engine = server.engine
    assert engine is not None
    seen: list[object] = []
    batches: list[int] = []

    def observer(values: list[object]) -> None:
        seen.extend(values)
        batches.append(len(values))

    server.call(lambda: engine.observe("herald", observer))
    herald = server.deploy(Herald())
    server.send(herald, Shout("one"))
    server.send(herald, Shout("lost", fail=True))
    server.send(herald, Shout("two"))
    wait_until("both durable shouts observed", lambda: seen == ["one", "two"])
    assert all(batches)  # never called with nothing
    server.call(lambda: engine.unobserve("herald"))
    server.send(herald, Shout("unheard"))
    wait_until(
        "the herald shouted again",
        lambda: agent_attr(server, herald, "heard") == ["one", "two", "unheard"],
    )
    assert seen == ["one", "two"]  # durable, but nobody observes the key any more
