"""``python -m perf codecs``: what each candidate wire format costs per notification.

The bus encodes every notification when it is sent and decodes it where it is delivered, so a
hop pays one encode and one decode. This suite times that pair, in one process and alternating
(so that every candidate sees the same machine), for the notifications of the ping-pong, the
stream, a topic publication and the torture's causal credit:

``aaabus``
    the bus's codec (:mod:`aaabus.wire.codec`: msgspec MessagePack, typed decoding, every field
    checked against its annotation);
``msgpack`` / ``cbor2``
    the same ``[tag, fields]`` shape through those libraries, the class rebuilt from a dict by
    a registry lookup and ``cls(**fields)`` -- with no field checked, so a floor rather than an
    equal;
``pickle``
    :func:`pickle.dumps` + :func:`pickle.loads`, what a bus that opts in to pickles pays (and
    that runs code);
``restricted``
    :func:`pickle.dumps` + the allow-list unpickler the bus used before the data codec
    (:class:`aaabus.config.trust.TrustPolicy`), for the record.

The last line is JSON: per notification, the body's bytes and each candidate's encode+decode
microseconds (best of ``--repeat``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pickle
import timeit
from collections.abc import Callable
from functools import partial
from typing import Any

from aaabus.config.trust import TrustPolicy
from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification, registered
from aaabus.model.pubsub import Publication
from aaabus.wire.codec import Codec, tag_of

CANDIDATES = ("aaabus", "msgpack", "cbor2", "pickle", "restricted")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--number", type=int, default=20_000, help="round trips per timing")
    parser.add_argument("--repeat", type=int, default=5, help="timings per candidate (best kept)")


def _samples() -> dict[str, Notification]:
    from aaabus.testing.bankload import Credit
    from perf.agents.pingpong import Ball
    from perf.agents.stream import Item

    me = AgentId(0, 1, 16)
    return {
        "ping-pong ball": Ball(7, b"", 1_795_000_000_000_000_000),
        "stream item": Item(123_456),
        "publication": Publication("site/3/temp", {"c": 21.5, "unit": "C"}, me, ("site/+/temp",)),
        "causal credit": Credit("s0-a1-17", {"s0-a1": 17, "s1-a4": 3, "s2-a9": 8}, 4, 25),
    }


def _by_dict(dumps: Callable[[Any], bytes], loads: Callable[[bytes], Any]) -> Any:
    """A ``[tag, fields]`` round trip through another library, rebuilt without checks."""

    def trip(note: Notification) -> Notification:
        fields = {f.name: getattr(note, f.name) for f in dataclasses.fields(note)}  # type: ignore[arg-type]
        tag, back = loads(dumps([tag_of(type(note)), fields]))
        cls = registered(tag)
        assert cls is not None
        return cls(**back)

    return trip


def _trips() -> dict[str, Callable[[Notification], Any]]:
    import cbor2
    import msgpack

    codec = Codec()
    policy = TrustPolicy(["perf.agents"])  # what a ping-pong server trusted (its service's module)
    return {
        "aaabus": lambda n: codec.decode(codec.encode(n)),
        "msgpack": _by_dict(msgpack.packb, msgpack.unpackb),
        "cbor2": _by_dict(cbor2.dumps, cbor2.loads),
        "pickle": lambda n: pickle.loads(pickle.dumps(n, pickle.HIGHEST_PROTOCOL)),
        "restricted": lambda n: policy.loads(pickle.dumps(n, pickle.HIGHEST_PROTOCOL)),
    }


def run(args: argparse.Namespace) -> int:
    trips = _trips()
    codec = Codec()
    rows = []
    for name, note in _samples().items():
        timings: dict[str, list[float]] = {c: [] for c in CANDIDATES}
        for candidate in CANDIDATES:  # every candidate carries this notification back whole
            back = trips[candidate](note)
            if back != note and candidate not in ("msgpack", "cbor2"):
                raise AssertionError(f"{candidate} changed {name}: {back!r}")
        for _ in range(args.repeat):  # alternated, so that all see the same machine
            for candidate in CANDIDATES:
                timed = partial(trips[candidate], note)
                timings[candidate].append(timeit.timeit(timed, number=args.number))
        row: dict[str, Any] = {"notification": name, "aaabus_bytes": len(codec.encode(note))}
        row["pickle_bytes"] = len(pickle.dumps(note, pickle.HIGHEST_PROTOCOL))
        for candidate in CANDIDATES:
            row[f"{candidate}_us"] = round(min(timings[candidate]) / args.number * 1e6, 3)
        rows.append(row)
        print(
            f"{name:16} {row['aaabus_bytes']:4} B (pickle {row['pickle_bytes']:4} B): "
            + ", ".join(f"{c} {row[f'{c}_us']:.2f}" for c in CANDIDATES)
            + " us per encode+decode"
        )
    print(json.dumps({"codecs": rows}))
    return 0
