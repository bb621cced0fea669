"""What a server remembers of the other servers' epochs, and the votes it gave (issue 42).

Every takeover of a server id raises that id's **epoch**; a peer refuses links of an epoch older
than the one it knows (:mod:`aaabus.io.network`), and a voter grants each epoch of a server once
(docs/architecture.md, "Replicas and failover"). The :class:`EpochBook` is that memory: for each
other server id, the highest epoch this server has accepted and which member holds it, plus the
last grant it gave (epoch, member). It survives restarts: a voter that forgot a grant could give
the same epoch to two members, and a peer that forgot an epoch could accept the old primary's
links again.

The file is ``epochs`` in the server's store directory, rewritten whole on every change (they
are rare: a takeover, or a link that shows a newer epoch): a temporary file written and
fsync'd, renamed over the old one, then the directory fsync'd, mode 0600. Nothing is written
while every server is at epoch 1 held by member 0 (where every bus starts, without a vote), so
a bus without failovers never writes it. A file that does not parse stops the server with one
line: the fence's memory is not silently dropped.

Threads: any. One lock guards the table and its writes; :meth:`EpochBook.grant` checks and
persists under it, so two candidates asking at once get one grant between them. A write that
fails raises :class:`~aaabus.errors.StoreError` and leaves the table as it was before the call.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from aaabus.errors import StoreError

__all__ = ["FILE_NAME", "FIRST", "EpochBook", "VoteAnswer"]

#: The file's name in the store directory.
FILE_NAME = "epochs"
#: Where every server starts, without a vote: epoch 1, held by member 0 (the ``<server>``).
FIRST = (1, 0)
_FORMAT = 1


@dataclass(frozen=True)
class VoteAnswer:
    """A voter's answer to a candidate: ``granted`` or not, the epoch and member the voter now
    knows for that server (after a grant: the ones granted), and why, in one line."""

    granted: bool
    epoch: int
    member: int
    why: str


@dataclass
class _Entry:
    known: tuple[int, int]
    granted: tuple[int, int] | None = None


class EpochBook:
    """The epochs known of other servers and the grants given, in ``directory/epochs``.

    ``directory`` None keeps them in memory only (a server on the ``memory`` store, which keeps
    nothing across a restart anyway). Raises :class:`StoreError` (one line) when the file
    exists and does not parse.
    """

    def __init__(self, directory: str | os.PathLike[str] | None) -> None:
        self._lock = threading.Lock()
        self._path = None if directory is None else Path(directory) / FILE_NAME
        self._table: dict[int, _Entry] = {} if self._path is None else _read(self._path)

    @property
    def path(self) -> Path | None:
        """The file (None: in memory only)."""
        return self._path

    def known(self, server_id: int) -> tuple[int, int] | None:
        """``(epoch, member)`` last accepted for ``server_id``; None if nothing but the start
        (epoch 1, member 0) was ever seen of it."""
        with self._lock:
            entry = self._table.get(server_id)
            return None if entry is None else entry.known

    def granted(self, server_id: int) -> tuple[int, int] | None:
        """The last grant given for ``server_id`` (epoch, member), if any."""
        with self._lock:
            entry = self._table.get(server_id)
            return None if entry is None else entry.granted

    def everything(self) -> dict[int, tuple[int, int]]:
        """Every server's known ``(epoch, member)`` (for the status view)."""
        with self._lock:
            return {sid: entry.known for sid, entry in sorted(self._table.items())}

    def raise_to(self, server_id: int, epoch: int, member: int) -> bool:
        """Record that ``member`` holds ``epoch`` of ``server_id``, if that is newer than what
        is known: a higher epoch, or the same epoch with another member (a link at epoch E
        proves which member won E, whatever grant this server gave). Persisted before it
        returns; True if it changed anything."""
        with self._lock:
            entry = self._table.get(server_id)
            current = FIRST if entry is None else entry.known
            if epoch < current[0] or (epoch, member) == current:
                return False
            new = _Entry((epoch, member), None if entry is None else entry.granted)
            self._store(server_id, new)
            return True

    def grant(
        self, server_id: int, epoch: int, member: int, silent_for_s: float, delay_s: float
    ) -> VoteAnswer:
        """Decide the vote of a candidate ``member`` for ``epoch`` of ``server_id``.

        Granted again if exactly (epoch, member) was granted before (a candidate retrying);
        refused if ``epoch`` is not above the one known; refused if the server was heard
        ``silent_for_s`` seconds ago, less than ``delay_s``; else granted, the grant and the
        epoch persisted before the answer is returned.
        """
        with self._lock:
            entry = self._table.get(server_id)
            known = FIRST if entry is None else entry.known
            if entry is not None and entry.granted == (epoch, member):
                return VoteAnswer(True, epoch, member, "already granted to this member")
            if epoch <= known[0]:
                return VoteAnswer(
                    False,
                    *known,
                    f"server {server_id} is at epoch {known[0]} (member {known[1]}) here: "
                    f"epoch {epoch} is not newer",
                )
            if silent_for_s < delay_s:
                return VoteAnswer(
                    False,
                    *known,
                    f"server {server_id} was heard from {silent_for_s:.3f} s ago, within the "
                    f"failover delay of {delay_s:g} s",
                )
            self._store(server_id, _Entry((epoch, member), (epoch, member)))
            return VoteAnswer(True, epoch, member, "granted")

    def _store(self, server_id: int, entry: _Entry) -> None:
        """Persist the table with ``entry`` (lock held), then adopt it: a failed write leaves
        both the file and the table as they were."""
        table = dict(self._table)
        table[server_id] = entry
        if self._path is not None:
            _write(self._path, table)
        self._table = table


def _read(path: Path) -> dict[int, _Entry]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise StoreError(f"epoch file {path} cannot be read ({exc})") from None
    try:
        return _parse(text)
    except (ValueError, TypeError, KeyError) as exc:
        raise StoreError(
            f"epoch file {path} is damaged ({exc}); restore it from a backup of this server's "
            "store, or delete it if no server of this bus ever failed over"
        ) from None


def _parse(text: str) -> dict[int, _Entry]:
    data = json.loads(text)
    if not isinstance(data, dict) or data.get("format") != _FORMAT:
        raise ValueError(f"not an epoch file of format {_FORMAT}")
    table: dict[int, _Entry] = {}
    for key, value in data["servers"].items():
        known = _pair(value["known"])
        granted = None if value.get("granted") is None else _pair(value["granted"])
        table[int(key)] = _Entry(known, granted)
    return table


def _pair(value: object) -> tuple[int, int]:
    if (
        not isinstance(value, list)
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        or value[0] < 1
        or value[1] < 0
    ):
        raise ValueError(f"{value!r} is not [epoch, member]")
    return value[0], value[1]


def _write(path: Path, table: dict[int, _Entry]) -> None:
    data = {
        "format": _FORMAT,
        "servers": {
            str(sid): {
                "known": list(entry.known),
                "granted": None if entry.granted is None else list(entry.granted),
            }
            for sid, entry in sorted(table.items())
        },
    }
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()  # a crash's leftover, or a planted link: unlink never follows one
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(data, out, sort_keys=True)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise StoreError(
            f"epoch file {path} cannot be written ({exc.strerror or exc}); free space or fix "
            "the store directory's permissions"
        ) from None
