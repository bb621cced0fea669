"""A replica of a server (issue 42): ``aaabus-server --id N --replica K --config a3.xml``.

It listens on its ``<replica>`` address for its primary (server N, proving N's key of its link
with itself, :mod:`aaabus.io.replink`), says which commit it has last, and applies what the
primary ships (:class:`aaabus.core.replication.Follower`) to its own log store in
``--storage`` (default ``./s<N>r<K>``), which is laid out as server N's store (``log/``): stopped,
it opens as server N's store with everything the primary had acknowledged. It acknowledges a
commit once it is on its disk. One primary connection at a time: a newer one (a primary that
restarted) replaces the current one.

Threads: ``aaabus-replica-<N>.<K>`` accepts; one ``aaabus-replica-<N>.<K>-link`` thread per
connection authenticates it (5 s deadline, at most 4 at once: more are closed) and, for its
primary, serves it, owning the store while it does (a newer one closes it and waits for it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path

from aaabus.config.reader import BusConfig
from aaabus.config.secret import load_server_keys, secret_path
from aaabus.core.logstorage import LogStorage
from aaabus.core.replication import Follower, hello
from aaabus.core.store import LOG_DIR
from aaabus.errors import AaabusError, ConfigError, StoreError, WireError
from aaabus.io.replink import ReplicaLink
from aaabus.node.replication import MAX_FRAME

log = logging.getLogger("aaabus.replica")

HANDSHAKE_S = 5.0
#: Connections authenticating at once; more are closed at once.
MAX_HANDSHAKES = 4
REFUSAL_LOG_S = 10.0


class ReplicaServer:
    """Replica ``index`` of server ``server_id`` of ``config``."""

    def __init__(
        self,
        config: BusConfig,
        server_id: int,
        index: int,
        storage: str | os.PathLike[str] | None = None,
    ) -> None:
        spec = config.server(server_id)
        self.spec = spec.replica(index)
        self.server_id = server_id
        self.index = index
        self.name = f"replica {index} of server {server_id}"
        kind = config.setting(server_id, "aaabus.store")
        if kind != "log":
            raise ConfigError(
                f"server {server_id} has replicas but aaabus.store is {kind!r}: only the log "
                "store is replicated; set aaabus.store=log"
            )
        self.segment_size = config.setting(server_id, "aaabus.store.segment_kb") << 10
        keys = load_server_keys(secret_path(config, server_id), server_id, ())
        try:
            self._key = keys.link_key(server_id)
        except KeyError:
            raise ConfigError(
                f"the key file of server {server_id} has no key for its replicas; make it again "
                f"with `aaabus secret --server {server_id} --config a3.xml --out FILE`"
            ) from None
        self.directory = Path(storage) if storage is not None else Path(f"s{server_id}r{index}")
        self.follower: Follower | None = None
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._current: tuple[ReplicaLink, threading.Thread] | None = None
        self._acceptor: threading.Thread | None = None
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        #: Set when the replica stops on its own (its store failed); ``failure`` says why.
        self.stopped = threading.Event()
        self.failure: str | None = None

    def _open(self) -> LogStorage:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return LogStorage(self.directory / LOG_DIR, segment_size=self.segment_size)

    def _wipe(self) -> None:
        shutil.rmtree(self.directory / LOG_DIR)

    def start(self) -> None:
        """Open the store and listen. Raises AaabusError (one line)."""
        self.follower = Follower(self._open, self._wipe)
        try:
            listener = socket.create_server((self.spec.hostname, self.spec.port))
        except OSError as exc:
            self.follower.close()
            raise ConfigError(
                f"{self.name} cannot listen on {self.spec.hostname}:{self.spec.port} "
                f"({exc.strerror or exc}); free the port or fix the <replica> element"
            ) from None
        self._listener = listener
        self._acceptor = threading.Thread(
            target=self._accept, name=f"aaabus-replica-{self.server_id}.{self.index}", daemon=True
        )
        self._acceptor.start()

    def stop(self) -> None:
        self._stop.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        if self._acceptor is not None:
            self._acceptor.join(5.0)
        self._replace(None)
        if self.follower is not None:
            self.follower.close()

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        refused_at = 0.0
        while not self._stop.is_set():
            try:
                sock, peer = listener.accept()
            except OSError:
                return  # closed by stop()
            if not self._handshakes.acquire(blocking=False):
                # Unauthenticated connections hold at most MAX_HANDSHAKES threads, each for at
                # most HANDSHAKE_S: a flood delays its primary's next connection by that, no more.
                sock.close()
                if time.monotonic() - refused_at > REFUSAL_LOG_S:
                    refused_at = time.monotonic()
                    log.warning(
                        "%s: %d handshakes under way; refusing connections (from %s:%s)",
                        self.name,
                        MAX_HANDSHAKES,
                        *peer[:2],
                    )
                continue
            threading.Thread(
                target=self._admit,
                args=(sock, peer),
                name=f"aaabus-replica-{self.server_id}.{self.index}-link",
                daemon=True,
            ).start()

    def _admit(self, sock: socket.socket, peer: tuple[str, int]) -> None:
        """A connection's thread: authenticate it, then (its primary's) serve it."""
        try:
            link = ReplicaLink.answer(
                sock, self._key, self.server_id, MAX_FRAME, time.monotonic() + HANDSHAKE_S
            )
        except (AaabusError, WireError, OSError) as exc:
            log.warning("%s: refused a connection from %s:%s (%s)", self.name, *peer[:2], exc)
            sock.close()
            return
        finally:
            self._handshakes.release()
        if self._replace((link, threading.current_thread())):
            self._serve(link)

    def _replace(self, new: tuple[ReplicaLink, threading.Thread] | None) -> bool:
        """Make ``new`` the connection served (None: none); close the current one and wait for
        its thread, so that one thread at a time owns the store. False (``new`` closed) once
        the replica stops."""
        with self._lock:
            if new is not None and self._stop.is_set():
                new[0].close()
                return False
            old, self._current = self._current, new
        if old is not None:
            old[0].close()
            if old[1].is_alive() and old[1] is not threading.current_thread():
                old[1].join()
        return True

    def _serve(self, link: ReplicaLink) -> None:
        follower = self.follower
        assert follower is not None
        try:
            link.send_many([hello(self.index, follower.position())])
            log.info("%s: primary connected; it has %s", self.name, follower.position().hex())
            acks: list[bytes] = []
            deaf = False
            while True:
                answer = follower.receive(link.receive_bytes())
                if answer is not None:
                    acks.append(answer)
                if acks and not link.buffered():
                    # What was read in one go is applied before it is acknowledged in one
                    # write: an ABORT that followed a commit is applied even if the primary
                    # is gone by the time its acknowledgement would go.
                    if not deaf:
                        try:
                            link.send_many(acks)
                        except OSError:
                            deaf = True  # read on to the end: an ABORT may still be there
                    acks = []
        except StoreError as exc:
            self.failure = str(exc)
            self.stopped.set()
        except (AaabusError, WireError, OSError) as exc:
            if not self._stop.is_set():
                log.warning("%s: primary link lost (%s); waiting for it", self.name, exc)
        finally:
            link.close()
            follower.settle()
