"""The bus secret: the shared key every server of a bus must hold to be let in.

A ``bus.key`` file is one line: a header word naming the format, then the key as 64 hexadecimal
digits (32 random bytes)::

    aaabus-secret-v1 0f1e...c3

The header lets a future format coexist with this one and makes a file of the wrong kind (a TLS
key, an empty file, a config pasted by mistake) fail with a clear message rather than being
silently used as key material. Blank lines and lines starting with ``#`` are ignored so that an
operator may annotate the file.

The key is the bus: whoever reads it can join as a server (see docs/operations.md, Trust model).
A key file is therefore created mode 0600 by :func:`write_secret` (exclusive create: an existing
file, or a symlink planted at the name, is never followed nor overwritten), and
:func:`load_secret` refuses a file that its group or others may read.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path

from aaabus.errors import SecretError

HEADER = "aaabus-secret-v1"
KEY_BYTES = 32

_FIX = "run `aaabus secret --out bus.key` beside the config (or set property aaabus.secret)"


def make_secret() -> str:
    """Return the text of a new ``bus.key`` file, fresh random key included."""
    return f"{HEADER} {secrets.token_bytes(KEY_BYTES).hex()}\n"


def parse_secret(text: str, where: str = "secret") -> bytes:
    """Decode the text of a ``bus.key`` file; ``where`` names it in the error message."""
    words: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            words.extend(stripped.split())
    if len(words) != 2 or words[0] != HEADER:
        raise SecretError(f"{where}: not a bus key (expected '{HEADER} <64 hex digits>'); {_FIX}")
    digits = words[1]
    if len(digits) != 2 * KEY_BYTES:
        raise SecretError(
            f"{where}: bus key has {len(digits)} hex digits, expected {2 * KEY_BYTES}; {_FIX}"
        )
    try:
        return bytes.fromhex(digits)
    except ValueError:
        raise SecretError(f"{where}: bus key is not hexadecimal; {_FIX}") from None


def write_secret(path: str | os.PathLike[str]) -> None:
    """Create ``path`` holding a fresh key, mode 0600; never replaces nor follows what is there.

    Raises :class:`SecretError` (one line) if the file exists or cannot be created.
    """
    where = os.fspath(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(where, flags, 0o600)
    except FileExistsError:
        raise SecretError(
            f"{where} already exists; a bus key is never overwritten: keep it, or move it away "
            "(every server and tool of the bus must then get the new one)"
        ) from None
    except OSError as exc:
        raise SecretError(f"{where}: cannot create bus key ({exc.strerror})") from None
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(make_secret())
        out.flush()
        os.fsync(out.fileno())


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read the key bytes from a ``bus.key`` file.

    Raises :class:`SecretError` (one line naming the file and the fix) if the file is missing,
    unreadable, malformed, or readable by its group or others (the line gives the ``chmod``).
    """
    where = os.fspath(path)
    try:
        with open(where, encoding="ascii") as key_file:
            mode = os.fstat(key_file.fileno()).st_mode
            if mode & 0o077:
                raise SecretError(
                    f"{where}: bus key is open to group or others (mode {mode & 0o777:o}): "
                    f"anyone who reads it can join the bus; run `chmod 600 {where}`"
                )
            text = key_file.read()
    except FileNotFoundError:
        raise SecretError(f"{where}: bus key file not found; {_FIX}") from None
    except UnicodeDecodeError:
        raise SecretError(f"{where}: not a bus key (binary content); {_FIX}") from None
    except OSError as exc:
        raise SecretError(f"{where}: cannot read bus key ({exc.strerror}); {_FIX}") from None
    return parse_secret(text, where)


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
