"""A FUSE file system that loses what was never synced, as a power cut does (issue 48.1).

``python -m tests.support.powerfs BACKING MOUNTPOINT`` mounts a pass-through view of the
directory ``BACKING`` at ``MOUNTPOINT`` and serves it in the foreground until it is killed. A
write is kept in this process's memory, visible to every reader of the mount, and reaches the
backing file only when a program calls ``fsync`` or ``fdatasync`` on that file; closing a file
syncs nothing. SIGKILL this process (after the programs using the mount) and whatever was written
but not synced is gone: the backing directory then holds what a disk would after a power cut,
and a program restarted on it must find everything it ever said was durable. This is LazyFS's
idea (the FUSE file system Jepsen uses on etcd and PostgreSQL), reduced to what the bus's log
store needs; docs/testing.md says why this and not a loop device or device-mapper.

What it models, and what not:

* File data: lost unless synced, per file, as a whole (a sync writes every pending write of the
  file, in the order they were made). A real disk may also keep some unsynced writes, or part of
  one; the store already survives torn tails (its recovery tests), so losing all of them is the
  hard case for what this checks: that nothing acknowledged depends on an unsynced write.
* Names and sizes (create, rename, unlink, mkdir, truncate): applied to the backing directory at
  once, as if every directory operation were durable at once. Losing a rename is not what
  these tests look for; the store syncs its directory after each rename that matters anyway.

One thread (libfuse's ``nothreads``) serves every request, so the pending writes have one
owner and need no lock. An exception in a handler becomes an errno for the caller (mfusepy).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import mfusepy as fuse

#: The stat fields a getattr answers with (the nanosecond times: ``use_ns``).
_STAT_FIELDS = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_atime", "st_mtime")


class PowerFS(fuse.Operations):
    """The operations: paths are relative to the mount (``/name``), files are opened on the
    backing directory and their handles are the backing descriptors."""

    use_ns = True  # times in nanoseconds (mfusepy's float seconds are deprecated)

    def __init__(self, backing: str) -> None:
        self.backing = backing
        #: path -> the writes not yet synced, oldest first: (offset, bytes).
        self.pending: dict[str, list[tuple[int, bytes]]] = {}

    def _real(self, path: str) -> str:
        return self.backing + path

    def _end(self, path: str) -> int:
        """Where the pending writes of ``path`` end (0: none)."""
        return max((off + len(data) for off, data in self.pending.get(path, ())), default=0)

    # -- names: straight to the backing directory --------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.lstat(self._real(path))
        attrs = {name: getattr(st, name) for name in _STAT_FIELDS}
        attrs["st_atime"], attrs["st_mtime"] = st.st_atime_ns, st.st_mtime_ns
        attrs["st_ctime"] = st.st_ctime_ns
        attrs["st_size"] = max(st.st_size, self._end(path))
        return attrs

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._real(path))]

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._real(path), amode):
            raise fuse.FuseOSError(errno.EACCES)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._real(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._real(path))
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._real(path))
        self.pending.pop(path, None)
        return 0

    def rename(self, old: str, new: str) -> int:
        os.rename(self._real(old), self._real(new))
        moved = self.pending.pop(old, None)
        self.pending.pop(new, None)  # the file it replaces is gone, its writes with it
        if moved is not None:
            self.pending[new] = moved
        return 0

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        os.chown(self._real(path), uid, gid)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        if times is None:
            os.utime(self._real(path))
        else:
            os.utime(self._real(path), ns=times)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self._real(path))
        names = ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree")
        return {name: getattr(st, name) for name in (*names, "f_favail", "f_flag", "f_namemax")}

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        os.truncate(self._real(path), length)
        kept = [
            (off, data[: length - off]) for off, data in self.pending.get(path, ()) if off < length
        ]
        if kept:
            self.pending[path] = kept
        else:
            self.pending.pop(path, None)
        return 0

    # -- data: kept here until a sync ----------------------------------------------------------

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        return os.open(self._real(path), os.O_RDWR | os.O_CREAT, mode)

    def open(self, path: str, flags: int) -> int:
        # Read-write whatever was asked: the handle also serves the syncs' writes. The kernel
        # did the permission check and O_TRUNC (a truncate) before this.
        return os.open(self._real(path), os.O_RDWR)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        stop = min(offset + size, self.getattr(path)["st_size"])
        if stop <= offset:
            return b""
        out = bytearray(os.pread(fh, stop - offset, offset))
        out.extend(bytes(stop - offset - len(out)))  # a hole up to pending data: zeros
        for off, data in self.pending.get(path, ()):  # newer writes over older ones
            lo, hi = max(off, offset), min(off + len(data), stop)
            if lo < hi:
                out[lo - offset : hi - offset] = data[lo - off : hi - off]
        return bytes(out)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self.pending.setdefault(path, []).append((offset, bytes(data)))
        return len(data)

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        for off, data in self.pending.pop(path, ()):
            view = memoryview(data)
            while view:
                view = view[os.pwrite(fh, view, off + len(data) - len(view)) :]
        if datasync:
            os.fdatasync(fh)
        else:
            os.fsync(fh)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0  # close(2) syncs nothing

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        return 0  # names are on the backing directory already


class Mount:
    """This file system in a child process, over ``backing`` at ``mountpoint`` (both made if
    missing); its messages go to ``log``. :meth:`cut` is the power cut."""

    def __init__(self, backing: Path, mountpoint: Path, log: Path) -> None:
        self.backing, self.mountpoint, self.log = backing, mountpoint, log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> Mount:
        """Mount, and return once the mount point is one (AssertionError if not by
        ``timeout``, with the child's last words)."""
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mountpoint.mkdir(parents=True, exist_ok=True)
        root = Path(__file__).resolve().parents[2]
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.support.powerfs",
                    str(self.backing),
                    str(self.mountpoint),
                ],
                cwd=root,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.mountpoint):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.cut()
                raise AssertionError(
                    f"powerfs did not mount {self.mountpoint}: {self.log.read_text()[-500:]}"
                )
            threading.Event().wait(0.02)  # the mount is the kernel's: poll for it
        return self

    def cut(self) -> None:
        """The power cut: the writes not synced, held by the child alone, die with it. Stop
        the programs that use the mount first: their requests fail once the child is gone."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        # A dead FUSE server's mount answers ENOTCONN until it is detached (lazily: a killed
        # program may still hold a descriptor on it for a moment).
        if os.path.ismount(self.mountpoint) or _stale(self.mountpoint):
            subprocess.run(["umount", "-l", str(self.mountpoint)], check=True, timeout=20)


def _stale(path: Path) -> bool:
    """Whether ``path`` is a mount whose FUSE server died (it then fails with ENOTCONN)."""
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN
    return False


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m tests.support.powerfs BACKING MOUNTPOINT", file=sys.stderr)
        return 2
    backing, mountpoint = (os.path.abspath(a) for a in argv)
    fuse.FUSE(PowerFS(backing), mountpoint, foreground=True, nothreads=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
