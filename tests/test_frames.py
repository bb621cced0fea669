"""The channel's data frames and the vetting of notification bodies, without a network.

A data frame is taken apart with fixed-size fields (no unpickling), and only the body inside is
unpickled, after :func:`aaabus.wire.message.vet_body` has refused the pickles that would make
CPython's C unpickler allocate without bound. The properties here: every pickle Python itself
writes passes (any protocol, cloudpickle too); the bombs, garbage and every cut-short pickle are
refused; frames round-trip; malformed frames raise ``ValueError`` and nothing else.
"""

from __future__ import annotations

import pickle
import tracemalloc
from typing import Any

import cloudpickle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aaabus.errors import BadBody, MalformedPickle
from aaabus.model.ids import AgentId
from aaabus.testing.bankload import Start
from aaabus.wire.codec import Codec, encode_note
from aaabus.wire.linkframes import decode_data, encode_data
from aaabus.wire.message import Message, vet_body
from aaabus.wire.pickles import pickle_end

values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**64, max_value=2**2000)
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=300),
    lambda children: (
        st.lists(children, max_size=5)
        | st.tuples(children, children)
        | st.dictionaries(st.text(max_size=5), children, max_size=5)
        | st.frozensets(st.integers(), max_size=4)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(value=values, protocol=st.integers(2, pickle.HIGHEST_PROTOCOL))
def test_every_pickle_python_writes_passes_and_every_cut_is_refused(
    value: Any, protocol: int
) -> None:
    # (Protocols 2 and up: what a bus that opted in to pickles sends, and all that starts with
    # the PROTO byte that tells a pickled body from a data one.)
    body = pickle.dumps(value, protocol)
    vet_body(body)
    for cut in range(1, len(body)):
        with pytest.raises(BadBody):
            vet_body(body[:cut])


def test_shared_and_recursive_values_pass_at_every_protocol() -> None:
    shared = [1, "two"]
    loop: list[object] = [shared, shared]
    loop.append(loop)  # memo puts and gets at every protocol
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        vet_body(pickle.dumps(loop, protocol))
        vet_body(pickle.dumps(Start(3, 4), protocol))


def test_notifications_sent_by_value_pass() -> None:
    class Local:  # defined in a function: cloudpickle sends the class itself
        def __init__(self) -> None:
            self.f = lambda: 42

    body = cloudpickle.dumps(Local(), pickle.HIGHEST_PROTOCOL)
    vet_body(body)
    assert pickle.loads(body).f() == 42
    vet_body(encode_note(Start(1, 2)))


@pytest.mark.parametrize(
    ("body", "says"),
    [
        # Fourteen bytes that ask the C unpickler for a memo of 2.5 billion slots (20 GB).
        (b")r\x99\n\xd6L.", "memo index at byte 3"),
        (b"(p99999999\n.", "memo index at byte 3"),
        (b"(pxyz\n.", "memo index at byte 3"),
        (b"", "cut short"),
        (b"K", "cut short"),
        (b"\x8c\xffabc", "cut short"),
        (b"\xff.", "byte 2 is not a pickle opcode"),
        (b"cos\nsystem", "cut short"),
        (b"\x8e" + (2**63).to_bytes(8, "little") + b".", "cut short"),  # BINBYTES8, huge
    ],
)
def test_bombs_and_garbage_are_refused(body: bytes, says: str) -> None:
    with pytest.raises(BadBody, match=says):
        vet_body(b"\x80\x05" + body)


def test_a_refused_bomb_would_really_have_hurt() -> None:
    # Why vet_body exists, measured rather than claimed: seven bytes make the C unpickler
    # allocate 16 MB here (a memo of 2 * 2**20 slots); the index is kept small so that the
    # demonstration is cheap, the twelve-byte version above asks for 20 GB.
    bomb = b"\x80\x05)r" + (2**20).to_bytes(4, "little") + b"."
    with pytest.raises(BadBody):
        vet_body(bomb)
    tracemalloc.start()
    try:
        assert pickle.loads(bomb) == ()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak > 2**20 * 8


ids = st.builds(
    AgentId, st.integers(0, 2**32 - 1), st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
)


@settings(deadline=None)  # timing is not what is tested (a loaded CI machine)
@given(
    seq=st.integers(0, 2**64 - 1),
    domain=st.text(max_size=20),
    stamp=st.binary(max_size=60),
    sender=ids,
    target=ids,
    value=values,
)
def test_data_frames_round_trip(
    seq: int, domain: str, stamp: bytes, sender: AgentId, target: AgentId, value: Any
) -> None:
    message = Message(sender, target, pickle.dumps(value, pickle.HIGHEST_PROTOCOL))
    assert decode_data(encode_data(seq, domain, stamp, message)) == (seq, domain, stamp, message)


FRAME = encode_data(
    7, "D0", b"stamp", Message(AgentId(0, 0, 20), AgentId(2, 2, 999), encode_note(Start(0, 0)))
)


@settings(deadline=None)
@given(st.data())
def test_malformed_frames_raise_value_error_only(data: st.DataObject) -> None:
    frame = bytearray(FRAME)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(frame) - 1))
        frame[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(frame)))
    try:
        seq, domain, stamp, message = decode_data(bytes(frame[:cut]))
    except ValueError:
        return
    # What passes is a frame with well-formed fields and a body that may be unpickled.
    assert isinstance(seq, int) and isinstance(domain, str) and isinstance(stamp, bytes)
    vet_body(message.body)


def test_every_cut_of_a_frame_is_refused_by_the_link_or_by_the_codec() -> None:
    # The frame's own fields are checked where it is received; its body is the codec's, on
    # the engine, which consumes an undecodable body as a dead letter rather than cutting the
    # link (a peer must not stall it by resending the same frame forever).
    body = encode_note(Start(0, 0))
    for cut in range(len(FRAME)):
        try:
            _, _, _, message = decode_data(FRAME[:cut])
        except ValueError:
            continue
        assert len(FRAME) - cut < len(body)
        with pytest.raises(BadBody):
            Codec().decode(message.body)


def test_pickle_end_finds_each_pickle_of_a_store_record() -> None:
    # A ZODB record is two pickles back to back (class, then state); protocol 3 as ZODB writes.
    first, second = pickle.dumps(Start, 3), pickle.dumps({"chains": 1, "ttl": [2, 3]}, 3)
    record = first + second
    assert pickle_end(record) == len(first)
    assert pickle_end(record, len(first)) == len(record)
    garbled = record.replace(b"aaabus.testing", b"aaabus.\xde\xad\xbe\xefing")
    assert garbled != record
    with pytest.raises(MalformedPickle, match="is not UTF-8"):
        pickle_end(garbled)
