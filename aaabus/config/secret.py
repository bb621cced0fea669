"""Key files and the credentials derived from them.

A ``bus.key`` file is one line: a header word naming the format, then the key as 64 hexadecimal
digits (32 random bytes)::

    aaabus-secret-v1 0f1e...c3

The header lets a future format coexist with this one and makes a file of the wrong kind (a TLS
key, an empty file, a config pasted by mistake) fail with a clear message rather than being
silently used as key material. Blank lines and lines starting with ``#`` are ignored so that an
operator may annotate the file.

Credentials that confine
    Nothing on the wire is keyed with the bus key itself; every key below is an HMAC-SHA256 of
    the one above it, so each is one-way: whoever holds a key learns nothing of its parent nor of
    its siblings.

    * ``link_key(a, b) = HMAC(bus_key, "aaabus/1 link key" | a | b)`` (``a < b``, 32-bit): the
      link between servers ``a`` and ``b``. A captured server ``j`` holds the keys of its own
      pairs, so it cannot pass for server ``i`` to ``k``.
    * ``tool_key(scope) = HMAC(bus_key, "aaabus/2 tool key" | scope)`` (one byte, see
      :mod:`aaabus.config.scopes`): what a tool of that scope holds (``aaabus secret --tool
      --scope S``, header ``aaabus-tool-key-v2``). It opens no link.
    * ``admin_key(scope, i) = HMAC(tool_key(scope), "aaabus/2 admin key" | i)`` (32-bit): what a
      tool proves, and server ``i`` proves back, on server ``i``'s admin port. A tool derives it
      for whichever server it talks to; a server holds only its own (one per scope), so a
      server's key file gives no admin key of another server and no tool key.

    A server derives its keys from the bus key, or reads them from its own server key file
    (``aaabus secret --server ID``, header ``aaabus-server-key-v2``: its links' keys, its admin
    keys, the bus identity; never the bus key nor a tool key). Files of the previous formats
    (``-v1``: a tool key for every scope, which every server key file also held) are refused
    with the command that makes the new one. Who holds which file and what it allows:
    docs/security.md.

The bus key lets its holder derive every credential (see docs/security.md, Trust model). A key
file is therefore created mode 0600 by :func:`write_secret` (exclusive create: an existing file,
or a symlink planted at the name, is never followed nor overwritten), and :func:`load_secret`
refuses a file that its group or others may read.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import struct
import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from aaabus.config.scopes import DEFAULT_SCOPE, Scope, parse_scope
from aaabus.errors import SecretError

if TYPE_CHECKING:
    from aaabus.config.reader import BusConfig

HEADER = "aaabus-secret-v1"
TOOL_HEADER = "aaabus-tool-key-v2"
SERVER_HEADER = "aaabus-server-key-v2"
KEY_BYTES = 32

_TOOL_PREFIX = "aaabus-tool-key-"
_SERVER_PREFIX = "aaabus-server-key-"
_FIX = "run `aaabus secret --out bus.key` beside the config (or set property aaabus.secret)"


def secret_path(config: BusConfig, server_id: int | None = None) -> Path:
    """Where the bus secret is: property ``aaabus.secret`` (relative to the config) or bus.key."""
    name: str = config.setting(server_id, "aaabus.secret")
    return Path(config.path).resolve().parent / name


def make_secret() -> str:
    """Return the text of a new ``bus.key`` file, fresh random key included."""
    return f"{HEADER} {secrets.token_bytes(KEY_BYTES).hex()}\n"


def link_key(bus_key: bytes, a: int, b: int) -> bytes:
    """The key of the link between servers ``a`` and ``b`` (either order gives the same key)."""
    low, high = sorted((a, b))
    return hmac.digest(bus_key, b"aaabus/1 link key" + struct.pack(">II", low, high), "sha256")


def tool_key(bus_key: bytes, scope: Scope) -> bytes:
    """The key of the tools of ``scope``; it opens no link between servers."""
    return hmac.digest(bus_key, b"aaabus/2 tool key" + struct.pack(">B", scope), "sha256")


def admin_key(scoped_tool_key: bytes, server_id: int) -> bytes:
    """The key a tool proves on the admin port of ``server_id`` (and that server proves back),
    from the tool key of its scope."""
    return hmac.digest(
        scoped_tool_key, b"aaabus/2 admin key" + struct.pack(">I", server_id), "sha256"
    )


def bus_identity(bus_key: bytes) -> bytes:
    """What a store records of the bus it belongs to: an HMAC of the bus key, not the key."""
    return hmac.digest(bus_key, b"aaabus/1 bus identity", "sha256")


class ServerKeys:
    """What one server holds: the key of each of its links, its admin key for each scope (what
    tools of that scope prove on its admin port), and the identity of its bus (recorded in its
    store). Immutable; shared by threads.

    From the bus key (:meth:`from_bus_key`) every key is derived; from a server key file
    (``aaabus secret --server ID``) only that server's are known, so that a captured server
    cannot pass for another one, to a server or to a tool.
    """

    def __init__(
        self,
        server_id: int,
        links: dict[int, bytes] | bytes,
        admin: Mapping[Scope, bytes],
        identity: bytes,
    ) -> None:
        self.server_id = server_id
        self._links = links  # per peer, or the bus key to derive them from
        self._admin = dict(admin)
        self.identity = identity

    @classmethod
    def from_bus_key(cls, bus_key: bytes, server_id: int) -> ServerKeys:
        admin = {s: admin_key(tool_key(bus_key, s), server_id) for s in Scope}
        return cls(server_id, bytes(bus_key), admin, bus_identity(bus_key))

    def link_key(self, peer: int) -> bytes:
        """The key of the link with ``peer``; KeyError for a peer the key file does not name."""
        if isinstance(self._links, bytes):
            return link_key(self._links, self.server_id, peer)
        return self._links[peer]

    def admin_key(self, scope: Scope) -> bytes:
        """The key tools of ``scope`` prove on this server's admin port."""
        return self._admin[scope]

    def peers(self) -> frozenset[int] | None:
        """The peers a server key file names (``None``: derived from the bus key, all)."""
        return None if isinstance(self._links, bytes) else frozenset(self._links)

    def server_key_text(self, peers: Iterable[int]) -> str:
        """The text of the server key file of this server, naming ``peers``."""
        lines = [f"{SERVER_HEADER} {self.server_id}", f"identity {self.identity.hex()}"]
        lines += [f"admin {s.label} {self._admin[s].hex()}" for s in Scope]
        lines += [f"link {p} {self.link_key(p).hex()}" for p in sorted(set(peers))]
        return "\n".join(lines) + "\n"


class Credential:
    """What a tool proves itself with on admin ports: the bus key, which gives every scope and
    claims ``scope`` (:data:`~aaabus.config.scopes.DEFAULT_SCOPE`, operate, unless the program
    asks for more), or a tool key (``tool=True``), which is one scope's. Immutable; shared freely
    between threads."""

    def __init__(self, key: bytes, scope: Scope = DEFAULT_SCOPE, *, tool: bool = False) -> None:
        self._key = bytes(key)
        self.scope = scope
        self.is_tool = tool

    def claiming(self, scope: Scope) -> Credential:
        """This bus key, claiming ``scope`` (a tool that needs less than the default, such as
        the console reading with ``read``). A tool key is one scope's: ValueError."""
        if self.is_tool:
            raise ValueError(f"a tool key is a {self.scope.label} key and claims nothing else")
        return Credential(self._key, scope)

    def admin_key(self, server_id: int) -> bytes:
        """The key to prove on the admin port of ``server_id``."""
        scoped = self._key if self.is_tool else tool_key(self._key, self.scope)
        return admin_key(scoped, server_id)


def as_credential(secret: bytes | Credential) -> Credential:
    """``secret`` as a :class:`Credential`: plain bytes are a bus key (what servers and
    programs that read ``bus.key`` hold), claiming the default scope."""
    return secret if isinstance(secret, Credential) else Credential(secret)


def parse_secret(text: str, where: str = "secret") -> bytes:
    """Decode the text of a ``bus.key`` file; ``where`` names it in the error message."""
    words = _credential_words(text, where)
    if words[0].startswith(_TOOL_PREFIX):
        raise SecretError(
            f"{where}: this is a tool key, which opens admin ports only; a server needs the bus "
            f"key; {_FIX}"
        )
    return _bus_key(words, where)


def parse_credential(text: str, where: str = "secret") -> Credential:
    """Decode a bus key or a tool key file; ``where`` names it in the error message."""
    words = _credential_words(text, where)
    if words[0] == TOOL_HEADER and len(words) == 3:
        fix = "make it again with `aaabus secret --tool --scope SCOPE --out FILE`"
        scope = parse_scope(words[1], where)
        return Credential(_hex(words[2], where, "tool key", fix), scope, tool=True)
    if words[0].startswith(_TOOL_PREFIX):
        raise SecretError(
            f"{where}: a tool key of an older format (one key for every request); move it away "
            "and make a scoped one with `aaabus secret --tool --scope operate --out FILE`"
        )
    return Credential(_bus_key(words, where))


def _words(text: str) -> list[str]:
    """The words of a key file, comments left out (``[""]`` for an empty one)."""
    words: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            words.extend(stripped.split())
    return words or [""]


def _credential_words(text: str, where: str) -> list[str]:
    """The words of a key file a tool or a server reads as a credential: never a server key
    file, which is no bus key and gives no tool's rights."""
    words = _words(text)
    if words[0].startswith(_SERVER_PREFIX):
        raise SecretError(
            f"{where}: this is one server's key file; this needs the bus key (or, for a tool, "
            "a tool key: aaabus secret --tool); " + _FIX
        )
    return words


def _bus_key(words: list[str], where: str) -> bytes:
    if len(words) != 2 or words[0] != HEADER:
        raise SecretError(f"{where}: not a bus key (expected '{HEADER} <64 hex digits>'); {_FIX}")
    return _hex(words[1], where, "bus key", _FIX)


def _hex(digits: str, where: str, what: str, fix: str) -> bytes:
    if len(digits) != 2 * KEY_BYTES:
        raise SecretError(
            f"{where}: {what} has {len(digits)} hex digits, expected {2 * KEY_BYTES}; {fix}"
        )
    try:
        return bytes.fromhex(digits)
    except ValueError:
        raise SecretError(f"{where}: {what} is not hexadecimal; {fix}") from None


def write_secret(path: str | os.PathLike[str], text: str | None = None) -> None:
    """Create ``path`` holding ``text`` (default: a fresh bus key), mode 0600; never replaces
    nor follows what is there.

    Raises :class:`SecretError` (one line) if the file exists or cannot be created.
    """
    where = os.fspath(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(where, flags, 0o600)
    except FileExistsError:
        raise SecretError(
            f"{where} already exists; a key file is never overwritten: keep it, or move it away "
            "(every server and tool of the bus must then get the new one)"
        ) from None
    except OSError as exc:
        raise SecretError(f"{where}: cannot create key file ({exc.strerror})") from None
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(make_secret() if text is None else text)
        out.flush()
        os.fsync(out.fileno())


def write_server_keys(
    path: str | os.PathLike[str],
    bus_key_file: str | os.PathLike[str],
    server_id: int,
    peers: Iterable[int],
    *,
    replicated: bool = False,
) -> None:
    """Create ``path`` (mode 0600, exclusive) holding server ``server_id``'s keys: its links to
    ``peers``, its admin keys, the bus identity, and with ``replicated`` the key of its link
    with itself, which it and its replicas prove to each other (:mod:`aaabus.io.replink`).
    Raises :class:`SecretError` (one line)."""
    keys = ServerKeys.from_bus_key(load_secret(bus_key_file), server_id)
    write_secret(path, keys.server_key_text(p for p in peers if p != server_id or replicated))


def write_tool_key(
    path: str | os.PathLike[str], bus_key_file: str | os.PathLike[str], scope: Scope
) -> None:
    """Create ``path`` (mode 0600, exclusive) holding the tool key of ``scope`` derived from
    the bus key in ``bus_key_file``. Raises :class:`SecretError` (one line)."""
    key = tool_key(load_secret(bus_key_file), scope)
    write_secret(path, f"{TOOL_HEADER} {scope.label} {key.hex()}\n")


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read the key bytes from a ``bus.key`` file (a tool key is refused: servers need the
    bus key).

    Raises :class:`SecretError` (one line naming the file and the fix) if the file is missing,
    unreadable, malformed, or readable by its group or others (the line gives the ``chmod``).
    """
    where = os.fspath(path)
    return parse_secret(_read_private(where), where)


def load_server_keys(
    path: str | os.PathLike[str], server_id: int, peers: Iterable[int]
) -> ServerKeys:
    """The keys of server ``server_id`` from the bus key or from its server key file, which
    must name every one of ``peers``. Raises :class:`SecretError` (one line)."""
    where = os.fspath(path)
    text = _read_private(where)
    header = _words(text)[0]
    if not header.startswith(_SERVER_PREFIX):
        return ServerKeys.from_bus_key(parse_secret(text, where), server_id)
    fix = f"move it away and run `aaabus secret --server {server_id} --config a3.xml --out FILE`"
    if header != SERVER_HEADER:
        raise SecretError(
            f"{where}: a server key file of an older format (it held the tool key, which gave "
            f"every server's admin port); {fix}"
        )
    keys = _parse_server_keys(text, where, fix)
    if keys.server_id != server_id:
        raise SecretError(
            f"{where}: this is the key file of server {keys.server_id}, not of server "
            f"{server_id}; give each server its own (aaabus secret --server ID)"
        )
    missing = sorted(set(peers) - {server_id} - (keys.peers() or frozenset()))
    if missing:
        raise SecretError(
            f"{where}: no key for the links to server(s) {', '.join(map(str, missing))}, which "
            f"the config names; make it again with `aaabus secret --server {server_id}`"
        )
    return keys


def _parse_server_keys(text: str, where: str, fix: str) -> ServerKeys:
    identity = b""
    admin: dict[Scope, bytes] = {}
    links: dict[int, bytes] = {}
    server_id = -1
    try:
        for line in text.splitlines():
            words = line.split()
            if not words or words[0].startswith("#"):
                continue
            if words[0] == SERVER_HEADER and len(words) == 2:
                server_id = int(words[1])
            elif words[0] == "identity" and len(words) == 2:
                identity = bytes.fromhex(words[1])
            elif words[0] == "admin" and len(words) == 3:
                admin[parse_scope(words[1], where)] = bytes.fromhex(words[2])
            elif words[0] == "link" and len(words) == 3:
                links[int(words[1])] = bytes.fromhex(words[2])
            else:
                raise ValueError(line)
    except (ValueError, SecretError):
        raise SecretError(f"{where}: not a valid server key file; {fix}") from None
    if server_id < 0 or not identity or set(admin) != set(Scope):
        raise SecretError(f"{where}: incomplete server key file; {fix}")
    return ServerKeys(server_id, links, admin, identity)


def load_credential(path: str | os.PathLike[str]) -> Credential:
    """Read a bus key or a tool key file (what a tool holds); errors as :func:`load_secret`."""
    where = os.fspath(path)
    return parse_credential(_read_private(where), where)


def read_private(where: str, encoding: str, open_to_others: Callable[[int], Exception]) -> str:
    """The text of a file that only its owner may read (a key, a password): checked on the open
    file, so a file swapped between the check and the read cannot slip through. A file open to
    group or others raises ``open_to_others(mode)``; OSError and UnicodeDecodeError as they
    come (each caller words them for its own file)."""
    with open(where, encoding=encoding) as file:
        mode = os.fstat(file.fileno()).st_mode
        if mode & 0o077:
            raise open_to_others(mode & 0o777)
        return file.read()


def _read_private(where: str) -> str:
    def open_to_others(mode: int) -> Exception:
        return SecretError(
            f"{where}: key file is open to group or others (mode {mode:o}): "
            f"anyone who reads it holds its rights on the bus; run `chmod 600 {where}`"
        )

    try:
        return read_private(where, "ascii", open_to_others)
    except FileNotFoundError:
        raise SecretError(f"{where}: bus key file not found; {_FIX}") from None
    except UnicodeDecodeError:
        raise SecretError(f"{where}: not a bus key (binary content); {_FIX}") from None
    except OSError as exc:
        raise SecretError(f"{where}: cannot read bus key ({exc.strerror}); {_FIX}") from None


def ensure_secret(path: str | os.PathLike[str]) -> bytes:
    """Create ``path`` with a fresh key if it does not exist, then load it.

    Creation is atomic and exclusive: the key is written to a private temporary file (mode 0600)
    in the same directory, then hard-linked to its final name. A reader therefore never sees a
    half-written key, and when two tools race to create the file, the first link wins and both
    end up using the same key (the loser's link fails with ``FileExistsError``).
    """
    target = Path(path)
    if not target.exists():
        directory = target.parent
        try:
            fd, tmp_name = tempfile.mkstemp(prefix=".bus.key.", dir=directory)  # mode 0600
        except OSError as exc:
            raise SecretError(f"{target}: cannot create bus key ({exc.strerror}); {_FIX}") from None
        try:
            with os.fdopen(fd, "w", encoding="ascii") as tmp:
                tmp.write(make_secret())
                tmp.flush()
                os.fsync(tmp.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(tmp_name, target)
        except OSError as exc:
            raise SecretError(f"{target}: cannot create bus key ({exc.strerror}); {_FIX}") from None
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
    return load_secret(target)
