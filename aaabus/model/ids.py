"""Agent identifiers: ``#from.to.stamp``.

``from`` is the server that created the identifier, ``to`` the server that hosts the agent, and
``stamp`` a counter of the creating server. The pair (from, stamp) is unique on the whole bus, and
``to`` tells every server where to route a notification without asking anyone.

Stamps below :data:`FIRST_USER_STAMP` are reserved for system agents present on every server:
``#s.s.0`` is the server itself (notifications from boot services and external clients carry it
as sender), ``#s.s.1`` is the server's agent factory, ``#s.s.2`` its topic representative
(:mod:`aaabus.topics`), the agent that ``publish`` and ``subscribe`` talk to, and ``#s.s.3`` the
handler of its MQTT sessions' moves between servers (a system handler run by the engine,
:meth:`aaabus.core.engine.Engine.handle`; :mod:`aaabus.mqtt.roaming`), ``#s.s.4`` that of its
MQTT shared subscriptions (:mod:`aaabus.mqtt.shared`).
"""

from __future__ import annotations

import re
from typing import NamedTuple

SERVER_STAMP = 0
FACTORY_STAMP = 1
TOPICS_STAMP = 2
SESSIONS_STAMP = 3
SHARES_STAMP = 4
FIRST_USER_STAMP = 16

_ID_RE = re.compile(r"#(\d+)\.(\d+)\.(\d+)\Z")


class AgentId(NamedTuple):
    """Immutable, hashable, ordered identifier of an agent. Printed as ``#from.to.stamp``."""

    origin: int
    server: int
    stamp: int

    def __str__(self) -> str:
        return f"#{self.origin}.{self.server}.{self.stamp}"

    def __repr__(self) -> str:
        return f"AgentId('{self}')"

    @classmethod
    def parse(cls, text: str) -> AgentId:
        """Parse ``#from.to.stamp``; raise ``ValueError`` with the expected form otherwise."""
        match = _ID_RE.match(text.strip())
        if not match:
            raise ValueError(f"bad agent id {text!r}: expected #from.to.stamp, e.g. #0.1.16")
        return cls(int(match[1]), int(match[2]), int(match[3]))

    @classmethod
    def factory(cls, server: int) -> AgentId:
        """The agent factory of ``server`` (``#s.s.1``)."""
        return cls(server, server, FACTORY_STAMP)

    @classmethod
    def topics_of(cls, server: int) -> AgentId:
        """The topic representative of ``server`` (``#s.s.2``)."""
        return cls(server, server, TOPICS_STAMP)

    @classmethod
    def sessions_of(cls, server: int) -> AgentId:
        """The handler of ``server``'s roaming MQTT sessions (``#s.s.3``)."""
        return cls(server, server, SESSIONS_STAMP)

    @classmethod
    def shares_of(cls, server: int) -> AgentId:
        """The handler of ``server``'s MQTT shared subscriptions (``#s.s.4``)."""
        return cls(server, server, SHARES_STAMP)

    @classmethod
    def server_of(cls, server: int) -> AgentId:
        """The pseudo-agent standing for ``server`` itself (``#s.s.0``)."""
        return cls(server, server, SERVER_STAMP)

    @property
    def is_system(self) -> bool:
        return self.stamp < FIRST_USER_STAMP
