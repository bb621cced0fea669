"""Authenticated TCP links between agent servers, driven by one I/O thread per :class:`Network`.

Topology
    Exactly one long-lived TCP connection per pair of servers: the lower id connects to the
    higher id's address (``peers[peer]``), the higher id accepts. A single dialling side means
    two servers can never race to open two connections to each other. While a higher peer is
    unreachable the lower one redials with jittered exponential backoff (20 ms doubling to 1 s).
    If a lower peer connects again while its old connection still looks alive (it restarted, or
    the old link is half-open), the new connection replaces the old one.

Security
    Each connection runs the mutual handshake of :mod:`aaabus.wire.frames` (optionally inside TLS)
    within ``handshake_timeout``; before it completes, frames are limited to a few hundred bytes
    so an unauthenticated client cannot make us buffer megabytes. Afterwards every frame is
    verified by a
    :class:`~aaabus.wire.frames.SessionCipher`; a frame that fails verification closes the
    connection. Only verified payloads reach ``on_frames``. Refused incoming connections are
    logged at WARNING with the remote address and the reason; the server keeps serving.

Threading contract
    * ``start``/``stop`` are called by the owner; everything else runs on the single daemon
      thread ``f"{name}-io"``, which owns the selector and every socket.
    * ``on_frames(peer, payloads)``, ``on_up(peer)`` and ``on_down(peer)`` are called on the I/O
      thread. They must return quickly and never block (hand work to another thread); while
      they run, no other connection is served. Exceptions they raise are logged and ignored.
      They may call :meth:`Network.send` / :meth:`Network.send_many` / :meth:`Network.is_up`.
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

TLS
    Optional: with ``ssl_client``/``ssl_server`` the TCP connection is wrapped in TLS before the
    aaabus handshake (same deadline). ``ssl_client`` gets the peer's host as ``server_hostname``.
    A TLS handshake costs milliseconds of CPU (key exchange, signatures) that anyone who can
    connect can make a server spend, so its steps never run on the I/O thread: each step (a
    non-blocking ``do_handshake``, which never waits for the network) runs on one
    ``{name}-tls`` worker thread at a lower scheduling priority, OpenSSL releasing the GIL
    meanwhile, while the I/O thread goes on serving established links. The connection leaves
    the selector during a step and comes back with its result; a connection closed meanwhile
    (deadline, eviction) has its socket closed when the step returns, never under the worker's
    feet. The aaabus handshake still runs inside TLS: TLS authenticates machines, the link keys
    authenticate servers.

Host names in ``peers`` are resolved on the I/O thread at each dial (``getaddrinfo`` blocks, so
prefer numeric addresses or names in ``/etc/hosts``).
"""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import logging
import os
import selectors
import socket
import ssl
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from aaabus.config.secret import link_key
from aaabus.errors import AuthError, FrameTooLarge, NetworkError, WireError
from aaabus.io.dialing import Dial
from aaabus.io.gate import PendingTable, RefusalLog
from aaabus.io.logpolicy import close_level, close_message
from aaabus.io.states import ConnState
from aaabus.wire.frames import (
    HANDSHAKE_MAX_FRAME,
    AcceptorHandshake,
    ConnectorHandshake,
    FrameDecoder,
    SessionCipher,
)

__all__ = ["Network", "NetworkError"]

_READ = selectors.EVENT_READ
_WRITE = selectors.EVENT_WRITE

# Connection states.
# The connection states, as module globals: read on every event of the selector loop, where a
# global lookup is cheaper than an attribute of the enum class.
_CONNECTING, _TLS, _HANDSHAKE, _UP, _CLOSED = ConnState

_READ_SIZE = 256 * 1024
#: Unauthenticated connections held at once from the configured peers' addresses, in all and per
#: address (both raised to two per configured peer where peers share an address: see start());
#: beyond either bound the oldest waiting one is evicted (see aaabus.io.gate).
_MAX_PENDING = 256
_MAX_PENDING_PER_ADDRESS = 64
#: The same for addresses that are no peer's: they can never authenticate here, so a flood from
#: them gets a small room of its own and cannot push a peer's connection out.
_MAX_STRANGERS = 32
_MAX_STRANGERS_PER_ADDRESS = 8
#: Threads running TLS handshake steps (CPU-bound, off the I/O thread): one bounds what a flood
#: of handshakes can take to one core, at a lower scheduling priority (see _lower_priority).
_TLS_WORKERS = 1
#: How much nicer than the rest of the process a TLS worker runs (Linux: per-thread nice).
_TLS_NICE = 10
#: Longest the I/O thread sleeps without a timer; it is woken by the socketpair anyway, so this
#: only bounds the damage of a lost wake-up.
_MAX_SELECT = 1.0


class _Conn:
    """One TCP connection, from connect/accept to close."""

    __slots__ = (
        "cipher",
        "deadline",
        "decoder",
        "direct",
        "doomed",
        "handshake",
        "host",
        "label",
        "lock",
        "mask",
        "out",
        "outgoing",
        "peer",
        "sock",
        "state",
        "tls_want",
        "verified",
    )
    # A connection in ``Network._in_worker`` belongs to a TLS worker: the I/O thread does not
    # touch its socket until the step's result comes back.

    def __init__(
        self, sock: socket.socket, label: str, *, outgoing: bool, peer: int | None, host: str
    ) -> None:
        self.sock = sock
        self.label = label  # "host:port" of the remote end, for logs
        self.host = host
        self.outgoing = outgoing
        # Expected peer while dialling; the proven peer once up; None for an unproven acceptee.
        self.peer = peer
        self.state = _CONNECTING
        self.decoder = FrameDecoder(HANDSHAKE_MAX_FRAME)
        self.handshake: ConnectorHandshake | AcceptorHandshake | None = None
        self.cipher: SessionCipher | None = None
        # ``lock`` guards ``state`` transitions to/from _UP, ``cipher`` send side, ``out`` and
        # ``direct``: sending threads and the I/O thread both write through it.
        self.lock = threading.Lock()
        self.out = bytearray()
        self.direct = False  # plain TCP and up: senders may write to the socket themselves
        # Reset requested (Network.reset): nothing more is written, the I/O thread closes it.
        self.doomed = False
        self.mask = 0  # events currently registered with the selector (0: not registered)
        self.tls_want = _READ
        self.deadline = 0.0
        self.verified = False  # a session frame from the peer passed its MAC


class Network:
    """The I/O thread and the connections of one server in one network (see module docstring).

    ``my_id``: this server; ``listen``: addresses to accept on (port 0: let the OS choose, see
    :attr:`addresses`); ``peers``: every other server of the network and its address (only the
    addresses of higher ids are dialled; lower ids are the only ones accepted). ``secret``: the
    bus key, from which the key of each link is derived
    (:func:`aaabus.config.secret.link_key`), or a function giving the key of the link with a peer
    (a server key file's). A connection claiming a peer's id must prove it holds that pair's key,
    which neither another pair's key nor a tool key gives.
    ``max_frame``: largest payload sent or accepted. ``name`` names the thread
    (``f"{name}-io"``), prefixes log lines and appears in errors as the network's name.
    ``handshake_timeout``: seconds from connect/accept to an authenticated link.
    """

    def __init__(
        self,
        *,
        my_id: int,
        listen: Sequence[tuple[str, int]],
        peers: Mapping[int, tuple[str, int]],
        secret: bytes | Callable[[int], bytes],
        on_frames: Callable[[int, list[bytes]], None],
        on_up: Callable[[int], None],
        on_down: Callable[[int], None] | None = None,
        max_frame: int = 16 << 20,
        ssl_server: ssl.SSLContext | None = None,
        ssl_client: ssl.SSLContext | None = None,
        log: logging.Logger | None = None,
        name: str = "net",
        handshake_timeout: float = 5.0,
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
        self._peers = {p: addr for p, addr in peers.items() if p != my_id}
        self._on_frames = on_frames
        self._on_up = on_up
        self._on_down = on_down
        self._max_frame = max_frame
        self._ssl_server = ssl_server
        self._ssl_client = ssl_client
        self._log = log or logging.getLogger("aaabus.network")
        self._name = name
        self._handshake_timeout = handshake_timeout
        # Lower ids dial us; we dial higher ids.
        self._acceptable = frozenset(p for p in self._peers if p < my_id)
        self._dials: dict[int, Dial[_Conn]] = {p: Dial() for p in self._peers if p > my_id}

        # Read by sending threads without a lock: a dict lookup is atomic under the GIL, and the
        # connection's own lock then tells whether it is still up.
        self._up: dict[int, _Conn] = {}
        self._conns: set[_Conn] = set()
        # Incoming connections not yet authenticated: from peers' addresses, and from others.
        self._pending: PendingTable[_Conn] = PendingTable(_MAX_PENDING, _MAX_PENDING_PER_ADDRESS)
        self._strangers: PendingTable[_Conn] = PendingTable(
            _MAX_STRANGERS, _MAX_STRANGERS_PER_ADDRESS
        )
        self._peer_addresses: frozenset[str] = frozenset()
        self._refusals = RefusalLog(self._log, name)
        self._listeners: list[socket.socket] = []
        self._sel: selectors.BaseSelector | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        # ``_lock`` guards the flush and reset requests of other threads and the wake-up flag.
        self._lock = threading.Lock()
        self._flush_requests: list[_Conn] = []
        self._reset_requests: list[tuple[_Conn, str]] = []
        self._woken = False
        # TLS handshake steps: the pool (only with TLS), the connections out in it (I/O thread
        # only), and the results workers hand back (under ``_lock``): (conn, want or error).
        self._tls_pool: ThreadPoolExecutor | None = None
        self._in_worker: set[_Conn] = set()
        self._tls_done: list[tuple[_Conn, int | Exception | None]] = []
        self._timers: list[tuple[float, int, int, _Conn | int]] = []
        self._timer_seq = itertools.count()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._io_ident: int | None = None
        self._rbuf = bytearray(_READ_SIZE)
        self._rview = memoryview(self._rbuf)
        #: ``perf_counter_ns`` when the latest socket read returned (I/O thread; callbacks read
        #: it to time what a frame costs from the read on: aaabus.core.trace.STAGES).
        self.read_ns = 0

    # ---------------------------------------------------------------- public API

    @property
    def addresses(self) -> list[tuple[str, int]]:
        """The bound listen addresses (useful when listening on port 0)."""
        return [s.getsockname()[:2] for s in self._listeners]

    def start(self) -> None:
        """Bind every listen address, then start the I/O thread. Raises :class:`NetworkError`."""
        if self._thread is not None:
            raise RuntimeError("Network already started")
        try:
            for host, port in self._listen_addrs:
                self._listeners.append(self._bind(host, port))
        except BaseException:
            for lsock in self._listeners:
                lsock.close()
            self._listeners.clear()
            raise
        hosts = [self._peers[p][0] for p in self._acceptable]
        self._peer_addresses = _addresses_of(hosts)
        # A host may run many peers (a bus on one machine, a rack behind one NAT address): each
        # may have a handshake under way at boot, so such an address gets room for two per peer
        # (its dial and ours) instead of the flat cap, which made big flat domains on one host
        # evict each other's handshakes and boot slower than their launchers wait.
        per_host: Counter[str] = Counter()
        for host, peers in Counter(hosts).items():
            for address in _addresses_of([host]):
                per_host[address] += peers
        room = {a: 2 * n for a, n in per_host.items() if 2 * n > _MAX_PENDING_PER_ADDRESS}
        self._pending = PendingTable(
            max(_MAX_PENDING, sum(2 * n for n in per_host.values())), _MAX_PENDING_PER_ADDRESS, room
        )
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel.register(self._wake_r, _READ, None)
        for lsock in self._listeners:
            self._sel.register(lsock, _READ, lsock)
        now = time.monotonic()
        for peer in self._dials:
            self._add_timer(now, peer)
        if self._ssl_server is not None or self._ssl_client is not None:
            self._tls_pool = ThreadPoolExecutor(
                _TLS_WORKERS, thread_name_prefix=f"{self._name}-tls", initializer=_lower_priority
            )
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
            if conn.state != _UP or conn.doomed:
                return
            assert conn.cipher is not None
            data = conn.cipher.wrap_frame(payload)
            needs_flush = self._write_locked(conn, data)
        if needs_flush:
            self._request_flush(conn)

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
            if conn.state != _UP or conn.doomed:
                return
            assert conn.cipher is not None
            wrap = conn.cipher.wrap_frame
            data = b"".join([wrap(payload) for payload in payloads])
            needs_flush = self._write_locked(conn, data)
        if needs_flush:
            self._request_flush(conn)

    def is_up(self, peer: int) -> bool:
        """Whether an authenticated connection to ``peer`` is currently established."""
        return peer in self._up

    def reset(self, peer: int, reason: str) -> None:
        """Close the connection with ``peer`` now up, logging ``reason``; any thread.

        What it still had to send is dropped; it goes through ``on_down`` and is dialled again
        like any connection lost. The close itself happens on the I/O thread (it owns the
        sockets), before that thread reads anything more from the connection.
        """
        conn = self._up.get(peer)
        if conn is None:
            return
        with conn.lock:
            conn.doomed = True  # nothing more leaves on it, from any thread
            conn.direct = False
            conn.out.clear()
        with self._lock:
            self._reset_requests.append((conn, reason))
        self._wake_for_requests()

    def stop(self, timeout: float = 5.0) -> None:
        """Close every socket and join the I/O thread (at most ``timeout`` seconds)."""
        self._stopping = True
        thread = self._thread
        if thread is None:
            for lsock in self._listeners:
                lsock.close()
            self._listeners.clear()
            return
        self._wake()
        if thread.ident != threading.get_ident():
            thread.join(timeout)
            if thread.is_alive():
                self._log.warning("%s: I/O thread did not stop within %.1f s", self._name, timeout)

    # ---------------------------------------------------------------- sending helpers

    def _check_peer(self, peer: int) -> None:
        if peer not in self._peers:
            raise ValueError(f"server {peer} is not a peer of server {self._my_id} ({self._name})")

    def _too_large(self, peer: int, size: int) -> FrameTooLarge:
        # Refused here rather than sent: the receiver would drop the connection, the layer above
        # would resend on reconnection, and the link would flap forever.
        return FrameTooLarge(
            f"payload of {size} bytes for server {peer} exceeds max_frame={self._max_frame}"
        )

    def _write_locked(self, conn: _Conn, data: bytes) -> bool:
        """Write or queue ``data`` (conn.lock held). True if the I/O thread must flush."""
        out = conn.out
        if out:
            # Something is already queued, so a flush is already requested or the socket is
            # registered for writing: just append, it leaves with the rest in one write.
            out += data
            return False
        if conn.direct:
            try:
                sent = conn.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                # Let the I/O thread retry the write, hit the same error and close properly.
                sent = 0
            if sent == len(data):
                return False
            out += memoryview(data)[sent:]
        else:
            out += data
        return True

    def _request_flush(self, conn: _Conn) -> None:
        """Ask the I/O thread to write ``conn.out``; wakes it unless we are that thread."""
        with self._lock:
            self._flush_requests.append(conn)
        self._wake_for_requests()

    def _wake_for_requests(self) -> None:
        """Wake the I/O thread for the requests just queued, once per batch of them, unless
        this is that thread (it processes requests at the end of every iteration)."""
        with self._lock:
            if self._woken or threading.get_ident() == self._io_ident:
                return
            self._woken = True
        self._wake()

    def _wake(self) -> None:
        wake_w = self._wake_w
        if wake_w is None:
            return
        with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
            wake_w.send(b"\0")

    # ---------------------------------------------------------------- the I/O thread

    def _run(self) -> None:
        self._io_ident = threading.get_ident()
        try:
            while not self._stopping:
                self._turn(_MAX_SELECT)
        except Exception:
            self._log.exception("%s: I/O thread crashed", self._name)
        finally:
            self._shutdown()

    def _turn(self, longest: float) -> None:
        """One turn of the I/O loop: due timers, then the selector (sleeping at most
        ``longest`` seconds), the events it gives, the other threads' requests."""
        sel = self._sel
        assert sel is not None
        for key, events in sel.select(min(self._run_timers(), longest)):
            data = key.data
            if isinstance(data, _Conn):
                try:
                    self._on_event(data, events)
                except Exception as exc:
                    # A bug met on one connection must not take down the others: drop that
                    # one (the layer above resends after the reconnection).
                    self._log.exception("%s: error on %s", self._name, data.label)
                    self._fail(data, f"internal error: {exc!r}")
            elif data is None:
                self._drain_wake()
            else:
                self._accept(data)
        self._process_flush_requests()
        self._process_tls_results()

    def _shutdown(self) -> None:
        if self._tls_pool is not None:
            # Steps are short (non-blocking); after this no worker holds a socket.
            self._tls_pool.shutdown(wait=True, cancel_futures=True)
        for conn in self._in_worker:
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._in_worker.clear()
        for conn in list(self._conns):
            with conn.lock:
                conn.state = _CLOSED
                conn.direct = False
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._conns.clear()
        self._up.clear()
        for sock in (*self._listeners, self._wake_r, self._wake_w):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self._listeners.clear()
        if self._sel is not None:
            self._sel.close()

    def _drain_wake(self) -> None:
        assert self._wake_r is not None
        with contextlib.suppress(BlockingIOError, InterruptedError):
            while self._wake_r.recv(4096):
                pass

    def _process_flush_requests(self) -> None:
        with self._lock:
            requests = self._flush_requests
            resets = self._reset_requests
            self._woken = False
            if not requests and not resets:
                return
            self._flush_requests = []
            self._reset_requests = []
        for conn, reason in resets:
            self._close(conn, reason, logging.WARNING)
        for conn in requests:
            self._flush(conn)

    # ---- timers: (when, seq, kind, target); stale entries are recognised and skipped

    _T_DIAL = 0
    _T_DEADLINE = 1

    def _add_timer(self, when: float, target: _Conn | int) -> None:
        kind = self._T_DEADLINE if isinstance(target, _Conn) else self._T_DIAL
        heapq.heappush(self._timers, (when, next(self._timer_seq), kind, target))

    def _run_timers(self) -> float:
        """Fire due timers; return how long select may sleep."""
        timers = self._timers
        now = time.monotonic()
        while timers and timers[0][0] <= now:
            _, _, kind, target = heapq.heappop(timers)
            if kind == self._T_DIAL:
                assert isinstance(target, int)
                dial = self._dials[target]
                if dial.conn is None and not self._stopping:
                    self._dial(target, dial)
            else:
                assert isinstance(target, _Conn)
                if target.state.handshaking and target.deadline <= now:
                    what = "connect" if target.state == _CONNECTING else "handshake"
                    self._fail(target, f"{what} timed out after {self._handshake_timeout:g} s")
            now = time.monotonic()
        if not timers:
            return _MAX_SELECT
        return min(max(timers[0][0] - now, 0.0), _MAX_SELECT)

    # ---- dialling

    def _schedule_redial(self, peer: int, dial: Dial[_Conn]) -> None:
        self._add_timer(time.monotonic() + dial.next_delay(), peer)

    def _dial(self, peer: int, dial: Dial[_Conn]) -> None:
        host, port = self._peers[peer]
        label = f"{host}:{port}"
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, _, _, _, sockaddr = infos[0]
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            self._log.debug("%s: cannot dial server %d at %s: %s", self._name, peer, label, exc)
            self._schedule_redial(peer, dial)
            return
        sock.setblocking(False)
        _tune(sock)
        conn = _Conn(sock, label, outgoing=True, peer=peer, host=host)
        dial.conn = conn
        self._conns.add(conn)
        conn.deadline = time.monotonic() + self._handshake_timeout
        self._add_timer(conn.deadline, conn)
        err = sock.connect_ex(sockaddr)
        if err in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            self._set_mask(conn)  # wait for writability: the connect's outcome
        else:
            self._fail(conn, f"connect failed: {errno.errorcode.get(err, err)}")

    def _connected(self, conn: _Conn) -> None:
        err = conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            self._fail(conn, f"connect failed: {errno.errorcode.get(err, err)}")
            return
        self._secure_or_handshake(conn)

    # ---- accepting

    def _accept(self, lsock: socket.socket) -> None:
        for _ in range(64):  # bounded so a connection flood cannot starve established links
            try:
                sock, addr = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # e.g. EMFILE: keep serving established links
                self._log.warning("%s: accept failed: %s", self._name, exc)
                return
            label = f"{addr[0]}:{addr[1]}"
            sock.setblocking(False)
            _tune(sock)
            conn = _Conn(sock, label, outgoing=False, peer=None, host=addr[0])
            self._conns.add(conn)
            table = self._pending if addr[0] in self._peer_addresses else self._strangers
            for old in table.add(conn, addr[0]):
                self._close(old, "evicted: too many unauthenticated connections", logging.DEBUG)
            conn.deadline = time.monotonic() + self._handshake_timeout
            self._add_timer(conn.deadline, conn)
            self._secure_or_handshake(conn)

    # ---- TLS and aaabus handshakes

    def _secure_or_handshake(self, conn: _Conn) -> None:
        context = self._ssl_client if conn.outgoing else self._ssl_server
        if context is None:
            self._begin_handshake(conn)
            return
        # wrap_socket detaches the plain socket object, so it must leave the selector first.
        self._unregister(conn)
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
        conn.state = _TLS
        self._tls_step(conn)

    def _tls_step(self, conn: _Conn) -> None:
        """I/O thread: hand the next handshake step of ``conn`` to a TLS worker."""
        assert self._tls_pool is not None
        self._unregister(conn)
        self._in_worker.add(conn)
        self._tls_pool.submit(self._tls_work, conn)

    def _tls_work(self, conn: _Conn) -> None:
        """A TLS worker: one non-blocking handshake step; the result goes to the I/O thread."""
        sock = conn.sock
        assert isinstance(sock, ssl.SSLSocket)
        outcome: int | Exception | None
        try:
            sock.do_handshake()
            outcome = None
        except ssl.SSLWantReadError:
            outcome = _READ
        except ssl.SSLWantWriteError:
            outcome = _WRITE
        except (OSError, ValueError) as exc:
            outcome = exc
        with self._lock:
            self._tls_done.append((conn, outcome))
        self._wake()

    def _process_tls_results(self) -> None:
        with self._lock:
            if not self._tls_done:
                return
            done, self._tls_done = self._tls_done, []
        for conn, outcome in done:
            self._in_worker.discard(conn)
            if conn.state != _TLS:  # closed while in the worker: its socket is ours to close
                with contextlib.suppress(OSError):
                    conn.sock.close()
            elif isinstance(outcome, Exception):
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
                if conn.state == _HANDSHAKE and sock.pending():
                    self._readable(conn)

    def _begin_handshake(self, conn: _Conn) -> None:
        conn.state = _HANDSHAKE
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

    def _established(self, conn: _Conn) -> None:
        handshake = conn.handshake
        assert handshake is not None and handshake.peer_id is not None
        peer = handshake.peer_id
        conn.handshake = None
        conn.decoder.max_frame = self._max_frame + SessionCipher.OVERHEAD
        self._forget_pending(conn)
        old = self._up.get(peer)
        if old is not None:
            # Only a holder of this pair's key can do this: the peer restarted (fine) or its key
            # leaked (not fine). Either way the operator should see both ends.
            self._close(
                old,
                f"replaced by a new connection from {conn.label} claiming the same server id",
                logging.WARNING,
            )
        conn.peer = peer
        with conn.lock:
            conn.cipher = handshake.cipher()
            conn.state = _UP
            conn.direct = not isinstance(conn.sock, ssl.SSLSocket)
        self._up[peer] = conn
        self._log.info(
            "%s: server %d %s %s is up",
            self._name,
            peer,
            "at" if conn.outgoing else "from",
            conn.label,
        )
        self._callback(self._on_up, peer)

    # ---- events

    def _on_event(self, conn: _Conn, events: int) -> None:
        state = conn.state
        if state in (_UP, _HANDSHAKE):
            if events & _READ:
                self._readable(conn)
            if events & _WRITE and conn.state != _CLOSED:
                self._flush(conn)
        elif state == _CONNECTING:
            self._connected(conn)
        elif state == _TLS and conn not in self._in_worker:
            # (Already there if a turn run inside on_frames took this event: see read_from.)
            self._tls_step(conn)

    def _readable(self, conn: _Conn) -> bool:
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
                if conn.state == _UP:
                    self._fail(conn, "connection closed by the peer")
                else:
                    self._fail(conn, "connection closed during the handshake")
                return True
            self._received(conn, self._rview[:count])
            # A TLS socket may hold decrypted bytes the selector cannot see: read them now.
            if conn.state == _CLOSED or not isinstance(sock, ssl.SSLSocket) or not sock.pending():
                return True

    def on_io_thread(self) -> bool:
        """Whether the calling thread is this network's I/O thread."""
        return threading.get_ident() == self._io_ident

    def read_from(self, peer: int, timeout: float, spin_ns: int = 0) -> bool:
        """Go on with the I/O thread's work for at most ``timeout`` seconds, returning after
        the first turn that handled something: first what this thread queued for itself, then
        ``peer``'s connection alone, polled for ``spin_ns`` (yielding the CPU between looks),
        then one turn of the loop over every connection. I/O thread only, from inside
        ``on_frames``: returns False at once, doing nothing, on any other thread.

        For a layer above that must hear from ``peer`` before it can finish what an
        ``on_frames`` call started (aaabus.core.channel: a group run on this thread, waiting
        for the durability notice of the frames it applied): it calls this until it has, rather
        than handing its work to another thread, which costs two thread hand-offs. Meanwhile
        the other connections are served as usual (their frames go to ``on_frames``, which
        must then not start anything that waits in turn).
        """
        if not self.on_io_thread():
            return False
        conn = self._up.get(peer)
        try:
            # What this thread queued for itself (what its last group owes its peers, the
            # notice among it; a reset) goes now: the end of the outer turn is a wait away.
            self._process_flush_requests()
            if conn is not None and conn.state == _UP:
                sock = conn.sock
                # A TLS socket may hold decrypted bytes the selector cannot see: look first.
                if spin_ns or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
                    clock = time.perf_counter_ns
                    until = clock() + min(spin_ns, int(timeout * 1e9))
                    while True:
                        if self._readable(conn):
                            # The others too, without waiting: a peer that keeps sending
                            # must not hold them up.
                            self._turn(0.0)
                            return True
                        if clock() >= until:
                            break
                        os.sched_yield()
            self._turn(timeout)
        except Exception as exc:
            # A bug met while serving must not count as the waiting group's failure: the
            # connection it waits on is dropped, as the loop drops one whose event failed,
            # and the wait ends on that.
            self._log.exception("%s: error while waiting on server %d", self._name, peer)
            if conn is not None:
                self._fail(conn, f"internal error: {exc!r}")
        return True

    def _received(self, conn: _Conn, data: memoryview | bytes) -> None:
        if conn.doomed:
            return  # reset by the layer above: it must not hear from this connection again
        try:
            if conn.state == _HANDSHAKE:
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
        cipher = conn.cipher
        peer = conn.peer
        assert cipher is not None and peer is not None
        payloads: list[bytes] = []
        failure: AuthError | None = None
        for frame in frames:
            try:
                payloads.append(cipher.unwrap(frame))
            except AuthError as exc:
                failure = exc  # what came before it was genuine: it is delivered first
                break
        if payloads:
            if not conn.verified:
                self._verified(conn)
            # One call per read, not per frame: the layer above hands the whole batch to its
            # engine at once (one lock, one wake-up).
            try:
                self._on_frames(peer, payloads)
            except Exception:
                self._log.exception("%s: on_frames(%d) failed", self._name, peer)
        if failure is not None and conn.state != _CLOSED:
            self._fail(conn, str(failure), violation=True)

    def _verified(self, conn: _Conn) -> None:
        """The first session frame of ``conn`` passed its MAC: the link really works.

        Only now does a dial count as a success (backoff reset): a peer, or a relay, that
        completes handshakes and then breaks the session must not earn fast redials.
        """
        conn.verified = True
        if conn.outgoing and conn.peer is not None:
            self._dials[conn.peer].succeeded()

    def _forget_pending(self, conn: _Conn) -> None:
        if not self._pending.remove(conn):
            self._strangers.remove(conn)

    def _handshake_step(self, conn: _Conn) -> bool:
        """Run buffered handshake messages; True once the connection is up."""
        handshake = conn.handshake
        assert handshake is not None
        while True:
            message = conn.decoder.pop()
            if message is None:
                return False
            reply = handshake.receive(message)
            if reply:
                self._write_io(conn, reply)
                if conn.state == _CLOSED:
                    return False
            if handshake.done:
                self._established(conn)
                return conn.state == _UP

    # ---- writing from the I/O thread

    def _write_io(self, conn: _Conn, data: bytes) -> None:
        with conn.lock:
            conn.out += data
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        """Write as much of ``conn.out`` as the socket takes; watch writability for the rest."""
        if conn.state == _CLOSED or conn.doomed:
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

    # ---- selector bookkeeping

    def _set_mask(self, conn: _Conn, want_write: bool = False) -> None:
        if conn.state == _CONNECTING:
            mask = _WRITE
        elif conn.state == _TLS:
            mask = conn.tls_want
        else:
            mask = _READ | (_WRITE if want_write else 0)
        if mask == conn.mask:
            return
        assert self._sel is not None
        if conn.mask:
            self._sel.modify(conn.sock, mask, conn)
        else:
            self._sel.register(conn.sock, mask, conn)
        conn.mask = mask

    def _unregister(self, conn: _Conn) -> None:
        if conn.mask:
            assert self._sel is not None
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(conn.sock)
            conn.mask = 0

    # ---- closing

    def _fail(self, conn: _Conn, reason: str, *, violation: bool = False) -> None:
        """Close ``conn`` after an error, logging it at the level its kind deserves.

        ``violation``: the peer broke the protocol (bad frame, bad MAC), which is worth a warning
        even on an authenticated link, unlike a mere disconnection.
        """
        if conn.state == _CLOSED:
            return
        peer = conn.peer

        def first_time() -> bool:
            assert peer is not None  # only asked for our own dials, which know their peer
            return self._dials[peer].first_time(reason)

        level = close_level(
            conn.state, outgoing=conn.outgoing, violation=violation, first_time=first_time
        )
        self._close(conn, reason, level)

    def _close(self, conn: _Conn, reason: str, level: int) -> None:
        if conn.state == _CLOSED:
            return
        was_up = conn.state == _UP
        if not was_up and not conn.outgoing:
            self._forget_pending(conn)
        with conn.lock:
            conn.state = _CLOSED
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
            self._refusals.refused(conn.label, reason)
        self._unregister(conn)
        if conn not in self._in_worker:  # else closed when the worker's step returns
            with contextlib.suppress(OSError):
                conn.sock.close()
        self._conns.discard(conn)
        if was_up and peer is not None and self._up.get(peer) is conn:
            del self._up[peer]
            if self._on_down is not None:
                self._callback(self._on_down, peer)
        if conn.outgoing and peer is not None:
            dial = self._dials[peer]
            if dial.conn is conn:
                dial.conn = None
                if not self._stopping:
                    self._schedule_redial(peer, dial)

    def _callback(self, callback: Callable[[int], None], peer: int) -> None:
        try:
            callback(peer)
        except Exception:
            self._log.exception("%s: callback %r(%d) failed", self._name, callback, peer)

    # ---- listening

    def _bind(self, host: str, port: int) -> socket.socket:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        where = f"(server {self._my_id}, network {self._name})"
        try:
            # create_server sets SO_REUSEADDR, so a restarted server can rebind a port whose old
            # connections linger in TIME_WAIT; a port with a live listener still fails.
            lsock = socket.create_server((host, port), family=family, backlog=128)
        except OSError as exc:
            detail = exc.strerror or str(exc)
            if exc.errno == errno.EADDRINUSE:
                raise NetworkError(f"port {port} on {host} is in use {where}: {detail}") from None
            raise NetworkError(f"cannot listen on {host}:{port} {where}: {detail}") from None
        lsock.setblocking(False)
        return lsock


def _addresses_of(hosts: Iterable[str]) -> frozenset[str]:
    """The numeric addresses ``hosts`` resolve to now (a host that does not resolve: none)."""
    found: set[str] = set()
    for host in hosts:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except OSError:
            continue
        found.update(str(info[4][0]) for info in infos)
    return frozenset(found)


def _lower_priority() -> None:
    """Run the calling thread (a TLS worker) at a lower priority: when strangers' handshakes and
    established links compete for a core, the kernel serves the links first. Linux applies
    ``setpriority`` to one thread given its native id; elsewhere this is a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + _TLS_NICE)


def _tune(sock: socket.socket) -> None:
    """Low latency, and notice a silently dead peer within about half a minute."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 10)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 5)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
