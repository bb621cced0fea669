"""Fuzzing: garbage on the wire (before and after authentication) and mutated configurations.

Wire: a live server s2 (real process) plays a rally with s1 while the fuzzer connects to it
unauthenticated (raw bytes) and, holding the bus secret, as the declared-but-absent server s0
(see :class:`aaabus.testing.fuzz.FuzzTarget`). The server must never crash, must drop the
offending connection or frame, and the rally must go on exactly (every volley once, in order).

An authenticated peer is trusted with the secret, but not with the server's life: a data frame is
taken apart with fixed-size fields, never unpickled as a whole, and the notification body inside
is vetted (:func:`aaabus.wire.message.vet_body`, see tests/test_frames.py) before anything unpickles
it. The fuzzer mutates the frame around an intact body, and the body inside an intact frame; a
body that cannot be unpickled is also its own test at the end (the reaction fails alone, its
input is consumed, and traffic goes on).

Config: random edits of valid a3.xml files must only ever raise ``ConfigError``, one line long;
``aaabus check`` must answer 0 or 2 with one line on stderr and no traceback.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aaabus.config.domains import Topology
from aaabus.config.reader import parse_config
from aaabus.core.clock import DomainClock
from aaabus.errors import ConfigError
from aaabus.model.ids import AgentId
from aaabus.testing.bankload import Start
from aaabus.testing.crash import wait_progress
from aaabus.testing.fuzz import (
    FuzzTarget,
    mutate,
    random_authenticated_payload,
    random_raw_bytes,
)
from aaabus.wire.codec import encode_note
from aaabus.wire.frames import MAGIC, VERSION, encode_frame
from aaabus.wire.linkframes import ACK, DATA, encode_data
from aaabus.wire.message import Message

FUZZ = settings(
    max_examples=1000,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # a fixed example sequence: a failure in `make test` can be replayed
    database=None,
)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FuzzTarget]:
    with FuzzTarget(tmp_path_factory.mktemp("fuzz")) as t:
        yield t
    assert t.codes == {1: 0, 2: 0}, f"servers did not stop cleanly after the fuzzing: {t.codes}"


def assert_still_serving(
    target: FuzzTarget, before: dict[str, int], more: int = 50, timeout: float = 30.0
) -> None:
    """Both servers alive, and the rally advanced ``more`` volleys past ``before``, exactly."""
    assert target.alive(), [list(p.lines)[-5:] for p in target.procs]
    after = wait_progress(target.progress, before["count"] + more, target.procs, timeout)
    assert after["errors"] == 0, after


# -- before authentication -------------------------------------------------------------------

raw_frames = st.one_of(
    st.binary(max_size=400),
    # a frame header announcing more than the 256 bytes allowed before authentication
    st.integers(257, 2**32 - 1).map(lambda n: n.to_bytes(4, "big") + b"x" * 16),
    # well-framed handshake-looking messages: right magic and version, anything after
    st.tuples(st.integers(0, 255), st.binary(min_size=0, max_size=120)).map(
        lambda t: encode_frame(MAGIC + bytes([VERSION, t[0]]) + t[1])
    ),
    st.randoms(use_true_random=False).map(lambda r: random_raw_bytes(r, b"")),
)


# Each fuzzing test checks the servers' survival itself, after its last example: a check in a
# test of its own would rely on file order, which pytest-xdist does not keep (it may run on a
# worker whose target was never fuzzed).


@pytest.mark.slow
def test_raw_bytes_before_authentication(target: FuzzTarget) -> None:
    @FUZZ
    @given(data=raw_frames, to_s1=st.booleans())
    def intrude(data: bytes, to_s1: bool) -> None:
        target.send_raw(data, to_s1=to_s1)

    intrude()
    assert_still_serving(target, target.rally())  # the servers took 1,000 intruders


# -- after authentication --------------------------------------------------------------------


def _data_frame(
    seq: int,
    domain: str,
    stamp: bytes,
    sender: tuple[int, int, int],
    target_id: tuple[int, int, int],
    body: bytes,
) -> bytes:
    return encode_data(seq, domain, stamp, Message(AgentId(*sender), AgentId(*target_id), body))


_STAMP = DomainClock(2, 0).prepare_send(1)
_BODY = encode_note(Start(0, 0))

ids = st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 4), st.integers(0, 2**64 - 1))
structured = st.builds(
    _data_frame,
    st.integers(0, 2**64 - 1),
    st.sampled_from(["D0", "D1", "", "nope"]),
    st.one_of(st.just(_STAMP), st.binary(max_size=40), st.just(_STAMP).map(lambda s: s[:-1])),
    ids,
    ids,
    st.one_of(st.just(_BODY), st.binary(max_size=80), st.just(b")r\x99\n\xd6L.")),
)
acks = st.builds(
    lambda upto, domain: ACK + upto.to_bytes(8, "big") + domain,
    st.integers(0, 2**64 - 1),
    st.sampled_from([b"D0", b"D1", b"", b"\xff\xfe", b"x" * 300]),
)
authenticated_payloads = st.one_of(
    st.binary(max_size=300),
    st.binary(max_size=300).map(lambda b: DATA + b),
    structured,
    structured.flatmap(lambda frame: st.integers(0, len(frame)).map(lambda cut: frame[:cut])),
    acks,
    st.randoms(use_true_random=False).map(lambda r: mutate(r, ACK + bytes(8) + b"D0")),
)


@pytest.mark.slow
def test_garbage_from_an_authenticated_peer(target: FuzzTarget) -> None:
    @FUZZ
    @given(payload=authenticated_payloads)
    def garbage(payload: bytes) -> None:
        target.send_authenticated(payload)

    garbage()
    assert_still_serving(target, target.rally())


@pytest.mark.slow
def test_mutated_frames_from_an_authenticated_peer(target: FuzzTarget) -> None:
    @settings(FUZZ, max_examples=500)
    @given(r=st.randoms(use_true_random=False))
    def mutated(r: random.Random) -> None:
        target.send_authenticated(random_authenticated_payload(r, target.templates))

    mutated()
    assert_still_serving(target, target.rally())


# Garbage no strategy above draws (they stay under 400 bytes), so that the engine's refusal of it,
# "not a data frame (1000 bytes, kind b'Z')", names these frames and no others.
MARKED = b"Z" + bytes(999)
MARKED_REFUSAL = "not a data frame (1000 bytes, kind b'Z')"


@pytest.mark.slow
def test_servers_survive_authenticated_fuzzing(target: FuzzTarget) -> None:
    """The garbage reaches the engine, which drops each frame alone, and the rally goes on.

    Counted on frames this test sends itself, in a session of its own: the fuzzing tests above
    may have run on another pytest-xdist worker, against another target."""
    target.drop_session()  # a new session: nothing an earlier test sent holds these frames up
    for _ in range(100):
        target.send_authenticated(MARKED)
    assert target.wait_dropped(100, 60.0, containing=MARKED_REFUSAL), (
        "the garbage never reached the engine: "
        f"{sum(MARKED_REFUSAL in line for line in target.drop_lines)} of 100 frames dropped"
    )
    assert_still_serving(target, target.rally())


@pytest.mark.slow
def test_a_frame_with_a_bad_mac_cuts_only_that_session(target: FuzzTarget) -> None:
    sessions = target.sessions
    target.send_authenticated(b"D", tamper=True)
    target.send_authenticated(ACK + bytes(8) + b"D0")  # needs a new session: the old one is cut
    assert target.sessions == sessions + 1
    assert_still_serving(target, target.rally())


@pytest.mark.parametrize(
    "body",
    [
        b"not a pickle",
        # A memo bomb: unpickled, these seven bytes would make s2 allocate 4 GB and clear it.
        b")r" + (2**28).to_bytes(4, "little") + b".",
    ],
    ids=["garbage", "memo-bomb"],
)
@pytest.mark.slow
def test_a_bad_body_is_dropped_and_traffic_goes_on(tmp_path: Path, body: bytes) -> None:
    with FuzzTarget(tmp_path) as target:
        before = target.rally()
        target.send_authenticated(_data_frame(1, "D0", _STAMP, (0, 0, 20), (2, 2, 999), body))
        assert_still_serving(target, before, timeout=5.0)
        assert target.wait_dropped(1, 5.0), "the bad body was not refused"


# -- configurations ----------------------------------------------------------------------------

VALID = [
    """<config>
  <domain name="D0"/><domain name="D1" order="fifo"/><domain name="D2" stamps="full"/>
  <property name="aaabus.engine.max_batch" value="8"/>
  <server id="0" name="s0" hostname="127.0.0.1"><network domain="D0" port="20000"/></server>
  <server id="1" name="s1"><network domain="D0" port="20001"/><network domain="D1" port="20002"/>
    <property name="aaabus.store" value="memory"/></server>
  <server id="2"><network domain="D1" port="20003"/><network domain="D2" port="20004"/>
    <service class="aaabus.testing.workload:bounce_setup" args="{}"/></server>
  <server id="3"><network domain="D2" port="20005"/></server>
</config>
""",
    """<config>
  <domain name="A"/>
  <server id="0"><network domain="A" port="21000"/></server>
  <server id="5" name="five"><network domain="A" port="21001"/></server>
</config>
""",
]

_TAG = re.compile(r"<(/?)(\w+)")
_ATTR = re.compile(r'(\w+)="([^"]*)"')
_NUMBER = re.compile(r"\d+")


def _edit(text: str, r: random.Random) -> str:
    """One structural edit of an XML text, picked at random."""
    lines = text.splitlines(keepends=True)
    op = r.randrange(10)
    if op == 0 and len(lines) > 1:  # delete a line (an element, or half of one)
        del lines[r.randrange(len(lines))]
    elif op == 1:  # duplicate a line
        i = r.randrange(len(lines))
        lines.insert(i, lines[i])
    elif op == 2:  # swap two lines
        i, j = r.randrange(len(lines)), r.randrange(len(lines))
        lines[i], lines[j] = lines[j], lines[i]
    else:
        matches: list[re.Match[str]]
        if op in (3, 4):
            matches = list(_ATTR.finditer(text))
        elif op in (5, 6):
            matches = list(_NUMBER.finditer(text))
        elif op == 7:
            matches = list(_TAG.finditer(text))
        else:
            matches = []
        if matches:
            m = r.choice(matches)
            replacement = {
                3: lambda: r.choice(["", f'{m.group(1)}x="{m.group(2)}"', f'{m.group(1)}=""']),
                4: lambda: f"{m.group(0)} {m.group(0)}",  # the attribute twice
                5: lambda: str(r.choice([-1, 0, 1, 2, 3, 65535, 65536, 2**40, r.randrange(99)])),
                6: lambda: r.choice(["", "x", "1.5", "0x10", " 7", "\u0661"]),
                7: lambda: f"<{m.group(1)}{r.choice(['domian', 'server', 'config', 'x:y', ''])}",
            }[op]()
            text = text[: m.start()] + replacement + text[m.end() :]
            return text
        # op 8, 9: break the XML itself
        cut = r.randrange(len(text) + 1)
        return text[:cut] + r.choice(["", "<", "&", "]]>", "<!DOCTYPE x>", "\x00", "&bogus;"])
    return "".join(lines)


@settings(max_examples=1500, deadline=None, derandomize=True, database=None)
@given(base=st.sampled_from(VALID), r=st.randoms(use_true_random=False), edits=st.integers(1, 4))
def test_mutated_configs_raise_only_one_line_config_errors(
    base: str, r: random.Random, edits: int
) -> None:
    text = base
    for _ in range(edits):
        text = _edit(text, r)
    try:
        cfg = parse_config(text, "a3.xml")
        Topology.from_config(cfg)
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message, repr(message)


def test_valid_bases_are_valid() -> None:
    # Otherwise the mutations above would start from an error and test little.
    for text in VALID:
        Topology.from_config(parse_config(text, "a3.xml"))


@pytest.mark.slow
def test_mutated_configs_through_the_check_command(tmp_path: Path) -> None:
    r = random.Random(2024)
    codes: set[int] = set()
    for i in range(6):
        text = VALID[i % len(VALID)]
        for _ in range(1 + i % 3):
            text = _edit(text, r)
        path = tmp_path / f"a3-{i}.xml"
        path.write_text(text)
        done = subprocess.run(
            [sys.executable, "-m", "aaabus", "check", str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        codes.add(done.returncode)
        assert done.returncode in (0, 2), (text, done.stderr)
        assert "Traceback" not in done.stderr, done.stderr
        if done.returncode == 2:
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert 2 in codes, "no mutation was refused: the mutator is too gentle to test anything"
