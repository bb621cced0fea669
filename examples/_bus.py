"""What every example needs: an ``a3.xml`` on free ports, a secret, and waiting with a deadline."""

from __future__ import annotations

import contextlib
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

from aaabus.config.admin_port import ADMIN_PORT_OFFSET
from aaabus.config.secret import ensure_secret

T = TypeVar("T")


def free_base(count: int, attempts: int = 200) -> int:
    """A port such that ``count`` ports from it, and their admin ports (+1000), are free now.

    Chosen below the kernel's ephemeral range (32768 and up on Linux), where outgoing
    connections take their local ports, so that nothing grabs them before the servers bind.
    """
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(20000, 31000 - count)
        ports = [*range(base, base + count)]
        if all(_free(port) for port in ports + [p + ADMIN_PORT_OFFSET for p in ports]):
            return base
    raise RuntimeError(f"no run of {count} free ports found")


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def write_bus(
    directory: Path,
    domains: list[list[int]],
    *,
    order: str = "causal",
    properties: Mapping[str, str] | None = None,
    server_properties: Mapping[int, Mapping[str, str]] | None = None,
) -> Path:
    """Write ``a3.xml`` (domain ``Di`` holds the servers of ``domains[i]``) and ``bus.key``."""
    directory.mkdir(parents=True, exist_ok=True)
    servers = sorted({sid for members in domains for sid in members})
    memberships = {
        sid: [d for d, members in enumerate(domains) if sid in members] for sid in servers
    }
    port = free_base(sum(len(m) for m in memberships.values()))
    lines = ["<config>"]
    lines += [f'  <domain name="D{d}" order="{order}"/>' for d in range(len(domains))]
    # The servers construct the examples' agents and notifications (see aaabus.trust).
    properties = {"aaabus.trust": "examples", **(properties or {})}
    lines += [f'  <property name="{k}" value="{v}"/>' for k, v in properties.items()]
    for sid in servers:
        lines.append(f'  <server id="{sid}" name="s{sid}" hostname="127.0.0.1">')
        for d in memberships[sid]:
            lines.append(f'    <network domain="D{d}" port="{port}"/>')
            port += 1
        for k, v in (server_properties or {}).get(sid, {}).items():
            lines.append(f'    <property name="{k}" value="{v}"/>')
        lines.append("  </server>")
    lines.append("</config>")
    config = directory / "a3.xml"
    config.write_text("\n".join(lines) + "\n")
    ensure_secret(directory / "bus.key")
    return config


def wait_for(condition: Callable[[], T | None], timeout: float, what: str) -> T:
    """Return ``condition()``'s first true value; fail after ``timeout`` seconds.

    Used for results that appear in another process (a file) or another thread: there is
    nothing to block on, so the condition is polled every 20 ms until the deadline.
    """
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g}s")
        pause.wait(0.02)


class Gate:
    """A TCP forwarder that is closed until :meth:`open`: a link that comes up late.

    Nothing listens on :attr:`port` until then, so a server dialling it keeps retrying (with its
    usual backoff) and its messages wait in its outgoing queue.
    """

    def __init__(self, target: tuple[str, int] = ("127.0.0.1", 0)) -> None:
        self.target = target  # may be set after construction, before open()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port: int = probe.getsockname()[1]
        self._listener: socket.socket | None = None
        self._socks: list[socket.socket] = []
        self._stopping = False

    def open(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(4)
        self._listener = listener
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._stopping:
            try:
                near, _ = self._listener.accept()
                far = socket.create_connection(self.target)
            except OSError:
                return
            self._socks += [near, far]
            for src, dst in ((near, far), (far, near)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stopping = True
        for sock in [*([self._listener] if self._listener else []), *self._socks]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept() or recv()
            with contextlib.suppress(OSError):
                sock.close()
