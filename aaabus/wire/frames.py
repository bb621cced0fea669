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
    that pair of servers, on an admin port the tool key (see :mod:`aaabus.config.secret`). Each
    message is the payload of one frame and starts with ``MAGIC`` (``b"AAAB"``), ``VERSION`` (one
    byte, currently 1) and a type byte::

        CHALLENGE  acceptor -> connector  42 bytes
            magic(4) version(1) type=1(1) acceptor_id(4) nonce_a(32)
        ANSWER     connector -> acceptor  78 bytes
            magic(4) version(1) type=2(1) connector_id(4) acceptor_id(4) nonce_c(32) mac_c(32)
            mac_c = HMAC(secret, "aaabus/1 connect" | nonce_a | nonce_c | ids)
        PROOF      acceptor -> connector  38 bytes
            magic(4) version(1) type=3(1) mac_a(32)
            mac_a = HMAC(secret, "aaabus/1 accept " | nonce_c | nonce_a | ids)

    session_key = HMAC(secret, "aaabus/1 session" | nonce_a | nonce_c | ids)

    where ``ids`` is ``connector_id(4) | acceptor_id(4)``.

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
    "MAGIC",
    "VERSION",
    "AcceptorHandshake",
    "AuthError",
    "ConnectorHandshake",
    "FrameDecoder",
    "FrameTooLarge",
    "SessionCipher",
    "WireError",
    "encode_frame",
]

MAGIC = b"AAAB"
#: 2: the channel's TENTATIVE and DURABLE frames (aaabus.core.early). A server of version 1 would
#: take tentative frames for durable ones, so the versions refuse each other at the handshake.
VERSION = 2
NONCE_BYTES = 32
MAC_BYTES = 32
#: Largest frame a peer may send before it has authenticated: the biggest handshake message is 78
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
_ANSWER = struct.Struct(f">4sBBII{NONCE_BYTES}s{MAC_BYTES}s")
_PROOF = struct.Struct(f">4sBB{MAC_BYTES}s")
_IDS = struct.Struct(">II")
_SEQ = struct.Struct(">Q")
_FRAME_HEAD = struct.Struct(">IQ")  # length prefix + seq of a session frame


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


def _mac(key: bytes, label: bytes, first: bytes, second: bytes, ids: bytes) -> bytes:
    return hmac.digest(key, label + first + second + ids, "sha256")


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
            f"bad handshake: peer speaks protocol version {version}, this server speaks {VERSION}"
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

    def _derive(self, nonce_a: bytes, nonce_c: bytes, ids: bytes) -> bytes:
        return _mac(self._secret, _LABEL_SESSION, nonce_a, nonce_c, ids)

    def cipher(self) -> SessionCipher:
        """The session cipher for this side of the connection (only once :attr:`done`)."""
        if self.session_key is None:
            raise RuntimeError("the handshake is not complete")
        return SessionCipher(self.session_key, connector=self._connector)


class ConnectorHandshake(_Handshake):
    """The side that opened the TCP connection (the lower server id).

    Protocol: ``start()`` (sends nothing: the acceptor speaks first), then ``receive(challenge)``
    returns the framed ANSWER to send, then ``receive(proof)`` returns ``b""`` and sets
    :attr:`done`. Any violation raises :class:`AuthError`.
    """

    _connector = True

    def __init__(self, secret: bytes, my_id: int, peer_id: int) -> None:
        super().__init__(secret, my_id)
        _check_id(peer_id, "peer_id")
        self._expected_peer = peer_id
        self._nonce_a = b""
        self._nonce_c = b""
        self._ids = _IDS.pack(my_id, peer_id)

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
            mac = _mac(self._secret, _LABEL_CONNECTOR, nonce_a, self._nonce_c, self._ids)
            answer = _ANSWER.pack(
                MAGIC, VERSION, _T_ANSWER, self.my_id, self._expected_peer, self._nonce_c, mac
            )
            return encode_frame(answer)
        try:
            _, _, _, mac = _unpack_message(message, _T_PROOF, _PROOF, "a proof")
        except AuthError as exc:
            raise self._fail(exc) from None
        expected = _mac(self._secret, _LABEL_ACCEPTOR, self._nonce_c, self._nonce_a, self._ids)
        if not hmac.compare_digest(mac, expected):
            raise self._fail(
                AuthError(
                    f"server {self._expected_peer} failed to prove it holds the bus secret "
                    "(bad MAC: the two servers use different bus keys)"
                )
            )
        self.peer_id = self._expected_peer
        self.session_key = self._derive(self._nonce_a, self._nonce_c, self._ids)
        return b""


class AcceptorHandshake(_Handshake):
    """The side that accepted the TCP connection (the higher server id).

    Protocol: ``start()`` returns the framed CHALLENGE, ``receive(answer)`` checks the connector
    and returns the framed PROOF; :attr:`done` is then set and :attr:`peer_id` is the connector's
    proven id. ``allowed_ids`` restricts which ids may connect (``None``: any id but our own).
    ``secret``: the key, or a function giving the key for a connector id (pairwise link keys).
    """

    _connector = False

    def __init__(
        self,
        secret: bytes | Callable[[int], bytes],
        my_id: int,
        allowed_ids: Collection[int] | None = None,
    ) -> None:
        # ``secret`` may depend on who connects (pairwise link keys): it is then a function of
        # the connector's claimed id, called once the ANSWER names it.
        self._key_for = secret if callable(secret) else None
        super().__init__(b"\0" if callable(secret) else secret, my_id)
        self._allowed = None if allowed_ids is None else frozenset(allowed_ids)
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
            _, _, _, connector_id, acceptor_id, nonce_c, mac = _unpack_message(
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
        if connector_id == self.my_id or (
            self._allowed is not None and connector_id not in self._allowed
        ):
            raise self._fail(
                AuthError(f"unknown server id {connector_id}: not a peer allowed to connect here")
            )
        ids = _IDS.pack(connector_id, self.my_id)
        if self._key_for is not None:
            self._secret = self._key_for(connector_id)
        expected = _mac(self._secret, _LABEL_CONNECTOR, self._nonce_a, nonce_c, ids)
        if not hmac.compare_digest(mac, expected):
            raise self._fail(
                AuthError(
                    f"peer claiming to be server {connector_id} failed authentication "
                    "(bad MAC: wrong bus key or replayed handshake)"
                )
            )
        self.peer_id = connector_id
        self.session_key = self._derive(self._nonce_a, nonce_c, ids)
        proof = _mac(self._secret, _LABEL_ACCEPTOR, nonce_c, self._nonce_a, ids)
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
