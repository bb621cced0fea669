"""Hello world: a Greeter agent on server 1 answers the hellos sent from server 0.

    python -m examples.hello

Both servers run in this process (``InProcessBus``), each with its engine, its store and its
network, talking over TCP on 127.0.0.1 exactly as separate processes would.
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
from examples._bus import write_bus


@dataclass
class Hello(Notification):
    text: str


class Greeter(Agent):
    def __init__(self) -> None:
        super().__init__("greeter")
        self.greeted = 0  # saved after every reaction that changes it

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Hello):
            self.greeted += 1
            self.send_to(sender, Hello(f"hello #{self.greeted}, {note.text}"))
        else:
            super().react(sender, note)  # system notifications; an error for anything else


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        config = load_config(write_bus(Path(tmp), [[0, 1]]))
        with InProcessBus(config) as bus:
            # What agents send to #0.0.0 (server 0 itself) reaches this listener after commit.
            replies: queue.Queue[tuple[AgentId, Notification]] = queue.Queue()
            bus[0].add_listener(lambda sender, note: replies.put((sender, note)))
            greeter = bus[0].deploy(Greeter(), server=1)
            print(f"deployed a Greeter on server 1: {greeter}")
            for name in ("world", "again"):
                bus[0].send(greeter, Hello(name))
                print(f"server 0 sent Hello({name!r}) to {greeter}")
            for _ in range(2):
                sender, note = replies.get(timeout=10)
                assert isinstance(note, Hello)
                print(f"server 0 received from {sender}: {note.text}")
    return 0


if __name__ == "__main__":
    # Run the module the servers import (examples.hello), not a copy named __main__: classes of
    # __main__ travel by value, as code, which a server loads only with aaabus.trust.by_value.
    from examples import hello

    sys.exit(hello.main())
