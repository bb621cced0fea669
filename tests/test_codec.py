"""The data codec (aaabus.wire.codec): what it carries back exactly, what it refuses, and a
fuzzer that feeds it random and mutated encodings of real notifications.

A refusal is always a BadBody with one line; nothing else escapes the decoder, and no input
makes it allocate much more than the input itself.
"""

from __future__ import annotations

import random
import tracemalloc
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from BTrees.LOBTree import LOBTree
from hypothesis import given, settings
from hypothesis import strategies as st

from aaabus import AgentId, ExceptionNotification, Notification, PersistentList, UnknownAgent
from aaabus.errors import BadBody
from aaabus.model.pubsub import MessageProps, Publication, Publish
from aaabus.testing.bankload import Credit
from aaabus.testing.chains import Chain
from aaabus.testing.workload import Bounce
from aaabus.topics.messages import (
    Carried,
    InterestChange,
    OpenMailbox,
    Relay,
    Relays,
    TopicRoutes,
)
from aaabus.wire.codec import Codec, conforms, encode_note, is_pickle
from tests.support.agents import Inc, Poke, Seen
from tests.support.hostile import Planted


@dataclass
class Typed(Notification):
    count: int
    ratio: float
    name: str
    blob: bytes
    where: AgentId
    tags: tuple[str, ...] = ()
    table: dict[str, list[int]] = field(default_factory=dict)
    maybe: int | None = None


@dataclass
class Holder(Notification):
    inner: Notification
    either: Carried | InterestChange | None = None


class NotData(Notification):
    def __init__(self, x: int) -> None:
        self.x = x


ID = AgentId(1, 2, 17)

#: Real notifications of every shape the bus sends.
SAMPLES: list[Notification] = [
    Inc(3),
    Bounce(7),
    Typed(-5, 0.5, "é", b"\x00\xff", ID, ("a", "b"), {"k": [1, 2]}, None),
    Credit("m1", {"a": 1}, 3, 10),
    Chain("m2", {"x": 2}, [("label", ID)]),
    ExceptionNotification(ID, Inc(1), "ValueError", "bad"),
    ExceptionNotification(ID, None, "BadBody", "garbage"),
    UnknownAgent(ID, Typed(1, 2.0, "", b"", ID)),
    Publish("a/b", {"x": (1, [2, {3}]), "id": ID, "n": Inc(4)}, True, qos=1),
    Publication("a/b", b"payload", ID, ("a/#",), False, qos=2),
    Relay((1, 2), Carried("t", frozenset([1]), ID)),
    Relay((3,), InterestChange(0, ("a/+",), True)),
    Relays.of(
        [
            (
                (1,),
                Carried(
                    "t",
                    (1, "x"),
                    ID,
                    True,
                    qos=1,
                    origin="dev",
                    props=MessageProps(content_type="a"),
                ),
            ),
            ((2, 3), InterestChange(0, ("a/#",), False)),
        ]
    ),
    TopicRoutes({1: 0, 2: 0}),
    OpenMailbox("m", None, (ID, Inc(9))),
    Poke(ID, Seen(ID, ID, bytearray(b"xy"))),
    Holder(Holder(Inc(1)), Carried("t", None, ID)),
]


@pytest.mark.parametrize("note", SAMPLES, ids=lambda n: type(n).__name__)
def test_every_shape_comes_back_equal_and_of_its_type(note: Notification) -> None:
    codec = Codec()
    body = codec.encode(note)
    back = codec.decode(body)
    assert back == note and type(back) is type(note)
    assert body[:1] == b"\x92" and not is_pickle(body)


def test_values_keep_their_python_types_under_any() -> None:
    codec = Codec()
    value = {"t": (1, 2), "s": {3}, "f": frozenset({4}), "b": bytearray(b"5"), "id": ID,
             "l": PersistentList([6]), "tree": LOBTree({7: "eight"}), "n": Inc(9)}  # fmt: skip
    back = codec.decode_value(codec.encode_value(value))
    assert {k: type(v) for k, v in back.items()} == {k: type(v) for k, v in value.items()}
    assert back["tree"][7] == "eight" and back["n"] == Inc(9) and back["t"] == (1, 2)


_INC = b"tests.support.agents:Inc"
_WRONG: list[tuple[bytes, str]] = [
    (encode_note(Inc(3)).replace(b"\x03", b"\xa1x"), "Inc refused: Expected `int`, got `str` - at `$.i`"),  # noqa: E501
    (encode_note(Inc(3)).replace(b"agents:Inc", b"agents:Inx"), "'tests.support.agents:Inx' is not registered"),  # noqa: E501
    (encode_note(Inc(3)).replace(_INC, b"posix:system".ljust(len(_INC))), "'posix:system "),
    (encode_note(Inc(3))[:-1], "does not decode"),
    (encode_note(Inc(3)) + b"\x00", "does not decode"),
    (b"\x80\x04" + encode_note(Inc(3)), "carries data only"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "says"), _WRONG)
def test_a_wrong_body_is_refused_in_one_line_naming_type_and_field(body: bytes, says: str) -> None:
    with pytest.raises(BadBody) as refused:
        Codec().decode(body)
    assert says in str(refused.value) and "\n" not in str(refused.value)


def test_a_dynamic_field_is_checked_against_its_annotation() -> None:
    codec = Codec()
    body = codec.encode(Holder(Inc(1), None)).replace(b"either\xc0", b"either\x01")
    with pytest.raises(BadBody, match="field 'either' holds a int, not"):
        codec.decode(body)
    assert conforms((ID, Inc(1)), tuple[AgentId, Notification] | None)
    assert not conforms((ID, 3), tuple[AgentId, Notification] | None)


def test_what_has_no_data_form_is_refused_at_the_send_unless_the_bus_opted_in() -> None:
    with pytest.raises(TypeError, match="not a dataclass"):
        Codec().encode(NotData(1))
    with pytest.raises(TypeError, match="field 'note'"):  # Any holding an object of no data form
        Codec().encode(Seen(ID, ID, object()))
    with pytest.raises(TypeError, match=r"int too big|can't serialize"):
        Codec().encode(Inc(2**64))
    body = Codec(pickles=True).encode(NotData(1))
    assert is_pickle(body) and Codec(pickles=True).decode(body).x == 1  # type: ignore[attr-defined]
    with pytest.raises(BadBody, match="carries data only"):
        Codec().decode(body)


def test_a_pickle_that_runs_code_is_never_loaded_without_the_opt_in(tmp_path: Any) -> None:
    import pickle

    marker = tmp_path / "ran"
    with pytest.raises(BadBody):
        Codec().decode(pickle.dumps(Planted(marker), 4))
    assert not marker.exists()


def test_types_are_imported_only_where_the_operator_trusts_their_module() -> None:
    body = msgspec.msgpack.encode(("tests.support.nomodule:Inc", {"i": 1}))
    asked: list[str] = []

    def may_import(module: str) -> bool:
        asked.append(module)
        return True

    with pytest.raises(BadBody, match="does not import here"):
        Codec(may_import=may_import).decode(body)
    main = msgspec.msgpack.encode(("aaabus.__main__:Inc", {"i": 1}))
    with pytest.raises(BadBody, match="not registered"):
        Codec(may_import=lambda m: True).decode(main)  # __main__ is never imported
    assert asked == ["tests.support.nomodule"]


notes = st.builds(
    Typed,
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False),
    st.text(max_size=30),
    st.binary(max_size=50),
    st.builds(AgentId, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**63)),
    st.lists(st.text(max_size=5), max_size=4).map(tuple),
    st.dictionaries(st.text(max_size=5), st.lists(st.integers(-5, 5), max_size=3), max_size=3),
    st.none() | st.integers(-(2**63), 2**64 - 1),
)


@settings(max_examples=300, deadline=None)
@given(note=notes)
def test_typed_notifications_round_trip(note: Typed) -> None:
    codec = Codec()
    assert codec.decode(codec.encode(note)) == note


# -- the fuzzer ---------------------------------------------------------------------------------

#: msgpack headers that claim far more than follows: an array, a map, a string, bytes, an ext.
_LIARS = [
    b"\xdd\xff\xff\xff\xff",
    b"\xdf\xff\xff\xff\xff",
    b"\xdb\xff\xff\xff\xff",
    b"\xc6\xff\xff\xff\xff",
    b"\xc9\xff\xff\xff\xff\x01",
    b"\xc9\x7f\xff\xff\xff\x03",
]


def _mutant(rng: random.Random, bodies: list[bytes]) -> bytes:
    body = bytearray(rng.choice(bodies))
    kind = rng.randrange(8)
    if kind == 0:
        return rng.randbytes(rng.randint(0, 64))
    if kind == 1:  # flip bytes
        for _ in range(rng.randint(1, 4)):
            body[rng.randrange(len(body))] = rng.randrange(256)
    elif kind == 2:  # cut
        del body[rng.randrange(len(body)) :]
    elif kind == 3:  # insert a lying header
        at = rng.randrange(len(body) + 1)
        body[at:at] = rng.choice(_LIARS)
    elif kind == 4:  # splice two real bodies
        other = rng.choice(bodies)
        body = body[: rng.randrange(len(body) + 1)] + other[rng.randrange(len(other) + 1) :]
    elif kind == 5:  # deep nesting
        depth = rng.choice([10, 1000, 100_000])
        return b"\x92\xa3a:b" + b"\x91" * depth + b"\xc0"
    elif kind == 6:  # another registered type's tag, with this one's fields
        tags = [b"tests.support.agents:Inc", b"aaabus.testing.workload:Bounce",
                b"aaabus.model.notifications:ExceptionNotification"]  # fmt: skip
        for tag in tags:
            if tag in body:
                body = body.replace(tag, rng.choice(tags), 1)
    else:  # our extension codes around garbage
        payload = rng.randbytes(rng.randint(0, 12))
        ext = bytes([0xC7, len(payload), rng.randrange(0, 12)]) + payload
        body = bytearray(b"\x92\xb9tests.support.agents:Poke\x82\xa2to") + ext + b"\xa4note" + ext
    return bytes(body)


@pytest.mark.slow
def test_fuzzed_bodies_are_refused_in_one_line_and_allocate_within_bounds() -> None:
    codec = Codec(may_import=lambda m: False)
    bodies = [codec.encode(n) for n in SAMPLES]
    rng = random.Random(20261128)
    refused = decoded = 0
    worst = 0.0
    tracemalloc.start()
    try:
        for _ in range(100_000):
            body = _mutant(rng, bodies)
            tracemalloc.reset_peak()
            base = tracemalloc.get_traced_memory()[0]
            try:
                codec.decode(body)
                decoded += 1
            except BadBody as exc:
                assert "\n" not in str(exc), exc
                refused += 1
            grown = tracemalloc.get_traced_memory()[1] - base
            # The bound: a decoded value cannot hold much more than the bytes it came from
            # (the biggest factor is a one-byte msgpack value becoming a Python object).
            assert grown <= 64 * len(body) + 64_000, (grown, body[:80])
            worst = max(worst, grown / max(1, len(body)))
    finally:
        tracemalloc.stop()
    assert refused + decoded == 100_000
    assert refused > 50_000 and decoded > 100, (refused, decoded)
