"""The MQTT standby responder of a member that is not its server's primary (issue 42).

A follower member does not run the MQTT listener: its store is the primary's copy, and a device
it accepted would write nowhere. Yet devices configured with every member's address (or a DNS
name over them) reach it, and must be sent on. :class:`Standby` listens on the follower's own
hostname and the server's MQTT port, reads each connection's CONNECT and answers it with a
CONNACK refusal, then closes:

* MQTT 5.0, primary known: reason 0x9C "use another server" with the Server Reference property
  ``host:port`` of the primary's MQTT listener (5.0 §4.11): a device that follows server
  redirection connects there at once;
* MQTT 5.0, primary unknown (a vote under way, or nobody answers): 0x88 "server unavailable";
* MQTT 3.1.1, either way: return code 0x03 "server unavailable" (3.1.1 has no redirection): the
  device retries, through the list of addresses it was given.

Nothing of the CONNECT is kept, no password is checked (there is nothing to protect: the answer
is the same to everyone, and the primary's address is no secret from a device that may connect
to it). A malformed CONNECT is refused as the listener refuses it (the codec's code, or a close).

Bounds, so that a flood costs a follower no more than a few file descriptors: at most
``max_connections`` connections are held at once and ``per_address`` from one remote address
(once its oldest has waited :data:`GRACE_S`), the oldest evicted first
(:class:`~aaabus.io.gate.PendingTable`); each must send a whole CONNECT
within ``connect_s`` of its accept; no packet over ``max_packet`` bytes is buffered (the codec
refuses it as soon as its length is known); after the CONNACK the responder stops writing and
reads (discarding, for at most :data:`LINGER_S`) until the device closes, so that a device that
pipelined packets after its CONNECT still reads its CONNACK rather than a reset. Refusals are
logged a few lines at a time (:class:`~aaabus.io.gate.RefusalLog`).

Threads: one asyncio event loop on a thread of its own (``mqtt-standby-<port>``) owns the
listening socket, every connection and the waiting table: no lock. ``primary`` is called on
that thread, once per CONNECT.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from aaabus.errors import ConfigError, MqttProtocolError
from aaabus.io.gate import PendingTable, RefusalLog
from aaabus.mqtt import codec as mc
from aaabus.mqtt import codes as mq
from aaabus.mqtt.protocol import MqttProtocol, State

__all__ = ["GRACE_S", "LINGER_S", "Standby", "server_reference"]

log = logging.getLogger(__name__)

#: How long a connection is read (and its bytes dropped) after its CONNACK, waiting for the
#: device to close first: closing with unread input would reset the connection, and a reset can
#: destroy the CONNACK before the device reads it.
LINGER_S = 1.0

#: An address at its cap loses its oldest connection only once that one has waited this long;
#: before, the newcomer is let in while the whole table has room: after a failover, a site's
#: devices behind one address reconnect here at once, and each needs a moment to send its
#: CONNECT (the listener's rule, :data:`aaabus.mqtt.listener.GRACE_S`).
GRACE_S = 1.0

#: How long :meth:`Standby.start` and :meth:`Standby.stop` wait for the loop thread.
THREAD_S = 5.0


def server_reference(address: tuple[str, int]) -> str:
    """The Server Reference of a listener at ``address``: ``host:port``, an IPv6 host in
    brackets (5.0 leaves the form to the implementations; this is the one clients parse)."""
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Standby:
    """Answers every MQTT CONNECT on ``host:port`` with "use another server" and closes.

    ``primary``: where the server's primary member listens for MQTT now, ``(host, port)``, or
    None when unknown; called on the standby's loop thread for each CONNECT, so it must not
    block (read a value another thread sets); an exception it raises is logged and counts as
    unknown. ``port`` 0 picks a free port (see :attr:`address`). ``tls``: the server context of
    the MQTT listener (``aaabus.mqtt.tls.cert``), so that devices speaking TLS read the answer.
    The other keywords are the bounds of the module docstring.
    """

    def __init__(
        self,
        host: str,
        port: int,
        primary: Callable[[], tuple[str, int] | None],
        *,
        max_connections: int = 256,
        per_address: int = 16,
        connect_s: float = 5.0,
        max_packet: int = 65536,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self._primary = primary
        self.connect_s = connect_s
        self.max_packet = max_packet
        self.tls = tls
        try:
            self._sock = socket.create_server((host, port))
        except OSError as exc:
            raise ConfigError(
                f"MQTT standby cannot listen on {host}:{port} ({exc.strerror or exc}); another "
                "process holds the port, or the host is not an address of this machine"
            ) from None
        self._sock.setblocking(False)
        #: ``(host, port)`` it listens on.
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._run, name=f"mqtt-standby-{self.address[1]}", daemon=True
        )
        self._ready = threading.Event()
        # -- owned by the loop thread --
        self._waiting: PendingTable[asyncio.Task[None]] = PendingTable(max_connections, per_address)
        self._server: asyncio.Server | None = None
        self._name = server_reference(self.address)
        self._refusals = RefusalLog(log, f"MQTT standby {self._name}")
        self._answered: dict[int, int] = {}  # CONNACKs sent, by code

    # -- any thread -----------------------------------------------------------------------------

    def start(self) -> Standby:
        """Start serving on the loop thread; returns once it accepts connections."""
        self._thread.start()
        if not self._ready.wait(THREAD_S) or self._server is None:
            # The loop thread logged why (or is stuck): a bug, not the operator's input.
            raise RuntimeError(f"MQTT standby {self._name} did not start within {THREAD_S:g} s")
        return self

    def stop(self) -> None:
        """Close the port and every connection, and end the loop thread (waits up to
        :data:`THREAD_S`). Idempotent; the port is free once it returns."""
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop already closed
                self._loop.call_soon_threadsafe(self._shutdown)
            self._thread.join(THREAD_S)
        elif self._thread.ident is None and not self._loop.is_closed():
            self._loop.close()  # never started: the loop thread would have closed it
        with contextlib.suppress(OSError):
            self._sock.close()

    def figures(self, timeout: float) -> dict[str, Any]:
        """What a status shows of the responder (any thread, while it runs; read on its loop):
        ``waiting`` connections, CONNACKs ``answered`` by code (``"0x9c"``: redirected)."""
        answer: Future[dict[str, Any]] = Future()

        def read() -> None:
            answer.set_result({
                "address": self._name,
                "waiting": len(self._waiting),
                "answered": {f"{code:#04x}": n for code, n in sorted(self._answered.items())},
            })  # fmt: skip

        self._loop.call_soon_threadsafe(read)
        return answer.result(timeout)

    def __enter__(self) -> Standby:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the loop thread ------------------------------------------------------------------------

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                # TLS is started by each connection (_serve), inside its deadline and once it
                # counts in the waiting table: a flood of handshakes is bounded like the rest.
                asyncio.start_server(self._serve, sock=self._sock)
            )
            self._ready.set()
            self._loop.run_forever()
        except Exception:
            log.exception("MQTT standby %s stopped", self._name)
        finally:
            self._ready.set()
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
        for task in tasks:
            task.cancel()

        async def _gather() -> None:
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        self._loop.create_task(_gather())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection, from accept to close: its CONNECT by the deadline, the answer."""
        task = asyncio.current_task()
        assert task is not None
        peer = writer.get_extra_info("peername")
        where = str(peer[0]) if peer else "?"
        for old in self._waiting.add(task, where, time.monotonic(), GRACE_S):
            old.cancel()  # evicted: the oldest of that address, or the oldest of all when full
            self._refusals.refused(where, "evicted: too many connections waiting for CONNECT")
        try:
            async with asyncio.timeout(self.connect_s):
                if self.tls is not None:
                    await writer.start_tls(self.tls)
                answer = await self._read_connect(reader, where)
            if answer is not None:
                writer.write(answer)
                await asyncio.wait_for(writer.drain(), self.connect_s)
                await self._linger(reader, writer)
        except TimeoutError:
            self._refusals.refused(where, f"no CONNECT within {self.connect_s:g} s")
        except asyncio.CancelledError:
            # Evicted, or the responder stops (its member takes over): the connection just
            # closes. Ended here, not propagated: Python 3.11's start_server asks a cancelled
            # handler for its exception and logs the CancelledError as an error with a traceback.
            pass
        except (OSError, asyncio.IncompleteReadError):
            pass  # the device went away, or its TLS handshake failed: nothing to answer
        except Exception:
            # A bug here: said with its traceback (asyncio would keep it to itself), and only
            # this connection is lost.
            log.exception("MQTT standby %s: connection from %s", self._name, where)
        finally:
            self._waiting.remove(task)
            writer.close()

    async def _read_connect(self, reader: asyncio.StreamReader, where: str) -> bytes | None:
        """The CONNACK to send for the connection's CONNECT (None: close without one)."""
        proto = MqttProtocol(self.max_packet)
        while True:
            try:
                packet = proto.next_packet()
            except MqttProtocolError as exc:
                self._refusals.refused(where, str(exc))
                if proto.state is not State.CONNECTING or exc.code is None:
                    return None  # not a CONNECT, or one that 3.1.1 says to close without answer
                return self._count(proto.refuse(exc.code))
            if packet is not None:
                # next_packet hands out a CONNECT first or raises: nothing else gets here.
                assert isinstance(packet, mc.Connect)
                return self._redirect(proto)
            data = await reader.read(65536)
            if not data:
                raise asyncio.IncompleteReadError(b"", None)
            proto.receive(data)

    def _redirect(self, proto: MqttProtocol) -> bytes:
        try:
            primary = self._primary()
        except Exception:
            log.exception("MQTT standby %s: primary() raised", self._name)
            primary = None
        if primary is None:
            return self._count(proto.refuse(mq.SERVER_UNAVAILABLE))
        return self._count(
            proto.refuse(mq.USE_ANOTHER_SERVER, {mq.SERVER_REFERENCE: server_reference(primary)})
        )

    def _count(self, connack: bytes) -> bytes:
        code = connack[3]  # fixed header (2 bytes), acknowledge flags, then the code
        self._answered[code] = self._answered.get(code, 0) + 1
        return connack

    async def _linger(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Stop writing, then drop what the device still sends until it closes (bounded)."""
        if writer.can_write_eof():
            writer.write_eof()
        with contextlib.suppress(TimeoutError, OSError):
            async with asyncio.timeout(LINGER_S):
                while await reader.read(65536):
                    pass
