"""aaabus behind its MQTT listener, for ``perf mqtt`` and ``perf edge``: a bus of server
processes on a layout of domains, some servers with a listener, some links between servers
through a delaying :class:`~aaabus.testing.proxy.FaultProxy` (the WAN of ``perf edge``).

Runs in the suite's main thread; servers are processes (stopped by PID through
:class:`~aaabus.tools.launch.Bus`), proxies are threads of this process, all stopped on exit.

For the scale scenarios of ``perf mqtt --devices``/``--storm``, :func:`mqtt_servers` also gives
each server's PID (its RSS, threads and CPU are read from ``/proc``), takes listener properties
(``aaabus.mqtt.max_connections`` ...) and can start the servers with a raised file limit
(``nofile``: their soft ``RLIMIT_NOFILE``, set by ``preexec_fn`` in the child before it runs the
server, never above the hard limit, never the system's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from aaabus.config.reader import load_config
from aaabus.config.topology import render
from aaabus.testing.proxy import FaultProxy
from aaabus.tools.launch import Bus, free_port_base
from perf.brokers import Endpoint, nofile_raiser
from perf.harness import REPO_ROOT


@dataclass(frozen=True)
class WanLink:
    """The link between servers ``a`` and ``b`` crosses a proxy delaying each way by ``delay``
    (plus up to ``jitter``) seconds; ``seed`` makes the jitter repeatable."""

    a: int
    b: int
    delay: float
    jitter: float
    seed: int


def _splice(text: str, server: int, properties: Mapping[str, str]) -> str:
    """``text`` with ``properties`` added to server ``server``'s element (per-server values)."""
    start = text.index(f'<server id="{server}"')
    end = text.index("</server>", start)
    xml = "".join(f'  <property name="{k}" value="{v}"/>\n  ' for k, v in properties.items())
    return text[:end] + xml + text[end:]


@dataclass
class MqttServers:
    """A running bus: each listener's endpoint, each server's PID, and the bus itself (to kill
    and restart a server: ``bus[sid].kill()``, ``bus[sid].start().wait_ready()``)."""

    endpoints: dict[int, Endpoint]
    pids: dict[int, int]
    bus: Bus


@contextlib.contextmanager
def mqtt_bus(
    work: Path,
    layout: list[list[int]],
    listeners: Mapping[int, int],
    wan: tuple[WanLink, ...] = (),
) -> Iterator[dict[int, Endpoint]]:
    """Start the bus of ``layout`` in ``work``; ``listeners`` maps a server to the inflight
    window of its MQTT listener. Yields each listener's endpoint; stops everything on exit."""
    with mqtt_servers(work, layout, listeners, wan) as servers:
        yield servers.endpoints


@contextlib.contextmanager
def mqtt_servers(
    work: Path,
    layout: list[list[int]],
    listeners: Mapping[int, int],
    wan: tuple[WanLink, ...] = (),
    properties: Mapping[str, str] | None = None,
    nofile: int | None = None,
    bus_properties: Mapping[str, str] | None = None,
) -> Iterator[MqttServers]:
    """:func:`mqtt_bus`, with ``properties`` added to every listener's server (they win over the
    defaults set here), ``bus_properties`` to the whole bus (global properties), and with
    ``nofile`` the servers' soft file limit raised to it (``perf.brokers.NOFILE_HARD``: to the
    hard limit). Yields the endpoints, the PIDs and the bus."""
    work.mkdir(parents=True, exist_ok=True)
    servers = 1 + max(max(members) for members in layout)
    ports = sum(len(m) for m in layout)
    # One run for the bus's ports and the listeners' after them: drawn apart, a listener's
    # port could be one of the bus's (both free before the bus starts), and a server failed to
    # bind it ("Address already in use").
    base = free_port_base(ports + 1 + len(listeners))
    text = render(
        layout,
        servers,
        base_port=base,
        properties={"aaabus.mqtt.anonymous": "true", **(bus_properties or {})},
    )
    config = work / "a3.xml"
    config.write_text(text)
    cfg = load_config(config)
    proxies: list[FaultProxy] = []
    try:
        extra: dict[int, dict[str, str]] = {s: {} for s in range(servers)}
        for link in wan:
            for src, dst in ((link.a, link.b), (link.b, link.a)):
                shared = next(d for d in cfg.servers[dst].domains if d in cfg.servers[src].domains)
                proxy = FaultProxy(
                    ("127.0.0.1", cfg.servers[dst].port_in(shared)),
                    name=f"wan-{src}-{dst}",
                    seed=link.seed * 2 + len(proxies),
                )
                proxies.append(proxy)
                proxy.set_delay(link.delay, jitter=link.jitter)
                extra[src][f"aaabus.dial.{dst}"] = f"127.0.0.1:{proxy.port}"
        mqtt_ports = {server: base + ports + 1 + i for i, server in enumerate(listeners)}
        for server, port in mqtt_ports.items():
            extra[server]["aaabus.mqtt.port"] = str(port)
            extra[server]["aaabus.mqtt.inflight"] = str(listeners[server])
            extra[server].update(properties or {})
        for server, props in extra.items():
            if props:
                text = _splice(text, server, props)
        config.write_text(text)
        bus = Bus(config, range(servers), work / "store", cwd=REPO_ROOT)
        if nofile is not None:
            preexec = nofile_raiser(nofile)
            for proc in bus.servers.values():
                proc.preexec = preexec  # raises the file limit of the server process alone
        with bus:
            yield MqttServers(
                {s: Endpoint("127.0.0.1", p) for s, p in mqtt_ports.items()},
                {sid: proc.pid for sid, proc in bus.servers.items()},
                bus,
            )
    finally:
        for proxy in proxies:
            proxy.stop()
