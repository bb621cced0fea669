"""Authenticated TCP links between agent servers, driven by one I/O thread per :class:`Network`.

Topology
    Exactly one long-lived TCP connection per pair of servers: the lower id dials the higher
    id's addresses (``peers[peer]``: one per member of that server, tried in turn,
    :mod:`aaabus.io.dialer`, redialling with jittered exponential backoff from 20 ms to 1 s),
    the higher id accepts (:mod:`aaabus.io.acceptor`). If a lower peer connects again while its
    old connection still looks alive (it restarted, or the old link is half-open), the new
    connection replaces the old one.

Epochs (issue 42)
    Once the handshake is done, each side's first session frame is ``EPOCH(epoch, member)``
    (:func:`aaabus.wire.frames.encode_epoch`): the epoch of its server id it speaks for, and
    which member of that server holds it (:attr:`Network.epoch`). The connection is up
    (``on_up``) only once the peer's EPOCH has been read and checked against ``epochs`` (the
    server's :class:`~aaabus.node.epochs.EpochBook`): an epoch older than the one known is
    refused and the connection closed, with one WARNING line naming the server, its epoch and
    the epoch that took over (through the dialler's or the acceptor's rate-limited refusal
    lines); a newer one is raised into the book (persisted, on the I/O thread: a rare fsync)
    and replaces the link still up with the older one. Any other first frame is a violation.
    :meth:`Network.fence` closes a link whose epoch a vote has since overtaken.

Keepalive
    With ``heartbeat_s``, every link that has sent nothing for a tick of ``heartbeat_s``
    seconds sends an empty session frame (:data:`~aaabus.wire.frames.KEEPALIVE`), so a link
    that is up is never silent for more than two ticks; the receiver drops it before
    ``on_frames`` (no engine wake-up, no commit). One timer per network, not per link, and no
    cost on the send path: a tick compares each link's count of frames sent with the last
    tick's. :meth:`Network.silent_for` is how long ago anything was last read from a peer.

Security
    Each connection runs the mutual handshake of :mod:`aaabus.wire.frames` (optionally inside
    TLS: :mod:`aaabus.io.tlssteps`) within ``handshake_timeout``; before it completes, frames
    are limited to a few hundred bytes so an unauthenticated client cannot make us buffer
    megabytes. Afterwards every frame is verified by a
    :class:`~aaabus.wire.frames.SessionCipher`; a frame that fails verification closes the
    connection. Only verified payloads reach ``on_frames``. Refused incoming connections are
    logged at WARNING with the remote address and the reason; the server keeps serving.

Threading contract
    * ``start``/``stop`` are called by the owner; everything else runs on the single daemon
      thread ``f"{name}-io"``, which owns the selector and every socket (:mod:`aaabus.io.loop`).
    * ``on_frames(peer, payloads)``, ``on_up(peer)`` and ``on_down(peer)`` are called on the I/O
      thread. They must return quickly and never block (hand work to another thread); while
      they run, no other connection is served. Exceptions they raise are logged and ignored.
      They may call :meth:`Network.send` / :meth:`Network.send_many` / :meth:`Network.is_up`.
    * ``on_frames`` may return work it started and cannot finish before more is read (a
      :class:`Wait`: a group waiting for its durability notice). The loop keeps it aside,
      serving every connection meanwhile, and resumes it on the I/O thread after each read,
      after each ``on_down``, and at its ``deadline``, until it returns None; it polls rather
      than sleeps until its ``spin_until_ns``. ``stop`` cancels it. One at a time: while it is
      aside, ``on_frames`` must not return another.
    * ``on_frames`` receives the payloads of one peer in the order that peer sent them: those
      of one socket read together, in a list it may keep.
    * ``on_up(peer)`` follows every successful handshake; ``on_down(peer)`` follows the loss of a
      connection that was up (including its replacement by a newer one, which is then announced
      by ``on_up``). Per peer the calls strictly alternate up, down, up, ... ``stop`` does not
      call ``on_down``.
    * ``send``/``send_many`` are thread-safe and never wait for the network. A payload sent
      while the peer is not up is dropped silently: the layer above resends what is
      unacknowledged when ``on_up`` fires. Payloads accepted while the peer is up are written
      in order, unless the connection is lost.

Latency
    On a plain TCP link, ``send`` MACs the frame and writes it to the non-blocking socket on the
    caller's thread (under a per-connection lock) when nothing is queued before it, so a send
    costs one system call and no thread hand-off. Only what the kernel does not accept at once
    is queued for the I/O thread, which then writes everything queued in one call (batching).
    With TLS all writes go through the I/O thread, because an ``SSLSocket`` must not be read and
    written by two threads at once; ``send`` then queues and wakes the I/O thread through a
    socketpair (once per batch, not once per frame).

The modules, each using only those below it:

* ``network``: this facade, and each connection's life once opened: TLS or not, handshake,
  session (reading, MACs, writes the kernel did not take), close;
* ``acceptor``, ``dialer``, ``tlssteps``: who opens connections (the listening side and its
  waiting rooms, the dialling side and its backoff) and the TLS worker;
* ``loop``: the selector, the timers and the work other threads post to the I/O thread;
* ``connection``: one connection's record, and the writes any thread makes on it;
* ``states``: every state of a connection and every transition, as one table.
"""

from __future__ import annotations

import contextlib
import logging
import math
import selectors
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeAlias

from aaabus.config.secret import link_key
from aaabus.errors import AaabusError, AuthError, FrameTooLarge, NetworkError, WireError
from aaabus.io.acceptor import Acceptor
from aaabus.io.connection import Connection
from aaabus.io.dialer import Dialer
from aaabus.io.logpolicy import close_level, close_message
from aaabus.io.loop import Loop
from aaabus.io.states import ConnEvent, ConnState
from aaabus.io.tlssteps import Outcome, TlsSteps
from aaabus.wire.frames import (
    KEEPALIVE,
    AcceptorHandshake,
    ConnectorHandshake,
    SessionCipher,
    decode_epoch,
    encode_epoch,
)

__all__ = ["Address", "EpochLedger", "Network", "NetworkError", "Wait"]

#: ``(host, port)``.
Address: TypeAlias = tuple[str, int]

_READ = selectors.EVENT_READ
_WRITE = selectors.EVENT_WRITE

# The connection states, as module globals: read on every event of the selector loop, where a
# global lookup is cheaper than an attribute of the enum class.
_CONNECTING = ConnState.CONNECTING
_TLS = ConnState.TLS
_HANDSHAKE = ConnState.HANDSHAKE
_EPOCH = ConnState.EPOCH
_UP = ConnState.UP
_CLOSING = ConnState.CLOSING
_CLOSED = ConnState.CLOSED

_READ_SIZE = 256 * 1024


class Wait(Protocol):
    """Work that ``on_frames`` set aside until more is read (see the module docstring)."""

    #: ``time.monotonic()`` by which it must be resumed, whatever was read.
    deadline: float
    #: ``time.perf_counter_ns()`` until which the loop polls for what it awaits.
    spin_until_ns: int

    def resume(self) -> Wait | None:
        """Go on (I/O thread): the work set aside again, or None once it is done."""
        ...

    def cancel(self, reason: str) -> None:
        """Give it up (I/O thread, the network stopping)."""
        ...


class EpochLedger(Protocol):
    """What the network needs of the server's memory of epochs
    (:class:`aaabus.node.epochs.EpochBook`); called on the I/O thread, once per new link."""

    def known(self, server_id: int) -> tuple[int, int] | None:
        """``(epoch, member)`` last accepted for ``server_id`` (None: epoch 1, member 0)."""
        ...

    def raise_to(self, server_id: int, epoch: int, member: int) -> bool:
        """Record a newer epoch of ``server_id``, persisted before it returns."""
        ...


class Network:
    """The I/O thread and the connections of one server in one network (see module docstring).

    ``my_id``: this server; ``listen``: addresses to accept on (port 0: let the OS choose, see
    :attr:`addresses`); ``peers``: every other server of the network and its address, or its
    addresses (one per member, dialled in turn; only the addresses of higher ids are dialled;
    lower ids are the only ones accepted, from the hosts of their addresses or anywhere else).
    ``secret``: the bus key, from which the key of each link is derived
    (:func:`aaabus.config.secret.link_key`), or a function giving the key of the link with a peer
    (a server key file's). A connection claiming a peer's id must prove it holds that pair's key,
    which neither another pair's key nor a tool key gives.
    ``max_frame``: largest payload sent or accepted. ``name`` names the thread
    (``f"{name}-io"``), prefixes log lines and appears in errors as the network's name.
    ``handshake_timeout``: seconds from connect/accept to an authenticated link.
    ``ssl_server``/``ssl_client``: TLS around every accepted/dialled connection, before the
    aaabus handshake (same deadline); ``ssl_client`` gets the peer's host as
    ``server_hostname``. TLS authenticates machines, the link keys authenticate servers.
    ``epochs``: the server's memory of the peers' epochs (None: every epoch is accepted, for a
    network tested alone); ``epoch``: ``(epoch, member)`` this server speaks for, settable as
    :attr:`epoch` until :meth:`start`. ``heartbeat_s``: the keepalive tick (None: no keepalive).
    """

    def __init__(
        self,
        *,
        my_id: int,
        listen: Sequence[tuple[str, int]],
        peers: Mapping[int, Address | Sequence[Address]],
        secret: bytes | Callable[[int], bytes],
        on_frames: Callable[[int, list[bytes]], Wait | None],
        on_up: Callable[[int], None],
        on_down: Callable[[int], None] | None = None,
        max_frame: int = 16 << 20,
        ssl_server: ssl.SSLContext | None = None,
        ssl_client: ssl.SSLContext | None = None,
        log: logging.Logger | None = None,
        name: str = "net",
        handshake_timeout: float = 5.0,
        epochs: EpochLedger | None = None,
        epoch: tuple[int, int] = (1, 0),
        heartbeat_s: float | None = None,
    ) -> None:
        if not secret:
            raise ValueError("the bus secret is empty")
        bus_key = b"" if callable(secret) else bytes(secret)
        #: The key of the link with each peer (see :mod:`aaabus.config.secret`).
        self._pair_key: Callable[[int], bytes] = (
            secret if callable(secret) else lambda peer: link_key(bus_key, my_id, peer)
        )
        self._my_id = my_id
        self._listen_addrs = list(listen)
        self._peers = {p: _addresses(addr) for p, addr in peers.items() if p != my_id}
        self._on_frames = on_frames
        self._on_up = on_up
        self._on_down = on_down
        self._max_frame = max_frame
        self._ssl_server = ssl_server
        self._ssl_client = ssl_client
        self._log = log or logging.getLogger("aaabus.network")
        self._name = name
        self._handshake_timeout = handshake_timeout
        self._epochs = epochs
        #: ``(epoch, member)`` this server speaks for in its EPOCH frames (set before start).
        self.epoch = epoch
        self._heartbeat_s = heartbeat_s
        #: ``perf_counter_ns`` of the last read from each peer on an admitted link (I/O thread
        #: writes, any thread reads: a dict lookup is atomic under the GIL).
        self._heard: dict[int, int] = {}
        # Lower ids dial us; we dial higher ids.
        self._acceptable = frozenset(p for p in self._peers if p < my_id)
        self._loop = Loop(self._on_event, self._on_error)
        self._acceptor = Acceptor(
            self._loop,
            adopt=self._adopt,
            begin=self._secure_or_handshake,
            close=self._close,
            log=self._log,
            name=name,
            where=f"(server {my_id}, network {name})",
        )
        self._dialer = Dialer(
            self._loop,
            {p: addr for p, addr in self._peers.items() if p > my_id},
            adopt=self._adopt,
            begin=self._secure_or_handshake,
            fail=self._fail,
            log=self._log,
            name=name,
        )
        self._tls: TlsSteps | None = None  # only with TLS
        # Read by sending threads without a lock: a dict lookup is atomic under the GIL, and the
        # connection's own lock then tells whether it is still up.
        self._up: dict[int, Connection] = {}
        self._conns: set[Connection] = set()
        # What on_frames set aside, until it is done (I/O thread).
        self._aside: Wait | None = None
        self._thread: threading.Thread | None = None
        self._rbuf = bytearray(_READ_SIZE)
        self._rview = memoryview(self._rbuf)
        #: ``perf_counter_ns`` when the latest socket read returned (I/O thread; callbacks read
        #: it to time what a frame costs from the read on: aaabus.core.trace.STAGES).
        self.read_ns = 0

    # ---------------------------------------------------------------- public API

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """The bound listen addresses (useful when listening on port 0)."""
        return self._acceptor.addresses

    def start(self) -> None:
        """Bind every listen address, then start the I/O thread. Raises :class:`NetworkError`."""
        if self._thread is not None:
            raise RuntimeError("Network already started")
        self._acceptor.bind(self._listen_addrs)
        self._loop.open()
        self._acceptor.open([host for p in self._acceptable for host, _port in self._peers[p]])
        self._dialer.start()
        if self._heartbeat_s is not None:
            self._loop.call_at(time.monotonic() + self._heartbeat_s, self._beat, None)
        if self._ssl_server is not None or self._ssl_client is not None:
            self._tls = TlsSteps(self._loop, self._tls_result, name=self._name)
        self._thread = threading.Thread(target=self._run, name=f"{self._name}-io", daemon=True)
        self._thread.start()

    def send(self, peer: int, payload: bytes) -> None:
        """Queue ``payload`` for ``peer``; dropped if the peer is not up. Thread-safe."""
        conn = self._up.get(peer)
        if conn is None:
            self._check_peer(peer)
            return
        if len(payload) > self._max_frame:
            raise self._too_large(peer, len(payload))
        with conn.lock:
            if conn.state is not _UP:
                return
            assert conn.cipher is not None
            needs_flush = conn.write_locked(conn.cipher.wrap_frame(payload))
        if needs_flush:
            self._loop.post(self._flush, conn)

    def send_many(self, peer: int, payloads: Sequence[bytes]) -> None:
        """Like :meth:`send` for several payloads, written (and waking the I/O thread) once."""
        conn = self._up.get(peer)
        if conn is None:
            self._check_peer(peer)
            return
        for payload in payloads:
            if len(payload) > self._max_frame:
                raise self._too_large(peer, len(payload))
        with conn.lock:
            if conn.state is not _UP:
                return
            assert conn.cipher is not None
            wrap = conn.cipher.wrap_frame
            needs_flush = conn.write_locked(b"".join([wrap(payload) for payload in payloads]))
        if needs_flush:
            self._loop.post(self._flush, conn)

    def is_up(self, peer: int) -> bool:
        """Whether an authenticated connection to ``peer`` is currently established."""
        return peer in self._up

    def silent_for(self, peer: int) -> float:
        """Seconds since anything was last read from ``peer`` on an admitted link (``inf``:
        never since this network started); any thread."""
        heard = self._heard.get(peer)
        if heard is None:
            return math.inf
        return (time.perf_counter_ns() - heard) / 1e9

    def fence(self, peer: int, epoch: int) -> None:
        """Close the link with ``peer`` if it speaks for an epoch older than ``epoch`` (any
        thread; a vote gave ``epoch`` away, already in the book). Checked now, and again on the
        I/O thread, which may be admitting an older link at this very moment."""
        reason = f"server {peer}'s epoch was taken over by epoch {epoch}"
        conn = self._up.get(peer)
        if conn is not None and conn.epoch < epoch:
            self._reset(conn, reason)
        if self._thread is not None:
            self._loop.post(self._fence_io, peer, epoch, reason)

    def _fence_io(self, peer: int, epoch: int, reason: str) -> None:
        conn = self._up.get(peer)
        if conn is not None and conn.epoch < epoch:
            self._reset(conn, reason)

    def reset(self, peer: int, reason: str) -> None:
        """Close the connection with ``peer`` now up, logging ``reason``; any thread.

        What it still had to send is dropped; it goes through ``on_down`` and is dialled again
        like any connection lost. The close itself happens on the I/O thread (it owns the
        sockets), before that thread reads anything more from the connection (CLOSING).
        """
        conn = self._up.get(peer)
        if conn is not None:
            self._reset(conn, reason)

    def _reset(self, conn: Connection, reason: str) -> None:
        with conn.lock:
            if conn.state is not _UP:
                return  # already closing, or closed
            conn.move(ConnEvent.RESET)  # nothing more leaves on it, from any thread
            conn.direct = False
            conn.out.clear()
        self._loop.post(self._close, conn, reason, logging.WARNING)

    def stop(self, timeout: float = 5.0) -> None:
        """Close every socket and join the I/O thread (at most ``timeout`` seconds)."""
        self._loop.stopping = True
        thread = self._thread
        if thread is None:
            self._acceptor.close()
            return
        self._loop.wake()
        if thread.ident != threading.get_ident():
            thread.join(timeout)
            if thread.is_alive():
                self._log.warning("%s: I/O thread did not stop within %.1f s", self._name, timeout)

    # ---------------------------------------------------------------- helpers of the API

    def _check_peer(self, peer: int) -> None:
        if peer not in self._peers:
            raise ValueError(f"server {peer} is not a peer of server {self._my_id} ({self._name})")

    def _too_large(self, peer: int, size: int) -> FrameTooLarge:
        # Refused here rather than sent: the receiver would drop the connection, the layer above
        # would resend on reconnection, and the link would flap forever.
        return FrameTooLarge(
            f"payload of {size} bytes for server {peer} exceeds max_frame={self._max_frame}"
        )

    # ---------------------------------------------------------------- the I/O thread

    def _run(self) -> None:
        try:
            self._loop.run()
        except Exception:
            self._log.exception("%s: I/O thread crashed", self._name)
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        waiting, self._aside = self._aside, None
        if waiting is not None:
            try:
                waiting.cancel("the network stopped")
            except Exception:
                self._log.exception("%s: cancelling the work set aside failed", self._name)
        if self._tls is not None:
            self._tls.stop()
        for conn in list(self._conns):
            with conn.lock:
                conn.move(ConnEvent.CLOSE)
                conn.direct = False
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._conns.clear()
        self._up.clear()
        self._acceptor.close()
        self._loop.close()

    def _on_event(self, conn: Connection, events: int) -> None:
        state = conn.state
        if state is _UP or state is _HANDSHAKE or state is _CLOSING or state is _EPOCH:
            if events & _READ:
                self._readable(conn)
            if events & _WRITE and conn.state is not _CLOSED:
                self._flush(conn)
        elif state is _CONNECTING:
            self._dialer.connected(conn)
        elif state is _TLS:
            assert self._tls is not None
            self._tls.step(conn)

    def _on_error(self, conn: Connection, exc: Exception) -> None:
        # A bug met on one connection must not take down the others: drop that one (the layer
        # above resends after the reconnection).
        self._log.exception("%s: error on %s", self._name, conn.label)
        self._fail(conn, f"internal error: {exc!r}")

    # ---- opening: every connection, dialled or accepted

    def _adopt(self, conn: Connection) -> None:
        """A new connection: tracked until closed, and closed if not up by the deadline."""
        self._conns.add(conn)
        conn.deadline = time.monotonic() + self._handshake_timeout
        self._loop.call_at(conn.deadline, self._deadline, conn)

    def _deadline(self, conn: Connection) -> None:
        if conn.state.handshaking:
            what = "connect" if conn.state is _CONNECTING else "handshake"
            self._fail(conn, f"{what} timed out after {self._handshake_timeout:g} s")

    def _secure_or_handshake(self, conn: Connection) -> None:
        context = self._ssl_client if conn.outgoing else self._ssl_server
        if context is None:
            self._begin_handshake(conn)
            return
        # wrap_socket detaches the plain socket object, so it must leave the selector first.
        self._loop.forget(conn)
        try:
            conn.sock = context.wrap_socket(
                conn.sock,
                server_side=not conn.outgoing,
                server_hostname=conn.host if conn.outgoing else None,
                do_handshake_on_connect=False,
            )
        except (OSError, ValueError) as exc:
            self._fail(conn, f"TLS setup failed: {exc}")
            return
        conn.move(ConnEvent.SECURE)
        assert self._tls is not None  # a context is set: so is the worker
        self._tls.step(conn)

    def _tls_result(self, conn: Connection, outcome: Outcome) -> None:
        """A TLS step of ``conn`` (still TLS) returned: failed, wants an event, or done."""
        if isinstance(outcome, Exception):
            self._fail(conn, f"TLS handshake failed: {outcome}")
        elif outcome is not None:
            conn.tls_want = outcome
            self._set_mask(conn)
        else:
            self._begin_handshake(conn)
            # The peer's first aaabus message may already sit decrypted in the TLS buffer,
            # where the selector cannot see it.
            sock = conn.sock
            assert isinstance(sock, ssl.SSLSocket)
            if conn.state is _HANDSHAKE and sock.pending():
                self._readable(conn)

    def _begin_handshake(self, conn: Connection) -> None:
        conn.move(ConnEvent.GREET)
        if conn.outgoing:
            assert conn.peer is not None
            key = self._pair_key(conn.peer)
            conn.handshake = ConnectorHandshake(key, self._my_id, conn.peer)
        else:
            # Servers only (the default roles): a tool's scope is no role on a network port.
            conn.handshake = AcceptorHandshake(
                lambda peer, _role: self._pair_key(peer), self._my_id, self._acceptable
            )
        first = conn.handshake.start()
        self._set_mask(conn)
        if first:
            self._write_io(conn, first)

    def _handshake_step(self, conn: Connection) -> bool:
        """Run buffered handshake messages; True once the peer is authenticated (EPOCH)."""
        handshake = conn.handshake
        assert handshake is not None
        while True:
            message = conn.decoder.pop()
            if message is None:
                return False
            reply = handshake.receive(message)
            if reply:
                self._write_io(conn, reply)
                if conn.state is _CLOSED:
                    return False
            if handshake.done:
                self._authenticated(conn)
                return conn.state is _EPOCH

    def _authenticated(self, conn: Connection) -> None:
        """The handshake proved the peer: our EPOCH goes out first, and its own is awaited."""
        handshake = conn.handshake
        assert handshake is not None and handshake.peer_id is not None
        conn.peer = handshake.peer_id
        conn.handshake = None
        conn.decoder.max_frame = self._max_frame + SessionCipher.OVERHEAD
        cipher = handshake.cipher()
        with conn.lock:
            conn.cipher = cipher
            conn.move(ConnEvent.AUTHENTICATED)
            first = cipher.wrap_frame(encode_epoch(*self.epoch))
        self._write_io(conn, first)

    def _admit(self, conn: Connection, frames: list[bytes]) -> list[bytes]:
        """``conn`` (EPOCH) read ``frames``: the first must be the peer's EPOCH, of an epoch
        not older than the book's. Returns the frames after it once the link is up, else none
        (the connection is then closed)."""
        peer, cipher = conn.peer, conn.cipher
        assert peer is not None and cipher is not None
        try:
            epoch, member = decode_epoch(cipher.unwrap(frames[0]))
            refusal = self._check_epoch(peer, epoch, member)
        except WireError as exc:
            self._fail(conn, str(exc), violation=True)
            return []
        if refusal is not None:
            self._fail(conn, refusal)
            return []
        conn.epoch = epoch
        self._acceptor.forget(conn)
        old = self._up.get(peer)
        if old is not None:
            if old.epoch < epoch:
                reason = f"server {peer} now speaks for epoch {epoch} (member {member})"
            else:
                # Only a holder of this pair's key can do this: the peer restarted (fine) or its
                # key leaked (not fine). Either way the operator should see both ends.
                reason = (
                    f"replaced by a new connection from {conn.label} claiming the same server id"
                )
            self._close(old, reason, logging.WARNING)
        with conn.lock:
            conn.move(ConnEvent.ADMITTED)
            conn.direct = not isinstance(conn.sock, ssl.SSLSocket)
        self._up[peer] = conn
        self._log.info(
            "%s: server %d %s %s is up (epoch %d, member %d)",
            self._name,
            peer,
            "at" if conn.outgoing else "from",
            conn.label,
            epoch,
            member,
        )
        self._callback(self._on_up, peer)
        return frames[1:] if conn.state is _UP else []

    def _check_epoch(self, peer: int, epoch: int, member: int) -> str | None:
        """Why ``peer`` at ``epoch`` held by ``member`` is refused, or None (a newer epoch is
        then in the book). A failing book write is a :class:`WireError`-like refusal too."""
        book = self._epochs
        if book is None:
            return None
        known = book.known(peer)
        if known is not None and epoch < known[0]:
            return (
                f"server {peer} speaks for its epoch {epoch} (member {member}), which epoch "
                f"{known[0]} (member {known[1]}) took over: refused"
            )
        try:
            book.raise_to(peer, epoch, member)
        except AaabusError as exc:
            return f"server {peer} at epoch {epoch} could not be recorded: {exc}"
        return None

    # ---- reading

    def _readable(self, conn: Connection) -> bool:
        """Read and handle what ``conn`` holds; False if there was nothing to read."""
        sock = conn.sock
        while True:
            try:
                count = sock.recv_into(self._rbuf)
                self.read_ns = time.perf_counter_ns()
            except (BlockingIOError, InterruptedError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return False
            except OSError as exc:
                self._fail(conn, f"read failed: {exc}")
                return True
            if count == 0:
                if conn.state.authenticated:
                    self._fail(conn, "connection closed by the peer")
                else:
                    self._fail(conn, "connection closed during the handshake")
                return True
            self._received(conn, self._rview[:count])
            # A TLS socket may hold decrypted bytes the selector cannot see: read them now.
            if conn.state is _CLOSED or not isinstance(sock, ssl.SSLSocket) or not sock.pending():
                return True

    def _received(self, conn: Connection, data: memoryview | bytes) -> None:
        if conn.state is _CLOSING:
            return  # reset by the layer above: it must not hear from this connection again
        try:
            if conn.state is _HANDSHAKE:
                conn.decoder.push(data)
                if not self._handshake_step(conn):
                    return
                data = b""  # the rest, if any, is already buffered in the decoder
            frames = conn.decoder.feed(data)
        except WireError as exc:
            self._fail(conn, str(exc), violation=True)
            return
        if not frames:
            return
        if conn.state is not _UP:  # EPOCH: the peer's first frame says which epoch it is
            frames = self._admit(conn, frames)
        cipher = conn.cipher
        peer = conn.peer
        assert cipher is not None and peer is not None
        if conn.state is _UP:
            self._heard[peer] = self.read_ns
        if not frames:
            return
        payloads: list[bytes] = []
        failure: AuthError | None = None
        for frame in frames:
            try:
                payload = cipher.unwrap(frame)
            except AuthError as exc:
                failure = exc  # what came before it was genuine: it is delivered first
                break
            if payload:  # else a keepalive: it has done its job by being read
                payloads.append(payload)
        if not conn.verified and (payloads or failure is None):
            self._verified(conn)
        if payloads:
            # One call per read, not per frame: the layer above hands the whole batch to its
            # engine at once (one lock, one wake-up).
            try:
                waiting = self._on_frames(peer, payloads)
            except Exception:
                self._log.exception("%s: on_frames(%d) failed", self._name, peer)
            else:
                if waiting is not None:
                    self._set_aside(waiting)
                elif self._aside is not None:
                    self._resume()  # this read may be what it waits for
        if failure is not None and conn.state is not _CLOSED:
            self._fail(conn, str(failure), violation=True)

    # ---- work set aside by on_frames

    def _set_aside(self, waiting: Wait) -> None:
        assert self._aside is None, "on_frames set aside more work while some was aside"
        self._aside = waiting
        self._loop.poll_until_ns = waiting.spin_until_ns
        self._loop.call_at(waiting.deadline, self._due, waiting)

    def _due(self, waiting: Wait) -> None:
        """The deadline of ``waiting`` came: resume it, unless it is done (a stale timer)."""
        if self._aside is waiting:
            self._resume()

    def _resume(self) -> None:
        waiting = self._aside
        assert waiting is not None
        self._aside = None
        self._loop.poll_until_ns = 0
        try:
            again = waiting.resume()
        except Exception:
            self._log.exception("%s: resuming the work set aside failed", self._name)
            return
        if again is waiting:
            self._aside = again
            self._loop.poll_until_ns = again.spin_until_ns
        elif again is not None:
            self._set_aside(again)

    def _beat(self, _: None) -> None:
        """The keepalive tick (I/O thread): an empty frame on every link up that has sent
        nothing since the previous tick."""
        assert self._heartbeat_s is not None
        if self._loop.stopping:
            return
        for peer, conn in list(self._up.items()):
            cipher = conn.cipher
            assert cipher is not None
            if cipher.sent == conn.beat_mark:
                self.send(peer, KEEPALIVE)
            conn.beat_mark = cipher.sent
        self._loop.call_at(time.monotonic() + self._heartbeat_s, self._beat, None)

    def _verified(self, conn: Connection) -> None:
        """A session frame after the EPOCHs passed its MAC: the link really works, both ways
        (a dial counts as a success only now: see :meth:`Dialer.verified`; a peer that refuses
        our epoch has admitted nothing, so an old primary redials at the backoff's pace)."""
        conn.verified = True
        if conn.outgoing and conn.peer is not None:
            self._dialer.verified(conn.peer)

    # ---- writing from the I/O thread

    def _write_io(self, conn: Connection, data: bytes) -> None:
        with conn.lock:
            conn.out += data
        self._flush(conn)

    def _flush(self, conn: Connection) -> None:
        """Write as much of ``conn.out`` as the socket takes; watch writability for the rest."""
        state = conn.state
        if state is _CLOSED or state is _CLOSING:
            return
        error: OSError | None = None
        with conn.lock:
            out = conn.out
            if out:
                try:
                    sent = conn.sock.send(out)
                except (BlockingIOError, InterruptedError, ssl.SSLWantWriteError):
                    sent = 0
                except ssl.SSLWantReadError:
                    sent = 0
                except OSError as exc:
                    error = exc
                    sent = 0
                if sent:
                    del out[:sent]
            pending = bool(out)
        if error is not None:
            self._fail(conn, f"write failed: {error}")
            return
        self._set_mask(conn, pending)

    def _set_mask(self, conn: Connection, want_write: bool = False) -> None:
        """Watch what ``conn`` waits for now: TLS, what its step wants; else reads, and writes
        while output is pending. (A connect in progress is the dialer's to watch.)"""
        mask = conn.tls_want if conn.state is _TLS else _READ | (_WRITE if want_write else 0)
        if mask != conn.mask:
            self._loop.watch(conn, mask)

    # ---- closing

    def _fail(self, conn: Connection, reason: str, *, violation: bool = False) -> None:
        """Close ``conn`` after an error, logging it at the level its kind deserves.

        ``violation``: the peer broke the protocol (bad frame, bad MAC), which is worth a warning
        even on an authenticated link, unlike a mere disconnection.
        """
        if conn.state is _CLOSED:
            return
        peer = conn.peer

        def first_time() -> bool:
            assert peer is not None  # only asked for our own dials, which know their peer
            return self._dialer.first_time(peer, reason)

        level = close_level(
            conn.state, outgoing=conn.outgoing, violation=violation, first_time=first_time
        )
        self._close(conn, reason, level)

    def _close(self, conn: Connection, reason: str, level: int) -> None:
        state = conn.state
        if state is _CLOSED:
            return
        was_up = state.authenticated
        if not was_up and not conn.outgoing:
            self._acceptor.forget(conn)
        with conn.lock:
            conn.move(ConnEvent.CLOSE)
            conn.direct = False
            conn.out.clear()
        peer = conn.peer
        # Logged before the socket closes, so that whoever watches the peer's end sees the
        # record already written when they observe the close.
        if was_up or conn.outgoing:
            message = close_message(was_up=was_up, peer=peer, label=conn.label)
            self._log.log(level, "%s: %s: %s", self._name, message, reason)
        else:
            # A stranger or a flood: rate-limited, so that the log cannot amplify an attack.
            self._acceptor.refusals.refused(conn.label, reason)
        self._loop.forget(conn)
        if self._tls is None or conn not in self._tls:  # else closed when its step returns
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._conns.discard(conn)
        if was_up and peer is not None and self._up.get(peer) is conn:
            del self._up[peer]
            if self._on_down is not None:
                self._callback(self._on_down, peer)
            if self._aside is not None:
                self._resume()  # it may wait for what this connection will never bring
        if conn.outgoing:
            self._dialer.lost(conn)

    def _callback(self, callback: Callable[[int], None], peer: int) -> None:
        try:
            callback(peer)
        except Exception:
            self._log.exception("%s: callback %r(%d) failed", self._name, callback, peer)


def _addresses(value: Address | Sequence[Address]) -> tuple[Address, ...]:
    """A peer's addresses: one ``(host, port)``, or several (one per member of that server)."""
    if len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int):
        return ((value[0], value[1]),)
    return tuple(value)  # type: ignore[arg-type]  # a sequence of addresses
