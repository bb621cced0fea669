"""A follower standing for its server's next epoch (issue 42; docs/architecture.md, "Replicas
and failover"): the candidate's side of a takeover.

:meth:`Takeover.stand`, when the primary has been silent for ``aaabus.failover.delay_ms``:

1. the candidate fences itself at epoch E = (the newest epoch it knows) + 1: from now on it
   refuses the replication of older epochs;
2. it fences the other members through their replication ports (FENCE; a follower answers its
   position, a live primary NEWER) and needs the positions of at least R - sync + 1 of the R
   followers, itself included, so that they overlap every set of ``sync`` followers that
   acknowledged the primary's last durable commit; if one of them is ahead of it, or the primary
   answers, it does not stand (another will, or the primary goes on);
3. it asks the voters (the servers that share a domain with its server,
   :func:`aaabus.node.vote.request_vote`) and needs a strict majority of them;
4. it writes epoch E in its store, the first commit of the epoch; the member then serves
   (:mod:`aaabus.node.member`).

Runs on the member's main thread; the questions to members and voters go out in parallel, one
short-lived thread each (``aaabus-ask-<N>.<K>``), within one deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from aaabus.config.reader import BusConfig, Member
from aaabus.config.secret import load_server_keys, secret_path
from aaabus.core.epoch import read_epoch, write_epoch
from aaabus.core.logstorage import LogStorage
from aaabus.core.replication import (
    CLAIM,
    FENCE,
    NEWER,
    RELEASED,
    VOTED,
    WHOIS,
    decode_epoch,
    decode_is,
    decode_position,
    epoch_message,
)
from aaabus.core.store import LOG_DIR
from aaabus.errors import AaabusError, WireError
from aaabus.io.replink import ReplicaLink
from aaabus.node.replica import ReplicaServer
from aaabus.node.replication import MAX_FRAME
from aaabus.node.vote import request_vote, whois

log = logging.getLogger("aaabus.member")

K = TypeVar("K")
V = TypeVar("V")

#: Longest wait for the answers of members and voters to one round of questions.
ASK_S = 2.0


def in_parallel(
    name: str, items: list[K], ask: Callable[[K], V | None], timeout: float
) -> dict[K, V]:
    """``ask(item)`` for every item at once, one thread each; the answers that came within
    ``timeout`` (an item whose ``ask`` returned None or raised AaabusError, WireError, OSError
    is left out)."""
    answers: dict[K, V] = {}
    lock = threading.Lock()

    def one(item: K) -> None:
        try:
            answer = ask(item)
        except (AaabusError, WireError, OSError):
            return
        if answer is not None:
            with lock:
                answers[item] = answer

    threads = [threading.Thread(target=one, args=(i,), name=name, daemon=True) for i in items]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        return dict(answers)


class Takeover:
    """The candidate procedure of member ``index`` of server ``server_id``, whose replication
    port is ``listener``."""

    def __init__(
        self, config: BusConfig, server_id: int, index: int, listener: ReplicaServer
    ) -> None:
        self.config = config
        self.server_id = server_id
        self.index = index
        self.listener = listener
        spec = config.server(server_id)
        self.name = f"server {server_id} member {index}"
        self.others = [m for m in spec.members() if m.index != index]
        self.sync: int = config.setting(server_id, "aaabus.replication.sync")
        self.delay_s = config.setting(server_id, "aaabus.failover.delay_ms") / 1000.0
        self.segment_size = config.setting(server_id, "aaabus.store.segment_kb") << 10
        self.keys = load_server_keys(secret_path(config, server_id), server_id, config.servers)
        mine = set(spec.domains)
        self.voters = sorted(
            sid
            for sid, srv in config.servers.items()
            if sid != server_id and mine.intersection(srv.domains)
        )
        self._told_no_voters = False

    # -- questions ------------------------------------------------------------------------------

    def ask(self, member: Member, question: bytes, timeout: float) -> bytes:
        return ReplicaLink.ask(
            (member.hostname, member.replication_port),
            self.listener.key,
            self.server_id,
            question,
            timeout,
            MAX_FRAME,
        )

    def whois_members(self, timeout: float) -> dict[int, tuple[int, int, bool]]:
        """What the other members answer WHOIS: member -> (epoch, member, says it is primary)."""
        answers = in_parallel(
            f"aaabus-ask-{self.server_id}.{self.index}",
            self.others,
            lambda m: decode_is(self.ask(m, WHOIS, timeout)),
            timeout,
        )
        return {m.index: answer for m, answer in answers.items()}

    def voters_know(self, timeout: float) -> list[tuple[int, int]]:
        """The (epoch, member) each voter that answers knows for this server."""

        def known(voter: int) -> tuple[int, int]:
            deadline = time.monotonic() + timeout
            return whois(self.config, self.keys, voter, self.server_id, deadline)

        name = f"aaabus-ask-{self.server_id}.{self.index}"
        return list(in_parallel(name, self.voters, known, timeout).values())

    # -- the procedure --------------------------------------------------------------------------

    def stand(self) -> int:
        """Stand for the next epoch (the module docstring): that epoch once it is written in
        the store (the store released: the member serves it), 0 when this member does not
        take over (it goes on following)."""
        held = self.listener.store_position()
        if held is None or held[0].epoch == 0:
            return 0  # it never followed a primary: epoch 1 is member 0's, unvoted
        if not self.voters:
            if not self._told_no_voters:
                self._told_no_voters = True
                log.warning(
                    "%s: no other server shares a domain with server %s, so no vote can be "
                    "held (a one-server bus): this member does not take over",
                    self.name,
                    self.server_id,
                )
            return 0
        record = held[0]
        if self._primary_answers(record.member):
            return 0
        if (
            self.listener.silent_for() < self.delay_s
            or self.listener.candidate_for() < self.delay_s
        ):
            return 0  # while it asked: the primary came back, or another member stands
        epoch = self.listener.fence[0] + 1
        if not self.listener.claim(epoch, self.index):
            return 0
        log.warning(
            "%s: nothing from primary member %s (epoch %s) for %.1f s; standing for epoch %s",
            self.name,
            record.member,
            record.epoch,
            self.listener.silent_for(),
            epoch,
        )
        fenced = self._fence_others(epoch, record.member)
        if fenced is None:
            return 0
        # Its store is final now: the old primary is cut and refused, newer ones are not voted.
        held = self.listener.store_position()
        assert held is not None
        record, position = held
        self.listener.release()
        try:
            granted = self._vote(epoch, position)
            if granted * 2 <= len(self.voters):
                log.warning(
                    "%s: %d of %d voters granted epoch %s: not a majority; following again",
                    self.name,
                    granted,
                    len(self.voters),
                    epoch,
                )
                self._conclude(epoch, fenced, RELEASED)
                self.listener.follow()
                return 0
            self._conclude(epoch, fenced, VOTED)
            storage = LogStorage(self.listener.directory / LOG_DIR, segment_size=self.segment_size)
            try:
                record = read_epoch(storage)
                write_epoch(storage, record.next(epoch, self.index, storage.lastTransaction()))
            finally:
                storage.close()
        except BaseException:
            if self.listener.follower is None:
                self.listener.follow()
            raise
        log.warning(
            "%s: voted in by %d of %d voters; serving server %s at epoch %s from %s",
            self.name,
            granted,
            len(self.voters),
            self.server_id,
            epoch,
            position.hex(),
        )
        return epoch

    def _conclude(self, epoch: int, fenced: list[Member], how: int) -> None:
        """Tell itself and the members it fenced how its candidacy for ``epoch`` ended:
        VOTED (the fence stays, for good) or RELEASED (their claims no longer hold)."""
        if how == VOTED:
            self.listener.voted(epoch, self.index)
        else:
            self.listener.released(epoch, self.index)
        question = epoch_message(FENCE, epoch, self.index, how)
        timeout = min(self.delay_s, ASK_S)
        in_parallel(
            f"aaabus-ask-{self.server_id}.{self.index}",
            fenced,
            lambda m: self.ask(m, question, timeout),
            timeout,
        )

    def _primary_answers(self, primary: int) -> bool:
        """Before fencing anyone: whether the primary answers on its replication port that it
        serves (its link to this member alone was silent). A candidacy fences followers, which
        then refuse the primary: no point in it while the primary lives. A paused primary
        does not answer (its kernel accepts the connection, nobody reads it): half the delay
        is all it is given."""
        member = next((m for m in self.others if m.index == primary), None)
        if member is None:
            return False
        try:
            answer = self.ask(member, WHOIS, min(self.delay_s / 2, ASK_S))
            epoch, who, serving = decode_is(answer)
        except (AaabusError, WireError, OSError):
            return False
        if serving:
            log.warning(
                "%s: its link was silent but member %s answers that it serves epoch %s: not "
                "standing",
                self.name,
                who,
                epoch,
            )
        return serving

    def _fence_others(self, epoch: int, primary: int) -> list[Member] | None:
        """Step 2: the followers fenced (enough of them, none ahead), or None (not standing:
        too few answered, one is ahead, a primary is alive or another candidate is at work).
        The old ``primary`` is not asked (it does not count, and a paused one would cost the
        whole deadline)."""
        held = self.listener.store_position()
        assert held is not None
        mine = (held[0].epoch, held[1])
        question = epoch_message(FENCE, epoch, self.index, CLAIM)
        timeout = min(self.delay_s, ASK_S)
        answers = in_parallel(
            f"aaabus-ask-{self.server_id}.{self.index}",
            [m for m in self.others if m.index != primary],
            lambda m: self.ask(m, question, timeout),
            timeout,
        )
        fenced: list[Member] = []
        refused = False
        for member, answer in answers.items():
            if answer[:1] == NEWER:
                known, who, voted = decode_epoch(answer)
                log.warning(
                    "%s: member %s answers that member %s %s epoch %s: not standing",
                    self.name,
                    member.index,
                    who,
                    "serves" if voted == VOTED else "stands for",
                    known,
                )
                refused = True
                continue
            fenced.append(member)
            theirs = decode_position(answer)
            if theirs > mine:
                log.warning(
                    "%s: member %s has more (%s, epoch %s) than this one (%s, epoch %s): not "
                    "standing, it will",
                    self.name,
                    member.index,
                    theirs[1].hex(),
                    theirs[0],
                    mine[1].hex(),
                    mine[0],
                )
                refused = True
        followers = len(self.others)  # every member but the primary, this one included
        needed = followers - max(self.sync, 1) + 1
        if not refused and 1 + len(fenced) < needed:
            log.warning(
                "%s: %d follower(s) answered of the %d needed to be sure none is ahead: not "
                "standing",
                self.name,
                1 + len(fenced),
                needed,
            )
            refused = True
        if refused:
            self._conclude(epoch, fenced, RELEASED)
            return None
        return fenced

    def _vote(self, epoch: int, position: bytes) -> int:
        """Step 3: how many voters granted ``epoch``."""
        timeout = max(self.delay_s, ASK_S)

        def ask(voter: int) -> bool:
            answer = request_vote(
                self.config,
                self.keys,
                voter,
                self.server_id,
                epoch,
                self.index,
                position.hex(),
                time.monotonic() + timeout,
            )
            if not answer.granted:
                log.warning(
                    "%s: voter %s refuses epoch %s (%s)", self.name, voter, epoch, answer.why
                )
            return answer.granted

        answers = in_parallel(
            f"aaabus-vote-{self.server_id}.{self.index}", self.voters, ask, timeout
        )
        return sum(1 for granted in answers.values() if granted)
