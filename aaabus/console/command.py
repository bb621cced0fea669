"""``aaabus console a3.xml [--port P]``: its options and its start (no aiohttp at import).

What it refuses, each in one line with exit status 2 before anything listens: a config with
errors, a key file that is missing or open to others, a ``--key`` of another scope than
``read`` (the console never reads with more), an ``--operate-key`` below ``operate``, another
address than a loopback one without ``--tls-cert``/``--tls-key``, a port in use. A server that
does not answer, or refuses the key, is not an error of the command: the page shows it.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import ssl
from typing import TYPE_CHECKING

from aaabus.extras import require

if TYPE_CHECKING:
    from aaabus.config.reader import BusConfig
    from aaabus.config.secret import Credential

__all__ = ["add_arguments", "run"]

#: What the console imports from its extra (pyproject.toml, ``console``).
NEEDS = ("aiohttp",)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="the bus description (a3.xml)")
    parser.add_argument(
        "--port", type=int, default=8470, help="HTTP port (default 8470; 0: any free port)"
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1); any other than a loopback address "
        "needs --tls-cert and --tls-key (docs/operations.md, 'The console')",
    )
    parser.add_argument(
        "--key",
        help="read-scoped key to read the servers with (aaabus secret --tool --scope read); "
        "default: the config's bus key, used for scope read only",
    )
    parser.add_argument(
        "--operate-key",
        help="an operate key: the page then offers to stop a server, after its name is typed "
        "as confirmation (without it the console changes nothing)",
    )
    parser.add_argument("--tls-cert", help="serve HTTPS with this certificate (PEM)")
    parser.add_argument("--tls-key", help="... and this private key (PEM)")


def run(args: argparse.Namespace) -> int:
    """The command (main thread): check everything, then serve until SIGINT or SIGTERM."""
    require("aaabus console", "console", *NEEDS)
    from aaabus.config.admin_port import admin_address
    from aaabus.config.domains import Topology
    from aaabus.config.reader import load_config
    from aaabus.console.board import Board
    from aaabus.console.web import Console

    config = load_config(args.config)
    topology = Topology.from_config(config)
    read, operate = _credentials(args, config)
    tls = _tls(args)
    if not 0 <= args.port <= 65535:
        from aaabus.errors import ConfigError

        raise ConfigError(f"--port {args.port} is not a port number (0..65535)")
    admin = {}
    for sid in config.servers:
        address, _ = admin_address(config, sid)
        admin[sid] = None if address is None else f"{address[0]}:{address[1]}"
    board = Board(config, topology, admin)
    console = Console(config, board, read, operate, args.host, args.port, tls)

    def ready(url: str) -> None:
        action = "stop with confirmation" if operate is not None else "read only"
        print(
            f"aaabus console: {url} ({len(config.servers)} servers, {action})",
            flush=True,
        )

    asyncio.run(console.serve(ready))
    return 0


def _credentials(
    args: argparse.Namespace, config: BusConfig
) -> tuple[Credential, Credential | None]:
    """The read credential (a read tool key, or the bus key claiming read) and the operate
    one, if given."""
    from aaabus.config.scopes import Scope
    from aaabus.config.secret import load_credential, secret_path
    from aaabus.errors import ConfigError

    path = args.key if args.key is not None else secret_path(config)
    given = load_credential(path)
    if given.is_tool and given.scope != Scope.READ:
        raise ConfigError(
            f"--key {path}: a {given.scope.label} key; the console reads with a read key only: "
            "make one with `aaabus secret --tool --scope read --out read.key`"
        )
    # A bus key gives every scope: the console claims read with it, never more.
    read = given if given.is_tool else given.claiming(Scope.READ)
    operate = None
    if args.operate_key is not None:
        operate = load_credential(args.operate_key)
        if not operate.scope.covers(Scope.OPERATE):
            raise ConfigError(
                f"--operate-key {args.operate_key}: a {operate.scope.label} key cannot stop a "
                "server; give an operate key (aaabus secret --tool --scope operate)"
            )
        if not operate.is_tool:
            operate = operate.claiming(Scope.OPERATE)
    return read, operate


def _tls(args: argparse.Namespace) -> ssl.SSLContext | None:
    from aaabus.errors import ConfigError

    if (args.tls_cert is None) != (args.tls_key is None):
        raise ConfigError("--tls-cert and --tls-key go together: give both or neither")
    loopback = False
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if args.tls_cert is None:
        if not loopback:
            raise ConfigError(
                f"--host {args.host} is not a loopback address: serve it over TLS (--tls-cert, "
                "--tls-key) or keep 127.0.0.1 behind your HTTPS proxy (docs/operations.md)"
            )
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.tls_cert, args.tls_key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"--tls-cert {args.tls_cert} / --tls-key {args.tls_key}: not usable ({exc})"
        ) from None
    return context
