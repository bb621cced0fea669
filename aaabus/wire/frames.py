"""The wire protocol between two agent servers, without any I/O.

Everything here is pure computation on bytes, so that it can be tested exhaustively without sockets
and reused by any transport. :mod:`aaabus.io.network` drives it from its I/O thread.

Framing
    Every message on a connection is a *frame*: a 4-byte big-endian length, then that many bytes of
    payload. :class:`FrameDecoder` cuts an arbitrarily split byte stream back into payloads and
    refuses an oversized frame as soon as its length prefix is seen, before a single byte of the
    body is buffered.

Handshake (mutual challenge-response over a shared key; never pickle)
    All integers are big-endian, ids are unsigned 32-bit, nonces are 32 random bytes, MACs are
    HMAC-SHA256 keyed with the connection's key (``secret`` below): between servers the key of
    that pair of servers, on an admin port the admin key of that server for the tool's scope
    (see :mod:`aaabus.config.secret`). Each message is the payload of one frame and starts with
    ``MAGIC`` (``b"AAAB"``), ``VERSION`` (one byte, currently 3) and a type byte::

        CHALLENGE  acceptor -> connector  42 bytes
            magic(4) version(1) type=1(1) acceptor_id(4) nonce_a(32)
        ANSWER     connector -> acceptor  79 bytes
            magic(4) version(1) type=2(1) connector_id(4) acceptor_id(4) role(1) nonce_c(32)
            mac_c(32)
            mac_c = HMAC(secret, "aaabus/1 connect" | nonce_a | nonce_c | context)
        PROOF      acceptor -> connector  38 bytes
            magic(4) version(1) type=3(1) mac_a(32)
            mac_a = HMAC(secret, "aaabus/1 accept " | nonce_c | nonce_a | context)

    session_key = HMAC(secret, "aaabus/1 session" | nonce_a | nonce_c | context)

    where ``context`` is ``version(1) | connector_id(4) | acceptor_id(4) | role(1)``. ``role``
    says what the connector is: :data:`ROLE_SERVER` (0) for a server opening a link, else a
    tool's scope (:mod:`aaabus.config.scopes`), which the acceptor uses to pick the key and
    which every MAC covers: a tool cannot claim more than its key's scope, nor a tool pass for
    a server or a server for a tool. An acceptor takes only the roles it was built for.
    :data:`ROLE_REPLICA` (255) is a server shipping its log to one of its own replicas
    (:mod:`aaabus.node.replication`): both ends then have the same id, which only that role
    allows, and the key is the server's link with itself (``link_key(N, N)``), which opens no
    link between two servers.

    Both sides refuse a message of another ``VERSION`` with one line naming both versions (the
    connector on reading the CHALLENGE, the acceptor on reading the ANSWER): a server or tool
    of another release is refused at the door, before anything else is read from it.

    The acceptor's fresh ``nonce_a`` makes a recorded ANSWER worthless on any later connection;
    the connector's fresh ``nonce_c`` does the same for a recorded PROOF and makes the session key
    fresh even if the acceptor's random generator were predictable. The two labels differ, so one
    side's MAC can never be reflected back as the other's. Both ids are inside every MAC: an
    answer meant for server 3 cannot be used on server 4, nor claim another connector id.

Session frames (after the handshake)
    ``seq(8) | payload | mac(16)`` where ``mac`` is the first 16 bytes of
    ``HMAC-SHA256(direction_key, seq | payload)`` and ``seq`` counts frames from 0 in each
    direction. The two direction keys are derived from the session key
    (``HMAC(session_key, "aaabus/1 c->a   ")`` and ``... "aaabus/1 a->c   "``): a direction-
    specific key is equivalent to putting a direction byte in every MAC input, without copying it
    in front of every payload. The receiver insists on the exact next ``seq``, so a frame cannot
    be replayed, dropped, reordered, reflected or injected without the session failing with
    :class:`AuthError`.

Link opening and keepalive (links between servers only, version 4)
    The first session frame each side of a link sends is ``EPOCH``: ``b"E" epoch(8)
    member(4)``, 13 bytes, the epoch of the sender's server id and the member holding it
    (issue 42; :mod:`aaabus.io.network` checks it before the link is up, and any other first
    frame is a violation). An empty session frame is a keepalive (:data:`KEEPALIVE`), which the
    network reads and drops: it tells the peer the sender is alive, nothing more.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Callable, Collection
from typing import Any

from aaabus.errors import AuthError, FrameTooLarge, WireError

__all__ = [
    "BODY_VERSION",
    "KEEPALIVE",
    "MAGIC",
    "ROLE_CANDIDATE",
    "ROLE_REPLICA",
    "ROLE_SERVER",
    "VERSION",
    "AcceptorHandshake",
    "AuthError",
    "ConnectorHandshake",
    "FrameDecoder",
    "FrameTooLarge",
    "SessionCipher",
    "WireError",
    "decode_epoch",
    "encode_epoch",
    "encode_frame",
]

MAGIC = b"AAAB"
#: 2: the channel's TENTATIVE and DURABLE frames (aaabus.core.early). A server of version 1 would
#: take tentative frames for durable ones, so the versions refuse each other at the handshake.
#: 3: notifications travel as data, not pickles (aaabus.wire.codec), and the handshake carries
#: the connector's role (a server, or a tool's scope) inside its MACs, with per-server admin keys.
#: 4: the first session frame of a link between servers is EPOCH, an empty session frame is a
#: keepalive, and a candidate of a failover may open an admin session (issue 42). A version-3
#: server would take EPOCH for a garbled frame and never see the epoch.
VERSION = 4
#: The format of the notification bodies and queued frames (:mod:`aaabus.wire.codec`,
#: :mod:`aaabus.wire.linkframes`), which a store records: unchanged by version 4, so a store
#: written under version 3 boots with its queues (:mod:`aaabus.core.upgrades`).
BODY_VERSION = 3
#: The ``role`` of a connector that is a server opening a link; tools' roles are their scopes.
ROLE_SERVER = 0
#: The ``role`` of a member of a server asking a voter of the bus for a vote (issue 42): the
#: connector id is that server's, the key its link key with the voter (:mod:`aaabus.node.voter`).
ROLE_CANDIDATE = 254
#: The ``role`` of a server connecting to a replica of its own (the acceptor has the same id).
ROLE_REPLICA = 255
NONCE_BYTES = 32
MAC_BYTES = 32
#: Largest frame a peer may send before it has authenticated: the biggest handshake message is 79
#: bytes, so anything much larger is garbage and must not make us buffer megabytes.
HANDSHAKE_MAX_FRAME = 256
MAX_SERVER_ID = 0xFFFFFFFF

_T_CHALLENGE = 1
_T_ANSWER = 2
_T_PROOF = 3

_LABEL_CONNECTOR = b"aaabus/1 connect"
_LABEL_ACCEPTOR = b"aaabus/1 accept "
_LABEL_SESSION = b"aaabus/1 session"
_LABEL_C2A = b"aaabus/1 c->a   "
_LABEL_A2C = b"aaabus/1 a->c   "

_LEN = struct.Struct(">I")
_HEAD = struct.Struct(">4sBB")  # magic, version, type
_CHALLENGE = struct.Struct(f">4sBBI{NONCE_BYTES}s")
_ANSWER = struct.Struct(f">4sBBIIB{NONCE_BYTES}s{MAC_BYTES}s")
_PROOF = struct.Struct(f">4sBB{MAC_BYTES}s")
_CONTEXT = struct.Struct(">BIIB")  # version, connector_id, acceptor_id, role
_SEQ = struct.Struct(">Q")
_FRAME_HEAD = struct.Struct(">IQ")  # length prefix + seq of a session frame
_EPOCH = struct.Struct(">cQI")  # kind, epoch, member
_EPOCH_KIND = b"E"
#: The payload of a keepalive session frame.
KEEPALIVE = b""


# --------------------------------------------------------------------------------------------
# Framing


def encode_frame(payload: bytes) -> bytes:
    """Prefix ``payload`` with its 4-byte big-endian length."""
    return _LEN.pack(len(payload)) + payload


class FrameDecoder:
    """Incremental frame decoder: feed it bytes as they arrive, get back whole payloads.

    ``max_frame`` bounds the payload length and may be changed between calls (the network layer
    starts with :data:`HANDSHAKE_MAX_FRAME` and raises it once the peer has authenticated). After
    :class:`FrameTooLarge` the stream has lost its framing; the decoder keeps raising.
    """

    __slots__ = ("_buf", "_error", "max_frame")

    def __init__(self, max_frame: int) -> None:
        self.max_frame = max_frame
        self._buf = bytearray()
        self._error: FrameTooLarge | None = None

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buf)

    def _too_large(self, length: int) -> FrameTooLarge:
        self._error = FrameTooLarge(
            f"frame of {length} bytes exceeds the limit of {self.max_frame}"
        )
        return self._error

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Append ``data`` and return every payload now complete, in order."""
        if self._error is not None:
            raise self._error
        buf = self._buf
        # Fast path: with nothing left over from the previous read, parse the caller's buffer
        # directly and only copy out the payloads and the incomplete tail.
        src: bytes | bytearray | memoryview
        if buf:
            buf += data
            src = buf
        else:
            src = data
        limit = self.max_frame
        frames: list[bytes] = []
        pos = 0
        end_of_data = len(src)
        while end_of_data - pos >= 4:
            (length,) = _LEN.unpack_from(src, pos)
            if length > limit:
                raise self._too_large(length)
            end = pos + 4 + length
            if end > end_of_data:
                break
            frames.append(bytes(src[pos + 4 : end]))
            pos = end
        if src is buf:
            del buf[:pos]  # O(1): bytearray deletes from the front by moving its start pointer
        elif pos < end_of_data:
            buf += src[pos:]
        return frames

    def push(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data`` without extracting frames (see :meth:`pop`)."""
        if self._error is not None:
            raise self._error
        self._buf += data
        self._check_head()

    def pop(self) -> bytes | None:
        """Remove and return the next complete payload, or ``None`` if there is none yet.

        Used while the limit may change between two frames (the handshake): the frames after the
        last handshake message must be judged by the new limit.
        """
        if self._error is not None:
            raise self._error
        buf = self._buf
        if len(buf) < 4:
            return None
        (length,) = _LEN.unpack_from(buf, 0)
        if length > self.max_frame:
            raise self._too_large(length)
        if len(buf) < 4 + length:
            return None
        payload = bytes(buf[4 : 4 + length])
        del buf[: 4 + length]
        # The next frame's length is judged when it is popped (or fed), by the limit in force
        # then: after the last handshake message, the limit is raised before the next pop.
        return payload

    def _check_head(self) -> None:
        if len(self._buf) >= 4:
            (length,) = _LEN.unpack_from(self._buf, 0)
            if length > self.max_frame:
                raise self._too_large(length)


# --------------------------------------------------------------------------------------------
# HMAC-SHA256 with the key schedule done once


class _Hmac:
    """HMAC-SHA256 with the padded-key hash states precomputed.

    ``hmac.digest`` re-derives the key schedule and fetches the algorithm from OpenSSL on every
    call (~2.3 µs for 200 bytes here); copying two prepared SHA-256 states costs about half of
    that. The result is bit-for-bit standard HMAC (checked by the tests against :mod:`hmac`).
    """

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes) -> None:
        if len(key) > 64:
            key = hashlib.sha256(key).digest()
        key = key.ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in key))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in key))

    def digest(self, data: bytes | memoryview, more: bytes = b"") -> bytes:
        """HMAC of ``data | more`` (two parts, so the caller need not concatenate them)."""
        inner = self._inner.copy()
        inner.update(data)
        if more:
            inner.update(more)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


def _mac(key: bytes, label: bytes, first: bytes, second: bytes, context: bytes) -> bytes:
    return hmac.digest(key, label + first + second + context, "sha256")


# --------------------------------------------------------------------------------------------
# Handshake


def _check_id(value: int, what: str) -> None:
    if not 0 <= value <= MAX_SERVER_ID:
        raise ValueError(f"{what} {value} is not a server id (0..{MAX_SERVER_ID})")


def _unpack_message(
    message: bytes, kind: int, struct_: struct.Struct, name: str
) -> tuple[Any, ...]:
    """Validate magic, version, type and length of a handshake message and unpack it."""
    if len(message) < _HEAD.size:
        raise AuthError(f"bad handshake: {len(message)}-byte message is too short for {name}")
    magic, version, got = _HEAD.unpack_from(message)
    if magic != MAGIC:
        raise AuthError(f"bad handshake: bad magic {magic!r} (not an aaabus server)")
    if version != VERSION:
        raise AuthError(
            f"bad handshake: the other side speaks wire version {version}, this side wire version "
            f"{VERSION}; every server and tool of a bus must run the same release (docs/"
            "operations.md, Upgrading a running bus)"
        )
    if got != kind:
        raise AuthError(f"bad handshake: expected {name}, got message type {got}")
    if len(message) != struct_.size:
        raise AuthError(f"bad handshake: {name} of {len(message)} bytes, expected {struct_.size}")
    return struct_.unpack(message)


class _Handshake:
    """State shared by both sides: results, and the rule that a failed handshake stays failed."""

    _connector: bool

    def __init__(self, secret: bytes, my_id: int) -> None:
        if not secret:
            raise ValueError("the bus secret is empty")
        _check_id(my_id, "my_id")
        self._secret = bytes(secret)
        self.my_id = my_id
        self.peer_id: int | None = None
        self.session_key: bytes | None = None
        self._failed: AuthError | None = None

    @property
    def done(self) -> bool:
        """True once the peer has proved it holds the secret; ``peer_id``/``session_key`` set."""
        return self.session_key is not None

    def _fail(self, error: AuthError) -> AuthError:
        self._failed = error
        return error

    def _derive(self, nonce_a: bytes, nonce_c: bytes, context: bytes) -> bytes:
        return _mac(self._secret, _LABEL_SESSION, nonce_a, nonce_c, context)

    def cipher(self) -> SessionCipher:
        """The session cipher for this side of the connection (only once :attr:`done`)."""
        if self.session_key is None:
            raise RuntimeError("the handshake is not complete")
        return SessionCipher(self.session_key, connector=self._connector)


class ConnectorHandshake(_Handshake):
    """The side that opened the TCP connection (the lower server id, or a tool).

    Protocol: ``start()`` (sends nothing: the acceptor speaks first), then ``receive(challenge)``
    returns the framed ANSWER to send, then ``receive(proof)`` returns ``b""`` and sets
    :attr:`done`. Any violation raises :class:`AuthError`. ``role``: what this side is
    (:data:`ROLE_SERVER`, or a tool's scope), bound into every MAC.
    """

    _connector = True

    def __init__(self, secret: bytes, my_id: int, peer_id: int, role: int = ROLE_SERVER) -> None:
        super().__init__(secret, my_id)
        _check_id(peer_id, "peer_id")
        self._expected_peer = peer_id
        self._role = role
        self._nonce_a = b""
        self._nonce_c = b""
        self._context = _CONTEXT.pack(VERSION, my_id, peer_id, role)

    def start(self) -> bytes:
        """Bytes to send first: none, the connector waits for the challenge."""
        return b""

    def receive(self, message: bytes) -> bytes:
        """Consume one handshake message (a frame's payload); return framed bytes to send."""
        if self._failed is not None:
            raise self._failed
        if self.done:
            raise self._fail(AuthError("bad handshake: unexpected message after the proof"))
        if not self._nonce_a:
            try:
                _, _, _, acceptor_id, nonce_a = _unpack_message(
                    message, _T_CHALLENGE, _CHALLENGE, "a challenge"
                )
            except AuthError as exc:
                raise self._fail(exc) from None
            if acceptor_id != self._expected_peer:
                raise self._fail(
                    AuthError(
                        f"wrong server: expected server {self._expected_peer}, "
                        f"server {acceptor_id} answered"
                    )
                )
            self._nonce_a = nonce_a
            self._nonce_c = secrets.token_bytes(NONCE_BYTES)
            mac = _mac(self._secret, _LABEL_CONNECTOR, nonce_a, self._nonce_c, self._context)
            answer = _ANSWER.pack(
                MAGIC,
                VERSION,
                _T_ANSWER,
                self.my_id,
                self._expected_peer,
                self._role,
                self._nonce_c,
                mac,
            )
            return encode_frame(answer)
        try:
            _, _, _, mac = _unpack_message(message, _T_PROOF, _PROOF, "a proof")
        except AuthError as exc:
            raise self._fail(exc) from None
        expected = _mac(self._secret, _LABEL_ACCEPTOR, self._nonce_c, self._nonce_a, self._context)
        if not hmac.compare_digest(mac, expected):
            raise self._fail(
                AuthError(
                    f"server {self._expected_peer} failed to prove it is server "
                    f"{self._expected_peer} of this bus (bad MAC: it holds another key: another "
                    "bus's, or it is posing as that server)"
                )
            )
        self.peer_id = self._expected_peer
        self.session_key = self._derive(self._nonce_a, self._nonce_c, self._context)
        return b""


class AcceptorHandshake(_Handshake):
    """The side that accepted the TCP connection (the higher server id, or an admin port).

    Protocol: ``start()`` returns the framed CHALLENGE, ``receive(answer)`` checks the connector
    and returns the framed PROOF; :attr:`done` is then set, :attr:`peer_id` is the connector's
    proven id and :attr:`role` its proven role. ``allowed_ids`` restricts which ids may connect
    (``None``: any id but our own), ``roles`` which roles (default: servers only).
    ``secret``: the key, or a function giving the key for a connector id and role (pairwise
    link keys, per-scope admin keys).
    """

    _connector = False

    def __init__(
        self,
        secret: bytes | Callable[[int, int], bytes],
        my_id: int,
        allowed_ids: Collection[int] | None = None,
        roles: Collection[int] = (ROLE_SERVER,),
    ) -> None:
        # ``secret`` may depend on who connects (pairwise link keys, a tool's scope): it is then
        # a function of the connector's claimed id and role, called once the ANSWER names them.
        self._key_for = secret if callable(secret) else None
        super().__init__(b"\0" if callable(secret) else secret, my_id)
        self._allowed = None if allowed_ids is None else frozenset(allowed_ids)
        self._roles = frozenset(roles)
        self.role: int | None = None
        self._nonce_a = b""

    def start(self) -> bytes:
        """The framed CHALLENGE, with a fresh nonce."""
        if self._nonce_a:
            raise RuntimeError("start() called twice")
        self._nonce_a = secrets.token_bytes(NONCE_BYTES)
        return encode_frame(
            _CHALLENGE.pack(MAGIC, VERSION, _T_CHALLENGE, self.my_id, self._nonce_a)
        )

    def receive(self, message: bytes) -> bytes:
        """Consume the connector's ANSWER; return the framed PROOF."""
        if self._failed is not None:
            raise self._failed
        if not self._nonce_a:
            raise RuntimeError("receive() before start()")
        if self.done:
            raise self._fail(AuthError("bad handshake: unexpected message after the answer"))
        try:
            _, _, _, connector_id, acceptor_id, role, nonce_c, mac = _unpack_message(
                message, _T_ANSWER, _ANSWER, "an answer"
            )
        except AuthError as exc:
            raise self._fail(exc) from None
        if acceptor_id != self.my_id:
            raise self._fail(
                AuthError(
                    f"wrong server: the peer wanted server {acceptor_id}, this is {self.my_id}"
                )
            )
        if (connector_id == self.my_id and role != ROLE_REPLICA) or (
            self._allowed is not None and connector_id not in self._allowed
        ):
            raise self._fail(
                AuthError(f"unknown server id {connector_id}: not a peer allowed to connect here")
            )
        if role not in self._roles:
            raise self._fail(
                AuthError(
                    f"bad handshake: connector {connector_id} claims role {role}, which this side "
                    f"does not serve (roles {', '.join(map(str, sorted(self._roles)))})"
                )
            )
        context = _CONTEXT.pack(VERSION, connector_id, self.my_id, role)
        if self._key_for is not None:
            self._secret = self._key_for(connector_id, role)
        expected = _mac(self._secret, _LABEL_CONNECTOR, self._nonce_a, nonce_c, context)
        if not hmac.compare_digest(mac, expected):
            raise self._fail(
                AuthError(
                    f"peer claiming to be server {connector_id} failed authentication "
                    "(bad MAC: wrong bus key or replayed handshake)"
                )
            )
        self.peer_id = connector_id
        self.role = role
        self.session_key = self._derive(self._nonce_a, nonce_c, context)
        proof = _mac(self._secret, _LABEL_ACCEPTOR, nonce_c, self._nonce_a, context)
        return encode_frame(_PROOF.pack(MAGIC, VERSION, _T_PROOF, proof))


# --------------------------------------------------------------------------------------------
# Session frames


class SessionCipher:
    """Authenticates the frames of one established session, in both directions.

    ``connector`` says which side of the handshake we were; it selects which direction key signs
    and which verifies. Not thread-safe: the caller serialises :meth:`wrap` calls (they must reach
    the wire in the order their sequence numbers were assigned) and :meth:`unwrap` calls.
    """

    OVERHEAD = _SEQ.size + 16

    __slots__ = ("_recv_mac", "_recv_seq", "_send_mac", "_send_seq")

    def __init__(self, session_key: bytes, *, connector: bool) -> None:
        c2a = _Hmac(hmac.digest(session_key, _LABEL_C2A, "sha256"))
        a2c = _Hmac(hmac.digest(session_key, _LABEL_A2C, "sha256"))
        self._send_mac, self._recv_mac = (c2a, a2c) if connector else (a2c, c2a)
        self._send_seq = 0
        self._recv_seq = 0

    @property
    def sent(self) -> int:
        """Frames wrapped so far (any thread may read it: a keepalive timer compares it)."""
        return self._send_seq

    def wrap(self, payload: bytes) -> bytes:
        """``seq | payload | mac16`` for the next outgoing frame."""
        seq = _SEQ.pack(self._send_seq)
        mac = self._send_mac.digest(seq, payload)
        # Count only once the MAC is computed: a bad payload type raising above must not leave a
        # gap in the sequence, which would kill the session at the receiver.
        self._send_seq += 1
        return b"".join((seq, payload, mac[:16]))

    def wrap_frame(self, payload: bytes) -> bytes:
        """Like :meth:`wrap`, with the length prefix too: exactly the bytes to write."""
        head = _FRAME_HEAD.pack(len(payload) + self.OVERHEAD, self._send_seq)
        mac = self._send_mac.digest(head[4:], payload)
        self._send_seq += 1
        return b"".join((head, payload, mac[:16]))

    def unwrap(self, frame: bytes) -> bytes:
        """Verify an incoming ``seq | payload | mac16`` and return the payload.

        Raises :class:`AuthError` if the MAC is wrong (tampered, injected, foreign session or
        reflected frame) or the sequence number is not the next one (replayed, dropped or
        reordered frame).
        """
        if len(frame) < self.OVERHEAD:
            raise AuthError(f"session frame of {len(frame)} bytes is shorter than its header")
        view = memoryview(frame)
        mac = self._recv_mac.digest(view[:-16])
        if not hmac.compare_digest(mac[:16], view[-16:]):
            raise AuthError("session frame failed authentication (bad MAC)")
        (seq,) = _SEQ.unpack_from(frame)
        if seq != self._recv_seq:
            raise AuthError(
                f"session frame out of sequence: got {seq}, expected {self._recv_seq} "
                "(replayed or reordered)"
            )
        self._recv_seq += 1
        return frame[_SEQ.size : -16]


# --------------------------------------------------------------------------------------------
# Link opening


def encode_epoch(epoch: int, member: int) -> bytes:
    """The EPOCH payload: "I speak for ``epoch`` of my server id, held by ``member``"."""
    return _EPOCH.pack(_EPOCH_KIND, epoch, member)


def decode_epoch(payload: bytes) -> tuple[int, int]:
    """``(epoch, member)`` of an EPOCH payload; :class:`WireError` (one line) for anything
    else, in constant time (only the length and the first byte are looked at before unpacking)."""
    if len(payload) != _EPOCH.size or payload[:1] != _EPOCH_KIND:
        raise WireError(
            f"the first frame of a link must be EPOCH ({_EPOCH.size} bytes, kind E), not "
            f"{len(payload)} bytes of kind {bytes(payload[:1])!r}"
        )
    _kind, epoch, member = _EPOCH.unpack(payload)
    if epoch < 1:
        raise WireError("EPOCH names epoch 0; epochs start at 1")
    return epoch, member
