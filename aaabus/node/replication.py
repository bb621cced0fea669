"""A primary's links to its replicas (issue 42): the socket side of :mod:`aaabus.core.replication`.

One thread per other member of the server, ``aaabus-repl-<id>.<index>``, dials the member's
replication address (``<replica hostname port>`` in ``a3.xml``, member 0's
``aaabus.replication.port``), authenticates (:mod:`aaabus.io.replink`), says the epoch it ships
(EPOCH), reads the member's HELLO, has the :class:`~aaabus.core.replication.Shipper` catch it up
(from nothing when the member's last commit is not in this store's history,
:meth:`aaabus.core.epoch.EpochRecord.holds`), and then writes whatever the shipper queues for it,
or a heartbeat when it has written nothing for the heartbeat period. The member's
acknowledgements are read by the commit that waits for them (on the committing thread, which
the acknowledgement then wakes directly: no second thread switch per commit), or by the writer
thread between its writes when nobody waits (:class:`_Acks`). When the connection
ends the member is detached and redialled (backoff from 50 ms to 2 s). A member that answers
NEWER of a voted epoch (it knows a newer primary) ends the shipping: ``on_newer`` is called (on
that link's thread) and the server stops serving. The committing thread only ever queues
(:class:`_Outbox`), never writes a socket: a slow replica never stalls a commit by its socket,
only by the acknowledgements the sync setting waits for.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aaabus.config.reader import Member
from aaabus.core.epoch import read_epoch
from aaabus.core.logstorage import LogStorage
from aaabus.core.logstorage.format import Z64
from aaabus.core.replication import (
    ACK,
    BEAT,
    EPOCH,
    MAX_QUEUED_BYTES,
    NEWER,
    VOTED,
    WIPE,
    Shipper,
    decode_epoch,
    decode_hello,
    decode_tid,
    epoch_message,
)
from aaabus.core.trace import CommitMarks
from aaabus.errors import AaabusError, WireError
from aaabus.io.backoff import Backoff
from aaabus.io.replink import ReplicaLink

log = logging.getLogger("aaabus.replication")

#: Largest replication frame either side takes: a RECORDS message holds at least one whole
#: record, and a record is as large as one object of the store (authenticated peers only).
MAX_FRAME = 1 << 30
DIAL_TIMEOUT_S = 5.0


class _Outbox:
    """The bytes queued for one replica, and who writes them.

    The committing thread wraps its messages (their sequence numbers are taken under the lock,
    in queue order) and, when nothing is queued or being written, writes them itself without
    blocking (``MSG_DONTWAIT``): a commit's records reach the replica without waking a thread.
    What the socket does not take at once is queued for the writer thread
    (``aaabus-repl-<id>.<index>``), which writes with blocking writes. One writer at a time
    (``_writing``), so the bytes reach the socket in sequence order."""

    def __init__(self, link: ReplicaLink) -> None:
        self._link = link
        self._cond = threading.Condition()
        self._items: deque[bytes] = deque()
        self._bytes = 0
        self._writing = False
        #: When bytes last went to the socket (``time.monotonic``): a heartbeat goes only after
        #: ``idle_s`` of nothing, whoever wrote last.
        self._written = time.monotonic()
        self.closed = False

    def put(self, messages: list[bytes], size: int) -> None:
        """Committing thread (or a link thread attaching): never blocks on the socket."""
        with self._cond:
            if self.closed:
                return
            if self._bytes + size > MAX_QUEUED_BYTES:
                # The replica cannot keep up: drop it; it reconnects and catches up from what
                # it has, rather than this server holding its log a second time in memory.
                self.closed = True
                self._cond.notify()
                return
            data = self._link.wrap(messages)
            if self._items or self._writing:
                self._items.append(data)
                self._bytes += len(data)
                self._cond.notify()
                return
            self._writing = True
        try:
            sent = self._link.send_now(data)
        except OSError:
            sent = len(data)  # the link is gone: the writer and the reader find out
            self.close()
        with self._cond:
            self._writing = False
            self._written = time.monotonic()
            if sent < len(data):
                self._items.appendleft(data[sent:])
                self._bytes += len(data) - sent
            if self._items:
                # Only when there is work for the writer: waking it after every commit written
                # here costs a thread switch (and the GIL) per commit for nothing.
                self._cond.notify()

    def write(self, idle_s: float) -> bool:
        """Writer thread: write what is queued (blocking), or a heartbeat when nothing was for
        ``idle_s``; or else wait at most until one would be due and return (the caller reads
        the replica's acknowledgements in between). False once closed."""
        with self._cond:
            if self.closed:
                return False
            if self._writing or not self._items:
                quiet = time.monotonic() - self._written
                if self._writing or self._items or quiet < idle_s:
                    self._cond.wait(idle_s if self._writing else max(idle_s - quiet, 0.0))
                    return not self.closed
                # Nothing written for idle_s, by anyone: a heartbeat (wrapped under the lock
                # like put()'s messages: sequence numbers in order).
                self._items.append(self._link.wrap([BEAT]))
            data = b"".join(self._items)
            self._items.clear()
            self._bytes = 0
            self._writing = True
        try:
            self._link.send_all(data)
        finally:
            with self._cond:
                self._writing = False
                self._written = time.monotonic()
                self._cond.notify()
        return True

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify()


class _Acks:
    """The reading side of one replica's link: its acknowledgements, read by whichever thread
    gets there first -- the commit that waits for them (:meth:`Shipper.wait`, so that the
    acknowledgement wakes that thread itself rather than a reader that would wake it), or the
    writer thread between its writes (acknowledgements nobody waits for: ``sync`` 0, a second
    replica, a catch-up). One reader at a time (``_lock``); a link that fails is marked dead and
    its outbox closed, which ends the writer's loop (the replica is detached and redialled)."""

    def __init__(self, index: int, link: ReplicaLink, shipper: Shipper, outbox: _Outbox) -> None:
        self._index = index
        self._link = link
        self._shipper = shipper
        self._outbox = outbox
        self._lock = threading.Lock()
        self.dead = False
        #: Why the link failed, once it has.
        self.why: BaseException | None = None

    def fileno(self) -> int:
        return self._link.sock.fileno()

    def drain(self) -> None:
        with self._lock:
            if self.dead:
                return
            try:
                for payload in self._link.receive_ready():
                    if payload[:1] != ACK:
                        raise WireError(f"expected an ACK, got {payload[:1]!r}")
                    self._shipper.acked(self._index, decode_tid(payload, 9))
            except (AaabusError, WireError, OSError) as exc:
                self.dead = True
                self.why = exc
                self._outbox.close()


class ReplicationLinks:
    """The links of member ``member`` of server ``server_id``, primary at ``epoch``, to the
    other ``members``; ``key``: the server's link with itself. ``on_newer(epoch, member)``: a
    member refused this epoch for a newer one (called once, on a link thread)."""

    def __init__(
        self,
        server_id: int,
        members: tuple[Member, ...],
        sync: int,
        key: bytes,
        storage: LogStorage,
        *,
        epoch: int = 0,
        member: int = 0,
        heartbeat_s: float = 0.375,
        on_newer: Callable[[int, int], None] | None = None,
        trace_dir: Path | None = None,
    ) -> None:
        self.server_id = server_id
        self._replicas = members
        self._key = key
        self._storage = storage
        self.epoch = epoch
        self.member = member
        self._heartbeat_s = heartbeat_s
        self._on_newer = on_newer
        self.shipper = Shipper(
            server_id, {m.index: f"{m.hostname}:{m.replication_port}" for m in members}, sync
        )
        if trace_dir is not None:
            self.shipper.marks = CommitMarks(
                trace_dir, f"s{server_id}m{member}-primary-{os.getpid()}"
            )
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._links: dict[int, ReplicaLink] = {}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        """Attach to the store (every later vote ships and, with ``sync`` > 0, waits) and start
        dialling the replicas."""
        self._storage.shipper = self.shipper
        for rep in self._replicas:
            thread = threading.Thread(
                target=self._run,
                args=(rep,),
                name=f"aaabus-repl-{self.server_id}.{rep.index}",
                daemon=True,
            )
            self._threads.append(thread)
            thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Any thread: fail a vote that waits (its commit is not acknowledged), close the links,
        join the threads."""
        self._stop.set()
        self.shipper.close()
        self.shipper.quiesce(1.0)
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.close()
        for thread in self._threads:
            thread.join(timeout)
        self._storage.shipper = None
        if self.shipper.marks is not None:
            self.shipper.marks.close()

    def figures(self) -> dict[str, Any]:
        return self.shipper.figures()

    # -- one replica's thread ------------------------------------------------------------------

    def _run(self, rep: Member) -> None:
        backoff = Backoff(0.05, 2.0)
        where = (
            f"{'replica' if rep.index else 'member'} {rep.index} of server {self.server_id} "
            f"({rep.hostname}:{rep.replication_port})"
        )
        told = False
        while not self._stop.is_set():
            try:
                link = ReplicaLink.dial(
                    (rep.hostname, rep.replication_port),
                    self._key,
                    self.server_id,
                    timeout=DIAL_TIMEOUT_S,
                    max_frame=MAX_FRAME,
                )
            except (AaabusError, WireError, OSError) as exc:
                if not told:
                    log.warning("%s: not reachable (%s); dialling it again", where, exc)
                    told = True
                self._stop.wait(backoff.next_delay())
                continue
            with self._lock:
                self._links[rep.index] = link
            try:
                self._serve(rep, link, where)
            except (AaabusError, WireError, OSError) as exc:
                if not self._stop.is_set():
                    log.warning("%s: link lost (%s); dialling it again", where, exc)
            finally:
                self.shipper.detach(rep.index)
                with self._lock:
                    self._links.pop(rep.index, None)
                link.close()
            told = False
            backoff.reset()
            self._stop.wait(backoff.next_delay())

    def _serve(self, rep: Member, link: ReplicaLink, where: str) -> None:
        link.send_many([epoch_message(EPOCH, self.epoch, self.member)])
        greeting = link.receive_bytes()
        if greeting[:1] == NEWER:
            epoch, member, voted = decode_epoch(greeting)
            # Only a voted epoch deposes: a claim is a candidacy that may yet fail.
            if voted == VOTED and epoch > self.epoch and self._on_newer is not None:
                # Nothing more is shipped: the other links stop dialling too.
                self._stop.set()
                self._on_newer(epoch, member)
                return
            raise WireError(f"it refuses epoch {self.epoch} (it knows epoch {epoch})")
        index, epoch, since = decode_hello(greeting)
        if index != rep.index:
            raise WireError(
                f"the process there is member {index}, not {rep.index}: fix its "
                "--replica or the <replica> port"
            )
        if not read_epoch(self._storage).holds(epoch, since, self._storage.lastTransaction()):
            # Its store holds a commit this one never made (another history): copy it whole.
            log.warning(
                "%s: its last commit (%s, epoch %d) is not in this server's history; it starts "
                "again empty",
                where,
                since.hex(),
                epoch,
            )
            link.send_many([WIPE])
            since = Z64
        outbox = _Outbox(link)
        acks = _Acks(rep.index, link, self.shipper, outbox)
        try:
            caught = self.shipper.attach(rep.index, since, self._storage, outbox.put, acks)
            log.info("%s: connected, catching up from %s to %s", where, since.hex(), caught.hex())
            while outbox.write(self._heartbeat_s):
                acks.drain()
            if not self._stop.is_set():
                raise OSError(
                    f"its link ended ({acks.why})"
                    if acks.dead
                    else "the replica fell too far behind, or its link ended"
                )
        finally:
            outbox.close()
            link.close()
