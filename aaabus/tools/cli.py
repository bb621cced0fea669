"""Command-line entry points: ``aaabus-server`` and ``aaabus``.

Every user error (bad config, bad flag, unusable storage, ...) ends as ONE line on stderr and exit
status 2; tracebacks are kept for bugs.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn

from aaabus.errors import AaabusError, ReplicationStopped
from aaabus.tools.readiness import READY_LINE, REPLICA_READY_LINE
from aaabus.tools.topiccmds import add_parsers as add_topic_commands

if TYPE_CHECKING:
    from aaabus.node.member import MemberProcess


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors are one line like every other error of ours."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _fail(prog: str, exc: AaabusError) -> int:
    print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
    return exc.exit_code


def _setup_logging(level: str, prefix: str) -> None:
    logging.basicConfig(
        stream=sys.stderr,
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"[{prefix}] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _dump_threads_on_sigusr1() -> None:
    """``kill -USR1 <pid>`` prints the stack of every thread to stderr (deadlock hunting).

    faulthandler writes from the signal handler itself, so it works even when every Python
    thread is stuck on a lock.
    """
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True, chain=False)


# -- aaabus-server ------------------------------------------------------------------------------


def _server_parser(prog: str) -> _Parser:
    parser = _Parser(prog=prog, description="Run one agent server of a bus in the foreground.")
    parser.add_argument("--id", type=int, required=True, help="server id, as in the config")
    parser.add_argument("--config", required=True, help="the bus description (a3.xml)")
    parser.add_argument(
        "--storage", help="storage directory (default: ./s<id>, a replica's ./s<id>r<index>)"
    )
    parser.add_argument(
        "--replica",
        type=int,
        metavar="INDEX",
        help="run replica INDEX of server --id (a <replica> of it in the config) instead of "
        "the server itself: it keeps a copy of the server's store",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("AAABUS_LOG", "WARNING"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: $AAABUS_LOG or WARNING)",
    )
    return parser


def run_server(args: argparse.Namespace, prog: str) -> int:
    from aaabus.config.reader import load_config
    from aaabus.node.member import MemberProcess
    from aaabus.node.server import AgentServer

    _setup_logging(args.log_level, f"s{args.id}")
    _dump_threads_on_sigusr1()
    stop = threading.Event()

    starting: list[AgentServer | MemberProcess] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()
        if starting:
            # A boot commit waiting for replicas that are not there would never end the start.
            starting[0].interrupt()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        config = load_config(args.config)
        if config.failover(args.id):
            member = MemberProcess(
                config,
                args.id,
                0 if args.replica is None else args.replica,
                args.storage,
                stop,
                lambda: _print_ready(args),
            )
            starting.append(member)
            return _run_member(member, prog)
    except AaabusError as exc:
        return _fail(prog, exc)
    if args.replica is not None:
        return _run_replica(args, prog, stop)
    try:
        # The collector is the process's: set here, by the process that runs one server, and
        # not by AgentServer (several share a process in simulations and tests).
        gc.set_threshold(*config.setting(args.id, "aaabus.gc.thresholds"))
        server = AgentServer(config, args.id, storage=args.storage, endpoints=True)
        starting.append(server)
        server.start()
    except AaabusError as exc:
        return _fail(prog, exc)
    except ReplicationStopped as exc:  # stopped while its boot waited for its replicas
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        starting.clear()
    # What boot built (modules, configuration, the agents loaded) lives as long as the process:
    # out of the collector's sight, full collections only walk what came since. Collected
    # first, so that no garbage cycle of the boot is frozen with it (never to be freed).
    gc.collect()
    gc.freeze()
    # One write of the whole line: print() writes the text and its newline apart, and a log
    # line from another thread landing between them (stdout and stderr may share a pipe, and
    # are unbuffered under the launcher) would hide the ready line from it.
    sys.stdout.write(READY_LINE.format(id=args.id) + "\n")
    sys.stdout.flush()
    # The engine stopping on its own (e.g. the disk is full) ends the process too, and so does
    # a stop asked through the admin port (`aaabus stop`), which sets server.stopped.
    while not stop.is_set() and not server.stopped.is_set():
        stop.wait(0.2)
    failure = server.failure
    try:
        server.stop()
    except TimeoutError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    if failure is not None:
        print(f"{prog}: error: server {args.id} stopped: {failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def _print_ready(args: argparse.Namespace) -> None:
    """The ready line of a server, or of one of its replicas (one write: see run_server)."""
    if args.replica is None:
        sys.stdout.write(READY_LINE.format(id=args.id) + "\n")
    else:
        sys.stdout.write(REPLICA_READY_LINE.format(id=args.id, index=args.replica) + "\n")
    sys.stdout.flush()


def _run_member(member: MemberProcess, prog: str) -> int:
    """A member of a server with failover on (aaabus.node.member): it follows or serves, and
    switches in the same process; it prints its ready line once it has taken its first role.
    Exit status 0 when stopped, 1 when its store or its server failed, 2 (one line) when it
    cannot start."""
    try:
        status = member.run()
    except ReplicationStopped as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr, flush=True)
        return 1
    if member.failure is not None:
        print(f"{prog}: error: {member.failure}", file=sys.stderr, flush=True)
    return status


def _run_replica(args: argparse.Namespace, prog: str, stop: threading.Event) -> int:
    """``aaabus-server --id N --replica K``: a replica of server N (aaabus.node.replica), which
    prints the ready line of server N once it listens for its primary."""
    from aaabus.config.reader import load_config
    from aaabus.node.replica import ReplicaServer

    try:
        config = load_config(args.config)
        replica = ReplicaServer(config, args.id, args.replica, args.storage)
        replica.start()
    except AaabusError as exc:
        return _fail(prog, exc)
    sys.stdout.write(REPLICA_READY_LINE.format(id=args.id, index=args.replica) + "\n")
    sys.stdout.flush()
    while not stop.is_set() and not replica.stopped.is_set():
        stop.wait(0.2)
    replica.stop()
    if replica.failure is not None:
        print(f"{prog}: error: {replica.failure}", file=sys.stderr, flush=True)
        return 1
    return 0


def server_main(argv: Sequence[str] | None = None) -> int:
    prog = "aaabus-server"
    args = _server_parser(prog).parse_args(argv)
    return run_server(args, prog)


# -- aaabus ------------------------------------------------------------------------------------


def _cmd_check(args: argparse.Namespace) -> int:
    from aaabus.config.domains import Topology
    from aaabus.config.reader import load_config

    config = load_config(args.config)
    topology = Topology.from_config(config)
    _check_mqtt_files(config)
    for warning in config.member_warnings():
        print(f"aaabus check: warning: {warning}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(topology.to_json(), indent=2))
    else:
        print(topology.describe())
    return 0


def _check_mqtt_files(config: Any) -> None:
    """Read the MQTT ACL and credentials files the servers of ``config`` (a BusConfig) would
    load at boot: a bad line, or a file others could change, fails the check as it would fail
    the server (a ConfigError naming the file)."""
    from pathlib import Path

    from aaabus.mqtt.acl import Acl
    from aaabus.mqtt.auth import Credentials

    base = Path(config.path).resolve().parent
    for sid in config.servers:
        if config.setting(sid, "aaabus.mqtt.port") is None:
            continue
        acl = config.setting(sid, "aaabus.mqtt.acl")
        if acl:
            Acl.load(base / acl)
        credentials = config.setting(sid, "aaabus.mqtt.credentials")
        if credentials:
            Credentials.load(base / credentials)


def _cmd_topology(args: argparse.Namespace) -> int:
    from aaabus.config.topology import generate

    sys.stdout.write(
        generate(
            args.kind,
            args.servers,
            domain_size=args.domain_size,
            base_port=args.base_port,
            host=args.host,
            properties=None if args.trust is None else {"aaabus.trust": args.trust},
        )
    )
    return 0


def _cmd_secret(args: argparse.Namespace) -> int:
    from aaabus.config.reader import load_config
    from aaabus.config.scopes import DEFAULT_SCOPE, parse_scope
    from aaabus.config.secret import make_secret, write_secret, write_server_keys, write_tool_key
    from aaabus.errors import ConfigError

    if (args.tool or args.server is not None) and args.out is None:
        raise ConfigError("--tool and --server need --out FILE (derived keys are never printed)")
    if args.tool and args.server is not None:
        raise ConfigError("--tool and --server make different files: give one of them")
    if args.scope is not None and not args.tool:
        raise ConfigError("--scope is the scope of a tool key: give it with --tool")
    if args.tool:
        scope = DEFAULT_SCOPE if args.scope is None else parse_scope(args.scope, "--scope")
        write_tool_key(args.out, args.bus_key, scope)
    elif args.server is not None:
        if args.config is None:
            raise ConfigError("--server needs --config a3.xml (the servers it links to)")
        config = load_config(args.config)
        config.server(args.server)  # unknown id: one line
        replicated = bool(config.server(args.server).replicas)
        write_server_keys(
            args.out, args.bus_key, args.server, config.servers, replicated=replicated
        )
    elif args.out is None:
        sys.stdout.write(make_secret())
    else:
        write_secret(args.out)
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from aaabus.config.domains import Topology
    from aaabus.config.reader import load_config
    from aaabus.tools.launch import Bus, local_server_ids

    config = load_config(args.config)
    Topology.from_config(config)  # refuse a bad topology before starting anything
    ids = local_server_ids([(sid, spec.hostname) for sid, spec in config.servers.items()])
    if not ids:
        print("aaabus launch: no server of this config lives on this host", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    lock = threading.Lock()
    bus_ref: list[Any] = []

    def on_usr1(signum: int, frame: FrameType | None) -> None:
        # Pass the thread-dump request on to every server: their stacks come back as log lines.
        for proc in bus_ref[0].servers.values() if bus_ref else ():
            if proc.running():
                proc.proc.send_signal(signal.SIGUSR1)

    if hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, on_usr1)

    def relay(line: str) -> None:
        with lock:
            print(line, flush=True)

    bus = Bus(args.config, ids, args.storage_root, sink=relay, log_level=args.log_level)
    bus_ref.append(bus)
    bus.start(timeout=args.timeout)
    relay(f"aaabus launch: {len(ids)} server(s) ready: {', '.join(map(str, ids))}")
    failed: list[int] = []
    reported: set[int] = set()
    try:
        while not stop.is_set():
            stop.wait(0.5)
            exited = {
                sid: proc.proc.returncode
                for sid, proc in bus.servers.items()
                if proc.proc is not None and proc.proc.poll() is not None
            }
            # A server stopped cleanly (`aaabus stop`, exit 0) is left stopped; a crash stops all.
            failed = [sid for sid, code in exited.items() if code != 0]
            if failed:
                relay(f"aaabus launch: server(s) {failed} failed; stopping the others")
                break
            for sid in sorted(set(exited) - reported):
                relay(f"aaabus launch: server {sid} stopped")
                reported.add(sid)
            if len(exited) == len(bus.servers):
                break
    finally:
        codes = bus.stop()
    relay(f"aaabus launch: stopped ({codes})")
    return 0 if all(code in (0, None) for code in codes.values()) and not failed else 1


# -- status, stop, send ------------------------------------------------------------------------


def _tool_credential(args: argparse.Namespace, config: Any) -> Any:
    """The key file a tool proves itself with: ``--key`` (a tool key or the bus key), else the
    bus key the config names."""
    from aaabus.config.secret import load_credential, secret_path

    return load_credential(args.key if args.key is not None else secret_path(config))


def _bus_and_ids(args: argparse.Namespace) -> tuple[Any, list[int], Any]:
    from aaabus.config.reader import load_config

    config = load_config(args.config)
    ids = sorted(config.servers) if args.id is None else [args.id]
    for sid in ids:
        config.server(sid)  # unknown id: one line, exit 2
    return config, ids, _tool_credential(args, config)


def _cmd_status(args: argparse.Namespace) -> int:
    from aaabus.tools.buswide import bus_status

    config, ids, secret = _bus_and_ids(args)
    servers = bus_status(config, ids, secret, timeout=args.timeout)
    if args.wait:
        # For scripts: after `aaabus launch ... &`, wait until every server answers.
        deadline = time.monotonic() + args.wait
        pause = threading.Event()
        while not all(st["up"] for st in servers) and time.monotonic() < deadline:
            pause.wait(0.1)
            servers = bus_status(config, ids, secret, timeout=args.timeout)
    if args.json:
        print(json.dumps({"servers": servers}, indent=2))
    else:
        print(_status_table(servers))
    busy = [st for st in servers if st.get("busy")]
    for st in busy:
        print(st["busy"], file=sys.stderr)
    # Both ends of a link see the same disagreement: each said once.
    diverged = list(dict.fromkeys(fact for st in servers for fact in st.get("diverged", ())))
    for fact in diverged:
        print(fact, file=sys.stderr)
    # A busy server is running but not answering, a store older than its peers remember holds
    # messages back for ever: a monitoring script must not read "fine".
    return 1 if busy or diverged or (args.wait and not all(st["up"] for st in servers)) else 0


def _status_table(servers: list[dict[str, Any]]) -> str:
    head = (
        "id", "name", "up", "uptime", "domains", "router", "input", "held", "outgoing",
        "sent", "delivered", "r/s", "clock", "storage",
    )  # fmt: skip
    rows: list[tuple[str, ...]] = [head]
    for st in servers:
        if not st["up"]:
            state = "busy" if st.get("busy") else "down"
            rows.append((str(st["id"]), "", state) + ("",) * (len(head) - 3))
            continue
        if st.get("partial"):
            # Its engine is inside a commit that waits for its replicas (see the lines below).
            rows.append((str(st["id"]), st["name"], "waiting") + ("",) * (len(head) - 3))
            continue
        queues, msgs = st["queues"], st["messages"]
        outgoing = ",".join(f"{p}:{n}" for p, n in queues["outgoing"].items()) or "-"
        rows.append((
            str(st["id"]), st["name"], "up", _duration(st["uptime_s"]), ",".join(st["domains"]),
            "yes" if st["router"] else "no", str(queues["input"]), str(queues["held_back"]),
            outgoing, str(msgs["sent"]), str(msgs["delivered"]), f"{st['reactions_per_s']:g}",
            "+".join(f"{k}x{k}" for k in st["clocks"].values()), _storage(st),
        ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    return "\n".join(
        lines
        + [line for st in servers for line in _replica_lines(st)]
        + [line for st in servers for line in _epoch_lines(st)]
    )


def _epoch_lines(st: dict[str, Any]) -> list[str]:
    """One line per other server that failed over, as this server knows it (issue 42)."""
    return [
        f"server {st['id']} knows server {sid} at epoch {epoch} (member {member})"
        for sid, (epoch, member) in st.get("epochs", {}).items()
    ]


def _replica_lines(st: dict[str, Any]) -> list[str]:
    """One line per replica of a primary: connected or not, how far behind."""
    shipping = st.get("replication")
    if not shipping:
        return []
    lines = []
    if shipping["waiting_s"] is not None:
        lines.append(
            f"server {st['id']}: a commit has waited {shipping['waiting_s']:.1f} s for "
            f"{shipping['sync']} replica(s); nothing is acknowledged meanwhile"
        )
    for index, rep in shipping["replicas"].items():
        state = "connected" if rep["connected"] else "NOT connected"
        behind = (
            "lag unknown (no acknowledgement yet)"
            if rep["behind_commits"] is None
            else f"behind {rep['behind_commits']} commit(s), {_size(rep['behind_bytes'])}"
        )
        lines.append(
            f"server {st['id']} replica {index} ({rep['address']}): {state} for "
            f"{_duration(rep['for_s'])}, {behind}"
        )
    return lines


def _storage(st: dict[str, Any]) -> str:
    """``live/file`` bytes (``file`` alone when the store cannot tell its live bytes)."""
    live = st.get("storage_live_bytes")
    size = _size(st["storage_bytes"])
    return size if live is None else f"{_size(live)}/{size}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _size(n: int) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _cmd_stop(args: argparse.Namespace) -> int:
    from aaabus.tools.buswide import stop_servers

    config, ids, secret = _bus_and_ids(args)
    outcome = stop_servers(config, ids, secret, timeout=args.timeout)
    for sid, what in outcome.items():
        print(f"server {sid}: {what}")
    return 0 if all(what not in ("still stopping", "busy") for what in outcome.values()) else 1


def _cmd_send(args: argparse.Namespace) -> int:
    from aaabus.config.reader import load_config
    from aaabus.errors import ConfigError
    from aaabus.model.ids import AgentId
    from aaabus.model.notifications import Notification
    from aaabus.tools.client import Client

    config = load_config(args.config)
    text = args.to if args.to.startswith("#") else f"#{args.to}"
    try:
        to = AgentId.parse(text)
    except ValueError as exc:
        raise ConfigError(f"--to: {exc} (quote it in the shell: '#' starts a comment)") from None
    if to.server not in config.servers:
        raise ConfigError(f"--to {to}: server {to.server} is not in {args.config}")
    cls: Any = _import_class(args.notification)
    if not (isinstance(cls, type) and issubclass(cls, Notification)):
        raise ConfigError(f"--notification {args.notification} is not a Notification class")
    make: Callable[..., Any] = cls
    try:
        values = json.loads(args.args)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--args is not JSON ({exc})") from None
    try:
        if isinstance(values, dict):
            note = make(**values)
        elif isinstance(values, list):
            note = make(*values)
        else:
            note = make(values)
    except Exception as exc:
        raise ConfigError(
            f"--args do not make a {cls.__name__} ({type(exc).__name__}: {exc})"
        ) from None
    via = to.server if args.via is None else args.via
    credential = _tool_credential(args, config)
    with Client(config, via, secret=credential, timeout=args.timeout) as client:
        performed = client.send(to, note, request_id=args.request_id)
    if performed:
        print(f"sent {cls.__name__} to {to} through server {via}")
    else:
        print(f"request {args.request_id} was already accepted by server {via}: not sent again")
    return 0


def _import_class(path: str) -> Any:
    from aaabus.errors import ConfigError

    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"--notification {path!r} is not of the form module:Class")
    # Like `python -m`, look in the current directory too, where the user's modules are.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as exc:
        raise ConfigError(
            f"--notification {path} cannot be imported ({type(exc).__name__}: {exc}); "
            "check the module path and PYTHONPATH"
        ) from None
    return target


def _cmd_server(args: argparse.Namespace) -> int:
    return run_server(args, "aaabus server")


KEY_HELP = (
    "key file to authenticate with: a tool key (aaabus secret --tool --scope ...) or the bus key, "
    "which claims scope operate (default: the config's aaabus.secret, bus.key)"
)


def _main_parser() -> _Parser:
    # Their options live with their code (shared with the checkout's `python -m perf`); importing
    # them needs none of the libraries of their extra, which each checks when it runs.
    from aaabus.analysis import analyze, plan

    parser = _Parser(prog="aaabus", description="Tools of the aaabus agent bus.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    check = sub.add_parser("check", help="validate a3.xml and print domains, routers and routes")
    check.add_argument("config")
    check.add_argument("--json", action="store_true", help="print one JSON object")
    check.set_defaults(func=_cmd_check)

    topo = sub.add_parser("topology", help="write a generated a3.xml to stdout")
    topo.add_argument("kind", choices=["flat", "bus", "star", "tree"])
    topo.add_argument("--servers", type=int, required=True)
    topo.add_argument("--domain-size", type=int, default=10)
    topo.add_argument("--base-port", type=int, default=16300)
    topo.add_argument("--host", default="127.0.0.1")
    topo.add_argument(
        "--trust",
        metavar="MODULES",
        help="comma-separated modules whose agents and notifications the servers may load "
        "(property aaabus.trust, docs/security.md)",
    )
    topo.set_defaults(func=_cmd_topology)

    for name, module, text in (
        ("plan", plan, "plan causality domains from traffic traces (Spark): a3.xml, its cost"),
        ("analyze", analyze, "timing traces to tables, growth fits and plots (Spark)"),
    ):
        command = sub.add_parser(name, help=f"{text}; needs aaabus[spark]")
        module.add_arguments(command)
        command.set_defaults(func=module.run)

    secret = sub.add_parser("secret", help="make a new bus secret (aaabus secret --out bus.key)")
    secret.add_argument(
        "--out",
        help="create this file (mode 0600, never overwritten); without it the key is printed",
    )
    secret.add_argument(
        "--tool",
        action="store_true",
        help="write a tool key derived from the bus key instead: it lets its holder make the "
        "admin requests of its --scope on every server, and cannot open a link as a server",
    )
    secret.add_argument(
        "--scope",
        metavar="SCOPE",
        help="with --tool: read (status, subscribe), operate (also send, publish, deploy by "
        "class, stop; the default) or code (also what may carry code, deploying by value "
        "included, on servers that load code); see docs/security.md",
    )
    secret.add_argument(
        "--server",
        type=int,
        metavar="ID",
        help="write the key file of server ID instead: the keys of its links (to every server "
        "of --config) and its own admin keys, not the bus key nor a tool key; set it as that "
        "server's aaabus.secret",
    )
    secret.add_argument("--config", help="with --server: the bus's a3.xml")
    secret.add_argument(
        "--from",
        dest="bus_key",
        default="bus.key",
        help="with --tool or --server: the bus key file to derive from (default bus.key)",
    )
    secret.set_defaults(func=_cmd_secret)

    launch = sub.add_parser(
        "launch", help="start every server of a3.xml that lives on this host, relay their logs"
    )
    launch.add_argument("config")
    launch.add_argument("--storage-root", default=".", help="stores go to DIR/s<id> (default .)")
    launch.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for ready")
    launch.add_argument(
        "--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"]
    )
    launch.set_defaults(func=_cmd_launch)

    status = sub.add_parser("status", help="show each server's figures, live")
    status.add_argument("config")
    status.add_argument("--key", help=KEY_HELP)
    status.add_argument("--id", type=int, help="only this server (default: all)")
    status.add_argument("--json", action="store_true", help='print {"servers": [...]}')
    status.add_argument("--timeout", type=float, default=5.0, help="seconds per server")
    status.add_argument(
        "--wait", type=float, metavar="SECONDS", help="wait up to SECONDS for all to be up"
    )
    status.set_defaults(func=_cmd_status)

    stop = sub.add_parser("stop", help="stop servers cleanly (as SIGTERM does)")
    stop.add_argument("config")
    stop.add_argument("--key", help=KEY_HELP)
    stop.add_argument("--id", type=int, help="only this server (default: all)")
    stop.add_argument("--timeout", type=float, default=30.0, help="seconds to wait")
    stop.set_defaults(func=_cmd_stop)

    send = sub.add_parser("send", help="send a notification to an agent from outside the bus")
    send.add_argument("config")
    send.add_argument("--key", help=KEY_HELP)
    send.add_argument("--to", required=True, help="the target agent, e.g. '#0.1.16' (quoted)")
    send.add_argument(
        "--notification", required=True, help="its class, module:Class (importable here)"
    )
    send.add_argument("--args", default="{}", help="JSON: an object (keywords) or a list")
    send.add_argument("--via", type=int, help="server to go through (default: the target's)")
    send.add_argument("--request-id", help="id making a retried send idempotent")
    send.add_argument("--timeout", type=float, default=30.0, help="seconds, retries included")
    send.set_defaults(func=_cmd_send)

    add_topic_commands(sub, KEY_HELP, _tool_credential)

    # Like plan and analyze: its options import nothing of its extra (aiohttp), checked at run.
    from aaabus.console import command as console

    shown = sub.add_parser(
        "console", help="serve the bus live in a browser on 127.0.0.1; needs aaabus[console]"
    )
    console.add_arguments(shown)
    shown.set_defaults(func=console.run)

    server = sub.add_parser("server", help="run one agent server (same as aaabus-server)")
    for action in _server_parser("aaabus server")._actions:
        if action.option_strings and action.dest != "help":
            server._add_action(action)
    server.set_defaults(func=_cmd_server)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _main_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except AaabusError as exc:
        return _fail(f"aaabus {args.command}", exc)
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
