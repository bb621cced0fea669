"""What attackers send: pickles that run a command when loaded, TLS hellos from strangers."""

from __future__ import annotations

import contextlib
import os
import pickle
import shlex
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aaabus import Agent, AgentId, Notification
from aaabus.model.ids import FIRST_USER_STAMP
from aaabus.model.notifications import AgentCreateRequest
from tests.support.records import PROTO


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


# -- the attack review's payloads (issue 30) as whole pickles, for the doors that take one: the
# admin port's requests and a peer's frames (tests/support/records.py builds their opcodes).


def whole_pickle(opcodes: bytes) -> bytes:
    """``opcodes`` (one value) as a pickle of its own."""
    return PROTO + opcodes + b"."


def walking_pickle(opcodes: bytes) -> bytes:
    """``opcodes`` as a pickle of protocol 4: the first at which stock pickle follows a dotted
    GLOBAL name (``PersistentMapping.__init__.__class__``) attribute by attribute, so that a
    walk runs code under ``pickle.loads`` (at 3 it fails on the lookup, and proves nothing)."""
    return b"\x80\x04" + opcodes + b"."


def runs_code_under_stock_pickle(payload: bytes, marker: Path, timeout: float = 30.0) -> bool:
    """Whether ``pickle.loads(payload)``, in a child process of its own (the sandbox: the
    repository as its only import path, no terminal, a deadline), creates ``marker``. The
    marker is removed again, so that a later "no marker" speaks of the bus alone."""
    root = Path(__file__).resolve().parents[2]
    # Whatever the payload raises once its code ran is beside the point: the marker says.
    code = (
        f"import pickle, sys\nsys.path.insert(0, {str(root)!r})\n"
        "try:\n    pickle.loads(sys.stdin.buffer.read())\nexcept Exception:\n    pass\n"
    )
    subprocess.run(
        [sys.executable, "-I", "-c", code],
        input=payload,
        cwd=root,
        capture_output=True,
        timeout=timeout,
        check=True,
    )
    ran = marker.exists()
    marker.unlink(missing_ok=True)
    return ran
