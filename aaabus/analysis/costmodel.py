"""The predicted cost of a layout of causality domains for a given traffic.

The model. A notification from server u to server v (u != v) follows the unique path between
them in the servers–domains tree: one *leg* per domain on that path, so ``legs - 1`` router
hops. A leg inside a domain of k members costs::

    leg_ms(k) = HOP_MS + BYTE_NS * clock_bytes(k) / 1e6

* ``HOP_MS``: what every leg pays whatever k: one durable commit at the receiving server, the
  link and the engine's hand-offs. A router hop is one more leg, hence one more commit.
* ``clock_bytes(k)``: the clock bytes one message handles on that leg (its stamp on the wire plus
  its share of the clock bytes its commit persists: ``stamp_bytes_mean + clock_bytes_per_msg``
  of ``aaabus analyze``), under traffic spread over the domain: ``FULL_BYTES_PER_K2 * k**2`` with
  full-matrix stamps; with delta stamps, the straight lines between the measured points of
  ``DELTA_CLOCK_BYTES`` (and the origin), continued past the last one with its slope.
* ``BYTE_NS``: the time per clock byte (encoding, sending, decoding, merging and persisting it).

The cost of a layout is the sum over ordered pairs (u, v) of ``notes[u, v] * sum(leg_ms(k) for
each leg of the route)``; it is reported per notification (that sum divided by the
notifications), in milliseconds. A notification to the sender's own server costs nothing in any
layout and is left out.

Calibration (this machine, FileStorage fsync'd at every commit; commands in perf/RESULTS.md):

* ``HOP_MS`` = 0.82 ms and ``BYTE_NS`` = 23 ns/byte: the quiet campaign's flat remote round trips
  (RESULTS.md, "Quiet campaign": p50 at 10, 50, 100, 150 servers, full and delta stamps), one
  leg being half a round trip. 0.82 ms is the intercept shared by both clock modes in a least
  squares fit (full: quadratic in k, delta: linear); 23 ns/byte is the slope of the full-stamp
  leg times, less 0.82 ms, against the clock bytes that workload handles (12 k² bytes per
  message: a stamp of 8 k² + 8 bytes plus about 4 k² persisted, measured).
* ``FULL_BYTES_PER_K2`` = 10 and ``DELTA_CLOCK_BYTES``: clock bytes per message measured in
  flat broadcast rounds (every server talks to server 0: the spread case) of 10, 50 and 100
  servers (RESULTS.md, "Clock bytes per message"). Full stamps: 8 k² + 8 bytes plus about 2 k²
  persisted (1,139, 25,274 and 100,485 bytes: 10 k² within 14 %). Delta stamps: about 12 k bytes
  plus 81 to 232 bytes per member persisted (923, 12,204 and 24,505 bytes). Between two servers
  only (a ping-pong), delta stamps stay at 20 bytes and the persisted bytes at about 1.2 KB
  whatever k: for such traffic the model overstates what a big delta domain costs.

The **busy** load (``CostModel(load="busy")``, delta stamps only) predicts instead what a
notification costs a bus on which every server keeps sending: latency is then queueing, in
proportion to the CPU each notification takes, and ``leg_ms(k)`` is the CPU per notification
(every server's user + system time, summed) measured on a flat bus of k servers all talking to
each other (``python -m perf groups --servers k --groups 1 --layouts flat --observe 0 --active
0``, k = 10, 20, 40, 60: ``BUSY_LEG_US``), with the clock bytes measured there
(``BUSY_CLOCK_BYTES``): linear between the points, continued past both ends. On a quiet bus a
leg is mostly a commit's fsync wait and a big domain is cheap; on a busy one its clock work
dominates (at 60 members a leg costs 5.7 times one at 10). Checked on the structured workload
(``perf groups --active 0``, RESULTS.md), which the calibration does not use.

Checks against measurements not used in the calibration: a bus of 111 domains of 10 in a line
(1,000 servers, delta stamps) predicts 2 x 111 legs x 0.84 ms = 187 ms per remote round trip;
the in-process campaign measured 184 ms. A star predicts 2 legs, 1.7 ms (measured in process:
1.4 ms).

:func:`evaluate` runs on the caller's thread; numpy does the per-pair work.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

HOP_MS = 0.82
BYTE_NS = 23.0
FULL_BYTES_PER_K2 = 10.0
#: (domain members, clock bytes per message) measured with delta stamps, spread traffic.
DELTA_CLOCK_BYTES = ((10, 923.0), (50, 12_204.0), (100, 24_505.0))
#: The busy bus (every server sending; ``python -m perf groups --groups 1 --layouts flat
#: --observe 0 --active 0``, delta stamps, RESULTS.md): (domain members, CPU µs per
#: notification, all servers summed) and (domain members, clock bytes per notification).
BUSY_LEG_US = ((10, 789.0), (20, 1_311.0), (40, 2_592.0), (60, 4_465.0))
BUSY_CLOCK_BYTES = ((10, 2_733.0), (20, 10_808.0), (40, 34_179.0), (60, 62_040.0))
STAMPS = ("delta", "full")
LOADS = ("idle", "busy")


def _interpolate(points: Sequence[tuple[int, float]], k: int) -> float:
    """The straight lines between ``points`` (sorted by k), continued past both ends."""
    segments = list(pairwise(points))
    (k0, y0), (k1, y1) = next((s for s in segments if k <= s[1][0]), segments[-1])
    return y0 + (y1 - y0) * (k - k0) / (k1 - k0)


@dataclass(frozen=True)
class CostModel:
    """The constants of the model (defaults: the calibration above), the clock mode and the
    load: ``idle`` predicts the latency of a notification on a quiet bus, ``busy`` the CPU time
    a notification costs a bus on which every server sends (what its latency is proportional to
    once the machines are saturated)."""

    stamps: str = "delta"
    load: str = "idle"
    hop_ms: float = HOP_MS
    byte_ns: float = BYTE_NS
    full_bytes_per_k2: float = FULL_BYTES_PER_K2
    delta_clock_bytes: tuple[tuple[int, float], ...] = DELTA_CLOCK_BYTES
    busy_leg_us: tuple[tuple[int, float], ...] = BUSY_LEG_US
    busy_clock_bytes: tuple[tuple[int, float], ...] = BUSY_CLOCK_BYTES

    def __post_init__(self) -> None:
        if self.stamps not in STAMPS:
            raise ValueError(f"unknown stamps {self.stamps!r}: expected one of {STAMPS}")
        if self.load not in LOADS:
            raise ValueError(f"unknown load {self.load!r}: expected one of {LOADS}")
        if self.load == "busy" and self.stamps != "delta":
            raise ValueError("the busy model is calibrated for delta stamps only")

    def clock_bytes(self, k: int) -> float:
        """Clock bytes one message handles on a leg inside a domain of ``k`` members."""
        if self.stamps == "full":
            return self.full_bytes_per_k2 * k * k
        if self.load == "busy":
            return max(0.0, _interpolate(((0, 0.0), *self.busy_clock_bytes), k))
        return _interpolate(((0, 0.0), *self.delta_clock_bytes), k)

    def leg_ms(self, k: int) -> float:
        """Predicted cost of one leg inside a domain of ``k`` members, in ms."""
        if self.load == "busy":
            return _interpolate(self.busy_leg_us, k) / 1e3
        return self.hop_ms + self.byte_ns * self.clock_bytes(k) / 1e6


@dataclass(frozen=True)
class LayoutCost:
    """What the model predicts for one layout and one traffic matrix."""

    name: str
    domains: int
    largest: int  # members of the largest domain
    routers: int  # servers in two domains or more
    links: int  # server pairs sharing a domain: the connections a bus of this layout opens
    legs_per_note: float  # mean legs per notification (router hops + 1)
    clock_bytes_per_note: float
    ms_per_note: float  # the cost: mean predicted time per notification

    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "domains": self.domains,
            "largest": self.largest,
            "routers": self.routers,
            "links": self.links,
            "legs_per_note": round(self.legs_per_note, 4),
            "clock_bytes_per_note": round(self.clock_bytes_per_note, 1),
            "ms_per_note": round(self.ms_per_note, 4),
        }


def evaluate(
    name: str,
    domains: Sequence[Sequence[int]],
    notes: npt.NDArray[np.float64],
    model: CostModel,
) -> LayoutCost:
    """The predicted cost of ``domains`` (members given as indices 0..N-1 of ``notes``).

    ``notes[u, v]`` is the number of notifications from u to v. ``domains`` must form a tree
    with the servers (every server in one domain at least, no cycle), as
    :meth:`aaabus.config.domains.Topology.from_config` demands.
    """
    import numpy as np

    n = notes.shape[0]
    m = len(domains)
    sizes = [len(d) for d in domains]
    leg_ms = np.array([model.leg_ms(k) for k in sizes])
    leg_bytes = np.array([model.clock_bytes(k) for k in sizes])
    # Per domain pair, sums over the domains of the tree path between them (both included).
    path_ms, path_bytes, path_legs = _domain_paths(domains, n, leg_ms, leg_bytes)
    pair_server = np.array([s for d in domains for s in d], dtype=np.int64)
    pair_domain = np.array([i for i, d in enumerate(domains) for _ in d], dtype=np.int64)
    total = float(notes.sum() - np.trace(notes))
    out = []
    for path in (path_ms, path_bytes, path_legs):
        # In a tree, a router's domain nearest to the other end is the one with the cheapest
        # path (any other of its domains adds itself to the path): so take minima, first over
        # the sender's domains, then over the receiver's.
        by_src = np.full((n, m), np.inf)
        np.minimum.at(by_src, pair_server, path[pair_domain])
        per_pair = np.full((n, n), np.inf)
        np.minimum.at(per_pair.T, pair_server, by_src.T[pair_domain])
        np.fill_diagonal(per_pair, 0.0)
        out.append(float((notes * per_pair).sum()) / total if total else 0.0)
    ms, nbytes, legs = out
    members = np.bincount(pair_server, minlength=n)
    return LayoutCost(
        name=name,
        domains=m,
        largest=max(sizes),
        routers=int((members > 1).sum()),
        links=sum(k * (k - 1) // 2 for k in sizes),  # a tree: two servers share one domain at most
        legs_per_note=legs,
        clock_bytes_per_note=nbytes,
        ms_per_note=ms,
    )


def _domain_paths(
    domains: Sequence[Sequence[int]],
    servers: int,
    leg_ms: npt.NDArray[np.float64],
    leg_bytes: npt.NDArray[np.float64],
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Sums of ``leg_ms``, ``leg_bytes`` and of legs over the domains of each domain-to-domain
    path of the servers–domains tree, by a traversal from every domain: O(domains x nodes)."""
    import numpy as np

    m = len(domains)
    # Nodes 0..servers-1 are servers, servers+d is domain d.
    adjacency: list[list[int]] = [[] for _ in range(servers + m)]
    for d, members in enumerate(domains):
        for s in members:
            adjacency[s].append(servers + d)
            adjacency[servers + d].append(s)
    ms = np.zeros((m, m))
    nbytes = np.zeros((m, m))
    legs = np.zeros((m, m))
    for start in range(m):
        acc = {servers + start: (leg_ms[start], leg_bytes[start], 1.0)}
        todo = deque([servers + start])
        while todo:
            node = todo.popleft()
            here = acc[node]
            for nxt in adjacency[node]:
                if nxt in acc:
                    continue
                if nxt >= servers:
                    d = nxt - servers
                    acc[nxt] = (here[0] + leg_ms[d], here[1] + leg_bytes[d], here[2] + 1.0)
                    ms[start, d], nbytes[start, d], legs[start, d] = acc[nxt]
                else:
                    acc[nxt] = here
                todo.append(nxt)
        ms[start, start], nbytes[start, start], legs[start, start] = acc[servers + start]
    return ms, nbytes, legs
