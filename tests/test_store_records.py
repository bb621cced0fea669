"""What a store's records may be: the walk of pickle opcodes, the exact names, the plain types.

The records the bus writes (its own, and agents holding the usual state types) load through the
vetted store; the walk (:func:`aaabus.wire.pickles.vet_pickles`) refuses each opcode sequence
that changes a class or calls what the pickle did not name, and follows the unpickler on random
opcode sequences; the policy resolves exact ``module.Class`` names only.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import decimal
import io
import json
import pickle
import subprocess
import sys
import time
import tracemalloc
import uuid
from array import _array_reconstructor as array_reconstructor  # type: ignore[attr-defined]
from array import array
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import zodbpickle.pickle
from BTrees.LOBTree import LOBTree
from BTrees.OOBTree import OOBTree, OOTreeSet
from hypothesis import given, settings
from hypothesis import strategies as st
from persistent import Persistent
from persistent.list import PersistentList
from persistent.mapping import PersistentMapping
from ZODB.Connection import TransactionMetaData
from ZODB.utils import oid_repr

from aaabus import AgentId
from aaabus.config.trust import TrustPolicy, home_of
from aaabus.core.records import vet_record
from aaabus.core.store import PersistentQueue, Store, open_store
from aaabus.errors import MalformedPickle, UntrustedClass
from aaabus.tools.launch import Bus
from aaabus.wire.message import Message
from aaabus.wire.pickles import vet_pickles
from tests.support.agents import Inc
from tests.support.bus import wait_json
from tests.support.harness import REPO_ROOT, TEST_TRUST
from tests.support.homes import Kept
from tests.support.records import glob, ops, root_record

TRUST = TEST_TRUST.split(",")


class Holder(Persistent):
    """An agent's state as applications keep it: persistent containers and plain values."""

    def __init__(self) -> None:
        queue = PersistentQueue()
        queue.put(Message(AgentId(0, 0, 16), AgentId(0, 1, 17), b"body"))
        self.items = PersistentList([1, "two", AgentId(1, 2, 3)])
        self.table = PersistentMapping({"k": AgentId(1, 2, 3), "note": Inc(4)})
        self.tree = OOBTree({"a": 1, "b": (2, b"x")})
        self.by_seq = LOBTree({1: "one"})
        self.members = OOTreeSet(["x", "y"])
        self.queue = queue
        self.when = datetime.datetime(2026, 1, 2, 3, 4, 5, 6, tzinfo=datetime.UTC)
        est = datetime.timezone(-datetime.timedelta(hours=5), "EST")
        self.local = datetime.datetime(2026, 1, 2, tzinfo=est)
        self.day, self.at = datetime.date(2026, 1, 2), datetime.time(3, 4, 5)
        self.delay = datetime.timedelta(days=1, microseconds=5)
        self.price = decimal.Decimal("-12.50")
        self.raw, self.no_raw = bytearray(b"\x00\xff"), bytearray()
        self.tags, self.frozen, self.none = {"a", "b"}, frozenset({1, 2}), set[int]()
        self.recent = collections.deque([1, 2], maxlen=3)
        self.counts = collections.Counter("aab")
        self.ordered = collections.OrderedDict([("z", 1), ("a", 2)])
        self.uid = uuid.UUID("12345678-1234-5678-1234-567812345678")
        self.z = complex(1, -2)
        self.page = array("q", [1, -2, 3])
        self.nested = {"ids": [AgentId(4, 5, 6)] * 2, "t": (1, 2.5, None, True, b"x", "é")}

    def values(self) -> dict[str, Any]:
        """Its attributes, BTrees and persistent containers as plain ones (to compare)."""
        plain = dict(vars(self))
        for name in ("tree", "by_seq", "queue"):
            plain[name] = dict(plain[name].items())
        plain["members"] = list(plain["members"])
        return plain


@pytest.mark.parametrize("kind", ["log", "file"])
def test_the_records_the_bus_writes_load_through_the_vetted_store(
    tmp_path: Path, kind: str
) -> None:
    store = open_store(kind, tmp_path, 0, TrustPolicy(TRUST))
    store.agents[(0, 99)] = Holder()
    store.qin.put(Message(AgentId(0, 0, 1), AgentId(0, 0, 99), b"body"))
    store.commit()
    written = store.agents[(0, 99)].values()
    store.close()
    store = open_store(kind, tmp_path, 0, TrustPolicy(TRUST))  # a fresh policy: nothing cached
    try:
        loaded = store.agents[(0, 99)]
        assert loaded.values() == written
        assert {k: type(v) for k, v in loaded.values().items()} == {
            k: type(v) for k, v in written.items()
        }
        assert store.qin.peek().target == AgentId(0, 0, 99)
        assert every_record_vets(store) >= 10
    finally:
        store.close()


def test_a_root_whose_state_fetches_from_its_class_pickle_opens(tmp_path: Path) -> None:
    # ZODB pickles a record's class and state with one pickler: a PersistentMapping under the
    # root is a reference whose class the state fetches from the class pickle's memo.
    store = open_store("log", tmp_path, 0)
    store.conn.root()["extra"] = PersistentMapping()
    store.commit()
    store.close()
    open_store("log", tmp_path, 0, TrustPolicy(TRUST)).close()


def every_record_vets(store: Store) -> int:
    """Vet every current record of ``store`` and load each object; how many there are."""
    storage, policy, count = store.conn.db().storage, TrustPolicy(TRUST), 0
    following: bytes | None = None
    while True:
        oid, _tid, record, following = storage.record_iternext(following)
        vet_record(policy, record)
        store.conn.get(oid)._p_activate()
        count += 1
        if following is None:
            return count


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["log", "file"])
def test_every_record_a_real_bus_wrote_vets_and_loads(
    tmp_path: Path, make_config: Any, kind: str
) -> None:
    # Two server processes bounce notifications: agents, queues in and out, held-back messages,
    # clocks and their pages, topic representatives, server records, as ZODB wrote them.
    done = tmp_path / "done.json"
    args = json.dumps({"echo": 1, "n": 300, "done": str(done)})
    service = f"<service class=\"aaabus.testing.workload:bounce_setup\" args='{args}'/>"
    trust = f"{TEST_TRUST},aaabus.testing"  # the workload's agents and notifications
    properties = {"aaabus.store": kind, "aaabus.trust": trust}
    config = make_config(servers=2, extra={0: service}, properties=properties)
    with Bus(config, [0, 1], tmp_path / "store", cwd=REPO_ROOT) as bus:
        assert wait_json(done, bus.servers.values(), 60) == {"count": 300, "errors": 0}
    for sid in (0, 1):
        store = open_store(kind, tmp_path / "store" / f"s{sid}", sid, TrustPolicy(TRUST))
        try:
            assert every_record_vets(store) >= 8
        finally:
            store.close()


def test_a_planted_record_below_the_root_is_refused_when_loaded_naming_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store("log", tmp_path, 0, TrustPolicy(TRUST))
    store.agents[(0, 99)] = Holder()
    store.commit()
    oid = store.agents[(0, 99)]._p_oid
    storage = store.conn.db().storage
    txn = TransactionMetaData()
    storage.tpc_begin(txn)
    planted = root_record(glob("aaabus.model.ids", "AgentId") + b"N}" + ops("parse") + b"Ns\x86b")
    storage.store(oid, storage.load(oid)[1], planted, "", txn)
    storage.tpc_vote(txn)
    storage.tpc_finish(txn)
    store.close()
    store = open_store("log", tmp_path, 0, TrustPolicy(TRUST))
    try:
        with pytest.raises(UntrustedClass, match=f"^record {oid_repr(oid)}: .*BUILD at byte"):
            store.agents[(0, 99)]._p_activate()
        assert AgentId.parse("#1.2.3") == AgentId(1, 2, 3)
        assert store.record.server_id == 0  # the rest of the store still loads
    finally:
        store.close()
    assert not [r for r in caplog.records if r.name == "ZODB.Connection"], caplog.text


# -- the walk ------------------------------------------------------------------------------


def vet(data: bytes) -> list[str]:
    """Vet one pickle (protocol 4 unless it says otherwise); the globals it names, in order."""
    named: list[str] = []
    body = data if data.startswith(b"\x80") else b"\x80\x04" + data
    vet_pickles(body, 1, lambda module, name: named.append(f"{module}.{name}"))
    return named


A = glob("m", "A")
TEXT_A = b"\x8c\x01m\x8c\x01A"  # SHORT_BINUNICODE "m", "A": what STACK_GLOBAL takes

REFUSED = {
    "BUILD on a global": (A + b"Nb.", "BUILD at byte 8 would change the global m.A"),
    "BUILD on a copy of a global": (A + b"2Nb.", "BUILD at byte 9"),
    "BUILD on a global from the memo": (A + b"q\x000h\x00Nb.", "BUILD at byte 13"),
    "BUILD on a STACK_GLOBAL": (TEXT_A + b"\x93Nb.", "would change the global m.A"),
    "BUILD on a STACK_GLOBAL of memoized text": (
        b"\x8c\x01m\x94\x8c\x01A\x9400h\x00h\x01\x93Nb.",
        "would change the global m.A",
    ),
    "BUILD on a global whose mark was popped": (A + b"(0Nb.", "BUILD at byte 10"),
    "BUILD on a global left by POP_MARK": (A + b"(NN1Nb.", "BUILD at byte 12"),
    "APPEND to a global": (A + b"Na.", "APPEND at byte 8"),
    "APPENDS to a global": (A + b"(NNe.", "APPENDS at byte 10"),
    "SETITEM on a global": (A + b"NNs.", "SETITEM at byte 9"),
    "SETITEMS on a global": (A + b"(NNu.", "SETITEMS at byte 10"),
    "ADDITEMS to a global": (A + b"(N\x90.", "ADDITEMS at byte 9"),
    "REDUCE of a value": (b"N)R.", "REDUCE at byte 4 calls something the pickle did not name"),
    "REDUCE of what a call returned": (A + b")R)R.", "REDUCE at byte 10 calls"),
    "NEWOBJ of a value": (b"N)\x81.", "NEWOBJ at byte 4 calls"),
    "NEWOBJ_EX of a value": (b"N)}\x92.", "NEWOBJ_EX at byte 5 calls"),
    "a global as a persistent id": (A + b"Q.", "BINPERSID at byte 7 takes the global m.A"),
    "INST": (b"(im\nA\n.", "opcode INST at byte 3"),
    "OBJ": (b"(" + A + b"o.", "opcode OBJ at byte 8"),
    "EXT1": (b"\x82\x01.", "opcode EXT1 at byte 2"),
    "NEXT_BUFFER": (b"\x97.", "opcode NEXT_BUFFER at byte 2"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_the_walk_refuses_what_find_class_cannot_see(name: str) -> None:
    data, says = REFUSED[name]
    with pytest.raises(UntrustedClass, match=f"^refused to unpickle: .*{says}"):
        vet(data)


MALFORMED = {
    "BUILD with nothing to build": (b"Nb.", "takes more from the stack than it holds"),
    "an item above a mark is not the target": (b"N(a.", "APPEND at byte 4 takes more"),
    "a memo entry never stored": (b"NNNNNNh\x05.", "fetches memo 5, never stored"),
    "a memo index no pickler writes": (b"Nr\xff\xff\xff\x7f.", "memo index at byte 3"),
    "STACK_GLOBAL of values": (b"NN\x93.", "STACK_GLOBAL at byte 4 does not name"),
    "no STOP": (A, "cut short"),
    "no opcode": (b"\xff.", "byte 2 is not a pickle opcode"),
    "a TUPLE without a mark": (b"Nt.", "TUPLE at byte 3 takes more"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_the_walk_refuses_what_the_unpickler_would_reject(name: str) -> None:
    data, says = MALFORMED[name]
    with pytest.raises(MalformedPickle, match=says):
        vet(data)


def test_the_walk_names_every_global_before_anything_runs_and_shares_the_record_memo() -> None:
    record = pickle.dumps(AgentId, 3) + pickle.dumps({"a": [AgentId(1, 2, 3)]}, 3)
    named: list[str] = []
    end = vet_pickles(record, 2, lambda m, n: named.append(f"{m}.{n}"))
    assert end == len(record) and named == ["aaabus.model.ids.AgentId"] * 2
    # ZODB's pickler shares its memo between a record's two pickles: the state may fetch (and
    # BUILD) what the class pickle memoized.
    state = b"\x80\x03h\x00N}" + ops("parse") + b"Ns\x86b."
    with pytest.raises(UntrustedClass, match="BUILD at byte 52 would change the global"):
        vet_pickles(pickle.dumps(AgentId, 3) + state, 2, lambda m, n: None)
    with pytest.raises(UntrustedClass, match=r"^refused to unpickle m\.A: no"):
        vet_pickles(b"\x80\x03" + A + b".", 1, refuse_all)


def refuse_all(module: str, name: str) -> None:
    raise UntrustedClass(f"refused to unpickle {module}.{name}: no")


def test_the_walk_is_linear_and_allocates_in_proportion_to_its_input() -> None:
    # The costliest shapes per byte: marks popped and pushed, text kept for STACK_GLOBAL,
    # every value memoized.
    worst = b"\x80\x04" + b"(N1" * 30_000 + b"\x8c\x00\x94" * 30_000 + b"N."
    tracemalloc.start()
    started = time.process_time()
    try:
        assert vet(worst) == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 100 * len(worst), (peak, len(worst))
    assert time.process_time() - started < 5  # ~0.1 s: a quadratic walk would take an hour


# -- the walk against the unpickler itself -------------------------------------------------------

EVENTS: list[str] = []


class _ProbeMeta(type):
    """What an unpickler does to a class object goes through its metaclass: recorded."""

    def __setstate__(cls, state: Any) -> None:
        EVENTS.append(f"BUILD on {cls.__name__}")

    def __setattr__(cls, name: str, value: Any) -> None:
        EVENTS.append(f"setattr on {cls.__name__}")

    def __setitem__(cls, key: Any, value: Any) -> None:
        EVENTS.append(f"setitem on {cls.__name__}")

    def append(cls, item: Any) -> None:
        EVENTS.append(f"append to {cls.__name__}")

    def extend(cls, items: Any) -> None:
        EVENTS.append(f"extend {cls.__name__}")

    def add(cls, item: Any) -> None:
        EVENTS.append(f"add to {cls.__name__}")


class _Probe(metaclass=_ProbeMeta):
    def __new__(cls, *args: Any, **kwargs: Any) -> _Probe:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        EVENTS.append("called an object the pickle did not name")


PROBES = {name: _ProbeMeta(name, (_Probe,), {}) for name in ("A", "B")}


class _StdlibProbing(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return PROBES[name]


class _ZodbProbing(zodbpickle.pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        return PROBES[name]


#: Opcodes that push, move, store and consume values, globals among them (protocol 3, then the
#: protocol 4 additions): random sequences of them reach the odd corners (marks popped by POP,
#: values below a mark), most of them rejected by both the walk and the unpickler.
TOKENS = {
    3: [
        glob("m", "A"), glob("m", "B"), b"(", b"0", b"1", b"2", b"N", b"K\x01", b"]", b"}", b")",
        b"t", b"\x85", b"\x86", b"\x87", b"l", b"d", b"a", b"e", b"s", b"u", b"b", b"R", b"\x81",
        *(b"q" + bytes([i]) for i in range(3)), *(b"h" + bytes([i]) for i in range(3)),
    ],
    4: [b"\x94", b"\x8c\x01m", b"\x8c\x01A", b"\x93", b"\x8f", b"\x90", b"\x91", b"\x92"],
}  # fmt: skip
TOKENS[4] += TOKENS[3]


def values(protocol: int) -> st.SearchStrategy[bytes]:
    """Opcodes that leave one value on the stack, built from others: well-formed programs that
    hand globals, copies of them, memo entries and call results to every consumer."""
    leaves = [glob("m", "A"), glob("m", "B"), b"N", b"K\x01", b"]", b"}", b")", b"h\x00", b"h\x01"]
    if protocol >= 4:
        leaves.append(b"\x8c\x01m\x8c\x01A\x93")  # STACK_GLOBAL

    def around(children: st.SearchStrategy[bytes]) -> st.SearchStrategy[bytes]:
        one, two = children, st.tuples(children, children).map(b"".join)
        some = st.lists(children, max_size=3).map(b"".join)
        forms = [
            one.map(lambda v: v + b"q\x00"),  # memoized (BINPUT 0)
            one.map(lambda v: v + b"q\x01"),
            one.map(lambda v: v + b"20"),  # DUP, POP
            one.map(lambda v: v + b"(0"),  # MARK, POP: pops the mark
            one.map(lambda v: v + b"(N1"),  # MARK, a value, POP_MARK
            two.map(lambda v: v + b"\x86"),  # TUPLE2
            two.map(lambda v: v + b"\x85R"),  # callee, (argument,): REDUCE
            two.map(lambda v: v + b"\x85\x81"),  # NEWOBJ
            two.map(lambda v: v + b"b"),  # BUILD
            two.map(lambda v: v + b"a"),  # APPEND
            st.tuples(two, one).map(lambda v: v[0] + v[1] + b"s"),  # SETITEM
            st.tuples(one, some).map(lambda v: v[0] + b"(" + v[1] + b"e"),  # APPENDS
            st.tuples(one, some).map(lambda v: v[0] + b"(" + v[1] + b"u"),  # SETITEMS
            some.map(lambda v: b"(" + v + b"t"),  # TUPLE
        ]
        if protocol >= 4:
            forms.append(st.tuples(one, some).map(lambda v: v[0] + b"(" + v[1] + b"\x90"))
        return st.one_of(forms)

    return st.recursive(st.sampled_from(leaves), around, max_leaves=12)


def programs(protocol: int) -> st.SearchStrategy[bytes]:
    """Whole pickles of ``protocol``: well-formed values, or random opcode sequences."""
    body = st.one_of(
        values(protocol), st.lists(st.sampled_from(TOKENS[protocol]), max_size=24).map(b"".join)
    )
    return body.map(lambda b: bytes([0x80, protocol]) + b + b".")


def unpickle_probing(unpickler: type, data: bytes) -> None:
    # A pickle the unpickler rejects did nothing more than what ran before the error.
    with contextlib.suppress(Exception):
        unpickler(io.BytesIO(data)).load()


def walk_then_unpickle(data: bytes, unpickler: type) -> None:
    try:
        vet_pickles(data, 1, lambda m, n: None)
    except (UntrustedClass, MalformedPickle):
        return
    EVENTS.clear()
    unpickle_probing(unpickler, data)
    assert EVENTS == [], (data, EVENTS)


PROPERTY = settings(max_examples=3000, deadline=None, derandomize=True, database=None)


@PROPERTY
@given(programs(4))
def test_what_the_walk_lets_through_never_changes_a_class_nor_calls_an_unnamed_object(
    data: bytes,
) -> None:
    walk_then_unpickle(data, _StdlibProbing)


@PROPERTY
@given(programs(3))
def test_the_same_holds_for_the_unpickler_zodb_uses(data: bytes) -> None:
    walk_then_unpickle(data, _ZodbProbing)


def test_the_probes_see_what_the_walk_refuses() -> None:
    # Without the walk, each of these reaches the class: the property above is not vacuous.
    for name in ("BUILD on a global", "APPENDS to a global", "SETITEM on a global"):
        EVENTS.clear()
        unpickle_probing(_StdlibProbing, b"\x80\x04" + REFUSED[name][0])
        assert EVENTS, name
    EVENTS.clear()
    unpickle_probing(_StdlibProbing, b"\x80\x04" + A + b")R)R.")
    assert EVENTS == ["called an object the pickle did not name"]


# -- exact names ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("module", "name", "says"),
    [
        ("aaabus", "AgentId", "it is aaabus.model.ids.AgentId"),  # a re-export
        ("tests.support.tls", "Path", "it is pathlib.Path"),  # pathlib._local's since 3.13
        ("tests.support.homes.elsewhere", "Kept", "it is tests.support.homes.Kept"),
        ("tests.support.tls", "subprocess", "a module, not a class"),
        ("tests.support.hostile", "planted_pickle", "a function, not a class"),
        ("tests.support.hostile", "Nothing", "no such name"),
        ("tests.support.hostile", "Planted.__reduce__", "a dotted name"),
        ("persistent.mapping", "default", "not trusted here"),  # a class, but not Persistent
        ("aaabus.tools.launch", "Bus", "not trusted here"),  # not a data class
        ("tests.__main__", "X", "a __main__ module is a program"),
        ("builtins", "range", "not trusted here"),
    ],
)
def test_a_record_names_exact_classes_only(module: str, name: str, says: str) -> None:
    with pytest.raises(UntrustedClass, match=f"^refused to unpickle {module}.{name}: .*{says}"):
        TrustPolicy(TRUST).find_class(module, name)


def test_a_class_published_by_its_package_has_the_package_for_home() -> None:
    # Kept is defined in tests.support.homes._defined and published by tests.support.homes, as
    # pathlib publishes Path (defined in pathlib._local from 3.13): a pickle names where it is
    # defined, a record written by another version or by hand may name the package.
    assert Kept.__module__ == "tests.support.homes._defined"
    assert home_of(Kept) == "tests.support.homes"
    assert home_of(Path) == "pathlib"  # on every version
    assert home_of(AgentId) == "aaabus.model.ids"  # a public module is its own home
    policy = TrustPolicy(TRUST)
    assert policy.find_class("tests.support.homes", "Kept") is Kept
    assert policy.find_class("tests.support.homes._defined", "Kept") is Kept


@pytest.mark.parametrize(("cls", "value"), [(Kept, 7), (PurePosixPath, "/7")])
def test_a_qualified_trust_entry_names_the_home_on_every_version(cls: type, value: Any) -> None:
    # Each interpreter pickles the class under its own __module__ (pathlib._local on 3.13,
    # pathlib before); the one entry aaabus.trust=<home>.<name> loads both spellings.
    name = cls.__qualname__
    policy = TrustPolicy([f"{home_of(cls)}.{name}"])
    assert type(policy.loads(pickle.dumps(cls(value)))) is cls
    assert policy.find_class(home_of(cls), name) is cls
    assert policy.find_class(cls.__module__, name) is cls
    with pytest.raises(UntrustedClass, match="not trusted here"):
        TrustPolicy([f"{home_of(cls)}.Other"]).find_class(cls.__module__, name)


_IMPORT_RULE = """
import sys
import pytest
from aaabus.config.trust import TrustPolicy, home_of
from aaabus.errors import UntrustedClass
assert "aaabus.tools.cli" not in sys.modules and "aaabus.testing.workload" not in sys.modules
with pytest.raises(UntrustedClass, match=r"module aaabus\\.tools\\.cli is not loaded here"):
    TrustPolicy(sys.argv[1].split(",")).find_class("aaabus.tools.cli", "main")
assert "aaabus.tools.cli" not in sys.modules
bouncer = TrustPolicy(sys.argv[1].split(",")).find_class("aaabus.testing.workload", "Bouncer")
assert bouncer.__module__ == "aaabus.testing.workload"  # the agents of its workloads
"""


def test_a_record_imports_no_module_but_trusted_ones_and_the_bus_s_stored_classes() -> None:
    # In a child process: a module imported twice in one process would register its classes
    # twice, and the rest of the suite would meet two classes of one name.
    run = subprocess.run(
        [sys.executable, "-c", _IMPORT_RULE, ",".join(TRUST)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ((pickle.loads, ()), "not trusted here"),
        ((bytearray, (10,)), r"bytearray\(int\): it takes only bytes"),
        ((set, ("abc",)), r"set\(str\): it takes only list or tuple"),
        ((collections.deque, ([], 1.5)), r"deque\(maxlen=float\): it takes only int or NoneType"),
        ((collections.Counter, ([1],)), r"Counter\(list\): it takes only dict"),
        ((array_reconstructor, (set, "b", 0, b"")), "for _set: array.array only"),
    ],
)
def test_the_plain_types_take_only_what_the_pickle_holds(value: Any, says: str) -> None:
    callee, args = value
    data = glob(callee.__module__, callee.__name__) + ops(args) + b"R."
    with pytest.raises(UntrustedClass, match=says):
        TrustPolicy(TRUST).loads(b"\x80\x03" + data)
