"""The status snapshot of a running server: what ``aaabus status`` and the metrics page show.

:func:`server_status` reads the engine, channel and network of a :class:`StatusSource` (the
:class:`~aaabus.node.server.AgentServer` is one) on the engine thread, between two reactions, so
that the figures describe one instant. It is called from an admin connection thread or a metrics
scrape thread and blocks until the engine thread has answered (``timeout``).
"""

from __future__ import annotations

import gc
import itertools
import os
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from aaabus.config.domains import Topology
from aaabus.config.reader import ServerConfig
from aaabus.core.channel import Channel
from aaabus.core.engine import Engine
from aaabus.errors import AdminError
from aaabus.io.network import Network
from aaabus.model.ids import TOPICS_STAMP
from aaabus.topics.representative import TopicRepresentative

__all__ = ["StatusSource", "server_status"]

T = TypeVar("T")


class FigureSource(Protocol):
    """An endpoint with figures of its own (the MQTT listener, the MQTT bridge), read on its
    own thread."""

    def figures(self, timeout: float) -> dict[str, Any]: ...


class EpochSource(Protocol):
    """What a server remembers of the others' epochs (:class:`aaabus.node.epochs.EpochBook`),
    read under its own lock on the caller's thread."""

    def everything(self) -> dict[int, tuple[int, int]]: ...


class ReplicationSource(Protocol):
    """A primary's replication links (:class:`aaabus.node.replication.ReplicationLinks`): their
    figures, read under their own lock on the caller's thread, never the engine's."""

    def figures(self) -> dict[str, Any]: ...


#: How long a status waits for the engine's figures before it looks whether a commit waits for
#: its replicas: the engine is then inside that commit, and the answer comes without them.
WAITING_ENGINE_S = 0.5


class MqttSource(FigureSource, Protocol):
    """The MQTT listener: its figures, and the details the console lists."""

    def clients(self, timeout: float, most: int) -> list[dict[str, Any]]: ...
    def anchored_now(self, most: int) -> list[dict[str, Any]]: ...


#: The most items of each list a detailed status carries (clients, filters, roaming sessions):
#: an answer stays small whatever the number of devices; ``truncated`` says when more exist.
DETAIL_MOST = 500


class StatusSource(Protocol):
    """The parts of a server a status snapshot reads (all set by the server, read-only here)."""

    @property
    def server_id(self) -> int: ...
    @property
    def spec(self) -> ServerConfig: ...
    @property
    def topology(self) -> Topology: ...
    @property
    def store_kind(self) -> str: ...
    @property
    def started_at(self) -> float: ...
    @property
    def engine(self) -> Engine | None: ...
    @property
    def channel(self) -> Channel | None: ...
    @property
    def network(self) -> Network | None: ...
    @property
    def mqtt(self) -> MqttSource | None: ...
    @property
    def bridge(self) -> FigureSource | None: ...
    @property
    def replication(self) -> ReplicationSource | None: ...
    @property
    def epoch(self) -> tuple[int, int]: ...
    @property
    def epochs(self) -> EpochSource | None: ...
    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T: ...


def server_status(
    server: StatusSource, timeout: float = 10.0, detail: bool = False
) -> dict[str, Any]:
    """One consistent snapshot of a running server's figures (see docs/operations.md).

    Queue depths, clocks, counters and the storage size are read together on the engine thread,
    between two reactions, so that they describe the same instant. ``detail`` (the console's
    request) adds lists under ``"detail"``: the topic filters subscribed on this server, the
    roaming MQTT sessions anchored here and the connected MQTT clients, each at most
    :data:`DETAIL_MOST` long.
    """
    engine = server.engine
    channel = server.channel
    if engine is None or channel is None:
        raise AdminError(f"server {server.server_id} is not started")
    me = server.server_id

    def read() -> dict[str, Any]:
        store = engine.store
        depths = channel.depths()
        clocks: dict[str, int] = {}
        sent_remote = received_remote = 0
        for name, clock in channel.clocks.items():
            clocks[name] = clock.size
            for j in range(clock.size):
                if j != clock.me:
                    sent_remote += clock.sent_to(j)
                    received_remote += clock.received_from(j)
        stats = engine.stats
        return {
            "queues": {
                "input": len(store.qin),
                "held_back": depths["held_back"],
                "parked": channel.links.parked_now(),
                "outgoing": {str(peer): n for peer, n in sorted(depths["outgoing"].items())},
            },
            "messages": {
                "sent": stats.sent,
                "delivered": stats.reactions,
                "sent_remote": sent_remote,
                "received_remote": received_remote,
                "tentative_dropped": channel.links.dropped,
            },
            "reactions": stats.reactions,
            "commits": stats.commits,
            "errors": stats.errors,
            # Inputs consumed unread: their body did not decode (aaabus.core.engine.EngineStats).
            "dead_letters": {"count": stats.dead_letters, "last": stats.last_dead_letter},
            "boots": store.record.boots,
            # Links whose peer's store and this one disagree (Channel.compare_state): a store
            # restarted older than what it had committed, on one side or the other.
            "diverged": depths["diverged"],
            "clocks": clocks,
            "clock_cells": sum(k * k for k in clocks.values()),
            "topics": _topic_figures(store.agents.get((me, TOPICS_STAMP))),
            **_storage_figures(store.disk()),
        }

    def read_detail() -> dict[str, Any]:
        figures = read()
        rep = engine.store.agents.get((me, TOPICS_STAMP))
        local = rep.local.keys() if isinstance(rep, TopicRepresentative) else ()
        filters = list(itertools.islice(local, DETAIL_MOST + 1))
        anchored = [] if mqtt is None else mqtt.anchored_now(DETAIL_MOST + 1)
        figures["detail"] = {
            "filters": filters[:DETAIL_MOST],
            "roaming": anchored[:DETAIL_MOST],
            "truncated": len(filters) > DETAIL_MOST or len(anchored) > DETAIL_MOST,
        }
        return figures

    mqtt = server.mqtt
    replication = server.replication
    future = engine.call(read_detail if detail else read)
    deadline = time.monotonic() + timeout
    while True:
        try:
            snapshot = future.result(min(WAITING_ENGINE_S, max(0.0, deadline - time.monotonic())))
            break
        except TimeoutError:
            shipping = None if replication is None else replication.figures()
            if shipping is not None and (shipping["waiting_s"] or 0.0) >= WAITING_ENGINE_S:
                # The engine is inside a commit that waits for replicas (aaabus.replication.sync):
                # say so, with their figures, rather than nothing; ``partial``: no engine figures.
                return {**_identity(server), "partial": True, "replication": shipping}
            if time.monotonic() >= deadline:
                raise
    shipping = None if replication is None else replication.figures()
    if shipping is not None:
        snapshot["replication"] = shipping
    if mqtt is not None:
        snapshot["mqtt"] = mqtt.figures(timeout)
        if detail:
            clients = mqtt.clients(timeout, DETAIL_MOST + 1)
            snapshot["detail"]["clients"] = clients[:DETAIL_MOST]
            snapshot["detail"]["truncated"] |= len(clients) > DETAIL_MOST
    elif detail:
        snapshot["detail"]["clients"] = []
    bridge = server.bridge
    if bridge is not None:
        snapshot["bridge"] = bridge.figures(timeout)
    return {
        **_identity(server),
        "gc": _collector_figures(),
        "threads": threading.active_count(),
        **snapshot,
    }


def _identity(server: StatusSource) -> dict[str, Any]:
    """What a status says of any running server, read without the engine."""
    me = server.server_id
    network = server.network
    spec = server.spec
    return {
        "id": me,
        "name": spec.name,
        "up": True,
        "pid": os.getpid(),
        "uptime_s": round(time.monotonic() - server.started_at, 3),
        "domains": list(spec.domains),
        "router": server.topology.is_router(me),
        "store": server.store_kind,
        "links": {
            str(p): network is not None and network.is_up(p) for p in server.topology.neighbours(me)
        },
        **_epoch_figures(server),
    }


def _epoch_figures(server: StatusSource) -> dict[str, Any]:
    """The epoch this server speaks for, ``[epoch, member]``, and those it knows of the other
    servers that ever failed over (issue 42): ``{"<id>": [epoch, member]}``."""
    book = server.epochs
    known = {} if book is None else book.everything()
    return {
        "epoch": list(server.epoch),
        "epochs": {str(sid): list(pair) for sid, pair in known.items()},
    }


def _collector_figures() -> dict[str, Any]:
    """The process's cycle collector (``aaabus.gc.thresholds``): its thresholds, the
    collections run per generation, and the objects frozen out of them at boot."""
    return {
        "thresholds": list(gc.get_threshold()),
        "collections": [generation["collections"] for generation in gc.get_stats()],
        "frozen": gc.get_freeze_count(),
    }


def _topic_figures(rep: Any) -> dict[str, int]:
    return rep.figures() if isinstance(rep, TopicRepresentative) else {}


def _storage_figures(disk: dict[str, Any]) -> dict[str, Any]:
    return {
        "storage_bytes": disk["file_bytes"],
        "storage_live_bytes": disk["live_bytes"],
        "storage_compacted_at": disk["compacted_at"],
    }
