"""Talking to a bus from a program that is not one of its servers.

::

    from aaabus.tools.client import Client

    with Client("a3.xml", server=0) as client:          # reads the bus secret beside a3.xml
        greeter = client.deploy(Greeter(), server=1)    # the new agent's id
        client.send(greeter, Hello("world"))

A client talks to ONE server of the bus, through its admin port (:mod:`aaabus.node.admin`),
authenticated with the bus secret. A server with replicas is reached at whichever of its members
is primary: every connection tries each member's admin address in turn (member 0 first, then
the one that answered last), so a client whose server fails over finds the new primary by
itself, through the retries below. What it sends leaves that server as if sent by a boot
service, from ``#s.s.0``: the server commits the notification (queued for its target like any
other send) *before* it answers, so once :meth:`Client.send` returns, delivery is guaranteed
exactly once and in causal order with everything else that server's ``#s.s.0`` sends — including
the client's earlier sends, which therefore arrive in the order they were sent.

Topics: :meth:`Client.publish` publishes from ``#s.s.0`` of that server; :meth:`Client.subscribe`
opens a subscription whose backlog waits in a mailbox agent on that server
(:mod:`aaabus.tools.subscription`); :meth:`Client.request` sends a notification and waits for the
agent's reply, which lands in a mailbox too.

Retries are safe: every request carries an id chosen by the client and kept across its retries;
the server records it in the transaction that performs the request and answers a repeated id with
the first answer instead of acting twice. The last ``aaabus.client.remember`` ids (default
100000) are kept, in the server's store. Ids are per server: a request retried through another
server could be performed twice. A request that gets no answer (the server is down, busy, or
cut the connection) is tried again, with its id, after a delay that
:class:`~aaabus.io.backoff.Backoff` draws (the policy a server redialling a peer follows too),
until the client's ``timeout``.
"""

from __future__ import annotations

import base64
import os
import threading
import time
import uuid
from typing import Any

import cloudpickle

from aaabus.config.admin_port import member_admin_addresses
from aaabus.config.reader import BusConfig, load_config
from aaabus.config.secret import Credential, load_credential, secret_path
from aaabus.errors import AdminError, RequestRefused, ServerBusy, ServerUnreachable, WireError
from aaabus.io.adminlink import AdminLink
from aaabus.io.backoff import Backoff
from aaabus.io.tls import tls_contexts
from aaabus.model.agent import Agent
from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification
from aaabus.model.pubsub import Publication
from aaabus.model.topicnames import check_filter, check_topic
from aaabus.tools.subscription import FETCH_WAIT, Subscription
from aaabus.wire.codec import Codec

__all__ = ["AdminError", "Client", "RequestRefused", "ServerUnreachable"]

#: Seconds between two attempts of a request, from RETRY_FIRST doubling up to RETRY_MAX with
#: jitter: the bus's one retry policy (aaabus.io.backoff), which a server redialling a peer uses.
RETRY_FIRST = 0.05
RETRY_MAX = 1.0


class Client:
    """A connection to one server of a bus: deploy agents, send notifications, ask its status.

    ``config``: the bus's ``a3.xml`` (path or loaded). ``server``: the server to go through
    (default: the lowest id). ``secret``: the bus key, or a
    :class:`~aaabus.config.secret.Credential` from
    :func:`~aaabus.config.secret.load_credential` (a tool key file, ``aaabus secret --tool
    --scope S``, whose scope bounds what the server lets this client do); default: the file the
    config names, ``bus.key`` beside it. The bus key claims scope ``operate``; a program that
    must deploy by value passes ``Credential(bus_key, Scope.CODE)`` (docs/security.md).
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
        members = member_admin_addresses(self.config, self.server)
        if not members:
            raise AdminError(f"server {self.server} has no admin port (aaabus.admin.port=off)")
        #: The admin address of each member of the server, member 0 first: only the primary
        #: listens, so a connection tries them in turn (issue 42, failover).
        self.addresses = tuple(address for _member, address in members)
        self._members = tuple(member for member, _address in members)
        # The position of the member that answered last: tried first by the next connection.
        self._at = 0
        self.secret = (
            secret if secret is not None else load_credential(secret_path(self.config, self.server))
        )
        self.timeout = timeout
        # TLS when the server's properties ask for it (aaabus.tls.*): the client presents the
        # same certificate, so it must run where those files are readable.
        self._tls = tls_contexts(self.config, self.server)[1]
        #: Data both ways; pickles only where the bus opted in (property aaabus.wire.pickle).
        self.codec = Codec(pickles=self.config.setting(self.server, "aaabus.wire.pickle"))
        self._link: AdminLink | None = None
        self._pause = threading.Event()  # never set: a wait that cannot be cut short

    @property
    def address(self) -> tuple[str, int]:
        """The admin address in use: the member that answered last (member 0 before any)."""
        return self.addresses[self._at]

    @property
    def member(self) -> int:
        """The index of the member that answered last (0: the server itself; K: its replica K),
        the primary when it answered."""
        return self._members[self._at]

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
        body = base64.b64encode(self.codec.encode(note)).decode("ascii")
        answer = self._request(
            {"op": "send", "id": request_id or _new_id(), "to": str(target), "note": body}
        )
        return not answer.get("duplicate", False)

    def deploy(
        self,
        agent: Agent,
        server: int | None = None,
        *,
        request_id: str | None = None,
        by_value: bool = False,
    ) -> AgentId:
        """Create ``agent`` on ``server`` (default: the client's server); returns its id.

        The agent travels as its class's name and its attributes, as data: its class must be
        in a module the servers import. ``by_value``: send its code instead (cloudpickle), for a
        class defined in ``__main__`` or a notebook -- code execution, which the server accepts
        only where its operator allowed it and from a credential allowed to (docs/security.md).
        As with a deploy from a reaction, anything sent to the new id afterwards through this
        client arrives after the creation.
        """
        if not isinstance(agent, Agent):
            raise TypeError(f"{type(agent).__name__} is not an aaabus.Agent")
        if agent.deployed:
            raise RuntimeError(f"{agent!r} is already deployed")
        data = cloudpickle.dumps(agent) if by_value else self.codec.encode_agent(agent)
        body = base64.b64encode(data).decode("ascii")
        answer = self._request(
            {"op": "deploy", "id": request_id or _new_id(), "agent": body, "server": server}
        )
        return AgentId.parse(answer["agent"])

    def publish(
        self, topic: str, payload: Any, *, retain: bool = False, request_id: str | None = None
    ) -> bool:
        """Publish ``payload`` (data: see :mod:`aaabus.wire.codec`) on ``topic``.

        Returns once the server has committed it, as :meth:`send` does (``False``: the server
        had already accepted ``request_id``). The publisher is the server, ``#s.s.0``: in causal
        order with everything this client published or sent through the same server before.
        Raises :class:`~aaabus.TopicError` for a malformed topic name.
        """
        body = base64.b64encode(self.codec.encode_value(payload)).decode("ascii")
        answer = self._request(
            {
                "op": "publish",
                "id": request_id or _new_id(),
                "topic": check_topic(topic),
                "payload": body,
                "retain": retain,
            }
        )
        return not answer.get("duplicate", False)

    def subscribe(self, topic_filter: str, name: str | None = None) -> Subscription[Publication]:
        """Subscribe to ``topic_filter``; iterate the result to get :class:`~aaabus.Publication` s.

        The subscription takes effect when this returns for publications made through this
        server, and once the other servers have heard of it for theirs (a few link delays; the
        ``topics`` figures of ``aaabus status`` show it). ``name``: a durable subscription, kept
        by the server across restarts and client processes, resumed by subscribing again with
        the same name (and filter; another filter is refused). Without a name it lasts until
        :meth:`Subscription.close`. Raises :class:`~aaabus.TopicError` for a bad filter.
        """
        check_filter(topic_filter)
        durable = name is not None
        mailbox = name if name is not None else f"client-{_new_id()}"
        self._request(
            {"op": "subscribe", "name": mailbox, "filter": topic_filter, "durable": durable}
        )
        return Subscription[Publication](
            self._request,
            mailbox,
            topic_filter,
            durable=durable,
            decode=self.codec.decode,
            wait=self._fetch_wait(),
        )

    def unsubscribe(self, name: str) -> None:
        """Delete the named subscription ``name`` and its backlog (nothing if there is none)."""
        self._request({"op": "unsubscribe", "name": name})

    def request(
        self, agent: AgentId | str, note: Notification, timeout: float = 30.0
    ) -> Notification:
        """Send ``note`` to ``agent`` and return its reply (the first notification it sends
        back to the sender it saw). The request is sent once, even if this call retries.

        The reply may be an :class:`~aaabus.ExceptionNotification` (the agent raised) or an
        :class:`~aaabus.UnknownAgent`. Raises :class:`TimeoutError` if none came within
        ``timeout`` seconds (a late reply is dropped with the request's mailbox).
        """
        target = AgentId.parse(agent) if isinstance(agent, str) else agent
        if not isinstance(note, Notification):
            raise TypeError(f"{type(note).__name__} is not an aaabus.Notification")
        key = _new_id()
        body = base64.b64encode(self.codec.encode(note)).decode("ascii")
        self._request({"op": "request", "id": key, "to": str(target), "note": body})
        replies = Subscription[Notification](
            self._request,
            f"request-{key}",
            "",
            durable=False,
            decode=self.codec.decode,
            batch=1,
            wait=self._fetch_wait(),
        )
        try:
            reply = replies.get(timeout)
        finally:
            replies.close()
        if reply is None:
            raise TimeoutError(f"no reply from {target} within {timeout:g}s")
        return reply

    def _fetch_wait(self) -> float:
        # A fetch that waits on the server must be answered well within this client's timeout.
        return min(FETCH_WAIT, self.timeout / 3)

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

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- retries ----------------------------------------------------------------------------------

    def _request(self, request: dict[str, Any]) -> dict[str, Any]:
        deadline = time.monotonic() + self.timeout
        backoff = Backoff(RETRY_FIRST, RETRY_MAX)
        while True:
            try:
                if self._link is None:
                    left = max(0.1, deadline - time.monotonic())
                    # Every member in turn, the last one that answered first: after a
                    # failover the new primary is found by the same retries.
                    self._link, self._at = AdminLink.connect_any(
                        self.addresses,
                        self.secret,
                        self.server,
                        first=self._at,
                        timeout=min(5.0, left),
                        tls=self._tls,
                    )
                self._link.sock.settimeout(max(0.1, deadline - time.monotonic()))
                answer = self._link.request(request)
            except (ServerUnreachable, ServerBusy, WireError, OSError) as exc:
                # The request may or may not have been performed: send it again, same id.
                self.close()
                delay = backoff.next_delay()
                if time.monotonic() + delay >= deadline:
                    raise ServerUnreachable(
                        f"server {self.server} did not answer within {self.timeout:g}s ({exc})"
                    ) from None
                self._pause.wait(delay)
                continue
            if not answer.get("ok"):
                if answer.get("close"):
                    self.close()  # the server ends the connection after such a refusal
                raise RequestRefused(f"server {self.server}: {answer.get('error', 'refused')}")
            return answer


def _new_id() -> str:
    return uuid.uuid4().hex
