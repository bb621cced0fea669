"""Talking to a bus from a program that is not one of its servers.

::

    from aaabus.tools.client import Client

    with Client("a3.xml", server=0) as client:          # reads the bus secret beside a3.xml
        greeter = client.deploy(Greeter(), server=1)    # the new agent's id
        client.send(greeter, Hello("world"))

A client talks to ONE server of the bus, through its admin port (:mod:`aaabus.node.admin`),
authenticated with the bus secret. What it sends leaves that server as if sent by a boot
service, from ``#s.s.0``: the server commits the notification (queued for its target like any
other send) *before* it answers, so once :meth:`Client.send` returns, delivery is guaranteed
exactly once and in causal order with everything else that server's ``#s.s.0`` sends — including
the client's earlier sends, which therefore arrive in the order they were sent.

Retries are safe: every request carries an id chosen by the client and kept across its retries;
the server records it in the transaction that performs the request and answers a repeated id with
the first answer instead of acting twice. The last ``aaabus.client.remember`` ids (default
100000) are kept, in the server's store. Ids are per server: a request retried through another
server could be performed twice.
"""

from __future__ import annotations

import base64
import os
import threading
import time
import uuid
from types import TracebackType
from typing import Any

import cloudpickle

from aaabus.config.admin_port import admin_address
from aaabus.config.reader import BusConfig, load_config
from aaabus.config.secret import Credential, load_credential, secret_path
from aaabus.errors import AdminError, RequestRefused, ServerBusy, ServerUnreachable, WireError
from aaabus.io.link import Link
from aaabus.io.tls import tls_contexts
from aaabus.model.agent import Agent
from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification
from aaabus.wire.message import encode_note

__all__ = ["AdminError", "Client", "RequestRefused", "ServerUnreachable"]


class Client:
    """A connection to one server of a bus: deploy agents, send notifications, ask its status.

    ``config``: the bus's ``a3.xml`` (path or loaded). ``server``: the server to go through
    (default: the lowest id). ``secret``: the bus key, or a
    :class:`~aaabus.config.secret.Credential` from
    :func:`~aaabus.config.secret.load_credential` (a tool key file, ``aaabus secret --tool``);
    default: the file the config names, ``bus.key`` beside it.
    ``timeout``: seconds a request may take, retries included. When the server's config sets
    ``aaabus.tls.cert``, the connection runs inside TLS with the certificate files the config
    names.
    Not thread-safe: one request at a time.
    """

    def __init__(
        self,
        config: str | os.PathLike[str] | BusConfig,
        server: int | None = None,
        *,
        secret: bytes | Credential | None = None,
        timeout: float = 30.0,
    ) -> None:
        self.config = config if isinstance(config, BusConfig) else load_config(config)
        self.server = min(self.config.servers) if server is None else server
        self.config.server(self.server)  # a one-line ConfigError for an unknown id
        address, _ = admin_address(self.config, self.server)
        if address is None:
            raise AdminError(f"server {self.server} has no admin port (aaabus.admin.port=off)")
        self.address = address
        self.secret = (
            secret if secret is not None else load_credential(secret_path(self.config, self.server))
        )
        self.timeout = timeout
        # TLS when the server's properties ask for it (aaabus.tls.*): the client presents the
        # same certificate, so it must run where those files are readable.
        self._tls = tls_contexts(self.config, self.server)[1]
        self._link: Link | None = None
        self._pause = threading.Event()  # never set: a wait that cannot be cut short

    # -- the API ----------------------------------------------------------------------------------

    def send(self, to: AgentId | str, note: Notification, *, request_id: str | None = None) -> bool:
        """Send ``note`` to agent ``to``; returns once the server has committed it.

        Returns ``True``, or ``False`` when the server had already accepted ``request_id``
        (an earlier attempt whose answer was lost): the notification was not sent twice.

        Raises :class:`RequestRefused` (bad target, notification the server cannot load) or
        :class:`ServerUnreachable` (no answer within the timeout: the notification may or may
        not have been accepted; sending again with the same ``request_id`` settles it).
        """
        target = AgentId.parse(to) if isinstance(to, str) else to
        if not isinstance(note, Notification):
            raise TypeError(f"{type(note).__name__} is not an aaabus.Notification")
        body = base64.b64encode(encode_note(note)).decode("ascii")
        answer = self._request(
            {"op": "send", "id": request_id or _new_id(), "to": str(target), "note": body}
        )
        return not answer.get("duplicate", False)

    def deploy(
        self, agent: Agent, server: int | None = None, *, request_id: str | None = None
    ) -> AgentId:
        """Create ``agent`` on ``server`` (default: the client's server); returns its id.

        As with a deploy from a reaction, anything sent to the new id afterwards through this
        client arrives after the creation.
        """
        if not isinstance(agent, Agent):
            raise TypeError(f"{type(agent).__name__} is not an aaabus.Agent")
        if agent.deployed:
            raise RuntimeError(f"{agent!r} is already deployed")
        body = base64.b64encode(cloudpickle.dumps(agent)).decode("ascii")
        answer = self._request(
            {"op": "deploy", "id": request_id or _new_id(), "agent": body, "server": server}
        )
        return AgentId.parse(answer["agent"])

    def arm_failpoints(self, spec: str) -> None:
        """Arm failpoints on the server (``name:action[:skip[:times]],...``, see
        :mod:`aaabus.core.failpoints`). A testing tool: the server refuses unless it was started
        with ``AAABUS_FAILPOINTS`` set."""
        self._request({"op": "failpoints", "arm": spec})

    def status(self) -> dict[str, Any]:
        """The server's figures, as ``aaabus status --json`` shows them."""
        status: dict[str, Any] = self._request({"op": "status"})["status"]
        return status

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- retries ----------------------------------------------------------------------------------

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        delay = 0.05
        while True:
            try:
                if self._link is None:
                    left = max(0.1, deadline - time.monotonic())
                    self._link = Link.connect(
                        self.address,
                        self.secret,
                        self.server,
                        timeout=min(5.0, left),
                        tls=self._tls,
                    )
                self._link.sock.settimeout(max(0.1, deadline - time.monotonic()))
                answer = self._link.request(request)
            except (ServerUnreachable, ServerBusy, WireError, OSError) as exc:
                # The request may or may not have been performed: send it again, same id.
                self.close()
                if time.monotonic() + delay >= deadline:
                    raise ServerUnreachable(
                        f"server {self.server} did not answer within {self.timeout:g}s ({exc})"
                    ) from None
                self._pause.wait(delay)
                delay = min(2 * delay, 1.0)
                continue
            if not answer.get("ok"):
                raise RequestRefused(f"server {self.server}: {answer.get('error', 'refused')}")
            return answer


def _new_id() -> str:
    return uuid.uuid4().hex
