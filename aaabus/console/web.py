"""The console's web server (aiohttp): the page, its JSON API and its live stream.

Everything runs on one asyncio event loop (the console's main thread): the request handlers,
the :class:`~aaabus.console.board.Board` they read, and the broadcaster that pushes the board to
the open pages. The pollers (:mod:`aaabus.console.poller`, one thread per server) hand their
readings to the loop with ``call_soon_threadsafe``; the one action, stopping a server, runs its
blocking admin request on the loop's default executor.

Routes::

    GET  /                      the page (static/index.html)
    GET  /static/<file>         its script and style, from the package (no network)
    GET  /api/servers           every server: id, name, domains, router, up, state, error,
                                figures (null unless up), links, history
    GET  /api/graph             domains, and per server and domain whether its links are up
    GET  /api/clients           connected MQTT devices (server, protocol, keep-alive, ...)
    GET  /api/topics            subscribed topic filters and the servers subscribed
    GET  /api/roaming           roaming MQTT sessions: anchor and holder
    GET  /api/state             all of the above in one object
    GET  /api/session           {"operate": bool, "token": ...}: what the page may offer
    GET  /api/events            Server-Sent Events: the state, each time it changed (<= 2/s)
    POST /api/servers/<id>/stop stop a server: only with an operate key, the page's token and
                                the server's name typed as confirmation

Who may ask: requests whose ``Host`` is not the console's own address are refused (a web page
elsewhere cannot reach the console by rebinding a name to 127.0.0.1), and the page may not be
framed. The stop request needs the token that only a same-origin page can read, in a header a
cross-site form cannot set.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources
import ipaddress
import json
import logging
import secrets
import signal
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from aaabus.config.admin_port import member_admin_addresses
from aaabus.config.reader import BusConfig
from aaabus.config.secret import Credential
from aaabus.console.board import Board
from aaabus.console.poller import Poller, Reading
from aaabus.errors import AaabusError, LaunchError
from aaabus.io.adminlink import AdminLink
from aaabus.io.tls import tls_contexts

__all__ = ["Console"]

log = logging.getLogger("aaabus.console")

#: Pages following the live stream at once; more are answered 503 (each holds a connection).
MAX_STREAMS = 32
#: Seconds between two pushes of the state at most, and between two keep-alive comments.
PUSH_EVERY = 0.5
KEEP_ALIVE = 15.0
#: Seconds the stop request has to reach the server and be answered.
STOP_TIMEOUT = 10.0
_STATIC = {
    "console.js": "text/javascript",
    "console.css": "text/css",
}
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Console:
    """The console of the bus ``config`` (see the module docstring).

    ``read``: the credential the pollers read with (``read`` scope); ``operate``: the one the
    stop action uses, or None (then the page offers no action). ``tls``: the context to serve
    HTTPS with, or None.
    """

    def __init__(
        self,
        config: BusConfig,
        board: Board,
        read: Credential,
        operate: Credential | None,
        host: str,
        port: int,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.config = config
        self.board = board
        self._read = read
        self._operate = operate
        self._host = host
        self._port = port
        self._tls = tls
        self._token = secrets.token_urlsafe(24)
        self._allowed_hosts: set[str] = set()
        self._streams = 0
        self._closing = False  # set once on the way out: the open streams end
        self._latest = b""
        self._tick = asyncio.Event()
        self._pollers: list[Poller] = []
        self._page = importlib.resources.files("aaabus.console").joinpath("static")

    # -- life ---------------------------------------------------------------------------------

    async def serve(self, on_ready: Callable[[str], None]) -> None:
        """Start the pollers and the web server, call ``on_ready(url)``, run until SIGINT or
        SIGTERM. LaunchError (one line) when the address cannot be bound."""
        loop = asyncio.get_running_loop()
        # Made before anything listens: a server's TLS files that cannot be read fail here.
        self._make_pollers(loop)
        app = web.Application(middlewares=[self._guard])
        self._routes(app)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, self._host, self._port, ssl_context=self._tls)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise LaunchError(
                f"cannot serve the console on {self._host}:{self._port} "
                f"({exc.strerror or exc}); choose another --port"
            ) from None
        port = _bound_port(runner, self._port)
        self._allowed_hosts = _host_names(self._host, port)
        for poller in self._pollers:
            poller.start()
        broadcaster = loop.create_task(self._broadcast(), name="console-broadcast")
        stop = asyncio.Event()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, stop.set)
        scheme = "https" if self._tls else "http"
        shown = f"[{self._host}]" if ":" in self._host else self._host
        on_ready(f"{scheme}://{shown}:{port}/")
        try:
            await stop.wait()
        finally:
            for poller in self._pollers:
                poller.stop()
            broadcaster.cancel()
            self._closing = True
            self._tick.set()  # wakes the open streams, which end: cleanup need not wait
            await runner.cleanup()

    def _make_pollers(self, loop: asyncio.AbstractEventLoop) -> None:
        def deliver(reading: Reading) -> None:
            # Poller threads: hand over to the loop, which owns the board. A reading that
            # arrives after the loop closed has nobody to tell.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self.board.update, reading)

        self._pollers = [
            Poller(self.config, sid, self._read, deliver) for sid in self.config.servers
        ]

    async def _broadcast(self) -> None:
        """Loop task: each PUSH_EVERY, if the board moved, serialize it once and wake every
        stream (each then writes the same bytes at its own pace)."""
        sent = -1
        while True:
            if self.board.version != sent:
                sent = self.board.version
                self._latest = json.dumps(self.board.state_json()).encode()
                tick, self._tick = self._tick, asyncio.Event()
                tick.set()
            await asyncio.sleep(PUSH_EVERY)

    # -- HTTP ---------------------------------------------------------------------------------

    def _routes(self, app: web.Application) -> None:
        views: dict[str, Callable[[], dict[str, Any] | list[dict[str, Any]]]] = {
            "servers": self.board.servers_json,
            "graph": self.board.graph_json,
            "clients": self.board.clients_json,
            "topics": self.board.topics_json,
            "roaming": self.board.roaming_json,
            "state": self.board.state_json,
        }
        app.router.add_get("/", self._index)
        app.router.add_get("/static/{name}", self._static)
        for name, view in views.items():
            app.router.add_get(f"/api/{name}", _json_view(view))
        app.router.add_get("/api/session", self._session)
        app.router.add_get("/api/events", self._events)
        app.router.add_post("/api/servers/{id}/stop", self._stop_server)

    @web.middleware
    async def _guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.host not in self._allowed_hosts:
            return web.Response(
                status=421, text=f"this console answers to {sorted(self._allowed_hosts)[0]}\n"
            )
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            response = exc
        for name, value in _HEADERS.items():
            response.headers.setdefault(name, value)
        return response

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._page.joinpath("index.html").read_bytes(),
            content_type="text/html",
            charset="utf-8",
        )

    async def _static(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        kind = _STATIC.get(name)
        if kind is None:  # only the files named here: no path ever reaches the file system
            raise web.HTTPNotFound()
        return web.Response(body=self._page.joinpath(name).read_bytes(), content_type=kind)

    async def _session(self, request: web.Request) -> web.Response:
        operate = self._operate is not None
        return web.json_response({"operate": operate, "token": self._token if operate else None})

    async def _events(self, request: web.Request) -> web.StreamResponse:
        if self._streams >= MAX_STREAMS:
            raise web.HTTPServiceUnavailable(text=f"at most {MAX_STREAMS} live pages at once\n")
        self._streams += 1
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        try:
            await response.prepare(request)
            if self._latest:
                await response.write(b"data: " + self._latest + b"\n\n")
            while True:
                tick = self._tick
                try:
                    await asyncio.wait_for(tick.wait(), KEEP_ALIVE)
                except TimeoutError:
                    await response.write(b": still here\n\n")
                    continue
                if self._closing or request.transport is None or request.transport.is_closing():
                    break
                await response.write(b"data: " + self._latest + b"\n\n")
        except ConnectionResetError:
            pass  # the page went away
        finally:
            self._streams -= 1
        return response

    async def _stop_server(self, request: web.Request) -> web.Response:
        if self._operate is None:
            return _refuse(403, "this console has no operate key (start it with --operate-key)")
        if not secrets.compare_digest(request.headers.get("X-Console-Token", ""), self._token):
            return _refuse(403, "missing or wrong X-Console-Token: reload the page")
        try:
            sid = int(request.match_info["id"])
            spec = self.config.servers[sid]
            body = await request.json()
        except (ValueError, KeyError, json.JSONDecodeError):
            return _refuse(400, "no such server, or the body is not JSON")
        if not isinstance(body, dict) or body.get("confirm") != spec.name:
            return _refuse(400, f"confirm by sending the server's name: {spec.name!r}")
        log.warning("console: stopping server %s (%s) as asked from the page", sid, spec.name)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, _stop, self.config, sid, self._operate)
        except AaabusError as exc:
            return _refuse(502, str(exc))
        return web.json_response({"ok": True, "stopped": sid})


def _json_view(view: Callable[[], Any]) -> Handler:
    async def handler(request: web.Request) -> web.Response:
        return web.json_response(view())

    return handler


def _refuse(status: int, error: str) -> web.Response:
    return web.json_response({"ok": False, "error": error}, status=status)


def _stop(config: BusConfig, sid: int, credential: Credential) -> None:
    """Ask server ``sid`` to stop (a thread of the loop's executor; AaabusError, one line)."""
    members = member_admin_addresses(config, sid)
    if not members:
        raise LaunchError(f"server {sid} has no admin port (aaabus.admin.port=off)")
    link, _at = AdminLink.connect_any(
        [address for _m, address in members],
        credential,
        sid,
        timeout=STOP_TIMEOUT,
        tls=tls_contexts(config, sid)[1],
    )
    try:
        link.sock.settimeout(STOP_TIMEOUT)
        answer = link.request({"op": "stop"})
    except OSError as exc:
        raise LaunchError(f"server {sid} did not answer the stop ({exc})") from None
    finally:
        link.close()
    if not answer.get("ok"):
        raise LaunchError(f"server {sid}: {answer.get('error', 'refused')}")


def _bound_port(runner: web.AppRunner, asked: int) -> int:
    """The port the site listens on (``asked``, or the one the kernel chose for 0)."""
    for address in runner.addresses:
        if isinstance(address, tuple):
            return int(address[1])
    return asked


def _host_names(host: str, port: int) -> set[str]:
    """The ``Host`` headers the console answers: its address, and the loopback names when it
    listens on a loopback address."""
    names = {host}
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host).is_loopback:
            names |= {"127.0.0.1", "localhost", "[::1]"}
    if ":" in host:
        names.add(f"[{host}]")
    return {f"{name}:{port}" for name in names}
