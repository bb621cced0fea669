"""What an attacker holding a credential sends: pickles that run a command when loaded."""

from __future__ import annotations

import os
import pickle
import shlex
from dataclasses import dataclass
from typing import Any

from aaabus import Agent, AgentId, Notification
from aaabus.ids import FIRST_USER_STAMP
from aaabus.notifications import AgentCreateRequest


class Planted(Notification):
    """Pickles as ``os.system("touch <marker>")``: loading it anywhere creates ``marker``.

    The class itself lives in a trusted test module; what its pickle names is ``posix.system``,
    which no server trusts, so a server refusing it never creates the marker.
    """

    def __init__(self, marker: str | os.PathLike[str]) -> None:
        self.marker = os.fspath(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def planted_pickle(marker: str | os.PathLike[str]) -> bytes:
    """The bytes of a :class:`Planted` notification."""
    return pickle.dumps(Planted(marker))


@dataclass
class Inject(Notification):
    """Asks an :class:`Injector` to aim a :class:`Planted` pickle at ``server``."""

    server: int
    marker: str
    via_factory: bool = False


class Injector(Agent):
    """A compromised peer's agent: its frames carry :class:`Planted` pickles to another server.

    Whatever comes back (the victim's error report, the factory's reply) is forwarded to the
    server's listeners (``#s.s.0``) for the test to read.
    """

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Inject):
            factory = AgentId.factory(note.server)
            if note.via_factory:
                agent_id = AgentId(self.id.server, note.server, FIRST_USER_STAMP + 99)
                payload = planted_pickle(note.marker)
                self.send_to(factory, AgentCreateRequest(agent_id, payload, reply=True))
            else:
                self.send_to(factory, Planted(note.marker))
        else:
            self.send_to(AgentId.server_of(self.id.server), note)
