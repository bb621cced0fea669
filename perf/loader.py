"""``python -m perf loader``: what the restricted unpickler costs per notification body.

Every body a server receives is unpickled by :class:`aaabus.config.trust.TrustPolicy` (each
global the pickle names is checked before anything is built) instead of :func:`pickle.loads`. This
suite times both on the bodies of the ping-pong's notification, in one process, alternating, and
prints the extra time per body; a remote round trip loads two bodies (the ball and its return).
Compare it with ``python -m perf pingpong --test remote`` on the same machine.
"""

from __future__ import annotations

import argparse
import json
import pickle
import timeit
from functools import partial

from aaabus.config.trust import TrustPolicy
from aaabus.wire.message import encode_note

#: Bodies measured: the ping-pong's ball, empty and with a payload.
PAYLOADS = (0, 1024)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--number", type=int, default=100_000, help="loads per timing")
    parser.add_argument("--repeat", type=int, default=5, help="timings per loader (best kept)")


def run(args: argparse.Namespace) -> int:
    from agents.pingpong import Ball

    policy = TrustPolicy(["agents"])  # what a ping-pong server trusts (its service's module)
    rows = []
    for size in PAYLOADS:
        body = encode_note(Ball(7, b"x" * size, 1_795_000_000_000_000_000))
        if policy.loads(body) != pickle.loads(body):
            raise AssertionError("the restricted loader built another object")
        plain: list[float] = []
        restricted: list[float] = []
        for _ in range(args.repeat):  # alternated, so that both see the same machine
            plain.append(timeit.timeit(partial(pickle.loads, body), number=args.number))
            restricted.append(timeit.timeit(partial(policy.loads, body), number=args.number))
        plain_us = min(plain) / args.number * 1e6
        restricted_us = min(restricted) / args.number * 1e6
        rows.append(
            {
                "payload": size,
                "body_bytes": len(body),
                "pickle_loads_us": round(plain_us, 3),
                "restricted_us": round(restricted_us, 3),
                "extra_us": round(restricted_us - plain_us, 3),
            }
        )
        print(
            f"body of {len(body)} B: pickle.loads {plain_us:.2f} us, restricted "
            f"{restricted_us:.2f} us, extra {restricted_us - plain_us:.2f} us per body"
        )
    print(json.dumps({"loader": rows}))
    return 0
