"""An agent server: the store, the engine and the channel of one server, put together.

Usable in-process (tests, simulation) as well as from the ``aaabus-server`` command::

    server = AgentServer(load_config("a3.xml"), 0)
    server.start()
    ...
    server.stop()
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from BTrees.LOBTree import LOBTree
from BTrees.OOBTree import OOBTree

from aaabus.config.domains import Topology
from aaabus.config.hosts import member_hosts
from aaabus.config.reader import BusConfig, Member, ServiceConfig
from aaabus.config.secret import load_server_keys, secret_path
from aaabus.config.trust import policy_for
from aaabus.core.channel import Channel
from aaabus.core.engine import Engine
from aaabus.core.epoch import NO_EPOCH, read_epoch, write_epoch
from aaabus.core.failpoints import ENV_VAR as FAILPOINTS_ENV
from aaabus.core.logstorage import LogStorage
from aaabus.core.store import STORE_KINDS, Store, open_store
from aaabus.core.trace import Tracer
from aaabus.errors import AaabusError, ConfigError, ServiceFailed
from aaabus.extras import require
from aaabus.io.network import Network
from aaabus.io.tls import tls_contexts
from aaabus.model.agent import Agent
from aaabus.model.ids import SESSIONS_STAMP, SHARES_STAMP, TOPICS_STAMP, AgentId
from aaabus.model.notifications import Notification
from aaabus.model.pubsub import Publish, Subscribe, Unsubscribe
from aaabus.mqtt.bridge import MqttBridge, forget_now
from aaabus.mqtt.bridgesettings import BridgeSettings
from aaabus.mqtt.sessions import MqttSessions, RetainedBounds
from aaabus.node.epochs import EpochBook
from aaabus.node.mailboxes import MailboxDesk
from aaabus.node.replication import ReplicationLinks
from aaabus.node.status import server_status
from aaabus.node.voter import Voter
from aaabus.topics.messages import TopicRoutes
from aaabus.topics.representative import TopicRepresentative
from aaabus.wire.codec import Codec

if TYPE_CHECKING:
    from aaabus.core.traffic import TrafficRecorder
    from aaabus.mqtt.listener import MqttListener
    from aaabus.node.admin import AdminEndpoint
    from aaabus.node.metrics import MetricsEndpoint

log = logging.getLogger("aaabus.server")
T = TypeVar("T")

#: Store root keys of the client request ids already accepted (see :meth:`accept_once`).
_SEEN = "client_requests"
_SEEN_ORDER = "client_requests_order"


@dataclass(frozen=True)
class BootContext:
    """What a boot-time service receives: ``service(ctx, args, first_time)``.

    The service runs on the engine thread inside a transaction whose sender is ``#s.s.0``;
    everything it sends or deploys is committed when it returns, or dropped if it raises.
    """

    server_id: int
    config: BusConfig
    send: Callable[[AgentId, Notification], None]


def resolve_service(cfg: BusConfig, service: ServiceConfig) -> Callable[..., Any]:
    """Import a service's ``module:attr``; a one-line ConfigError if that fails."""
    module_name, _, attr = service.cls.partition(":")
    where = cfg.where(service.line)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(
            f"service class {service.cls} cannot be imported ({type(exc).__name__}: {exc}); "
            "check the module path and PYTHONPATH",
            where,
        ) from None
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise ConfigError(
                f"service class {service.cls}: module {module_name} has no attribute {attr}", where
            )
    if not callable(target):
        raise ConfigError(f"service class {service.cls} is not callable", where)
    return target


class AgentServer:
    """One agent server of the bus described by ``config``."""

    def __init__(
        self,
        config: BusConfig,
        server_id: int,
        *,
        storage: str | os.PathLike[str] | None = None,
        store_kind: str | None = None,
        endpoints: bool = False,
        topology: Topology | None = None,
        member: int = 0,
        members: tuple[Member, ...] | None = None,
    ) -> None:
        """``endpoints``: also serve the admin port and, if configured, the metrics port (what
        a server process does; off for in-process simulations of many servers).
        ``topology``: the validated topology of ``config``, shared by the servers of one
        process (default: built and validated here). ``member``: which member of the server
        serves (issue 42; ``config`` is then :meth:`BusConfig.as_member`'s) and ``members``
        all of them, where it ships its commits (default: the configuration's)."""
        self.config = config
        self.server_id = server_id
        self.spec = config.server(server_id)
        self.member = member
        self.members = members if members is not None else self.spec.members()
        #: ``(epoch, member)`` this server serves at (aaabus.core.epoch): read from its store
        #: by :meth:`start`.
        self.epoch: tuple[int, int] = (1, member)
        #: (epoch, member) of the newer epoch that made this primary stop serving, if one did.
        self.deposed: tuple[int, int] | None = None
        kind = store_kind or config.setting(server_id, "aaabus.store")
        if kind not in STORE_KINDS:
            raise ConfigError(f"store kind {kind!r}: expected one of {', '.join(STORE_KINDS)}")
        self.store_kind = kind
        self.segment_size = config.setting(server_id, "aaabus.store.segment_kb") << 10
        self.pack_every = config.setting(server_id, "aaabus.store.pack_mb") << 20
        self.storage = Path(storage) if storage is not None else Path(f"s{server_id}")
        self.max_batch: int = config.setting(server_id, "aaabus.engine.max_batch")
        self.max_group_ms: int = config.setting(server_id, "aaabus.engine.max_group_ms")
        self.inline: bool = config.setting(server_id, "aaabus.engine.inline")
        self.early: bool = config.setting(server_id, "aaabus.link.early")
        self.notice_wait_ms: int = config.setting(server_id, "aaabus.link.notice_wait_ms")
        self.notice_spin_us: int = notice_spin_us(config, server_id)
        self.max_frame: int = config.setting(server_id, "aaabus.max_frame")
        self.remember: int = config.setting(server_id, "aaabus.client.remember")
        self.backlog: int = config.setting(server_id, "aaabus.topics.backlog")
        allow_cycles: bool = config.setting(server_id, "aaabus.test.allow_cycles")
        # Validated at every boot: a cyclic domain graph would silently break causal order.
        if topology is None or topology.cfg is not config or topology.allow_cycles != allow_cycles:
            topology = Topology.from_config(config, allow_cycles=allow_cycles)
        self.topology = topology
        self.secret_path = secret_path(config, server_id)
        #: This server's link keys, its admin keys, its bus's identity (see aaabus.config.secret).
        self.keys = load_server_keys(self.secret_path, server_id, config.servers)
        #: What pickles from peers, tools and the store may construct (see aaabus.config.trust).
        self.trust = policy_for(config, server_id)
        #: How notifications cross its sockets (data; pickles only if the bus opted in).
        self.codec = Codec(
            may_import=self.trust.may_import,
            pickles=config.setting(server_id, "aaabus.wire.pickle"),
        )
        self.trace_dir = config.directory(server_id, "aaabus.trace")
        self.traffic_dir = config.directory(server_id, "aaabus.traffic")
        self.traffic: TrafficRecorder | None = None
        # A property whose library is an extra not installed here: refused now, before the
        # store is opened, rather than at the feature's first use.
        if self.traffic_dir is not None:
            require("property aaabus.traffic", "traffic", "pyarrow")
        if endpoints and config.setting(server_id, "aaabus.metrics.port") is not None:
            require("property aaabus.metrics.port", "metrics", "prometheus_client")
        #: The checked properties of the MQTT bridge (None: this server bridges nothing).
        self.bridge_settings: BridgeSettings | None = None
        if config.setting(server_id, "aaabus.mqtt.bridge.address") is not None:
            require("property aaabus.mqtt.bridge.address", "bridge", "paho")
            self.bridge_settings = BridgeSettings.load(config, server_id)
        elif config.setting(server_id, "aaabus.mqtt.bridge.out") or config.setting(
            server_id, "aaabus.mqtt.bridge.in"
        ):
            raise ConfigError(
                "aaabus.mqtt.bridge.out or .in is set but aaabus.mqtt.bridge.address is not: "
                "give the broker's host:port, or remove the filters"
            )
        # Import every service before touching the store: a typo must not leave half a boot.
        self._services = [(svc, resolve_service(config, svc)) for svc in self.spec.services]
        self.store: Store | None = None
        self.engine: Engine | None = None
        #: The mailboxes of outside consumers (client subscriptions and requests).
        self.mailboxes = MailboxDesk(
            server_id,
            self.call,
            lambda: self._require_store().agents,
            self._send_from_server,
            self.codec.encode,
        )

        #: The sessions of MQTT devices (used by the MQTT listener, if there is one).
        def mqtt(name: str) -> Any:
            return config.setting(server_id, f"aaabus.mqtt.{name}")

        self.mqtt_sessions = MqttSessions(
            server_id,
            self.backlog,
            lambda: self._require_store().agents,
            lambda: self._require_store().conn.root(),
            self._send_from_server,
            RetainedBounds(mqtt("retained"), mqtt("retained_bytes"), mqtt("retained_total")),
            fold_to_rep=self._fold_to_representative,
        )
        self.mqtt: MqttListener | None = None
        #: The links to this server's replicas (None: it has none).
        self.replication: ReplicationLinks | None = None
        self.bridge: MqttBridge | None = None
        self.channel: Channel | None = None
        self.network: Network | None = None
        self.tracer: Tracer | None = None
        self.stopped = threading.Event()
        self.started_at = time.monotonic()
        self.endpoints = endpoints
        self.admin: AdminEndpoint | None = None
        self.metrics: MetricsEndpoint | None = None
        delay_ms: int = config.setting(server_id, "aaabus.failover.delay_ms")
        heartbeat_ms: int | None = config.setting(server_id, "aaabus.failover.heartbeat_ms")
        #: How long a server must have been silent before its voters grant a takeover (s).
        self.failover_delay_s = delay_ms / 1000.0
        #: The keepalive tick of its links (s); sent only by a server with replicas, the only
        #: kind that can fail over, whose voters must tell it is alive.
        self.heartbeat_s = (heartbeat_ms if heartbeat_ms is not None else delay_ms // 4) / 1000.0
        #: What it remembers of the others' epochs and the votes it gave (set by start()).
        self.epochs: EpochBook | None = None
        #: Its answers to the candidates of the others' failovers (set by start()).
        self.voter: Voter | None = None
        # stop() may come from a signal, the admin port and the owner at once: one at a time.
        self._stop_lock = threading.Lock()
        self._stop_requested = False
        self._stopping = threading.Lock()
        self.failpoints_allowed = False

    def start(self) -> None:
        """Open the store, run the boot services, start the engine. Raises AaabusError."""
        self.mailboxes.set_stopping(False)
        self.store = open_store(
            self.store_kind,
            self.storage,
            self.server_id,
            self.trust,
            self.keys.identity,
            segment_size=self.segment_size,
            pack_every=self.pack_every,
        )
        if self.store.journal is not None:
            # Mailbox items are this server's notifications: decoded as it decodes them.
            self.store.journal.backlogs.codec = self.codec
        try:
            self._read_epoch(self.store)
            self.epochs = EpochBook(None if self.store_kind == "memory" else self.storage)
            self.voter = Voter(
                self.server_id,
                self.config,
                self.epochs,
                lambda: self.network,
                self.failover_delay_s,
                time.monotonic(),
            )
            self._start_replication(self.store)
            self.engine = Engine(
                self.store,
                self.server_id,
                max_batch=self.max_batch,
                max_group_s=self.max_group_ms / 1000.0,
                on_exit=self.stopped.set,
                trust=self.trust,
                codec=self.codec,
            )
            self.engine.run_inline = self.inline
            # The variable being set at all (even empty) is the operator's opt-in to arming
            # failpoints later through the admin port (see arm_failpoints).
            failpoints = os.environ.get(FAILPOINTS_ENV)
            self.failpoints_allowed = failpoints is not None
            if failpoints:
                self.engine.failpoints.arm_from_text(failpoints)
            self.engine.add_listener(self.mailboxes.on_note)
            self._install_roaming(self.engine)
            # MQTT shared subscriptions' groups (#s.s.4): on every server, listener or not
            # (their state is in the store; a server whose listener is off still receives).
            self.engine.handle(SHARES_STAMP, self.mqtt_sessions.shared.react)
            # An agent's publications and subscriptions are handled by the representative
            # inside the agent's reaction (Engine.fold): one reaction and two queued records
            # less per publication. Both kinds, so that their order is the agent's.
            self.engine.fold(
                TOPICS_STAMP, (Publish, Subscribe, Unsubscribe), TopicRepresentative.folded
            )
            if self.trace_dir is not None:
                self.tracer = self.engine.tracer = Tracer(
                    self.trace_dir, self.server_id, self.engine.effects
                )
            self._boot()
            if self.traffic_dir is not None and self.channel is not None:
                from aaabus.core.traffic import TrafficRecorder

                # Before the engine thread starts: it is then the only one that records.
                self.traffic = self.channel.traffic = TrafficRecorder(
                    self.traffic_dir,
                    self.server_id,
                    window_ms=self.config.setting(self.server_id, "aaabus.traffic.window_ms"),
                )
            self.engine.start()
            if self.channel is not None and self.topology.neighbours(self.server_id):
                self.network = self._make_network(self.engine, self.channel)
                self.channel.transport = self.network
                self.network.start()
            self.started_at = time.monotonic()
            if self.config.setting(self.server_id, "aaabus.mqtt.port") is not None:
                # Imported by the servers that listen only, like the other optional endpoints.
                from aaabus.mqtt.listener import MqttListener

                self.mqtt = MqttListener(
                    self.config,
                    self.server_id,
                    self.mqtt_sessions,
                    self.engine,
                )
                self.mqtt.start()
            if self.bridge_settings is not None:
                self.bridge = MqttBridge(
                    self.bridge_settings,
                    self.server_id,
                    self.backlog,
                    self.engine,
                    self.mqtt_sessions,
                )
                self.bridge.start()
            if self.endpoints:
                self._start_endpoints()
        except BaseException:
            self._stop_mqtt()
            self._stop_endpoints()
            if self.network is not None:
                self.network.stop()
                self.network = None
            if self.engine is not None and self.engine.alive:
                self.engine.stop()
            self._close_traffic()
            self.store.close()
            self.store = None
            raise
        log.info("server %s started (%s)", self.server_id, self.store.description)

    def _close_traffic(self) -> None:
        """Write the last traffic window (the engine thread has ended: no record() races)."""
        if self.traffic is not None:
            self.traffic.close()
            self.traffic = None

    def _start_endpoints(self) -> None:
        from aaabus.config.admin_port import admin_address
        from aaabus.errors import AdminError
        from aaabus.node.admin import AdminEndpoint

        address, explicit = admin_address(self.config, self.server_id)
        if address is not None:
            try:
                self.admin = AdminEndpoint(self, address)
            except AdminError as exc:
                if explicit:
                    raise
                # The default port is a convenience: a clash must not keep the bus down.
                log.warning("%s; running without an admin endpoint", exc)
            else:
                self.admin.start()
                log.info("server %s: admin endpoint on %s:%s", self.server_id, *address)
        metrics_port: int | None = self.config.setting(self.server_id, "aaabus.metrics.port")
        if metrics_port is not None:
            from aaabus.node.metrics import MetricsEndpoint

            host: str = self.config.setting(self.server_id, "aaabus.metrics.host")
            self.metrics = MetricsEndpoint(self, host, metrics_port)
            log.info(
                "server %s: metrics on http://%s:%s/metrics", self.server_id, *self.metrics.address
            )

    def _stop_mqtt(self) -> None:
        if self.bridge is not None:
            self.bridge.stop()
            self.bridge = None
        if self.mqtt is not None:
            self.mqtt.stop()
            self.mqtt = None

    def _stop_endpoints(self) -> None:
        if self.admin is not None:
            self.admin.stop()
            self.admin = None
        if self.metrics is not None:
            self.metrics.stop()
            self.metrics = None

    def _boot(self) -> None:
        assert self.engine is not None and self.store is not None
        store = self.store
        record = store.record
        engine = self.engine
        ctx = BootContext(
            self.server_id,
            self.config,
            engine.send,
        )

        def boot() -> None:
            # The channel's clocks and queues are created in the boot transaction, before any
            # service can send through them.
            self.channel = engine.channel = Channel(
                engine,
                self.config,
                self.topology,
                tracer=self.tracer,
                max_frame=self.max_frame,
                early=self.early,
                notice_wait_s=self.notice_wait_ms / 1000.0,
                notice_spin_us=self.notice_spin_us,
            )
            if self.tracer is not None:
                clocks = list(self.channel.clocks.values())
                self.tracer.watch_clocks(lambda: sum(c.dirty_bytes() for c in clocks))
            # Client request ids already accepted (accept_once): created once, kept forever.
            root = store.conn.root()
            if _SEEN not in root:
                root[_SEEN] = OOBTree()
                root[_SEEN_ORDER] = LOBTree()
            record.boots += 1
            # Before the services: they may publish or open mailboxes through it.
            self._install_representative(engine)
            if self.bridge_settings is None:
                forget_now(root, engine.send)  # the mailbox of a bridge no longer configured
            for spec, service in self._services:
                first_time = spec.cls not in record.services_started
                record.services_started[spec.cls] = True
                service(ctx, spec.args, first_time)

        try:
            engine.run_in_transaction(boot)
        except AaabusError:
            raise
        except Exception as exc:
            raise ServiceFailed(
                f"a boot service of server {self.server_id} failed "
                f"({type(exc).__name__}: {exc}); the server did not start"
            ) from None

    def _install_representative(self, engine: Engine) -> None:
        """Boot transaction: the topic representative ``#s.s.2`` exists and knows the routes."""
        routes = {dst: hop.server for dst, hop in self.topology.routes_from(self.server_id).items()}
        rep = engine.install(
            AgentId.topics_of(self.server_id), TopicRepresentative(routes, self.backlog)
        )
        if not isinstance(rep, TopicRepresentative):
            raise ServiceFailed(f"server {self.server_id}: #s.s.2 in the store is {rep!r}")
        if rep.backlog != self.backlog:
            rep.backlog = self.backlog  # for mailboxes created from now on
        if rep.routes != routes:
            # Through a reaction: the representative tells newcomers what it subscribes to.
            engine.send(rep.id, TopicRoutes(routes))

    def _install_roaming(self, engine: Engine) -> None:
        """With ``aaabus.mqtt.roaming``: the handler ``#s.s.3`` of the moves of MQTT sessions,
        on every server (a directory or an anchor need no listener). Raises ConfigError for a
        directory that is not a server of the bus."""
        if not self.config.setting(self.server_id, "aaabus.mqtt.roaming"):
            return
        from aaabus.mqtt.roaming import Roaming

        directory: int | None = self.config.setting(self.server_id, "aaabus.mqtt.directory")
        if directory is None:
            directory = min(self.config.servers)
        elif directory not in self.config.servers:
            raise ConfigError(
                f"aaabus.mqtt.directory = {directory} is not a server of this bus; name one of "
                f"{', '.join(str(s) for s in sorted(self.config.servers))}"
            )
        roaming = Roaming(
            self.mqtt_sessions,
            directory,
            self.max_frame,
            self.config.setting(self.server_id, "aaabus.mqtt.roam_bytes_s"),
            self.config.setting(self.server_id, "aaabus.mqtt.roam_burst"),
        )
        engine.handle(SESSIONS_STAMP, roaming.react)

    def _require_store(self) -> Store:
        if self.store is None:
            raise RuntimeError(f"server {self.server_id} is not started")
        return self.store

    def _send_from_server(self, to: AgentId, note: Notification) -> None:
        self._require_engine().send(to, note)

    def _fold_to_representative(self, note: Notification) -> object:
        """Hand ``note`` to this server's topic representative as ``#s.s.0``, folded (engine
        thread, in the group): what its :meth:`TopicRepresentative.folded` returned, or
        ``NOT_FOLDED`` (it was sent as a message: the representative is not stored yet)."""
        return self._require_engine().fold_now(
            AgentId.topics_of(self.server_id), note, AgentId.server_of(self.server_id)
        )

    def call(self, fn: Callable[[], T], timeout: float = 30.0) -> T:
        """Run ``fn`` on the engine thread as ``#s.s.0`` (any calling thread); wait for its commit.

        Inside ``fn``, agent operations work as in a boot service: ``agent.deploy()``,
        :meth:`BootContext.send`. Raises what ``fn`` raised (its changes rolled back).
        """
        return self._require_engine().call(fn).result(timeout)

    def deploy(self, agent: Agent, server: int | None = None, timeout: float = 30.0) -> AgentId:
        """Deploy ``agent`` from outside the bus; returns its id once the request is durable."""
        return self.call(lambda: agent.deploy(server), timeout)

    def send(self, to: AgentId, note: Notification, timeout: float = 30.0) -> None:
        """Send ``note`` to ``to`` from ``#s.s.0``; returns once it is durable here."""
        engine = self._require_engine()
        self.call(lambda: engine.send(to, note), timeout)

    def status(self, timeout: float = 10.0, detail: bool = False) -> dict[str, Any]:
        """One consistent snapshot of this server's figures (:mod:`aaabus.node.status`)."""
        return server_status(self, timeout, detail)

    def reactions(self) -> int:
        """Reactions run since the engine started (0 before); any thread."""
        return self.engine.stats.reactions if self.engine else 0

    def accept_once(
        self, request_id: str, fn: Callable[[], str], timeout: float = 30.0
    ) -> tuple[str, bool]:
        """Run ``fn`` as :meth:`call` does, unless request ``request_id`` was accepted before.

        Returns ``(result, duplicate)``: ``fn``'s result, or the result remembered from the
        first time. The request id is recorded in the same transaction as ``fn``'s effects, so
        a client that retries after a lost answer gets exactly one effect. The last
        ``aaabus.client.remember`` ids are remembered, in the store (they survive restarts).
        """
        engine = self._require_engine()
        bound = self.remember

        def once() -> tuple[str, bool]:
            root = engine.store.conn.root()
            seen: OOBTree = root[_SEEN]
            order: LOBTree = root[_SEEN_ORDER]
            hit = seen.get(request_id)
            if hit is not None:
                return hit[1], True
            result = fn()
            seq = order.maxKey() + 1 if order else 0
            order[seq] = request_id
            seen[request_id] = (seq, result)
            # Keys are consecutive, so the count is a subtraction (len() of a BTree is a scan).
            while seq - order.minKey() >= bound:
                seen.pop(order.pop(order.minKey()), None)
            return result, False

        return self.call(once, timeout)

    def send_now(self, to: AgentId, note: Notification) -> str:
        """Engine thread only (inside :meth:`call`): send ``note`` from ``#s.s.0``."""
        engine = self._require_engine()
        if not isinstance(note, Notification):
            raise TypeError(f"{type(note).__name__} is not an aaabus.Notification")
        engine.send(to, note)
        return ""

    def deploy_now(self, agent: Agent, server: int | None) -> str:
        """Engine thread only (inside :meth:`call`): deploy ``agent``; returns its id."""
        if not isinstance(agent, Agent):
            raise TypeError(f"{type(agent).__name__} is not an aaabus.Agent")
        return str(agent.deploy(server))

    def arm_failpoints(self, text: str) -> None:
        """Arm failpoints (``name:action[:skip[:times]],...``) from another thread: a testing
        tool, refused unless the process was started with ``AAABUS_FAILPOINTS`` set.

        Not through :meth:`call`: a transaction would itself go through the steps being armed.
        The engine thread reads the registry's plain dicts; a hit racing with the arming is
        counted before or after it, which is all a test needs.
        """
        if not self.failpoints_allowed:
            raise ConfigError(
                f"server {self.server_id}: failpoints are off (start the server with "
                f"{FAILPOINTS_ENV} set, even empty, to allow arming them; tests only)"
            )
        self._require_engine().failpoints.arm_from_text(text, where="failpoints request")

    def request_stop(self) -> None:
        """Stop as on SIGTERM, from another thread; returns at once (see :attr:`stopped`)."""
        with self._stop_lock:
            if self._stop_requested:
                return
            self._stop_requested = True
        threading.Thread(target=self.stop, name=f"stop-{self.server_id}", daemon=True).start()

    def add_listener(self, listener: Callable[[AgentId, Notification], None]) -> None:
        """Receive, after commit, the notifications agents send to ``#s.s.<this server>``.

        Called on the engine thread: hand the data over, do not block.
        """
        self._require_engine().add_listener(listener)

    def _make_network(self, engine: Engine, channel: Channel) -> Network:
        me = self.spec
        peers: dict[int, tuple[tuple[str, int], ...]] = {}
        for peer in self.topology.neighbours(self.server_id):
            other = self.config.servers[peer]
            shared = next(d for d in other.domains if d in me.domains)
            # Whichever member of the peer is its primary listens on the peer's port on its own
            # host (issue 42): each member's host in turn, the <server>'s first.
            port = other.port_in(shared)
            peers[peer] = tuple((host, port) for host in member_hosts(other))
            # Where to dial a peer, if not where it listens (a NAT, a tunnel, a test proxy):
            # then only there. A lower peer dials us, and may do so from any of its members.
            override: tuple[str, int] | None = self.config.setting(
                self.server_id, f"aaabus.dial.{peer}"
            )
            if override is not None and peer > self.server_id:
                peers[peer] = (override,)

        def on_up(peer: int) -> None:
            channel.links.up(peer)
            engine.submit(lambda _engine: channel.resend(peer))

        assert self.epochs is not None
        ssl_server, ssl_client = tls_contexts(self.config, self.server_id)
        return Network(
            my_id=self.server_id,
            listen=[(me.hostname, net.port) for net in me.networks],
            peers=peers,
            secret=self.keys.link_key,
            on_frames=channel.on_read,
            on_up=on_up,
            on_down=channel.links.down,
            max_frame=self.max_frame,
            ssl_server=ssl_server,
            ssl_client=ssl_client,
            log=logging.getLogger(f"aaabus.network.s{self.server_id}"),
            name=f"net-{self.server_id}",
            epochs=self.epochs,
            epoch=self.epoch,
            heartbeat_s=self.heartbeat_s if me.replicas else None,
        )

    def _require_engine(self) -> Engine:
        if self.engine is None:
            raise RuntimeError(f"server {self.server_id} is not started")
        return self.engine

    @property
    def failure(self) -> BaseException | None:
        return self.engine.failure if self.engine is not None else None

    def _read_epoch(self, store: Store) -> None:
        """The epoch of ``store`` (aaabus.core.epoch): member 0 of a server with replicas whose
        store has none starts epoch 1, without a vote (the configuration designates it), in a
        commit of its own before the replicas are shipped to (they get it with their catch-up).
        A server without replicas serves at epoch 1 without writing it."""
        storage = store.storage
        if not isinstance(storage, LogStorage):
            return
        record = read_epoch(storage)
        if record.epoch == 0 and self.spec.replicas and self.member == 0:
            record = NO_EPOCH.next(1, 0, storage.lastTransaction())
            write_epoch(storage, record)
            log.info("server %s: epoch 1 written in its store (member 0)", self.server_id)
        self.epoch = (max(1, record.epoch), self.member)

    def step_down(self, epoch: int, member: int) -> None:
        """A newer ``epoch`` of this server, served by ``member``, exists (any thread): this
        member acknowledges nothing more (every vote fails from now on) and stops; the member
        process (aaabus.node.member) then follows the new primary. Said in one line, once."""
        replication = self.replication
        with self._stop_lock:
            if self.deposed is not None:
                return
            self.deposed = (epoch, member)
        log.warning(
            "server %s: member %s (epoch %s) stops serving: epoch %s of member %s took over; "
            "it acknowledges nothing more and follows it",
            self.server_id,
            self.member,
            self.epoch[0],
            epoch,
            member,
        )
        if replication is not None:
            replication.shipper.depose(
                f"server {self.server_id}: epoch {epoch} of member {member} took over from "
                f"epoch {self.epoch[0]}; this member acknowledges nothing more"
            )
        self.request_stop()

    def _start_replication(self, store: Store) -> None:
        """With ``<replica>`` elements: ship every commit of ``store`` to the other members, and
        make it durable only once ``aaabus.replication.sync`` of them have it (issue 42)."""
        others = tuple(m for m in self.members if m.index != self.member)
        if not self.spec.replicas or not others:
            return
        storage = store.storage
        if not isinstance(storage, LogStorage):
            raise ConfigError(
                f"server {self.server_id} has replicas but aaabus.store is {self.store_kind!r}: "
                "only the log store is replicated; set aaabus.store=log"
            )
        try:
            key = self.keys.link_key(self.server_id)
        except KeyError:
            raise ConfigError(
                f"the key file of server {self.server_id} has no key for its replicas; make it "
                f"again with `aaabus secret --server {self.server_id} --config a3.xml --out FILE`"
            ) from None
        sync: int = self.config.setting(self.server_id, "aaabus.replication.sync")
        self.replication = ReplicationLinks(
            self.server_id,
            others,
            sync,
            key,
            storage,
            epoch=self.epoch[0],
            member=self.member,
            heartbeat_s=self.heartbeat_s,
            on_newer=self.step_down,
            trace_dir=self.trace_dir,
        )
        self.replication.start()

    def interrupt(self) -> None:
        """Any thread, a signal handler included: a commit waiting for this server's replicas
        fails now (it was never acknowledged), so that a start or a stop stuck on replicas that
        are gone ends."""
        replication = self.replication
        if replication is not None:
            replication.shipper.close()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop taking frames, finish the group in flight, stop the engine, close the store.

        Idempotent and safe from any thread. The admin endpoint closes last: a client that
        asked for the stop sees its connection end once the store is closed.
        """
        with self._stop_lock:
            self._stop_requested = True
        self.mailboxes.set_stopping(True)  # admin connections waiting on mailboxes answer now
        with self._stopping:
            if self.store is None:
                self._stop_endpoints()
                self.stopped.set()
                return
            try:
                # First: devices stop publishing while the engine can still commit what they sent.
                self._stop_mqtt()
                if self.network is not None:
                    self.network.stop(timeout)
                    self.network = None
                replication = self.replication
                if replication is not None and replication.figures()["waiting_s"] is not None:
                    # A commit waits for replicas that do not answer: fail it (it was never
                    # acknowledged) rather than wait for them to stop.
                    replication.stop()
                if self.engine is not None:
                    self.engine.stop(timeout)
            finally:
                if self.replication is not None:
                    self.replication.stop()
                    self.replication = None
                if self.store is not None:
                    self.store.close()
                    self.store = None
                if self.tracer is not None:
                    self.tracer.close()
                    self.tracer = None
                self._close_traffic()
                self.stopped.set()
                log.info("server %s stopped", self.server_id)
                self._stop_endpoints()


#: How long a group polls for a durability notice when its host has a core per server.
DEFAULT_NOTICE_SPIN_US = 300


def notice_spin_us(config: BusConfig, server_id: int, cores: int | None = None) -> int:
    """``aaabus.link.notice_spin_us`` for ``server_id``; unset: :data:`DEFAULT_NOTICE_SPIN_US`
    if the configuration puts at most ``cores`` (this machine's) servers on its host, else 0.

    Polling pays when the poller has a core to itself; when more servers than cores share a
    host, a poller takes the CPU that the server it waits for needs to finish its sync
    (measured: a round trip through two routers, ten servers on two cores, slower with polling
    than without)."""
    value: int | None = config.setting(server_id, "aaabus.link.notice_spin_us")
    if value is not None:
        return value
    host = config.servers[server_id].hostname
    on_host = sum(1 for spec in config.servers.values() if spec.hostname == host)
    available = cores if cores is not None else (os.cpu_count() or 1)
    return DEFAULT_NOTICE_SPIN_US if on_host <= available else 0
