"""Ping-pong agents: the report's measurement protocol.

A :class:`PingDriver` on server 0 sends a :class:`Ball` to responders and measures, round after
round, the time until every responder's ball has come back (local: one responder on the driver's
server; remote: one on the highest-numbered server; broadcast: one on every server). Each
:class:`Pong` sends the ball straight back.

Each ball carries the driver's clock reading at the moment it was sent (``sent_ns``, 8 bytes):
the round trip is measured when the ball is back on the same process, and nothing needs to survive
in the driver between rounds. The collected timings are kept in volatile attributes (``_v_*``,
never persisted): writing a growing list at every commit would make the measurement measure
itself. ZODB may drop volatile attributes whenever it turns an object into a ghost (after an
aborted group, for instance); the driver then starts collecting again and reports the rounds it
actually timed.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aaabus import Agent, AgentCreateReply, AgentId, BootContext, Notification, PersistentList


@dataclass
class Ball(Notification):
    round: int
    payload: bytes = b""
    #: time.perf_counter_ns() on the driver's process when the round started.
    sent_ns: int = 0


class Pong(Agent):
    """Sends every ball straight back to its sender."""

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, Ball):
            self.send_to(sender, note)
        else:
            super().react(sender, note)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_values:
        return float("nan")
    rank = max(0, min(len(sorted_values) - 1, round(q / 100.0 * len(sorted_values) + 0.5) - 1))
    return sorted_values[rank]


def summarise(rtts_ns: list[int]) -> dict[str, float]:
    ms = sorted(v / 1e6 for v in rtts_ns)
    return {
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
        "mean": statistics.fmean(ms) if ms else float("nan"),
        "min": ms[0] if ms else float("nan"),
        "max": ms[-1] if ms else float("nan"),
    }


class PingDriver(Agent):
    """Runs ``rounds`` measured rounds (after ``warmup`` unmeasured ones) and writes the result.

    The result is written as JSON to ``out`` (atomically, by rename) when the last round is in.
    """

    def __init__(
        self,
        *,
        test: str,
        rounds: int,
        responders: list[int],
        out: str,
        payload: int = 0,
        warmup: int = 50,
        then: list[dict[str, Any]] | None = None,
    ) -> None:
        super().__init__(name=f"ping-{test}")
        #: Tests to run after this one, each by a new driver (a sweep point runs several).
        self.then = list(then or [])
        self.test = test
        self.rounds = rounds
        self.warmup = warmup
        self.payload = payload
        self.out = out
        self.servers = list(responders)
        self.pongs: PersistentList = PersistentList()
        self.round = -1
        self.pending = 0
        self.finished = False

    def on_init(self, first_time: bool) -> None:
        if first_time:
            for server in self.servers:
                Pong(name="pong").deploy(server, reply=True)

    def react(self, sender: AgentId, note: Notification) -> None:
        if isinstance(note, AgentCreateReply):
            if not note.ok:
                raise RuntimeError(f"responder creation failed: {note.error}")
            self.pongs.append(note.agent_id)
            if len(self.pongs) == len(self.servers):
                self._v_rtts: list[int] = []
                self._start_window()
                self._next_round()
        elif isinstance(note, Ball):
            if note.round != self.round:
                raise RuntimeError(f"ball of round {note.round} during round {self.round}")
            self.pending -= 1
            if self.pending == 0:
                now = time.perf_counter_ns()
                rtts = getattr(self, "_v_rtts", None)
                if rtts is None:  # the server restarted mid-run: timings are meaningless now
                    rtts = self._v_rtts = []
                    self._v_wall0 = now
                if self.round >= self.warmup:
                    rtts.append(now - note.sent_ns)
                if self.round + 1 < self.warmup + self.rounds:
                    self._next_round()
                else:
                    self.finished = True
                    self._write_result(rtts, now)
                    if self.then:
                        PingDriver(**self.then[0], then=self.then[1:]).deploy()
        else:
            super().react(sender, note)

    def _next_round(self) -> None:
        self.round += 1
        self.pending = len(self.pongs)
        if self.round == self.warmup:
            self._start_window()
        ball = Ball(self.round, b"x" * self.payload, time.perf_counter_ns())
        for pong in self.pongs:
            self.send_to(pong, ball)

    def _start_window(self) -> None:
        """The measured rounds start: their wall-clock window and this process's CPU time."""
        self._v_wall0 = time.perf_counter_ns()
        self._v_epoch0 = time.time_ns()
        self._v_cpu0 = resource.getrusage(resource.RUSAGE_SELF)

    def _write_result(self, rtts: list[int], now: int) -> None:
        wall_ms = (now - getattr(self, "_v_wall0", now)) / 1e6
        cpu0 = getattr(self, "_v_cpu0", None)
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)  # µs-grained, unlike os.times()
        rounds = max(1, len(rtts))
        result: dict[str, Any] = {
            "test": self.test,
            "rounds": len(rtts),
            "payload": self.payload,
            "responders": len(self.pongs),
            "rtt_ms": summarise(rtts),
            "wall_ms_per_round": wall_ms / max(1, len(rtts)),
            # Wall-clock window of the measured rounds, to pick their hops out of the traces.
            "window_ns": [getattr(self, "_v_epoch0", 0), time.time_ns()],
            # The driver's server (all its threads) over the measured rounds: user and system
            # CPU per round. With aaabus.link.notice_spin_us > 0, it includes the I/O thread's
            # polling while a group waits for a notice; at 0 none (each wake-up costs more).
            "driver_cpu_us_per_round": None
            if cpu0 is None
            else {
                "user": round((cpu1.ru_utime - cpu0.ru_utime) * 1e6 / rounds, 1),
                "system": round((cpu1.ru_stime - cpu0.ru_stime) * 1e6 / rounds, 1),
            },
            "rtts_ns": rtts,
        }
        path = Path(self.out)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)


def bench_service(ctx: BootContext, args: str, first_time: bool) -> None:
    """Boot service deploying a :class:`PingDriver` configured by ``args`` (JSON), once."""
    if first_time:
        PingDriver(**json.loads(args)).deploy()
