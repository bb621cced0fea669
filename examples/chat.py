"""A chat that goes wrong without causal order, and right with it.

    python -m examples.chat

Alice (server 0) asks a question to Bob (server 1) and Carol (server 2); Bob answers both. The
link from Alice's server to Carol's is slow — here it is simply not up yet (a gate that opens
later) — so Alice's question is still in her server's outgoing queue when Bob's answer reaches
Carol's server.

* In a domain with ``order="fifo"`` each link keeps its own order and nothing more: Carol reads
  the answer before the question.
* In a domain with ``order="causal"`` (the default) the answer's stamp says that it depends on a
  message from Alice that Carol's server has not received: the server holds the answer back
  (``aaabus status`` shows it under "held") and delivers it right after the question.

Alice posts to Bob *before* Carol, in one reaction. That does not matter: a reaction is one
event, and all the messages it sends are stamped together, so her message to Carol is in the
causal past of anything Bob sends after reading his, whatever the order of her sends.
"""

from __future__ import annotations

import queue
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from aaabus import Agent, AgentId, Notification
from aaabus.config.reader import load_config
from aaabus.node.inprocess import InProcessBus
from examples._bus import Gate, wait_for, write_bus


@dataclass
class Say(Notification):
    """From the program to a member: post ``text`` to the others."""

    text: str


@dataclass
class Post(Notification):
    author: str
    text: str


@dataclass
class Members(Notification):
    ids: list[AgentId]


class Member(Agent):
    """A chat member: posts to the others; Bob answers the first question he reads."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.others: list[AgentId] = []

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Members):
            self.others = [m for m in note.ids if m != self.id]
        elif isinstance(note, Say):
            self._post(note.text)
        elif isinstance(note, Post):
            # Show it to the program, through the server this member lives on.
            self.send_to(AgentId.server_of(self.id.server), note)
            if self.name == "Bob" and note.text.endswith("?"):
                self._post("At the station, at noon.")
        else:
            super().react(sender, note)

    def _post(self, text: str) -> None:
        for other in self.others:
            self.send_to(other, Post(self.name, text))


def run(order: str, root: Path) -> list[str]:
    """One conversation in a domain with ``order``; returns what Carol read, in order."""
    gate = Gate()
    # Server 0 dials server 2 (lower ids dial higher ones): through the gate, closed for now.
    path = write_bus(
        root / order,
        [[0, 1, 2]],
        order=order,
        server_properties={0: {"aaabus.dial.2": f"127.0.0.1:{gate.port}"}},
    )
    config = load_config(path)
    gate.target = ("127.0.0.1", config.servers[2].networks[0].port)
    try:
        with InProcessBus(config) as bus:
            carol_read: queue.Queue[Post] = queue.Queue()
            bus[2].add_listener(lambda sender, note: carol_read.put(note))
            # Each member is created by its own server: nothing has to cross the closed link.
            ids = [bus[i].deploy(Member(name)) for i, name in enumerate(("Alice", "Bob", "Carol"))]
            alice, bob, carol = ids
            for i, member in enumerate(ids):
                bus[i].send(member, Members([alice, bob, carol]))  # Bob first: see above
            bus[0].send(ids[0], Say("Where shall we meet?"))
            lines: list[str] = []
            if order == "fifo":
                first = carol_read.get(timeout=10)
                lines.append(f"{first.author}: {first.text}")
                print(f"  [{order}] Carol reads: {lines[-1]}")
            else:
                held = wait_for(
                    lambda: bus[2].status()["queues"]["held_back"],
                    10,
                    "Bob's answer held back at Carol's server",
                )
                print(f"  [{order}] Carol's server holds back {held} message (Bob's answer)")
            print(f"  [{order}] the slow link from Alice's server to Carol's comes up")
            gate.open()
            while len(lines) < 2:
                post = carol_read.get(timeout=15)
                lines.append(f"{post.author}: {post.text}")
                print(f"  [{order}] Carol reads: {lines[-1]}")
            return lines
    finally:
        gate.close()


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for order in ("fifo", "causal"):
            print(f'domain order="{order}":')
            lines = run(order, Path(tmp))
            question_first = lines[0].startswith("Alice")
            verdict = "makes sense" if question_first else "the answer came before the question!"
            print(f"  -> Carol's view {verdict}")
            if question_first != (order == "causal"):
                print("unexpected order", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    # Run the module the servers import (examples.chat), not a copy named __main__: classes of
    # __main__ travel by value, as code, which a server loads only with aaabus.trust.by_value.
    from examples import chat

    sys.exit(chat.main())
