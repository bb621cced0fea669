"""MQTT credentials: a file of salted scrypt hashes that CONNECT's username/password are checked
against (property ``aaabus.mqtt.credentials``). Never the bus secret: a device holds only its own
password, and a stolen device opens no link between servers.

The file has one ``user:scrypt$N$r$p$salt$hash`` line per user (hex salt and hash; ``#`` starts a
comment). ``python -m aaabus.mqtt.auth USER`` reads a password from standard input and prints
the line to append. scrypt is memory-hard, so a copied file is slow to attack; its cost is paid at
each CONNECT whose password was not verified lately (about 30 ms with the defaults), on a
thread of the listener's auth pool; a user name the file does not hold costs the same.

Threads: a loaded :class:`Credentials` is read-only and shared by every thread.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import sys
from pathlib import Path

from aaabus.config.guard import read_guarded
from aaabus.errors import ConfigError

__all__ = ["Credentials", "hash_password"]

_N, _R, _P = 1 << 14, 8, 1


def _derive(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
    return hashlib.scrypt(password.encode("utf-8"), salt=salt, n=n, r=r, p=p, dklen=32)


def hash_password(password: str, salt: bytes | None = None) -> str:
    """The ``scrypt$N$r$p$salt$hash`` text of ``password`` (a fresh random salt by default)."""
    salt = salt if salt is not None else os.urandom(16)
    digest = _derive(password, salt, _N, _R, _P)
    return f"scrypt${_N}${_R}${_P}${salt.hex()}${digest.hex()}"


class Credentials:
    """The users of one credentials file: ``check(user, password)``."""

    def __init__(self, entries: dict[str, tuple[int, int, int, bytes, bytes]]) -> None:
        self._entries = entries
        # What a user name the file does not hold is checked against: the parameters of the
        # file's costliest entry (the defaults when empty), a salt of its own, no password.
        n, r, p = _N, _R, _P
        if entries:
            n, r, p, _salt, _digest = max(entries.values(), key=lambda e: e[0] * e[1] * e[2])
        self._nobody = (n, r, p, os.urandom(16), b"")

    @classmethod
    def load(cls, path: Path) -> Credentials:
        """Read ``path``; :class:`ConfigError` (one line, with the line number) if malformed, or
        naming the file when someone else than its owner could change it
        (:mod:`aaabus.config.guard`)."""
        try:
            text = read_guarded(path, "MQTT credentials file").decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"MQTT credentials file unreadable ({exc}); check aaabus.mqtt.credentials",
                str(path),
            ) from None
        entries: dict[str, tuple[int, int, int, bytes, bytes]] = {}
        for number, line in enumerate(text.splitlines(), 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            user, _, hashed = line.partition(":")
            parts = hashed.split("$")
            try:
                if not user or len(parts) != 6 or parts[0] != "scrypt":
                    raise ValueError
                n, r, p = int(parts[1]), int(parts[2]), int(parts[3])
                entries[user] = (n, r, p, bytes.fromhex(parts[4]), bytes.fromhex(parts[5]))
            except ValueError:
                raise ConfigError(
                    f"line {number} is not user:scrypt$N$r$p$salt$hash; write it with "
                    "`python -m aaabus.mqtt.auth USER`",
                    str(path),
                ) from None
        return cls(entries)

    def check(self, user: str | None, password: str | None) -> bool:
        """Whether ``user`` exists and ``password`` is its password (constant-time compare). A
        user the file does not hold costs the same scrypt as one it does, then False: how long
        the answer takes does not tell who exists."""
        if password is None:
            return False
        entry = self._entries.get(user or "")
        n, r, p, salt, digest = entry if entry is not None else self._nobody
        return hmac.compare_digest(_derive(password, salt, n, r, p), digest) and entry is not None


def main(argv: list[str]) -> int:
    if len(argv) != 1 or ":" in argv[0] or not argv[0]:
        print("usage: python -m aaabus.mqtt.auth USER  (password on stdin)", file=sys.stderr)
        return 2
    password = sys.stdin.readline().rstrip("\n")
    if not password:
        print("mqttauth: empty password on standard input; give one", file=sys.stderr)
        return 2
    print(f"{argv[0]}:{hash_password(password)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
