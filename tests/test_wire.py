"""The sans-I/O wire protocol: framing, handshake and session frames (plus the bus key file)."""

from __future__ import annotations

import hmac
import itertools
import os
import stat
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aaabus.config.secret import ensure_secret, load_secret, make_secret, write_secret
from aaabus.errors import AuthError, FrameTooLarge, SecretError
from aaabus.wire import frames as wire
from aaabus.wire.frames import (
    AcceptorHandshake,
    ConnectorHandshake,
    FrameDecoder,
    SessionCipher,
    encode_frame,
)

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))


def one_frame(data: bytes) -> bytes:
    """The single payload inside framed handshake output."""
    frames = FrameDecoder(wire.HANDSHAKE_MAX_FRAME).feed(data)
    assert len(frames) == 1
    return frames[0]


def handshake(
    connector: ConnectorHandshake, acceptor: AcceptorHandshake
) -> tuple[bytes, bytes, bytes]:
    """Run a full exchange; return the (challenge, answer, proof) payloads."""
    assert connector.start() == b""
    challenge = one_frame(acceptor.start())
    answer = one_frame(connector.receive(challenge))
    proof = one_frame(acceptor.receive(answer))
    assert connector.receive(proof) == b""
    return challenge, answer, proof


def ciphers() -> tuple[SessionCipher, SessionCipher]:
    connector = ConnectorHandshake(SECRET, 1, 2)
    acceptor = AcceptorHandshake(SECRET, 2, {1})
    handshake(connector, acceptor)
    return connector.cipher(), acceptor.cipher()


# ------------------------------------------------------------------------------ framing


@settings(max_examples=200, deadline=None)
@given(
    payloads=st.lists(st.binary(max_size=300), max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30),
    kind=st.sampled_from([bytes, bytearray, memoryview]),
)
def test_decoder_reassembles_any_split(
    payloads: list[bytes], cuts: list[int], kind: type[bytes]
) -> None:
    stream = b"".join(encode_frame(p) for p in payloads)
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    decoder = FrameDecoder(max_frame=300)
    out: list[bytes] = []
    for start, end in itertools.pairwise(points):
        out.extend(decoder.feed(kind(stream[start:end])))
    assert out == payloads
    assert decoder.buffered == 0


@settings(max_examples=100, deadline=None)
@given(
    payloads=st.lists(st.binary(max_size=100), max_size=10),
    chunk=st.integers(min_value=1, max_value=50),
)
def test_push_pop_matches_feed(payloads: list[bytes], chunk: int) -> None:
    stream = b"".join(encode_frame(p) for p in payloads)
    decoder = FrameDecoder(max_frame=100)
    out: list[bytes] = []
    for start in range(0, len(stream), chunk):
        decoder.push(stream[start : start + chunk])
        while (frame := decoder.pop()) is not None:
            out.append(frame)
    assert out == payloads


def test_oversize_detected_from_the_prefix_alone() -> None:
    decoder = FrameDecoder(max_frame=1000)
    assert decoder.feed(encode_frame(b"a" * 1000)) == [b"a" * 1000]  # the limit itself is fine
    assert decoder.feed(b"\x00\x00") == []  # half a prefix: nothing to judge yet
    with pytest.raises(FrameTooLarge, match="1001 bytes exceeds the limit of 1000"):
        decoder.feed(b"\x03\xe9")  # completes the prefix 1001; no body byte sent
    with pytest.raises(FrameTooLarge):  # the stream has lost its framing for good
        decoder.feed(encode_frame(b"ok"))


def test_oversize_detected_by_push_and_pop() -> None:
    decoder = FrameDecoder(max_frame=10)
    with pytest.raises(FrameTooLarge):
        decoder.push(b"\xff\xff\xff\xff")
    decoder = FrameDecoder(max_frame=10)
    decoder.push(encode_frame(b"hello") + b"\x00\x00\x01\x00")
    assert decoder.pop() == b"hello"
    with pytest.raises(FrameTooLarge):
        decoder.pop()


def test_limit_change_applies_to_the_next_frame() -> None:
    # What the network layer does: small limit during the handshake, larger afterwards, with the
    # last handshake message and a big frame arriving in the same read.
    decoder = FrameDecoder(max_frame=wire.HANDSHAKE_MAX_FRAME)
    decoder.push(encode_frame(b"proof") + encode_frame(b"x" * 5000))
    assert decoder.pop() == b"proof"
    decoder.max_frame = 10_000
    assert decoder.feed(b"") == [b"x" * 5000]


# ------------------------------------------------------------------------------ handshake


def test_handshake_success_and_session_key() -> None:
    connector = ConnectorHandshake(SECRET, 3, 9)
    acceptor = AcceptorHandshake(SECRET, 9, {1, 3})
    challenge, answer, proof = handshake(connector, acceptor)
    assert (len(challenge), len(answer), len(proof)) == (42, 79, 38)
    assert challenge[:5] == answer[:5] == proof[:5] == wire.MAGIC + bytes([wire.VERSION])
    assert connector.done and acceptor.done
    assert connector.peer_id == 9 and acceptor.peer_id == 3
    assert connector.session_key == acceptor.session_key
    assert connector.session_key is not None and len(connector.session_key) == 32


def test_fresh_nonces_give_fresh_session_keys() -> None:
    keys = set()
    for _ in range(3):
        connector = ConnectorHandshake(SECRET, 1, 2)
        handshake(connector, AcceptorHandshake(SECRET, 2, None))
        keys.add(connector.session_key)
    assert len(keys) == 3


def test_acceptor_refuses_wrong_secret() -> None:
    connector = ConnectorHandshake(OTHER_SECRET, 1, 2)
    acceptor = AcceptorHandshake(SECRET, 2, {1})
    answer = one_frame(connector.receive(one_frame(acceptor.start())))
    with pytest.raises(AuthError, match="bad MAC"):
        acceptor.receive(answer)
    assert not acceptor.done
    with pytest.raises(AuthError):  # a failed handshake stays failed
        acceptor.receive(answer)


def test_connector_refuses_acceptor_with_wrong_secret() -> None:
    # An impostor acceptor that lacks the secret can only guess the proof; forge it the way it
    # would have to, with its own key, over the right nonces.
    connector = ConnectorHandshake(SECRET, 1, 2)
    impostor = AcceptorHandshake(OTHER_SECRET, 2, {1})
    challenge = one_frame(impostor.start())
    answer = one_frame(connector.receive(challenge))
    nonce_a, nonce_c = challenge[10:42], answer[15:47]
    context = wire._CONTEXT.pack(wire.VERSION, 1, 2, wire.ROLE_SERVER)
    forged = wire._mac(OTHER_SECRET, wire._LABEL_ACCEPTOR, nonce_c, nonce_a, context)
    proof = wire._PROOF.pack(wire.MAGIC, wire.VERSION, wire._T_PROOF, forged)
    with pytest.raises(AuthError, match="failed to prove"):
        connector.receive(proof)
    assert not connector.done and connector.session_key is None


def test_connector_refuses_reflected_answer_as_proof() -> None:
    connector = ConnectorHandshake(SECRET, 1, 2)
    acceptor = AcceptorHandshake(SECRET, 2, {1})
    answer = one_frame(connector.receive(one_frame(acceptor.start())))
    reflected = wire._PROOF.pack(wire.MAGIC, wire.VERSION, wire._T_PROOF, answer[47:79])
    with pytest.raises(AuthError, match="failed to prove"):
        connector.receive(reflected)


def test_replayed_answer_is_refused() -> None:
    # Record a complete, successful handshake ...
    recorded_connector = ConnectorHandshake(SECRET, 1, 2)
    _, answer, proof = handshake(recorded_connector, AcceptorHandshake(SECRET, 2, {1}))
    # ... and replay the connector's answer against a fresh challenge.
    acceptor = AcceptorHandshake(SECRET, 2, {1})
    acceptor.start()
    with pytest.raises(AuthError, match="bad MAC"):
        acceptor.receive(answer)
    # Likewise the recorded proof against a connector with a fresh nonce.
    connector = ConnectorHandshake(SECRET, 1, 2)
    connector.receive(one_frame(AcceptorHandshake(SECRET, 2, {1}).start()))
    with pytest.raises(AuthError, match="failed to prove"):
        connector.receive(proof)


def test_unknown_id_refused() -> None:
    acceptor = AcceptorHandshake(SECRET, 5, {1, 2})
    connector = ConnectorHandshake(SECRET, 3, 5)
    answer = one_frame(connector.receive(one_frame(acceptor.start())))
    with pytest.raises(AuthError, match="unknown server id 3"):
        acceptor.receive(answer)


def test_own_id_refused_even_when_any_id_allowed() -> None:
    acceptor = AcceptorHandshake(SECRET, 5, None)
    connector = ConnectorHandshake(SECRET, 5, 5)
    answer = one_frame(connector.receive(one_frame(acceptor.start())))
    with pytest.raises(AuthError, match="unknown server id 5"):
        acceptor.receive(answer)


def test_wrong_server_answering_is_refused() -> None:
    connector = ConnectorHandshake(SECRET, 1, 2)
    with pytest.raises(AuthError, match="expected server 2, server 4 answered"):
        connector.receive(one_frame(AcceptorHandshake(SECRET, 4, None).start()))


def test_answer_for_another_acceptor_is_refused() -> None:
    # An answer computed for server 4's challenge, relayed to server 2 with 2's nonce patched in,
    # still names server 4 inside the MAC.
    acceptor = AcceptorHandshake(SECRET, 2, {1})
    challenge = bytearray(one_frame(acceptor.start()))
    challenge[6:10] = (4).to_bytes(4, "big")
    answer = one_frame(ConnectorHandshake(SECRET, 1, 4).receive(bytes(challenge)))
    with pytest.raises(AuthError, match="wanted server 4"):
        acceptor.receive(answer)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda m: b"XXXX" + m[4:], "bad magic"),
        (lambda m: m[:4] + b"\x05" + m[5:], "wire version 5, this side wire version 4"),
        # A server of version 3 would take a link's EPOCH frame for a garbled one: refused.
        (lambda m: m[:4] + b"\x03" + m[5:], "wire version 3, this side wire version 4"),
        # A server of version 1 would take early frames for durable ones: refused.
        (lambda m: m[:4] + b"\x01" + m[5:], "wire version 1"),
        (lambda m: m[:5] + b"\x03" + m[6:], "expected an answer"),
        (lambda m: m[:-1], "78 bytes, expected 79"),
        (lambda m: m + b"\x00", "80 bytes"),
        (lambda m: m[:3], "too short"),
    ],
)
def test_malformed_answer_refused(mutate: object, reason: str) -> None:
    acceptor = AcceptorHandshake(SECRET, 2, {1})
    answer = one_frame(ConnectorHandshake(SECRET, 1, 2).receive(one_frame(acceptor.start())))
    with pytest.raises(AuthError, match=reason):
        acceptor.receive(mutate(answer))  # type: ignore[operator]


def answer_of(connector: ConnectorHandshake, acceptor: AcceptorHandshake) -> bytes:
    """The connector's ANSWER to a fresh challenge of ``acceptor``."""
    return one_frame(connector.receive(one_frame(acceptor.start())))


def test_both_sides_refuse_another_wire_version_in_one_line_naming_both() -> None:
    # The connector reads a CHALLENGE of version 3 (from an older server) ...
    old_challenge = bytearray(one_frame(AcceptorHandshake(SECRET, 2, {1}).start()))
    old_challenge[4] = 3
    with pytest.raises(AuthError) as refused:
        ConnectorHandshake(SECRET, 1, 2).receive(bytes(old_challenge))
    # ... and the acceptor an ANSWER of version 3 (from an older connector).
    acceptor = AcceptorHandshake(SECRET, 2, {1})
    old_answer = bytearray(answer_of(ConnectorHandshake(SECRET, 1, 2), acceptor))
    old_answer[4] = 3
    with pytest.raises(AuthError) as also_refused:
        acceptor.receive(bytes(old_answer))
    for error in (refused.value, also_refused.value):
        line = str(error)
        assert "\n" not in line and "wire version 3, this side wire version 4" in line, line


def keyed_by_role(_connector: int, role: int) -> bytes:
    return SECRET + bytes([role])


def test_the_role_is_bound_into_every_mac() -> None:
    # A tool of scope 1 (read) proves the key of scope 1 to an acceptor serving scopes 1..3.
    acceptor = AcceptorHandshake(keyed_by_role, 5, None, (1, 2, 3))
    connector = ConnectorHandshake(keyed_by_role(9, 1), 9, 5, 1)
    handshake(connector, acceptor)
    assert acceptor.role == 1 and connector.session_key == acceptor.session_key
    # Claiming scope 2 with the key of scope 1 fails: the acceptor checks with scope 2's key ...
    acceptor = AcceptorHandshake(keyed_by_role, 5, None, (1, 2, 3))
    with pytest.raises(AuthError, match="bad MAC"):
        acceptor.receive(answer_of(ConnectorHandshake(keyed_by_role(9, 1), 9, 5, 2), acceptor))
    # ... and rewriting the role byte of an honest answer breaks its MAC, even under one key.
    acceptor = AcceptorHandshake(SECRET, 5, None, (1, 2, 3))
    answer = bytearray(answer_of(ConnectorHandshake(SECRET, 9, 5, 1), acceptor))
    answer[14] = 2
    with pytest.raises(AuthError, match="bad MAC"):
        acceptor.receive(bytes(answer))


def test_an_acceptor_takes_only_its_roles() -> None:
    # A network port serves servers only (role 0); an admin port, tools' scopes only.
    for roles, claimed in (((wire.ROLE_SERVER,), 2), ((1, 2, 3), wire.ROLE_SERVER)):
        acceptor = AcceptorHandshake(SECRET, 5, None, roles)
        answer = answer_of(ConnectorHandshake(SECRET, 9, 5, claimed), acceptor)
        with pytest.raises(AuthError, match=f"claims role {claimed}, which this side"):
            acceptor.receive(answer)


@settings(max_examples=300, deadline=None)
@given(garbage=st.binary(max_size=100))
def test_garbage_only_ever_raises_auth_error(garbage: bytes) -> None:
    acceptor = AcceptorHandshake(SECRET, 2, None)
    acceptor.start()
    with pytest.raises(AuthError):
        acceptor.receive(garbage)
    with pytest.raises(AuthError):
        ConnectorHandshake(SECRET, 1, 2).receive(garbage)


def test_hmac_helper_is_standard_hmac() -> None:
    for key in (b"k", b"k" * 64, b"k" * 100):
        for data in (b"", b"abc", bytes(1000)):
            assert wire._Hmac(key).digest(data) == hmac.digest(key, data, "sha256")
            assert wire._Hmac(key).digest(data, b"xy") == hmac.digest(key, data + b"xy", "sha256")


# ------------------------------------------------------------------------------ session frames


def test_session_frames_both_ways() -> None:
    connector, acceptor = ciphers()
    for i in range(5):
        payload = bytes([i]) * (i * 50)
        assert acceptor.unwrap(connector.wrap(payload)) == payload
        assert connector.unwrap(acceptor.wrap(payload)) == payload
    framed = connector.wrap_frame(b"hello")
    assert FrameDecoder(100).feed(framed) == [framed[4:]]
    assert acceptor.unwrap(framed[4:]) == b"hello"
    assert len(framed) == 4 + len(b"hello") + SessionCipher.OVERHEAD


@pytest.mark.parametrize("position", [0, 7, 8, 12, -16, -1])
def test_tampered_frame_refused(position: int) -> None:
    connector, acceptor = ciphers()
    frame = bytearray(connector.wrap(b"some payload"))
    frame[position] ^= 0x01
    with pytest.raises(AuthError):
        acceptor.unwrap(bytes(frame))


def test_replayed_frame_refused() -> None:
    connector, acceptor = ciphers()
    frame = connector.wrap(b"pay me once")
    assert acceptor.unwrap(frame) == b"pay me once"
    with pytest.raises(AuthError, match="got 0, expected 1"):
        acceptor.unwrap(frame)


def test_reordered_and_dropped_frames_refused() -> None:
    connector, acceptor = ciphers()
    first, second = connector.wrap(b"1"), connector.wrap(b"2")
    with pytest.raises(AuthError, match="got 1, expected 0"):
        acceptor.unwrap(second)
    assert first  # never delivered: the session is unusable after a gap


def test_reflected_and_foreign_frames_refused() -> None:
    connector, _ = ciphers()
    with pytest.raises(AuthError, match="bad MAC"):
        connector.unwrap(connector.wrap(b"echo"))  # our own frame sent back to us
    _, other_acceptor = ciphers()
    with pytest.raises(AuthError, match="bad MAC"):
        other_acceptor.unwrap(connector.wrap(b"from another session"))


def test_short_frame_refused() -> None:
    _, acceptor = ciphers()
    with pytest.raises(AuthError, match="shorter"):
        acceptor.unwrap(b"\x00" * 23)


def test_cipher_needs_a_finished_handshake() -> None:
    with pytest.raises(RuntimeError):
        ConnectorHandshake(SECRET, 1, 2).cipher()


# ------------------------------------------------------------------------------ bus key file


def test_make_and_load_secret(tmp_path: Path) -> None:
    text = make_secret()
    assert text.startswith("aaabus-secret-v1 ") and text.endswith("\n")
    path = tmp_path / "bus.key"
    path.write_text("# the bus key\n" + text)
    path.chmod(0o600)
    key = load_secret(path)
    assert len(key) == 32 and key.hex() in text
    assert make_secret() != text


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (None, "not found"),
        ("", "not a bus key"),
        ("-----BEGIN PRIVATE KEY-----\n", "not a bus key"),
        ("aaabus-secret-v1 abcd\n", "4 hex digits, expected 64"),
        ("aaabus-secret-v1 " + "zz" * 32 + "\n", "not hexadecimal"),
    ],
)
def test_bad_secret_file(tmp_path: Path, content: str | None, reason: str) -> None:
    path = tmp_path / "bus.key"
    if content is not None:
        path.write_text(content)
        path.chmod(0o600)
    with pytest.raises(SecretError, match=reason) as info:
        load_secret(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    assert "run `aaabus secret --out bus.key` beside the config" in message


def test_ensure_secret_creates_once_with_private_mode(tmp_path: Path) -> None:
    path = tmp_path / "bus.key"
    key = ensure_secret(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert ensure_secret(path) == key == load_secret(path)
    assert [p.name for p in tmp_path.iterdir()] == ["bus.key"]  # no temporary left behind


def test_secret_command_creates_a_private_key_once_and_never_follows_a_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from aaabus.tools.cli import main

    old = os.umask(0o022)  # the usual umask, under which `aaabus secret > bus.key` made 0644
    try:
        path = tmp_path / "bus.key"
        assert main(["secret", "--out", str(path)]) == 0
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and len(load_secret(path)) == 32
        key = path.read_bytes()
        assert main(["secret", "--out", str(path)]) == 2  # never overwritten
        assert "already exists" in capsys.readouterr().err and path.read_bytes() == key
        target = tmp_path / "victim"
        target.write_text("precious")
        (tmp_path / "planted.key").symlink_to(target)
        assert main(["secret", "--out", str(tmp_path / "planted.key")]) == 2
        assert target.read_text() == "precious"
    finally:
        os.umask(old)


def test_a_key_readable_by_others_is_refused_with_the_chmod_to_run(tmp_path: Path) -> None:
    path = tmp_path / "bus.key"
    path.write_text(make_secret())
    path.chmod(0o644)
    with pytest.raises(SecretError, match=rf"run `chmod 600 {path}`"):
        load_secret(path)
    path.chmod(0o600)
    assert len(load_secret(path)) == 32


def test_a_server_key_file_holds_its_own_links_only(tmp_path: Path) -> None:
    from aaabus.config.scopes import Scope
    from aaabus.config.secret import (
        ServerKeys,
        admin_key,
        link_key,
        load_server_keys,
        tool_key,
        write_server_keys,
    )

    write_secret(tmp_path / "bus.key")
    bus = load_secret(tmp_path / "bus.key")
    write_server_keys(tmp_path / "s1.key", tmp_path / "bus.key", 1, [0, 1, 2])
    keys = load_server_keys(tmp_path / "s1.key", 1, [0, 1, 2])
    derived = ServerKeys.from_bus_key(bus, 1)
    assert keys.link_key(0) == derived.link_key(0) == link_key(bus, 0, 1)
    assert keys.link_key(2) == link_key(bus, 2, 1) and keys.peers() == {0, 2}
    for scope in Scope:
        assert keys.admin_key(scope) == admin_key(tool_key(bus, scope), 1)
    assert keys.identity == derived.identity
    with pytest.raises(KeyError):
        keys.link_key(3)  # a server the file does not know: no key to guess
    text = (tmp_path / "s1.key").read_text()
    assert bus.hex() not in text
    assert not any(tool_key(bus, scope).hex() in text for scope in Scope)
    with pytest.raises(SecretError, match="key file of server 1, not of server 2"):
        load_server_keys(tmp_path / "s1.key", 2, [0, 1, 2])
    with pytest.raises(SecretError, match=r"no key for the links to server\(s\) 3"):
        load_server_keys(tmp_path / "s1.key", 1, [0, 1, 2, 3])
    with pytest.raises(SecretError, match="one server's key file"):
        load_secret(tmp_path / "s1.key")
