"""Failpoints: named steps of a group that a test can make fail, free when none is armed.

Every step where the engine or the channel changes something on the way to a commit, or hands a
committed result to the network, calls ``if failpoints.armed: failpoints.hit(NAME)``. Nothing is
armed in production, so the cost is one attribute test. A test arms a step with an action:

* ``raise``: raise :class:`FailpointError` there, as a bug or a transient fault would;
* ``kill``: SIGKILL the process there, as a crash would (real server processes only);
* ``count``: only count the hits (to learn which steps a workload goes through).

``skip`` hits pass first, then the action fires ``times`` times (``0``: every time after the
skipped ones). :data:`STEPS` names every failpoint and what it interrupts; the walk in
``tests/test_failpoints.py`` tries each of them against a set of scenarios.

A server process arms failpoints from the environment variable ``AAABUS_FAILPOINTS`` (a
comma-separated list of ``name:action[:skip[:times]]``); it is a testing tool, documented in
docs/operations.md, and means nothing to a bus that does not set it.

One registry per engine (not per process), so that servers sharing a process (the in-process
bus) are armed one by one. Counters are read by the test thread while the engine thread writes
them: plain integers, no lock needed for a test's purposes.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

from aaabus.errors import ConfigError, FailpointError

__all__ = ["ENV_VAR", "STEPS", "FailpointError", "Failpoints"]

ENV_VAR = "AAABUS_FAILPOINTS"

#: Every failpoint, in the order a message meets them, and the step it interrupts.
STEPS: dict[str, str] = {
    "engine.input": "before the engine applies one input (a received frame, an ack, a call)",
    "channel.clock_test": "a received frame, before its stamp is tested against the clock",
    "channel.hold_back": "a received frame that must wait, before it is stored as held back",
    "channel.deliver": "a received frame, after its stamp was merged, before it is delivered",
    "channel.restamp": "a router, before it re-stamps a message for the next domain",
    "engine.react": "before an agent's react() runs",
    "engine.reacted": "after an agent's react() returned, before its state is finished",
    "engine.send": "a notification sent from a reaction, after it was queued or stamped",
    "channel.send": "a message for another server, after it was stamped and staged",
    "factory.create": "the factory, after a new agent was stored, before its on_init(True)",
    "factory.on_init": "the factory, after a new agent's on_init(True) returned",
    "engine.delete": "an agent deleting itself, after it was removed from the store",
    "engine.commit": "before the group's commit",
    "channel.sent_early": "the group's frames left early, tentative, and ZODB prepared its "
    "records; before the store writes them",
    "channel.flush": "before a batch of frames is handed to the network: the group's own, "
    "tentative as its commit starts (early frames), or after it (notices, acks, late frames)",
    "channel.flushed": "after a batch of frames was handed to the network",
}

ACTIONS = ("raise", "kill", "count")


@dataclass
class _Arming:
    action: str
    skip: int
    times: int
    fired: int = 0


class Failpoints:
    """The failpoints of one engine (see the module docstring)."""

    def __init__(self) -> None:
        #: True when some failpoint is armed: the only thing a call site reads when none is.
        self.armed = False
        self._armed: dict[str, _Arming] = {}
        #: Hits per failpoint since it was armed (every armed failpoint counts).
        self.hits: dict[str, int] = {}

    def arm(self, name: str, action: str = "raise", *, skip: int = 0, times: int = 1) -> None:
        """Arm failpoint ``name`` (one of :data:`STEPS`); see the module docstring."""
        if name not in STEPS:
            raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(STEPS)}")
        if action not in ACTIONS:
            raise ValueError(f"unknown failpoint action {action!r}; use one of {ACTIONS}")
        if skip < 0 or times < 0:
            raise ValueError("skip and times must be >= 0")
        self._armed[name] = _Arming(action, skip, times)
        self.hits[name] = 0
        self.armed = True

    def arm_all(self, action: str = "count") -> None:
        """Arm every failpoint with ``action`` (``count`` to learn what a workload reaches)."""
        for name in STEPS:
            self.arm(name, action, times=0)

    def disarm(self) -> None:
        self._armed.clear()
        self.armed = False

    def fired(self, name: str) -> int:
        """How many times failpoint ``name`` took its action since it was armed."""
        arming = self._armed.get(name)
        return arming.fired if arming is not None else 0

    def hit(self, name: str) -> None:
        """A call site reached failpoint ``name`` (called only while :attr:`armed`)."""
        arming = self._armed.get(name)
        if arming is None:
            return
        self.hits[name] += 1
        if arming.action == "count" or self.hits[name] <= arming.skip:
            return
        if arming.times and arming.fired >= arming.times:
            return
        arming.fired += 1
        if arming.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise FailpointError(f"failpoint {name} ({STEPS[name]})")

    def arm_from_text(self, text: str, where: str = ENV_VAR) -> None:
        """Arm from ``name:action[:skip[:times]],...``; a one-line ConfigError if malformed."""
        for item in filter(None, (part.strip() for part in text.split(","))):
            fields = item.split(":")
            try:
                if not 2 <= len(fields) <= 4:
                    raise ValueError("expected name:action[:skip[:times]]")
                numbers = [int(f) for f in fields[2:]]
                self.arm(
                    fields[0],
                    fields[1],
                    skip=numbers[0] if numbers else 0,
                    times=numbers[1] if len(numbers) > 1 else 1,
                )
            except ValueError as exc:
                raise ConfigError(f"{where}: bad failpoint {item!r}: {exc}") from None
