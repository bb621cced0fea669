"""Command-line entry points: ``aaabus-server`` and ``aaabus``.

Every user error (bad config, bad flag, unusable storage, ...) ends as ONE line on stderr and exit
status 2; tracebacks are kept for bugs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import NoReturn

from aaabus.errors import AaabusError

READY_LINE = "AgentServer#{id} started"


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


# -- aaabus-server ------------------------------------------------------------------------------


def _server_parser(prog: str) -> _Parser:
    parser = _Parser(prog=prog, description="Run one agent server of a bus in the foreground.")
    parser.add_argument("--id", type=int, required=True, help="server id, as in the config")
    parser.add_argument("--config", required=True, help="the bus description (a3.xml)")
    parser.add_argument("--storage", help="storage directory (default: ./s<id>)")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("AAABUS_LOG", "WARNING"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="logging level (default: $AAABUS_LOG or WARNING)",
    )
    return parser


def run_server(args: argparse.Namespace, prog: str) -> int:
    from aaabus.config import load_config
    from aaabus.server import AgentServer

    _setup_logging(args.log_level, f"s{args.id}")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        config = load_config(args.config)
        server = AgentServer(config, args.id, storage=args.storage)
        server.start()
    except AaabusError as exc:
        return _fail(prog, exc)
    print(READY_LINE.format(id=args.id), flush=True)
    # The engine stopping on its own (e.g. the disk is full) ends the process too.
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


def server_main(argv: Sequence[str] | None = None) -> int:
    prog = "aaabus-server"
    args = _server_parser(prog).parse_args(argv)
    return run_server(args, prog)


# -- aaabus ------------------------------------------------------------------------------------


def _cmd_check(args: argparse.Namespace) -> int:
    from aaabus.config import load_config
    from aaabus.domains import Topology

    topology = Topology.from_config(load_config(args.config))
    if args.json:
        print(json.dumps(topology.to_json(), indent=2))
    else:
        print(topology.describe())
    return 0


def _cmd_topology(args: argparse.Namespace) -> int:
    from aaabus.topology import generate

    sys.stdout.write(
        generate(
            args.kind,
            args.servers,
            domain_size=args.domain_size,
            base_port=args.base_port,
            host=args.host,
        )
    )
    return 0


def _cmd_secret(args: argparse.Namespace) -> int:
    from aaabus.secret import make_secret

    sys.stdout.write(make_secret())
    return 0


def _cmd_launch(args: argparse.Namespace) -> int:
    from aaabus.config import load_config
    from aaabus.domains import Topology
    from aaabus.launch import Bus, local_server_ids

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

    def relay(line: str) -> None:
        with lock:
            print(line, flush=True)

    bus = Bus(args.config, ids, args.storage_root, sink=relay, log_level=args.log_level)
    bus.start(timeout=args.timeout)
    relay(f"aaabus launch: {len(ids)} server(s) ready: {', '.join(map(str, ids))}")
    dead: list[int] = []
    try:
        while not stop.is_set():
            stop.wait(0.5)
            dead = [sid for sid, proc in bus.servers.items() if not proc.running()]
            if dead:
                relay(f"aaabus launch: server(s) {dead} exited; stopping the others")
                break
    finally:
        codes = bus.stop()
    relay(f"aaabus launch: stopped ({codes})")
    return 0 if all(code in (0, None) for code in codes.values()) and not dead else 1


def _cmd_server(args: argparse.Namespace) -> int:
    return run_server(args, "aaabus server")


def _main_parser() -> _Parser:
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
    topo.set_defaults(func=_cmd_topology)

    secret = sub.add_parser("secret", help="print a new bus secret (aaabus secret > bus.key)")
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
