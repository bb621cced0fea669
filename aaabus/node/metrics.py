"""An optional Prometheus endpoint per server: the figures of ``aaabus status`` as metrics.

Enabled by property ``aaabus.metrics.port`` (``0``: any free port, see the log line), bound to
``aaabus.metrics.host`` (default ``127.0.0.1``: the page is not authenticated, so it is not exposed
beyond the machine unless asked). Served by the standard ``prometheus_client`` HTTP server; each
scrape takes one consistent snapshot on the engine thread
(:func:`aaabus.node.status.server_status`),
so a scrape costs about what one ``aaabus status`` does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from aaabus.errors import AdminError, MetricsError
from aaabus.node.control import NodeControl

__all__ = ["MetricsEndpoint", "MetricsError"]

log = logging.getLogger("aaabus.metrics")

#: Counters: (status path, metric name, help).
_COUNTERS = (
    (("reactions",), "aaabus_reactions", "Reactions run since the server started."),
    (("commits",), "aaabus_commits", "Group commits since the server started."),
    (("errors",), "aaabus_reaction_errors", "Reactions that raised, since the server started."),
    (
        ("dead_letters", "count"),
        "aaabus_dead_letters",
        "Inputs consumed unread because their body did not decode, since the server started.",
    ),
    (("messages", "sent"), "aaabus_notifications_sent", "Notifications sent since start."),
    (
        ("messages", "delivered"),
        "aaabus_notifications_delivered",
        "Notifications delivered to this server's agents since start.",
    ),
    (
        ("messages", "sent_remote"),
        "aaabus_messages_sent_remote",
        "Messages stamped for other servers since the store was created (clock row).",
    ),
    (
        ("messages", "received_remote"),
        "aaabus_messages_received_remote",
        "Messages accepted from other servers since the store was created (clock column).",
    ),
)
_GAUGES = (
    (("uptime_s",), "aaabus_uptime_seconds", "Seconds since the server started."),
    (("queues", "input"), "aaabus_queue_input", "Deliverable notifications waiting (qin)."),
    (("queues", "held_back"), "aaabus_queue_held_back", "Messages held back by causal order."),
    (("storage_bytes",), "aaabus_storage_bytes", "Size of the server's store."),
    (("clock_cells",), "aaabus_clock_cells", "Cells of all this server's matrix clocks."),
)


class _Collector(Collector):
    def __init__(self, server: NodeControl) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        labels = {"server": str(self.server.server_id)}
        try:
            status = self.server.status(timeout=5.0)
        except (AdminError, TimeoutError):
            up = GaugeMetricFamily("aaabus_up", "1 when the server answers.", labels=["server"])
            up.add_metric([labels["server"]], 0)
            yield up
            return
        up = GaugeMetricFamily("aaabus_up", "1 when the server answers.", labels=["server"])
        up.add_metric([labels["server"]], 1)
        yield up
        if "replication" in status:
            yield from _replication_metrics(labels["server"], status["replication"])
        if status.get("partial"):
            return  # the engine is inside a commit waiting for replicas: only their figures
        for path, name, text in _COUNTERS:
            counter = CounterMetricFamily(name, text, labels=["server"])
            counter.add_metric([labels["server"]], _dig(status, path))
            yield counter
        for path, name, text in _GAUGES:
            gauge = GaugeMetricFamily(name, text, labels=["server"])
            gauge.add_metric([labels["server"]], _dig(status, path))
            yield gauge
        outgoing = GaugeMetricFamily(
            "aaabus_queue_outgoing",
            "Messages not yet acknowledged by the next hop.",
            labels=["server", "peer"],
        )
        for peer, depth in status["queues"]["outgoing"].items():
            outgoing.add_metric([labels["server"], peer], depth)
        yield outgoing
        links = GaugeMetricFamily(
            "aaabus_link_up", "1 when the link to a neighbour is up.", labels=["server", "peer"]
        )
        for peer, is_up in status["links"].items():
            links.add_metric([labels["server"], peer], 1 if is_up else 0)
        yield links
        clocks = GaugeMetricFamily(
            "aaabus_clock_size",
            "Servers in each of this server's domains.",
            labels=["server", "domain"],
        )
        for domain, size in status["clocks"].items():
            clocks.add_metric([labels["server"], domain], size)
        yield clocks


def _replication_metrics(server: str, figures: dict[str, Any]) -> Iterator[Metric]:
    """A primary's replicas (aaabus.node.replication): connected, how far behind, and how long
    the commit waiting for them (if one does) has waited."""
    waiting = GaugeMetricFamily(
        "aaabus_replication_waiting_seconds",
        "How long the commit waiting for its synchronous replicas has waited (0: none waits).",
        labels=["server"],
    )
    waiting.add_metric([server], figures["waiting_s"] or 0.0)
    yield waiting
    families = {
        "connected": GaugeMetricFamily(
            "aaabus_replica_connected",
            "1 when the replica's link is up.",
            labels=["server", "replica"],
        ),
        "behind_commits": GaugeMetricFamily(
            "aaabus_replica_lag_commits",
            "Commits of this server the replica has not acknowledged yet.",
            labels=["server", "replica"],
        ),
        "behind_bytes": GaugeMetricFamily(
            "aaabus_replica_lag_bytes",
            "Bytes of commits of this server the replica has not acknowledged yet.",
            labels=["server", "replica"],
        ),
    }
    for index, rep in figures["replicas"].items():
        for key, family in families.items():
            value = rep[key]
            if value is not None:  # the lag is unknown until its first acknowledgement
                family.add_metric([server, index], float(value))
    yield from families.values()


def _dig(status: dict[str, Any], path: tuple[str, ...]) -> float:
    value: Any = status
    for key in path:
        value = value[key]
    return float(value)


class MetricsEndpoint:
    """``GET /metrics`` for one server, on its own registry (several servers may share a
    process)."""

    def __init__(self, server: NodeControl, host: str, port: int) -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Collector(server))
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise MetricsError(
                f"metrics port {port} on {host} of server {server.server_id} is not usable "
                f"({exc.strerror or exc}); change property aaabus.metrics.port"
            ) from None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._httpd.server_address[:2]
        return str(host), int(port)

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)
