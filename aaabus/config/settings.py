"""Typed settings: every ``aaabus.*`` property of ``a3.xml``, declared once.

Each :class:`Setting` has a name, a parser that turns the property's text into a typed value (or
says in one line what is wrong and how to fix it), a default and a line of documentation. The
configuration reader (:mod:`aaabus.config.reader`) checks every ``aaabus.*`` property against these
declarations when it reads the file, so ``aaabus check`` refuses what a server would refuse at
boot, with the file and line; a name that is not declared is refused too (a typo would otherwise
be silently ignored). Properties outside the ``aaabus.`` prefix belong to the application and are
left alone.

The reference table of ``docs/config.md`` is this module's :func:`reference_table` (a test keeps
them equal; ``python -m aaabus.config.settings`` prints it).

This module is a leaf: it imports nothing from the rest of the runtime.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["SETTINGS", "Setting", "find", "parse", "reference_table"]

PREFIX = "aaabus."


@dataclass(frozen=True)
class Setting:
    """One property: ``name`` (a ``<id>`` part matches any server id), its parser, its default
    (``None``: unset, the feature is off or computed), how the default reads in the docs, and
    what it does."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    doc: str
    shown_default: str = ""

    @property
    def pattern(self) -> re.Pattern[str]:
        return re.compile(re.escape(self.name).replace(re.escape("<id>"), r"\d+") + "$")


# -- parsers: text -> value, or ValueError("what is wrong; how to fix it") -----------------------


def integer(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        stripped = text.strip()
        if not re.fullmatch(r"[+]?\d+", stripped) or not low <= int(stripped) <= high:
            raise ValueError(f"expected an integer in {low}..{high}")
        return int(stripped)

    return parse


def choice(*values: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in values:
            raise ValueError(f"expected one of {', '.join(values)}")
        return text

    return parse


def boolean(text: str) -> bool:
    if text not in ("true", "false"):
        raise ValueError("expected true or false")
    return text == "true"


def path(text: str) -> str | None:
    """A path relative to the configuration file; empty means unset."""
    return text or None


def names(text: str) -> tuple[str, ...]:
    """Comma-separated dotted Python names (modules, or ``module.Class``)."""
    entries = tuple(e.strip() for e in text.split(",") if e.strip())
    for entry in entries:
        if not all(part.isidentifier() for part in entry.split(".")):
            raise ValueError(
                f"{entry!r} is not a module or module.Class name; give comma-separated names "
                "like myapp,otherapp.notes.Ping"
            )
    return entries


def file_name(text: str) -> str:
    if not text.strip():
        raise ValueError("expected a file name (relative to the configuration file)")
    return text


def host(text: str) -> str:
    if not text or any(c.isspace() for c in text):
        raise ValueError("expected a host name or address")
    return text


def port_or_off(text: str) -> int | None:
    """A TCP port, or ``off`` (``None``)."""
    if text.strip().lower() == "off":
        return None
    try:
        return integer(1, 65535)(text)
    except ValueError:
        raise ValueError("expected a port in 1..65535 or off") from None


def gc_thresholds(text: str) -> tuple[int, int, int]:
    """Three generation thresholds of Python's cycle collector, ``g0,g1,g2``."""
    parts = text.split(",")
    if len(parts) != 3 or not all(re.fullmatch(r"\s*\d+\s*", p) for p in parts):
        raise ValueError("expected three integers g0,g1,g2, like 50000,20,100")
    g0, g1, g2 = (int(p) for p in parts)
    if not (100 <= g0 <= 10_000_000 and 1 <= g1 <= 1000 and 1 <= g2 <= 1000):
        raise ValueError("expected g0 in 100..10000000 and g1, g2 in 1..1000")
    return g0, g1, g2


def host_port(text: str) -> tuple[str, int]:
    name, _, port = text.rpartition(":")
    if not name or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError("expected host:port")
    return name, int(port)


def text_or_unset(text: str) -> str | None:
    """Any text; empty means unset."""
    return text or None


def comma_list(text: str) -> tuple[str, ...]:
    """Comma-separated entries (MQTT topic filters: checked as filters where they are used)."""
    entries = tuple(e.strip() for e in text.split(","))
    if not all(entries):
        raise ValueError("expected comma-separated topic filters, like sensors/#,alarms/+")
    return entries


def mqtt_protocol(text: str) -> int:
    """An MQTT protocol version: 3 (3.1.1) or 5 (5.0)."""
    if text.strip() not in ("3", "5"):
        raise ValueError("expected 3 (MQTT 3.1.1) or 5 (MQTT 5.0)")
    return int(text)


# -- the declarations ---------------------------------------------------------------------------

SETTINGS: tuple[Setting, ...] = (
    Setting(
        "aaabus.store",
        choice("log", "file", "memory"),
        "log",
        "`log`: the bus's own log store (preallocated segment files, one write and one "
        "`fdatasync` per commit, background compaction) in the server's storage directory "
        "(`--storage`, default `./s<id>`). `file`: a ZODB `FileStorage`, fsync'd at every commit "
        "and packed in the background (`aaabus.store.pack_mb`). `memory`: a non-durable "
        "`MappingStorage`, for tests and simulation; everything is lost when the process ends.",
    ),
    Setting(
        "aaabus.store.segment_kb",
        integer(4, 1 << 20),
        4096,
        "Size of one log store segment file, in KiB (log store only). Compaction recycles whole "
        "segments, so disk use is about the live data plus a few segments.",
    ),
    Setting(
        "aaabus.store.pack_mb",
        integer(0, 1 << 20),
        64,
        "File store only: pack `data.fs` in the background each time it has grown by this many "
        "MB since the last pack (0: never pack; the file then grows forever).",
    ),
    Setting(
        "aaabus.replication.sync",
        integer(0, 255),
        1,
        "For a server with `<replica>` elements: how many of its replicas must have a commit on "
        "their disk before it counts as durable (its frames leave, its PUBACKs and "
        "acknowledgements go). Any replicas will do, the first to answer. A replica that does not "
        'answer makes the server wait, never drop the guarantee (docs/architecture.md, "Replicas '
        "and failover\"). `0`: asynchronous shipping, a commit is durable on the server's own "
        "disk alone and the replicas follow as fast as they can (a failover may lose its last "
        "commits). At most the number of replicas (`aaabus check`).",
    ),
    Setting(
        "aaabus.replication.port",
        integer(1, 65535),
        None,
        "For a server with `<replica>` elements: where member 0 (the `<server>` itself) listens, "
        "on its `hostname`, for the replication link of a replica that has taken over (a "
        "replica listens on its `<replica>` `port`). Each (hostname, port) pair is used once in "
        "the file (`aaabus check`).",
        shown_default="first `<network>` port + 2000",
    ),
    Setting(
        "aaabus.failover",
        choice("on", "off"),
        None,
        "For a server with `<replica>` elements: `on`, a follower that hears nothing from the "
        "primary for `aaabus.failover.delay_ms` stands for a new epoch and, voted in, takes "
        'over (docs/architecture.md, "Replicas and failover"); `off`, the replicas only keep '
        "copies and never take over (an operator restarts the server). No effect without "
        "replicas.",
        shown_default="`on` with `<replica>` elements, else `off`",
    ),
    Setting(
        "aaabus.failover.delay_ms",
        integer(20, 600_000),
        1000,
        "How long a server must have been silent before a takeover of it may be voted (ms): a "
        "voter refuses a candidate while it has heard from the server within this delay, or "
        'has itself been running for less (docs/architecture.md, "Replicas and failover"). '
        "Give every server of a bus the same value. A follower stands for its primary's place "
        "once it has heard nothing from it (no commit, no heartbeat) for this long. A takeover "
        "takes about this delay plus half a second (the vote, the new primary's start); the "
        "default keeps that under 2 s, and a server paused longer than this (a stalled disk, "
        "a pause of its machine) is replaced, safely, since it is fenced.",
    ),
    Setting(
        "aaabus.failover.heartbeat_ms",
        integer(5, 600_000),
        None,
        "A server with `<replica>` elements sends an empty keepalive frame on each of its links "
        "that has sent nothing for this long (ms), so that its voters can tell it is alive; a "
        "link is then never silent for more than twice this. Keepalives reach no engine and "
        "cost no commit. A primary sends one to its followers too (replication links). Keep it "
        "well under `aaabus.failover.delay_ms`.",
        shown_default="`aaabus.failover.delay_ms` / 4",
    ),
    Setting(
        "aaabus.secret",
        file_name,
        "bus.key",
        "The key file: the bus key (`aaabus secret --out bus.key`), the same for every server, "
        "or, set per server, that server's own key file (`aaabus secret --server ID --config "
        "a3.xml --out sID.key`), which holds only its links' keys and its own admin keys (see "
        "`docs/security.md`). Tools read it too unless given `--key` (a tool key, `aaabus "
        "secret --tool --scope ...`; a server's key file is no tool's). A server without a "
        "readable key file, or with one that its group or others may read, refuses to start.",
    ),
    Setting(
        "aaabus.trust",
        names,
        None,
        "Comma-separated module prefixes (`myapp` covers `myapp` and `myapp.*`) or qualified "
        "class names (`myapp.notes.Ping`): the application's modules. Notifications and agents "
        "cross the bus as data, and a server builds only the registered notification and agent "
        "classes of modules it has imported; a body naming a class of a module not imported yet "
        "makes the server import that module only if it is listed here (never a `__main__`). The "
        "records of the server's store may name these modules' classes too (besides plain data "
        "of the standard library, `persistent`/`BTrees` and aaabus's own classes); anything else "
        "a record names is refused before anything is built, and a store whose root names it "
        "does not boot. Name modules of data classes, not of classes that act when built: any "
        "key holder can have them constructed with fields of its choosing. See "
        "`docs/security.md`.",
        shown_default="the modules of the config's `<service>` classes",
    ),
    Setting(
        "aaabus.trust.by_value",
        boolean,
        False,
        "`true` lets this server load agents and notifications that travel **by value** "
        "(classes defined in `__main__`, a notebook or a function, which cloudpickle sends as "
        "code). A pickle by value is a program: with `true` the checks of `aaabus.trust` are off "
        "altogether on this server, and **anyone holding a tool key of scope `code` (or a "
        "peer's key file) can run any code inside it**; deploying an agent by value through the "
        "admin port needs both that scope and this property. Enable it only where every such "
        "key holder may have a shell on the server's machine.",
    ),
    Setting(
        "aaabus.wire.pickle",
        boolean,
        False,
        "`true` lets notifications and payloads that have no data form (not a dataclass, a "
        "value under `Any` of no data type) travel as pickles, and makes this server and the "
        "tools that talk to it **load** pickles from peers and tools. A pickle is a program: "
        "with `true`, **every holder of a key that reaches the server (a peer's key file, a tool "
        "key) can run any code inside it**, whatever `aaabus.trust` says. Set it for the whole "
        "bus (in `<config>`), or not at all. Off, every byte that crosses a socket is data "
        "(docs/security.md).",
    ),
    Setting(
        "aaabus.max_frame",
        integer(1024, 1 << 31),
        16 << 20,
        "Largest frame, in bytes, accepted from a peer; a larger one closes the connection. A "
        "notification that would exceed it makes the sending reaction fail (the sender receives "
        "an `ExceptionNotification`).",
    ),
    Setting(
        "aaabus.engine.max_batch",
        integer(1, 1_000_000),
        64,
        "Most reactions in one group commit. Each reaction stays atomic; a group makes several "
        "durable with one fsync. The messages that arrived with the group, and the local "
        "messages that their reactions (or those of queued messages) send, run in it beyond "
        "this bound: they are bounded by what came in. `1` gives one commit per queued "
        "reaction.",
    ),
    Setting(
        "aaabus.engine.max_group_ms",
        integer(1, 60_000),
        5,
        "Longest a group keeps running reactions before it commits (ms).",
    ),
    Setting(
        "aaabus.gc.thresholds",
        gc_thresholds,
        (50_000, 20, 100),
        "Thresholds of Python's cycle collector in a server process (`gc.set_threshold`), "
        "`g0,g1,g2`. CPython's 700,10,10 runs a young collection every 700 allocations and "
        "full ones often while messages wait in queues, which cost a receiving server a third "
        "of its CPU in a stream; objects alive after boot are also frozen out of the "
        "collections (`gc.freeze`). `700,10,10` restores CPython's behaviour.",
        "`50000,20,100`",
    ),
    Setting(
        "aaabus.engine.inline",
        boolean,
        True,
        "When the engine is idle, the network thread that read a peer's frames runs their group "
        "itself instead of waking the engine thread (one thread wake-up less per hop). Turn off "
        "if reactions may block for long: meanwhile that thread reads no other connection.",
    ),
    Setting(
        "aaabus.link.early",
        boolean,
        True,
        "Frames leave as their group's commit starts, marked tentative, and a durability "
        "notice follows once the group is synced: the receiver reacts meanwhile but commits, "
        "acknowledges and shows nothing derived from them before the notice (docs/architecture.md,"
        ' "Early frames"). A reaction may then run on a frame its sender loses in a crash, and '
        "be rolled back. `false`: frames leave only once durable.",
    ),
    Setting(
        "aaabus.link.notice_spin_us",
        integer(0, 100_000),
        None,
        "How long a group waiting for a durability notice polls for it (yielding the CPU "
        "between looks) before it sleeps: a sleeping thread wakes tens of µs after the notice, "
        "on every hop of a chain of them. Unset: 300 when the configuration puts no more "
        "servers on this server's host than it has cores, else 0 (pollers would take the CPU "
        "the servers they wait for need). `0`: sleep at once.",
        "300 or 0 (see meaning)",
    ),
    Setting(
        "aaabus.link.notice_wait_ms",
        integer(1, 5_000),
        100,
        "How long a group that applied tentative frames waits, before it commits, for their "
        "sender's durability notice. Past it, the group is replayed and that sender is late for "
        "a second: its tentative frames are parked apart until their notice, so that a slow or "
        "silent sender delays only its own frames (at most 10,000 frames or 64 MiB parked per "
        "connection, then it is closed). Keep it well under the 10 s a server's stop waits.",
    ),
    Setting(
        "aaabus.trace",
        path,
        None,
        "A directory: every server appends one JSON line per message hop to `hops-s<id>.jsonl` "
        "(stamp bytes, clock CPU time, commit time, clock bytes persisted), and one with an MQTT "
        "listener one line per batch of its devices' operations to `mqtt-s<id>.jsonl` (where its "
        "time goes: `perf mqtt --breakdown`); with replicas, each member one line per replicated "
        "commit to `replication-s<id>m<member>-<side>-<pid>.jsonl` (where its wait goes: `perf "
        "pingpong --breakdown --replicas N`). Off when unset; free when off.",
    ),
    Setting(
        "aaabus.traffic",
        path,
        None,
        "A directory (relative to the configuration file): the server counts the notifications "
        "its agents send to each other server and writes them, per time window, as Parquet files "
        "under `traffic/` (source, destination, notifications, bytes), the input of `aaabus "
        "plan`. Needs pyarrow (`aaabus[traffic]`). Off when unset.",
    ),
    Setting(
        "aaabus.traffic.window_ms",
        integer(1, 86_400_000),
        10_000,
        "Length of one traffic window in ms (windows are aligned on the epoch, so the windows of "
        "all servers line up). A file is written every six windows and at stop.",
    ),
    Setting(
        "aaabus.domains.rebuild",
        boolean,
        False,
        "Set it for the first boot of a DRAINED bus under new domains (see `docs/operations.md`, "
        "changing the configuration): a server whose stored clocks no longer match its domains "
        "then drops them and starts those domains afresh, keeping its agents and their state; "
        "it refuses if such a domain still holds messages. Every member of a changed domain "
        "must boot this way, together.",
    ),
    Setting(
        "aaabus.tls.cert",
        path,
        None,
        "PEM certificate: when set, connections between servers and to the admin port run inside "
        "TLS with client certificates checked against `aaabus.tls.ca`. Clients (`aaabus "
        "status/stop/send`, `aaabus.Client`) read the same properties from the config, so they "
        "must run where those files are readable. The bus secret is still required: TLS "
        "authenticates machines, the secret membership.",
    ),
    Setting("aaabus.tls.key", path, None, "PEM private key of `aaabus.tls.cert` (default: in it)."),
    Setting(
        "aaabus.tls.ca",
        path,
        None,
        "PEM file of the certificates trusted for TLS links.",
        shown_default="`aaabus.tls.cert`",
    ),
    Setting(
        "aaabus.dial.<id>",
        host_port,
        None,
        "`host:port` to dial to reach server `<id>` instead of where it listens (a tunnel, a NAT, "
        "a test proxy); without it a server with replicas is dialled at each member's host in "
        "turn, on the same port.",
    ),
    Setting(
        "aaabus.admin.port",
        port_or_off,
        None,
        "The admin endpoint (`aaabus status`, `stop`, `send`, `aaabus.tools.client.Client`), "
        "on the server's `hostname`, open only to holders of the bus secret. A port, or `off`. "
        "When set, a port that cannot be bound stops the server from starting; the default port, "
        "when taken, is skipped with a warning (the server runs without an admin endpoint). "
        "Not served by in-process simulations (`InProcessBus`). See `docs/operations.md`.",
        shown_default="first `<network>` port + 1000",
    ),
    Setting(
        "aaabus.admin.lifetime",
        integer(1, 86_400),
        600,
        "Seconds an admin session lasts at most, however often it asks: then the server closes "
        "it between two requests and the tool reconnects (`Client` does so by itself). Keeps a "
        "slot from being held forever by cheap requests; see docs/security.md, *Admin sessions*.",
    ),
    Setting(
        "aaabus.client.remember",
        integer(1, 100_000_000),
        100_000,
        "How many client request ids a server remembers (in its store, the most recent ones) to "
        "recognise retried client requests and perform them only once.",
    ),
    Setting(
        "aaabus.topics.backlog",
        integer(1, 100_000_000),
        100_000,
        "Most publications (or replies) one outside consumer's mailbox keeps for it on this "
        "server: a named or unnamed `Client.subscribe` / `aaabus subscribe` backlog, in the "
        "store, until the consumer acknowledges them. Beyond it the **oldest** is dropped and "
        "counted (the consumer sees `dropped` grow): a slow or absent consumer never holds the "
        "bus back. Read when a mailbox is created.",
    ),
    Setting(
        "aaabus.metrics.port",
        integer(0, 65535),
        None,
        "A Prometheus endpoint (`/metrics`, standard `prometheus_client` format) with the "
        "figures of `aaabus status`. Needs prometheus_client (`aaabus[metrics]`). Off when "
        "unset; `0` picks a free port (logged at INFO).",
    ),
    Setting(
        "aaabus.metrics.host",
        host,
        "127.0.0.1",
        "Where the metrics endpoint listens. It is not authenticated: keep it on the loopback or "
        "a monitoring network.",
    ),
    Setting(
        "aaabus.mqtt.port",
        integer(0, 65535),
        None,
        "An MQTT listener (3.1.1 and 5.0; docs/mqtt.md): devices publish and subscribe to the "
        "bus's topics. Off when unset; `0` picks a free port (logged at INFO).",
    ),
    Setting("aaabus.mqtt.host", host, "127.0.0.1", "Where the MQTT listener listens."),
    Setting(
        "aaabus.mqtt.credentials",
        path,
        None,
        "File of `user:scrypt$...` lines (`python -m aaabus.mqtt.auth USER` writes one) that "
        "CONNECT's username/password are checked against. Never the bus secret.",
    ),
    Setting(
        "aaabus.mqtt.login_queue",
        integer(1, 1000000),
        64,
        "CONNECTs waiting for their password check (scrypt, on two threads; a password "
        "verified lately is not checked again); beyond, CONNACK 0x03 (5.0: 0x89 server busy) "
        "at once. Served round-robin across remote addresses; one whose socket closed is "
        "dropped unchecked.",
    ),
    Setting(
        "aaabus.mqtt.login_per_address",
        integer(1, 1000000),
        8,
        "CONNECTs of one remote address waiting for their password check; beyond, as over "
        "`aaabus.mqtt.login_queue`.",
    ),
    Setting(
        "aaabus.mqtt.anonymous",
        boolean,
        False,
        "Accept a CONNECT without a username (only when no credentials file is set); for tests "
        "and closed networks. Otherwise such a CONNECT gets CONNACK 0x05.",
    ),
    Setting(
        "aaabus.mqtt.acl",
        path,
        None,
        "ACL file (Mosquitto's `acl_file` lines: `user`, `topic`, `pattern` with %u/%c; "
        'docs/mqtt.md, "Access control") checked on PUBLISH, SUBSCRIBE and will topics. '
        "Unset: every device may publish and subscribe to every topic but `$` ones.",
    ),
    Setting(
        "aaabus.mqtt.sys_interval_s",
        integer(1, 86400),
        10,
        "Seconds between two sends of the listener's `$SYS/aaabus/<id>/...` status topics to "
        "the devices subscribed to them (where the ACL grants it).",
    ),
    Setting(
        "aaabus.mqtt.tls.cert",
        path,
        None,
        "PEM certificate of the MQTT listener: TLS on `aaabus.mqtt.port` (plain TCP when unset).",
    ),
    Setting("aaabus.mqtt.tls.key", path, None, "PEM private key of `aaabus.mqtt.tls.cert`."),
    Setting(
        "aaabus.mqtt.max_packet",
        integer(64, 268435455),
        1 << 20,
        "Largest MQTT packet accepted, in bytes; a larger one closes the connection (5.0: "
        "told as CONNACK's Maximum Packet Size; DISCONNECT 0x95).",
    ),
    Setting(
        "aaabus.mqtt.user_properties",
        integer(0, 65535),
        64,
        "User Properties one MQTT 5.0 packet may carry (a CONNECT's will counts apart); beyond, "
        "the connection is closed with reason 0x95 (CONNACK or DISCONNECT), before they are "
        "decoded.",
    ),
    Setting(
        "aaabus.mqtt.user_properties_bytes",
        integer(0, 268435455),
        16384,
        "Bytes the User Properties of one MQTT 5.0 packet may take (names and values with "
        "their lengths); beyond, as over `aaabus.mqtt.user_properties`.",
    ),
    Setting(
        "aaabus.mqtt.connect_ms",
        integer(10, 3600000),
        5000,
        "A connection that has not sent a complete CONNECT this long after accept is closed.",
    ),
    Setting(
        "aaabus.mqtt.max_connections",
        integer(1, 1000000),
        10000,
        "Connected devices (CONNECT accepted) the MQTT listener holds at once; beyond, a CONNECT "
        "gets CONNACK 0x03 (5.0: 0x97). Each costs a file descriptor: raise the process's "
        "`ulimit -n` with it.",
    ),
    Setting(
        "aaabus.mqtt.max_waiting",
        integer(1, 1000000),
        10000,
        "Connections waiting for their CONNECT at once; beyond, the oldest waiting one is closed "
        "(the waiting room evicts before it refuses). A site reconnecting at once waits here: "
        "keep it above the largest such burst.",
    ),
    Setting(
        "aaabus.mqtt.per_address",
        integer(1, 1000000),
        50,
        "Connections waiting for their CONNECT per remote address; beyond, the oldest of them "
        "that has waited over a second is closed (silent connections cycle through the table, a "
        "site's devices reconnecting at once behind one address all get in).",
    ),
    Setting(
        "aaabus.mqtt.inflight",
        integer(1, 65535),
        100,
        "QoS 1/2 messages sent to one device and not yet acknowledged by it; also the device's "
        "packets being committed at once (beyond, its socket is not read until they are). 5.0: "
        "CONNACK's Receive Maximum (a device over it gets DISCONNECT 0x93); a device's own "
        "lower Receive Maximum bounds what is sent to it.",
    ),
    Setting(
        "aaabus.mqtt.queued_bytes",
        integer(1024, 1 << 30),
        262144,
        "Bytes queued to one device's socket; beyond, delivery waits (the backlog stays in the "
        "store) until the device reads.",
    ),
    Setting(
        "aaabus.mqtt.max_filters",
        integer(1, 1000000),
        100,
        "Topic filters one session subscribes to; beyond, SUBSCRIBE gets 0x80 (5.0: 0x97) for "
        "the extra filters.",
    ),
    Setting(
        "aaabus.mqtt.max_keepalive",
        integer(1, 65535),
        3600,
        "Longest keep-alive a CONNECT may ask for, in seconds; longer gets CONNACK 0x02 "
        "(5.0: accepted, with this as its Server Keep Alive).",
    ),
    Setting(
        "aaabus.mqtt.keepalive_0",
        boolean,
        True,
        "Accept a 3.1.1 CONNECT with keep-alive 0 (the device need not ping; `max_idle_s` still "
        "closes it when silent that long); `false`: CONNACK 0x02. A 5.0 device asking for 0 is "
        "always accepted and told `max_keepalive` as its Server Keep Alive.",
    ),
    Setting(
        "aaabus.mqtt.max_idle_s",
        integer(1, 1 << 31),
        5400,
        "A connected device that sends nothing for this long (seconds) is closed, whatever its "
        "keep-alive (5.0: DISCONNECT 0x8D): the deadline of a device with keep-alive 0. The "
        "default, 1.5 × the default `max_keepalive`, never cuts a device that keeps its "
        "keep-alive.",
    ),
    Setting(
        "aaabus.mqtt.topic_aliases",
        integer(0, 65535),
        16,
        "Topic aliases one MQTT 5.0 device may set (its CONNACK's Topic Alias Maximum); `0` "
        "disables them. An alias out of range is DISCONNECT 0x94. Also the most the server "
        "sets towards a device whose CONNECT allows them.",
    ),
    Setting(
        "aaabus.mqtt.connections_per_user",
        integer(1, 1000000),
        1000,
        "Connections one named user holds at once; beyond, CONNACK 0x03 (5.0: 0x97). Anonymous "
        "devices (aaabus.mqtt.anonymous) are bounded by max_connections only.",
    ),
    Setting(
        "aaabus.mqtt.connections_per_address",
        integer(1, 1000000),
        1000,
        "Connected devices (CONNECT accepted) from one remote address at once; beyond, CONNACK "
        "0x03 (5.0: 0x97). The per-source bound of anonymous devices; raise it for a site whose "
        "devices share one address (NAT) beyond it.",
    ),
    Setting(
        "aaabus.mqtt.sessions_per_user",
        integer(1, 1000000),
        100,
        "Persistent sessions one user keeps on this server (the devices without a user name "
        "count as one user); beyond, a CONNECT that would create one gets CONNACK 0x03 (5.0: "
        "0x97).",
    ),
    Setting(
        "aaabus.mqtt.session_expiry_s",
        integer(1, 1 << 31),
        604800,
        "A persistent session whose device has been away this long (seconds) is deleted with "
        "its backlog and subscriptions; also the cap of an MQTT 5.0 session's expiry interval.",
    ),
    Setting(
        "aaabus.mqtt.retained",
        integer(0, 1000000),
        1000,
        "Retained topics one user may hold through this server, wills included (the devices "
        "without a user name count as one user, the bridge as another); beyond, a new one is "
        "refused (3.1.1: dropped and logged; 5.0: reason 0x97). Every server keeps a copy of "
        "each.",
    ),
    Setting(
        "aaabus.mqtt.retained_bytes",
        integer(0, 1 << 40),
        4194304,
        "Bytes of retained payloads one user may hold through this server.",
    ),
    Setting(
        "aaabus.mqtt.retained_total",
        integer(0, 100000000),
        100000,
        "Retained topics all users may hold through this server.",
    ),
    Setting(
        "aaabus.mqtt.bridge.address",
        host_port,
        None,
        "`host:port` of an external MQTT broker this server bridges topics to and from "
        '(docs/mqtt.md, "Bridging out to another broker"). Off when unset. Needs paho-mqtt '
        "(`aaabus[bridge]`).",
    ),
    Setting(
        "aaabus.mqtt.bridge.out",
        comma_list,
        (),
        "Comma-separated bus topic filters whose publications the bridge sends to the broker "
        "(QoS 1, acknowledged on the bus once the broker has them).",
        shown_default="none",
    ),
    Setting(
        "aaabus.mqtt.bridge.in",
        comma_list,
        (),
        "Comma-separated broker topic filters the bridge subscribes to (QoS 1, persistent "
        "session) and publishes on the bus.",
        shown_default="none",
    ),
    Setting(
        "aaabus.mqtt.bridge.client_id",
        text_or_unset,
        None,
        "The bridge's MQTT client id at the broker (its persistent session there).",
        shown_default="`aaabus-bridge-<server id>`",
    ),
    Setting(
        "aaabus.mqtt.bridge.username",
        text_or_unset,
        None,
        "User name the bridge gives the broker (none when unset).",
    ),
    Setting(
        "aaabus.mqtt.bridge.password_file",
        path,
        None,
        "File holding the bridge's password at the broker (its first line; relative to a3.xml); "
        "it must be private (mode 600): the server refuses to start otherwise.",
    ),
    Setting(
        "aaabus.mqtt.bridge.tls.ca",
        path,
        None,
        "PEM file of the certificates trusted for the broker's: the bridge speaks TLS when set "
        "(plain TCP otherwise).",
    ),
    Setting(
        "aaabus.mqtt.bridge.prefix_out",
        text_or_unset,
        None,
        "Text put before a bus topic to make its topic at the broker (e.g. `site-7/`).",
    ),
    Setting(
        "aaabus.mqtt.bridge.prefix_in",
        text_or_unset,
        None,
        "Text put before a broker topic to make its topic on the bus (e.g. `cloud/`).",
    ),
    Setting(
        "aaabus.mqtt.bridge.protocol",
        mqtt_protocol,
        3,
        "MQTT version the bridge speaks to the broker: 3 (3.1.1, which every broker speaks) "
        "or 5 (5.0: the broker sends the bridge none of its own messages back).",
    ),
    Setting(
        "aaabus.mqtt.roaming",
        boolean,
        False,
        "Persistent MQTT sessions follow their device to any server of the bus (docs/mqtt.md, "
        '"Sessions that follow a device"). Global: set it the same on every server.',
    ),
    Setting(
        "aaabus.mqtt.directory",
        integer(0, 1 << 30),
        None,
        "With `aaabus.mqtt.roaming`: the server that keeps the directory of roaming sessions "
        "(client id -> anchor server, user). Global (default: the lowest server id).",
        "lowest id",
    ),
    Setting(
        "aaabus.mqtt.roam_bytes_s",
        integer(1, 1 << 40),
        65536,
        "With `aaabus.mqtt.roaming`: bytes per second a session's moves may carry on average "
        "(its backlog, plus 16 KiB per move); a CONNECT that would move it sooner gets CONNACK "
        "server busy (0x89; 3.1.1: 0x03). Set at the session's anchor.",
    ),
    Setting(
        "aaabus.mqtt.roam_burst",
        integer(0, 1 << 40),
        1 << 20,
        "With `aaabus.mqtt.roaming`: bytes a session's moves may carry at once before "
        "`aaabus.mqtt.roam_bytes_s` applies (one move may overdraw it; the next waits until "
        "it is paid back).",
        "1 MiB",
    ),
    Setting(
        "aaabus.test.allow_cycles",
        boolean,
        False,
        "Test only: boot a configuration whose domain graph has a cycle, to show what breaks. "
        "Never in production: causal order is then not guaranteed.",
    ),
)


def find(name: str) -> Setting:
    """The declaration of property ``name``; ValueError naming the closest one if unknown."""
    for setting in SETTINGS:
        if setting.pattern.match(name):
            return setting
    close = difflib.get_close_matches(name, [s.name for s in SETTINGS], n=1)
    hint = f"did you mean {close[0]}?" if close else "see the table in docs/config.md"
    raise ValueError(f"unknown property {name!r}; {hint}")


def parse(name: str, text: str) -> Any:
    """The typed value of property ``name`` given as ``text``; ValueError (one line) if bad."""
    setting = find(name)
    try:
        return setting.parse(text)
    except ValueError as exc:
        raise ValueError(f"property {name}={text!r}: {exc}") from None


def value(properties: Mapping[str, str], name: str) -> Any:
    """The typed value of ``name`` in ``properties`` (already merged: server over bus), or
    its default when absent."""
    setting = find(name)
    if name not in properties:
        return setting.default
    return parse(name, properties[name])


def reference_table() -> str:
    """The markdown table of every setting, as ``docs/config.md`` shows it."""
    rows = ["| property | default | meaning |", "|----------|---------|---------|"]
    for s in SETTINGS:
        if s.shown_default:
            default = s.shown_default
        elif s.default is None:
            default = "unset"
        elif isinstance(s.default, bool):
            default = f"`{str(s.default).lower()}`"
        else:
            default = f"`{s.default}`"
        rows.append(f"| `{s.name}` | {default} | {s.doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_table())
