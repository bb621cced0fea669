"""The bus secret: the shared key every server of a bus must hold to be let in.

A ``bus.key`` file is one line: a header word naming the format, then the key as 64 hexadecimal
digits (32 random bytes)::

    aaabus-secret-v1 0f1e...c3

The header lets a future format coexist with this one and makes a file of the wrong kind (a TLS
key, an empty file, a config pasted by mistake) fail with a clear message rather than being
silently used as key material. Blank lines and lines starting with ``#`` are ignored so that an
operator may annotate the file.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from aaabus.errors import SecretError

if TYPE_CHECKING:
    from aaabus.config.reader import BusConfig

HEADER = "aaabus-secret-v1"
KEY_BYTES = 32

_FIX = "run `aaabus secret > bus.key` beside the config (or set property aaabus.secret)"


def secret_path(config: BusConfig, server_id: int | None = None) -> Path:
    """Where the bus secret is: property ``aaabus.secret`` (relative to the config) or bus.key."""
    name: str = config.setting(server_id, "aaabus.secret")
    return Path(config.path).resolve().parent / name


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


def load_secret(path: str | os.PathLike[str]) -> bytes:
    """Read the key bytes from a ``bus.key`` file.

    Raises :class:`SecretError` (one line naming the file and the fix) if the file is missing,
    unreadable or malformed.
    """
    where = os.fspath(path)
    try:
        text = Path(path).read_text(encoding="ascii")
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
