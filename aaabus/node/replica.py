"""A member of a server on its replication port (issue 42): ``aaabus-server --id N --replica K``.

It listens on its replication address (a ``<replica>``'s ``hostname:port``, member 0's
``aaabus.replication.port``) for connections proving N's key of its link with itself
(:mod:`aaabus.io.replink`). Their first message says what they are:

* **EPOCH**: a primary that ships. While this member follows (it is not primary itself), a
  primary of an epoch older than its *fence* is refused with NEWER; otherwise the member says which
  commit it has last and of which epoch (HELLO) and applies what the primary ships
  (:class:`aaabus.core.replication.Follower`) to its own log store in ``--storage`` (default
  ``./s<N>r<K>``, member 0 ``./s<N>``), which is laid out as server N's store (``log/``): stopped,
  it opens as server N's store with everything the primary had acknowledged. It acknowledges a
  commit once it is on its disk, and nothing of an epoch older than its fence. While this member
  is primary (``serving``), a newer epoch makes it stop serving (``on_newer``) and an older one
  is refused.
* **FENCE** (a candidate, failover): a *claim* raises the fence to the candidate's epoch for
  :data:`CLAIM_S` (unless another claim or a newer epoch holds it: NEWER) and the member answers
  its position (POSITION); the candidate then says whether it was voted in (the epoch is then
  *voted*: kept in the file ``fence`` beside the store, so that a restart keeps it) or lost
  (the claim is released). A primary answers NEWER (it is alive) and stays.

The fence is the newest epoch this member knows: voted (its store's, a primary's that shipped to
it, a candidate's that won) or claimed by a candidacy under way. A claim expires, so that a
candidate that dies half-way does not keep the live primary out for ever; a winner that reaches
a follower only after its claim expired may find it acknowledging the old primary meanwhile,
which a primary that lost its voters' links (they refuse its epoch) rarely still is.
* **WHOIS**: the member answers IS: itself at its epoch if it is primary, else its fence.
* **FENCE, how BALLOT** (a server that shares no domain with another: its members are its
  voters): the member applies the voters' grant rule (:meth:`ballot`, with
  :meth:`aaabus.node.epochs.EpochBook.grant` on the book ``epochs`` in its own store directory)
  and answers FENCE how VOTED (granted) or RELEASED (refused); a primary answers NEWER. A grant
  is a fence of its own, kept across restarts: from then on the member refuses primaries below
  the granted epoch, even if that candidate loses (docs/architecture.md, "the lone server").

One primary connection at a time: a newer one (a primary that restarted) replaces the current
one. :meth:`release` closes the store (the member is about to serve it), :meth:`follow` opens it
again.

Threads: ``aaabus-replica-<N>.<K>`` accepts; one ``aaabus-replica-<N>.<K>-link`` thread per
connection authenticates it (5 s deadline, at most 4 at once: more are closed) and answers it
or, for its primary, serves it, owning the store while it does (a newer one closes it and waits
for it). The fence and the figures are under one lock; ``serving`` and ``on_newer`` are called
on a connection's thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from aaabus.config.reader import BusConfig
from aaabus.config.secret import load_server_keys, secret_path
from aaabus.core.epoch import EpochRecord
from aaabus.core.logstorage import LogStorage
from aaabus.core.replication import (
    BALLOT,
    BEAT,
    COMMIT,
    EPOCH,
    FENCE,
    NEWER,
    RELEASED,
    VOTED,
    WHOIS,
    Follower,
    decode_epoch,
    epoch_message,
    hello,
    is_message,
    position_message,
)
from aaabus.core.store import LOG_DIR
from aaabus.core.trace import CommitMarks
from aaabus.errors import AaabusError, ConfigError, StoreError, WireError
from aaabus.io.replink import ReplicaLink
from aaabus.node.epochs import EpochBook, VoteAnswer
from aaabus.node.replication import MAX_FRAME

log = logging.getLogger("aaabus.replica")

HANDSHAKE_S = 5.0
#: Connections authenticating at once; more are closed at once.
MAX_HANDSHAKES = 4
REFUSAL_LOG_S = 10.0
#: The file beside the store that keeps the fence across restarts.
FENCE_FILE = "fence"
#: How long a candidacy's claim holds a member's fence (s, plus twice the failover delay): the
#: candidate's whole procedure takes less (:mod:`aaabus.node.takeover`).
CLAIM_S = 5.0


def member_directory(server_id: int, index: int) -> Path:
    """A member's default store directory: ``s<N>`` for member 0, ``s<N>r<K>`` for replica K."""
    return Path(f"s{server_id}" if index == 0 else f"s{server_id}r{index}")


class ReplicaServer:
    """Member ``index`` of server ``server_id`` of ``config`` on its replication port.

    ``serving()``: (epoch, member) while this member is primary, else None; ``on_newer(epoch,
    member)``: a primary of a newer epoch reached this member while it served."""

    def __init__(
        self,
        config: BusConfig,
        server_id: int,
        index: int,
        storage: str | os.PathLike[str] | None = None,
        *,
        serving: Callable[[], tuple[int, int] | None] = lambda: None,
        on_newer: Callable[[int, int], None] = lambda epoch, member: None,
    ) -> None:
        spec = config.server(server_id)
        self.spec = spec.member(index)
        self.server_id = server_id
        self.index = index
        self.name = f"{'replica' if index else 'member'} {index} of server {server_id}"
        kind = config.setting(server_id, "aaabus.store")
        if kind != "log":
            raise ConfigError(
                f"server {server_id} has replicas but aaabus.store is {kind!r}: only the log "
                "store is replicated; set aaabus.store=log"
            )
        self.segment_size = config.setting(server_id, "aaabus.store.segment_kb") << 10
        keys = load_server_keys(secret_path(config, server_id), server_id, ())
        try:
            self.key = keys.link_key(server_id)
        except KeyError:
            raise ConfigError(
                f"the key file of server {server_id} has no key for its replicas; make it again "
                f"with `aaabus secret --server {server_id} --config a3.xml --out FILE`"
            ) from None
        self.directory = (
            Path(storage) if storage is not None else member_directory(server_id, index)
        )
        self._serving = serving
        self._on_newer = on_newer
        self.follower: Follower | None = None
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._current: tuple[ReplicaLink, threading.Thread] | None = None
        self._acceptor: threading.Thread | None = None
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        #: The newest voted (epoch, member) this member knows of (under the lock).
        self._voted = (0, 0)
        #: A candidacy's (epoch, member, until ``time.monotonic()``), newer than ``_voted``.
        self._claim: tuple[int, int, float] | None = None
        self.delay_s = config.setting(server_id, "aaabus.failover.delay_ms") / 1e3
        #: Whether its members vote on its takeover (no other server shares a domain with it).
        self.lone = not config.voters(server_id)
        self._claim_s = CLAIM_S + 2 * self.delay_s
        #: The newest ballot this member granted (epoch, member), from its book (under the lock).
        self._granted = (0, 0)
        #: One ballot at a time reads and rewrites the book.
        self._ballot_lock = threading.Lock()
        #: (epoch, member) of the primary followed now (under the lock), None when none.
        self._following: tuple[int, int] | None = None
        #: When a primary last said something (``time.monotonic()``): boot counts as that.
        self._heard = time.monotonic()
        #: When another member last raised the fence (a candidate at work), or -inf.
        self._fenced_at = float("-inf")
        #: Set when the replica stops on its own (its store failed); ``failure`` says why.
        #: Heartbeats read from its primaries (written by the link thread that serves one).
        self.beats = 0
        self.stopped = threading.Event()
        self.failure: str | None = None
        trace_dir = config.directory(server_id, "aaabus.trace")
        #: This member's marks of the commits it applies (``aaabus.trace``; perf's breakdown).
        self.marks = (
            None
            if trace_dir is None
            else CommitMarks(trace_dir, f"s{server_id}m{index}-replica-{os.getpid()}")
        )

    def _open(self) -> LogStorage:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        return LogStorage(self.directory / LOG_DIR, segment_size=self.segment_size)

    def _wipe(self) -> None:
        shutil.rmtree(self.directory / LOG_DIR)

    def start(self) -> None:
        """Open the store and listen. Raises AaabusError (one line)."""
        self._voted = self._read_fence()
        self._granted = EpochBook(self.directory).granted(self.server_id) or (0, 0)
        self.follow()
        try:
            listener = socket.create_server((self.spec.hostname, self.spec.replication_port))
        except OSError as exc:
            self.release()
            raise ConfigError(
                f"{self.name} cannot listen on {self.spec.hostname}:{self.spec.replication_port} "
                f"({exc.strerror or exc}); free the port or fix the <replica> element "
                "(member 0: aaabus.replication.port)"
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
        self.release()
        if self.marks is not None:
            self.marks.close()

    # -- the member's roles (the member process's thread) --------------------------------------

    def follow(self) -> None:
        """Open the store and follow whichever primary connects (StoreError if it fails)."""
        follower = Follower(self._open, self._wipe)
        with self._lock:
            self.follower = follower
            self._heard = time.monotonic()
            held = follower.epoch()
            if held.epoch > self._voted[0]:
                self._voted = (held.epoch, held.member)

    def release(self) -> None:
        """Stop following: close the primary's connection (waiting for its thread) and the
        store, which the member may then serve."""
        self._replace(None)
        with self._lock:
            follower, self.follower = self.follower, None
            if follower is not None:
                follower.close()

    def _fence_now(self) -> tuple[int, int, bool]:
        """Under the lock: (epoch, member, voted) of the fence: the voted epoch, or a newer one
        this member granted (not voted: a grant does not depose a primary), or a newer claim."""
        fence = (*self._voted, True)
        if self._granted[0] > fence[0]:
            fence = (*self._granted, False)
        claim = self._claim
        if claim is not None and claim[2] > time.monotonic() and claim[0] > fence[0]:
            return claim[0], claim[1], False
        return fence

    @property
    def fence(self) -> tuple[int, int, bool]:
        """(epoch, member, voted) of the newest epoch this member knows."""
        with self._lock:
            return self._fence_now()

    def claim(self, epoch: int, member: int) -> bool:
        """A candidacy of ``member`` for ``epoch``: refuse older epochs for a while (the primary
        followed now is cut if older). False when the fence is already at ``epoch`` or newer
        for another reason (another candidacy, a voted epoch)."""
        with self._lock:
            fence = self._fence_now()
            if epoch < fence[0] or (epoch == fence[0] and fence[1:] != (member, False)):
                return False
            self._claim = (epoch, member, time.monotonic() + self._claim_s)
            if member != self.index:
                self._fenced_at = time.monotonic()
        self._cut_older(epoch)
        return True

    def voted(self, epoch: int, member: int) -> None:
        """``epoch`` is ``member``'s, voted: refuse older ones from now on, across restarts."""
        with self._lock:
            if epoch > self._voted[0] or (epoch == self._voted[0] and member != self._voted[1]):
                self._voted = (epoch, member)
                self._write_fence()
            if self._claim is not None and self._claim[0] <= epoch:
                self._claim = None
        self._cut_older(epoch)

    def released(self, epoch: int, member: int) -> None:
        """The candidacy of ``member`` for ``epoch`` failed: its claim no longer holds."""
        with self._lock:
            if self._claim is not None and self._claim[:2] == (epoch, member):
                self._claim = None

    def ballot(self, epoch: int, member: int) -> VoteAnswer:
        """The vote of this member on ``member``'s candidacy for ``epoch`` (a server sharing no
        domain: its members vote), by the voters' rule (:meth:`EpochBook.grant`): not above the
        epoch known, or the primary heard within the delay (or this member started within it),
        is refused; a grant is persisted before this returns, and from then on primaries below
        ``epoch`` are refused (the one followed now is cut). Any thread: a connection's, or the
        candidate's own for itself. Raises StoreError (one line) when the book fails.

        The book is read afresh for each ballot: while this member served, its server kept the
        same file (the epochs it knows of its peers)."""
        with self._ballot_lock:
            book = EpochBook(self.directory)
            with self._lock:
                voted = self._voted
                silent = time.monotonic() - self._heard
            if voted[0] >= 1:
                book.raise_to(self.server_id, *voted)  # what its store holds is known
            answer = book.grant(self.server_id, epoch, member, silent, self.delay_s)
            if not answer.granted:
                return answer
            with self._lock:
                if epoch > self._granted[0]:
                    self._granted = (epoch, member)
        self._cut_older(epoch)
        return answer

    def _cut_older(self, epoch: int) -> None:
        with self._lock:
            current = self._current
            cut = self._following is not None and self._following[0] < epoch
        if cut and current is not None:
            current[0].close()

    def store_position(self) -> tuple[EpochRecord, bytes] | None:
        """The store's epoch record and last tid (a voted commit included); None when this
        member does not hold its store (it serves it)."""
        with self._lock:
            follower = self.follower
            if follower is None:
                return None
            return follower.epoch(), follower.position()

    def following(self) -> tuple[int, int] | None:
        """(epoch, member) of the primary followed now, if one is."""
        with self._lock:
            return self._following

    def heard_now(self) -> None:
        """Count the primary as heard now (a member that was itself paused cannot tell how long
        its primary was silent: what the primary sent meanwhile waits unread in its socket)."""
        with self._lock:
            self._heard = time.monotonic()

    def candidate_for(self) -> float:
        """Seconds since another member last raised this member's fence (a candidacy under
        way, or a new primary), ``inf`` if none did since boot."""
        with self._lock:
            return time.monotonic() - self._fenced_at

    def silent_for(self) -> float:
        """Seconds since a primary last said something here (or since boot)."""
        with self._lock:
            return time.monotonic() - self._heard

    def _read_fence(self) -> tuple[int, int]:
        try:
            raw = json.loads((self.directory / FENCE_FILE).read_text())
            return int(raw["epoch"]), int(raw["member"])
        except FileNotFoundError:
            return (0, 0)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise StoreError(
                f"{self.name}: {self.directory / FENCE_FILE} is unreadable ({exc}); delete it "
                "if the store's epoch is the newest this member knows"
            ) from None

    def _write_fence(self) -> None:
        """Under the lock: the fence file, replaced atomically and synced before it counts."""
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        path = self.directory / FENCE_FILE
        temp = path.with_suffix(".tmp")
        data = json.dumps({"epoch": self._voted[0], "member": self._voted[1]}).encode()
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)

    # -- connections ---------------------------------------------------------------------------

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
        """A connection's thread: authenticate it, read what it is, answer or serve it."""
        try:
            deadline = time.monotonic() + HANDSHAKE_S
            link = ReplicaLink.answer(sock, self.key, self.server_id, MAX_FRAME, deadline)
            first = link.receive_within(max(0.0, deadline - time.monotonic()))
        except (AaabusError, WireError, OSError) as exc:
            log.warning("%s: refused a connection from %s:%s (%s)", self.name, *peer[:2], exc)
            sock.close()
            return
        finally:
            self._handshakes.release()
        try:
            kind = first[:1]
            if kind == EPOCH:
                self._primary(link, *decode_epoch(first)[:2])
            elif kind == FENCE:
                self._fenced(link, *decode_epoch(first))
            elif kind == WHOIS:
                self._whois(link)
            else:
                raise WireError(f"unexpected first message {kind!r}")
        except (AaabusError, WireError, OSError) as exc:
            log.warning("%s: connection from %s:%s ended (%s)", self.name, *peer[:2], exc)
        finally:
            link.close()

    def _primary(self, link: ReplicaLink, epoch: int, member: int) -> None:
        serving = self._serving()
        if serving is not None:
            if epoch > serving[0]:
                self._on_newer(epoch, member)  # it redials and finds a follower
            else:
                link.send_many([epoch_message(NEWER, *serving, VOTED)])
            return
        with self._lock:
            fence = self._fence_now()
            holding = self.follower is not None
        if not holding:
            return  # between roles: it redials
        # An epoch is held by one member only (voted once, or epoch 1 by member 0): any primary
        # of the newest epoch known is that epoch's, even if this member stood for it too.
        if epoch < fence[0]:
            log.warning(
                "%s: refused member %s as primary at epoch %s: epoch %s of member %s is %s",
                self.name,
                member,
                epoch,
                fence[0],
                fence[1],
                "newer" if fence[2] else "claimed by a candidate",
            )
            link.send_many([epoch_message(NEWER, fence[0], fence[1], int(fence[2]))])
            return
        self.voted(epoch, member)
        if self._replace((link, threading.current_thread())):
            self._serve(link, epoch, member)

    def _fenced(self, link: ReplicaLink, epoch: int, member: int, how: int) -> None:
        serving = self._serving()
        if serving is not None:
            # Alive: the candidate backs off.
            link.send_many([epoch_message(NEWER, *serving, VOTED)])
            return
        if how == BALLOT:
            answer = (
                self.ballot(epoch, member)
                if self.lone
                else VoteAnswer(False, *self.fence[:2], "its voters are servers, not members")
            )
            if not answer.granted:
                log.warning(
                    "%s: refused member %s's ballot for epoch %s (%s)",
                    self.name,
                    member,
                    epoch,
                    answer.why,
                )
            how = VOTED if answer.granted else RELEASED
            link.send_many([epoch_message(FENCE, answer.epoch, answer.member, how)])
            return
        if how == VOTED:
            self.voted(epoch, member)
        elif how == RELEASED:
            self.released(epoch, member)
        elif not self.claim(epoch, member):
            fence = self.fence
            link.send_many([epoch_message(NEWER, fence[0], fence[1], int(fence[2]))])
            return
        else:
            log.warning(
                "%s: member %s stands for epoch %s; older epochs are refused meanwhile",
                self.name,
                member,
                epoch,
            )
        held = self.store_position()
        if held is not None:
            link.send_many([position_message(held[0].epoch, held[1])])

    def _whois(self, link: ReplicaLink) -> None:
        serving = self._serving()
        if serving is not None:
            link.send_many([is_message(*serving, True)])
        else:
            link.send_many([is_message(*self.fence[:2], False)])

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

    def _serve(self, link: ReplicaLink, epoch: int, member: int) -> None:
        with self._lock:
            follower = self.follower
            if follower is None:
                return
            self._following = (epoch, member)
            self._heard = time.monotonic()
        try:
            mine = follower.epoch().epoch
            link.send_many([hello(self.index, mine, follower.position())])
            log.info(
                "%s: member %s is primary at epoch %s; this one has %s (epoch %s)",
                self.name,
                member,
                epoch,
                follower.position().hex(),
                mine,
            )
            acks: list[bytes] = []
            deaf = False
            marks = self.marks
            # With marks: the last commit applied and not yet acknowledged, and its times.
            marked: tuple[bytes, dict[str, int]] | None = None
            while True:
                payload = link.receive_bytes()
                received = 0 if marks is None else time.perf_counter_ns()
                with self._lock:
                    self._heard = time.monotonic()
                    fenced = self._fence_now()[0] > epoch
                if fenced:
                    # Fenced (the link is being cut, which is what stops the acknowledgements):
                    # nothing more of this epoch is applied either, so that the position this
                    # member gave the candidate stays its own.
                    raise OSError(f"fenced at epoch {self.fence[0]}")
                # A heartbeat only says the primary lives (but may end a read whose
                # acknowledgements are still to be sent).
                if payload == BEAT:
                    self.beats += 1
                    answer = None
                else:
                    answer = follower.receive(payload)
                if answer is not None:
                    acks.append(answer)
                    if marks is not None and payload[:1] == COMMIT:
                        marked = _marked(answer[1:], received, follower.storage.last_vote_ns)
                if acks and not link.buffered():
                    # What was read in one go is applied before it is acknowledged in one
                    # write: an ABORT that followed a commit is applied even if the primary
                    # is gone by the time its acknowledgement would go.
                    if marks is not None and marked is not None:
                        # Before the write: the primary may read the acknowledgement before
                        # this thread runs again, and its mark must come later.
                        marked[1]["acked"] = time.perf_counter_ns()
                    if not deaf:
                        try:
                            link.send_many(acks)
                        except OSError:
                            deaf = True  # read on to the end: an ABORT may still be there
                    if marks is not None and marked is not None:
                        marks.write("replica", *marked)
                        marked = None
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
            with self._lock:
                self._following = None


def _marked(
    tid: bytes, received: int, vote_ns: tuple[int, int, int] | None
) -> tuple[bytes, dict[str, int]] | None:
    """A replica's marks of commit ``tid`` (see :data:`aaabus.core.trace.REPLICA_STAGES`)."""
    if vote_ns is None:
        return None
    voting, written, synced = vote_ns
    return tid, {"received": received, "voting": voting, "written": written, "synced": synced}
