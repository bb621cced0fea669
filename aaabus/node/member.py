"""A member of a server that may serve it (issue 42): ``aaabus-server --id N [--replica K]`` with
``aaabus.failover`` on.

Every member runs this, on its own store directory, and is at any moment in one of two roles:

* **follower**: its :class:`~aaabus.node.replica.ReplicaServer` holds the store and follows the
  primary that ships to it; the MQTT standby responder (:class:`aaabus.mqtt.standby.Standby`)
  answers devices on the server's MQTT port, on this member's hostname, with the primary's
  address. When no primary has said anything for ``aaabus.failover.delay_ms`` (it sends a
  heartbeat when idle), the member stands for the next epoch (:mod:`aaabus.node.takeover`);
  voted in, it becomes primary.
* **primary**: it runs the whole server (:class:`~aaabus.node.server.AgentServer`) on its store,
  on its own hostname (:meth:`BusConfig.as_member`), shipping to the other members. Told of a
  newer epoch (a member it ships to refuses it, a newer primary dials it), the server stops
  acknowledging at once (:meth:`AgentServer.step_down`), stops, and the member follows again,
  in the same process: the store is closed by the server and opened again by the follower; the
  new primary, finding the member's last commit outside its history, has it start empty.

At boot a member asks the others which of them is primary (WHOIS on their replication ports)
and follows one that says so at an epoch at least its store's; otherwise member 0 on a store
without an epoch starts epoch 1 (no vote: the configuration designates it), and a member whose
store says it was the last primary serves again at that epoch (its peers and followers refuse it
if a newer one was voted meanwhile); any other member follows, and stands when nobody ships.

Threads: the process's main thread runs :meth:`MemberProcess.run` (the roles, the takeover);
``serving`` and ``on_newer`` are called on the replication port's connection threads and only
read or hand over (:meth:`AgentServer.step_down` starts the stop on a thread of its own).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aaabus.config.reader import BusConfig
from aaabus.errors import AaabusError, ReplicationStopped
from aaabus.node.replica import ReplicaServer, member_directory
from aaabus.node.server import AgentServer
from aaabus.node.takeover import ASK_S, Takeover

if TYPE_CHECKING:
    from aaabus.mqtt.standby import Standby

log = logging.getLogger("aaabus.member")

#: How often the main thread looks at its follower's silence and at the stop request.
TICK_S = 0.05


class MemberProcess:
    """Member ``index`` of server ``server_id``; ``storage``: its directory (default
    ``s<N>`` / ``s<N>r<K>``); ``stop``: set to end it (SIGTERM); ``ready``: called once, when
    the member has taken its first role (the process prints its ready line)."""

    def __init__(
        self,
        config: BusConfig,
        server_id: int,
        index: int,
        storage: str | None,
        stop: threading.Event,
        ready: Callable[[], None],
    ) -> None:
        self.config = config
        self.server_id = server_id
        self.index = index
        self.spec = config.server(server_id)
        self.me = self.spec.member(index)
        self.directory = storage if storage is not None else str(member_directory(server_id, index))
        self.delay_s = config.setting(server_id, "aaabus.failover.delay_ms") / 1000.0
        self._stop = stop
        self._ready = ready
        self.listener = ReplicaServer(
            config,
            server_id,
            index,
            self.directory,
            serving=self._serving,
            on_newer=self._on_newer,
        )
        self.takeover = Takeover(config, server_id, index, self.listener)
        #: The server while this member is primary (set and cleared by the main thread).
        self.server: AgentServer | None = None
        #: (epoch, member) while this member is primary and serving (read by any thread).
        self._serving_as: tuple[int, int] | None = None
        self._standby: Standby | None = None
        self._announced = False
        self.failure: str | None = None

    # -- hooks of the replication port (its connection threads) --------------------------------

    def _serving(self) -> tuple[int, int] | None:
        return self._serving_as

    def _on_newer(self, epoch: int, member: int) -> None:
        server = self.server
        if server is not None:
            server.step_down(epoch, member)

    def interrupt(self) -> None:
        """Any thread (a signal handler): a start waiting for replicas that are gone ends."""
        server = self.server
        if server is not None:
            server.interrupt()

    # -- the main thread -----------------------------------------------------------------------

    def run(self) -> int:
        """Serve or follow until ``stop``; 0, or 1 when the store failed (``failure``).
        Raises AaabusError (one line) when the member cannot start at all."""
        self.listener.start()
        try:
            # The role: serve at that epoch (> 0), follow (0), or end (None).
            role: int | None = self._boot_role()
            if not role:
                self._start_standby()
            while role is not None and not self._stop.is_set():
                role = self._serve(role) if role else self._follow()
        finally:
            self._stop_standby()
            self.listener.stop()
        if self.failure is None and self.listener.failure is not None:
            self.failure = self.listener.failure
        return 0 if self.failure is None else 1

    def _announce(self) -> None:
        if not self._announced:
            self._announced = True
            self._ready()

    def _boot_role(self) -> int:
        """The epoch this member starts serving at, or 0: it follows (the module docstring)."""
        held = self.listener.store_position()
        assert held is not None
        record = held[0]
        fence = self.listener.fence
        timeout = min(self.delay_s, ASK_S)
        # What the other members and the voters know: (epoch, member, whether it serves).
        known = [
            (epoch, who, primary and who == member)
            for member, (epoch, who, primary) in self.takeover.whois_members(timeout).items()
        ]
        known += [(epoch, who, False) for epoch, who in self.takeover.voters_know(timeout)]
        for epoch, who, serves in known:
            # A newer epoch than its store's: this store is behind, or empty (a wiped disk):
            # serving it would lose what the others hold. At its own epoch: another serves it.
            if epoch > record.epoch or (serves and epoch == record.epoch):
                log.warning(
                    "server %s member %s: epoch %s of member %s is known (%s), its store is at "
                    "epoch %s: it follows",
                    self.server_id,
                    self.index,
                    epoch,
                    who,
                    "it serves" if serves else "by a member or a voter",
                    record.epoch,
                )
                return 0
        if fence[0] > record.epoch:
            return 0  # a primary of a newer epoch, or a candidate, reached it
        if record.epoch == 0:
            return 1 if self.index == 0 else 0
        return record.epoch if record.member == self.index else 0

    def _follow(self) -> int | None:
        """Follow until this member should serve (the epoch it was voted) or stop (None)."""
        self._announce()
        ticked = time.monotonic()
        # Followers that all hear the primary fall silent at once would stand at once, fence
        # each other and split the votes: each waits a little more, at random.
        wait = self.delay_s * random.uniform(1.0, 1.25)
        # Read once: a setting's lookup costs tens of µs of the GIL, every tick, taken from the
        # link thread that applies the primary's commits.
        may_stand = self.config.failover(self.server_id)
        while not self._stop.is_set():
            if self.listener.stopped.is_set():
                return None
            now = time.monotonic()
            if now - ticked > self.delay_s / 2:
                # This process was paused (SIGSTOP, a VM pause, swapping): whatever its primary
                # sent meanwhile is unread, so its silence is unknown, not long.
                self.listener.heard_now()
            ticked = now
            if (
                may_stand
                and self.listener.silent_for() >= wait
                # Another member stands (it fenced this one): its vote decides first.
                and self.listener.candidate_for() >= self.delay_s
            ):
                epoch = self.takeover.stand()
                if epoch:
                    return epoch
                # Not voted (or not allowed to stand): the primary may be back meanwhile.
                self._stop.wait(self.delay_s * random.uniform(0.5, 1.5))
                wait = self.delay_s * random.uniform(1.0, 1.25)
                ticked = time.monotonic()
                continue
            self._stop.wait(TICK_S)
        return None

    def _serve(self, epoch: int) -> int | None:
        """Serve as primary at ``epoch`` until stopped (None) or deposed (0: follow)."""
        self._stop_standby()
        self.listener.release()
        # Said before the boot: a member asking who serves must not take it for a follower
        # while its boot commit waits for that very member to follow.
        self._serving_as = (epoch, self.index)
        server = AgentServer(
            self.config.as_member(self.server_id, self.index),
            self.server_id,
            storage=self.directory,
            endpoints=True,
            member=self.index,
            members=self.spec.members(),
        )
        self.server = server
        try:
            server.start()
        except ReplicationStopped as exc:
            # Deposed during its boot (the boot commit waited for members that refuse it).
            self.server = None
            self._serving_as = None
            if server.deposed is None:
                self.failure = str(exc)
                return None
            return self._rejoin()
        except AaabusError:
            self.server = None
            self._serving_as = None
            raise
        self._announce()
        while not self._stop.is_set() and not server.stopped.is_set():
            self._stop.wait(0.2)
        self._serving_as = None
        failure = server.failure
        deposed = server.deposed
        try:
            server.stop()
        finally:
            self.server = None
        if deposed is not None:
            return self._rejoin()
        if failure is not None and not isinstance(failure, ReplicationStopped):
            self.failure = f"server {self.server_id} stopped: {failure}"
        return None

    def _rejoin(self) -> int:
        """After serving: follow (the store again in the follower's hands)."""
        self.listener.follow()
        self._start_standby()
        return 0

    # -- the MQTT standby responder --------------------------------------------------------------

    def _start_standby(self) -> None:
        port: int | None = self.config.setting(self.server_id, "aaabus.mqtt.port")
        if port is None or self._standby is not None:
            return
        from aaabus.mqtt.standby import Standby

        host: str = self.config.as_member(self.server_id, self.index).setting(
            self.server_id, "aaabus.mqtt.host"
        )
        # Imported by the members that answer devices only, like the listener.
        self._standby = Standby(host, port, self._primary_mqtt).start()

    def _primary_mqtt(self) -> tuple[str, int] | None:
        """Where the primary's MQTT listener is, as far as this member knows (the standby's
        loop thread: reads what the replication port's threads set)."""
        following = self.listener.following()
        port: int | None = self.config.setting(self.server_id, "aaabus.mqtt.port")
        if following is None or port is None:
            return None
        host: str = self.config.as_member(self.server_id, following[1]).setting(
            self.server_id, "aaabus.mqtt.host"
        )
        return host, port

    def _stop_standby(self) -> None:
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.stop()
