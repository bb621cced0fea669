"""What the console knows of the bus: the servers' last readings, shaped into the page's JSON.

A :class:`Board` is owned by the console's event loop thread: the pollers hand it their
:class:`~aaabus.console.poller.Reading` s through the loop (``call_soon_threadsafe``), and the web
handlers read it there, so it needs no lock. Everything it returns is plain JSON data.

Figures (``GET /api/servers``, each server's ``figures``; ``null`` while it is not up, so that a
stale figure never passes for a live one):

* ``msgs_in_per_s``/``msgs_out_per_s``: notifications delivered to and sent by its agents per
  second, from the last two readings (``messages.delivered``, ``messages.sent``);
* ``queued``: inputs waiting plus messages waiting to leave (``queues.input`` + the outgoing
  queues), ``held_back`` (waiting for causal order), ``dead_letters``;
* ``clock_size``: the largest matrix clock (servers of its biggest domain), ``clock_cells``;
* MQTT: ``mqtt_connections``, ``mqtt_sessions`` (stored), ``retained``,
  ``publications_in``/``publications_out`` (counts since start), and their rates.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aaabus.config.domains import Topology
from aaabus.config.reader import BusConfig
from aaabus.console.poller import Reading

__all__ = ["HISTORY", "Board"]

#: Readings kept per server for the rate charts (one a second: a minute).
HISTORY = 60


@dataclass
class _Server:
    """One server: its place in the config and its last reading (loop thread)."""

    id: int
    name: str
    domains: list[str]
    router: bool
    admin: str | None
    neighbours: dict[str, list[int]]  # domain -> the other servers of it
    state: str = "unknown"  # before the first reading
    error: str | None = None
    status: dict[str, Any] | None = None
    rates: dict[str, float] = field(default_factory=dict)
    # (in/s, out/s) per reading while up, for the page's chart.
    history: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=HISTORY))
    previous: tuple[float, dict[str, float]] | None = None  # (at, counters) of the last reading


_COUNTERS = {
    "delivered": ("messages", "delivered"),
    "sent": ("messages", "sent"),
    "publications_in": ("mqtt", "publications_in"),
    "publications_out": ("mqtt", "publications_out"),
}


class Board:
    """The servers of ``config`` and what their pollers last read (see the module docstring)."""

    def __init__(self, config: BusConfig, topology: Topology, admin: dict[int, str | None]) -> None:
        self.config = config
        self.topology = topology
        self.servers: dict[int, _Server] = {}
        for sid, spec in config.servers.items():
            self.servers[sid] = _Server(
                id=sid,
                name=spec.name,
                domains=list(topology.domains_of(sid)),
                router=topology.is_router(sid),
                admin=admin.get(sid),
                neighbours={
                    d: [m for m in topology.domains[d] if m != sid]
                    for d in topology.domains_of(sid)
                },
            )
        #: Bumped by every reading that changed something: the stream sends when it moved.
        self.version = 0

    # -- the pollers' side (loop thread) --------------------------------------------------------

    def update(self, reading: Reading) -> None:
        """Take one reading in."""
        server = self.servers[reading.server]
        self.version += 1
        server.state = reading.state
        server.error = reading.error
        if reading.state != "up" or reading.status is None:
            server.status = None
            server.rates = {}
            server.previous = None  # rates start again from the next reading that is up
            return
        status = reading.status
        counters = {name: float(_dig(status, path)) for name, path in _COUNTERS.items()}
        if server.previous is not None:
            at, before = server.previous
            span = max(reading.at - at, 1e-3)
            # A restarted server's counters start again from 0: no negative rate.
            server.rates = {
                name: round(max(0.0, counters[name] - before[name]) / span, 1) for name in counters
            }
            server.history.append((server.rates["delivered"], server.rates["sent"]))
        server.previous = (reading.at, counters)
        server.status = status

    # -- the JSON views (loop thread) -------------------------------------------------------------

    def servers_json(self) -> list[dict[str, Any]]:
        """``GET /api/servers``: every server of the config, up or not, in id order."""
        return [self._server_json(s) for s in sorted(self.servers.values(), key=lambda s: s.id)]

    def _server_json(self, server: _Server) -> dict[str, Any]:
        status = server.status
        return {
            "id": server.id,
            "name": server.name,
            "domains": server.domains,
            "router": server.router,
            "up": server.state == "up",
            "state": server.state,
            "error": server.error,
            "admin": server.admin,
            "figures": None if status is None else _figures(status, server.rates),
            "links": None if status is None else status.get("links", {}),
            "history": [list(point) for point in server.history],
        }

    def graph_json(self) -> dict[str, Any]:
        """``GET /api/graph``: domains with their servers, and per server and domain whether
        every link of the server into that domain is up (``null``: the server is not up)."""
        edges = []
        for server in self.servers.values():
            links = (server.status or {}).get("links", {})
            for domain, peers in server.neighbours.items():
                up = None if server.status is None else all(links.get(str(p)) for p in peers)
                edges.append({"server": server.id, "domain": domain, "up": up})
        return {
            "domains": [
                {"name": name, "servers": list(members)}
                for name, members in self.topology.domains.items()
            ],
            "edges": edges,
        }

    def clients_json(self) -> dict[str, Any]:
        """``GET /api/clients``: the MQTT devices connected to every server that is up."""
        clients = [
            {"server": sid, **client}
            for sid, detail in self._details()
            for client in detail.get("clients", [])
        ]
        return {"clients": clients, "truncated": self._truncated()}

    def topics_json(self) -> dict[str, Any]:
        """``GET /api/topics``: each subscribed topic filter and the servers it is subscribed
        on (whose representative holds a local subscription to it)."""
        where: dict[str, list[int]] = {}
        for sid, detail in self._details():
            for topic_filter in detail.get("filters", []):
                where.setdefault(topic_filter, []).append(sid)
        topics = [{"filter": f, "servers": where[f]} for f in sorted(where)]
        return {"topics": topics, "truncated": self._truncated()}

    def roaming_json(self) -> dict[str, Any]:
        """``GET /api/roaming``: the roaming MQTT sessions, by their anchors (which must be up
        to be listed), with the server holding each."""
        sessions = [s for _, detail in self._details() for s in detail.get("roaming", [])]
        return {"sessions": sessions, "truncated": self._truncated()}

    def state_json(self) -> dict[str, Any]:
        """Everything the page shows, in one object (what the live stream sends)."""
        return {
            "servers": self.servers_json(),
            "graph": self.graph_json(),
            "clients": self.clients_json(),
            "topics": self.topics_json(),
            "roaming": self.roaming_json(),
        }

    def _details(self) -> list[tuple[int, dict[str, Any]]]:
        return [
            (s.id, s.status.get("detail") or {})
            for s in sorted(self.servers.values(), key=lambda s: s.id)
            if s.status is not None
        ]

    def _truncated(self) -> bool:
        return any(detail.get("truncated") for _, detail in self._details())


def _figures(status: dict[str, Any], rates: dict[str, float]) -> dict[str, Any]:
    queues = status.get("queues", {})
    outgoing = sum(queues.get("outgoing", {}).values())
    clocks = status.get("clocks", {})
    mqtt = status.get("mqtt") or {}
    return {
        "uptime_s": status.get("uptime_s"),
        "storage_bytes": status.get("storage_bytes"),
        "queued": queues.get("input", 0) + outgoing,
        "input": queues.get("input", 0),
        "outgoing": outgoing,
        "held_back": queues.get("held_back", 0),
        "dead_letters": _dig(status, ("dead_letters", "count")),
        "sent": _dig(status, ("messages", "sent")),
        "delivered": _dig(status, ("messages", "delivered")),
        "msgs_in_per_s": rates.get("delivered", 0.0),
        "msgs_out_per_s": rates.get("sent", 0.0),
        "reactions_per_s": status.get("reactions_per_s", 0.0),
        "clock_size": max(clocks.values(), default=0),
        "clock_cells": status.get("clock_cells", 0),
        "mqtt": bool(mqtt),
        "mqtt_connections": mqtt.get("connected", 0),
        "mqtt_sessions": mqtt.get("sessions_stored", 0),
        "retained": _dig(status, ("topics", "retained")),
        "publications_in": mqtt.get("publications_in", 0),
        "publications_out": mqtt.get("publications_out", 0),
        "publications_in_per_s": rates.get("publications_in", 0.0),
        "publications_out_per_s": rates.get("publications_out", 0.0),
    }


def _dig(status: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = status
    for key in path:
        if not isinstance(value, dict):
            return 0
        value = value.get(key, 0)
    return value if isinstance(value, int | float) else 0
