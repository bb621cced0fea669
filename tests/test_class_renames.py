"""Classes that moved (aaabus.model.renames): a store record and a wire frame naming a class by
its old path still load as the class now there, and the store upgrade rewrites the records, so
that a store no longer needs the table afterwards."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import ZODB.utils
from BTrees.OOBTree import OOBTree
from persistent import Persistent
from ZODB.FileStorage import FileStorage

from aaabus import AgentId
from aaabus.config.trust import TrustPolicy
from aaabus.core import upgrades
from aaabus.core.store import open_store
from aaabus.model import renames
from aaabus.model.notifications import Notification
from aaabus.mqtt.roamnotes import Taken
from aaabus.mqtt.sessions import SessionRecord
from aaabus.wire.codec import Codec, encode_note

OLD_MODULE = "tests.formerly"
HERE = __name__


class Kept(Persistent):
    """A stored class, written below under OLD_MODULE as an earlier version would have."""

    def __init__(self, value: int) -> None:
        self.value = value


@dataclass
class Moved(Notification):
    value: int


@pytest.fixture
def moved(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The table says both classes moved from OLD_MODULE to this module."""
    monkeypatch.setitem(renames.RENAMED, f"{OLD_MODULE}.Kept", f"{HERE}.Kept")
    monkeypatch.setitem(renames.RENAMED, f"{OLD_MODULE}.Moved", f"{HERE}.Moved")
    yield


def _as_old(cls: type, module: str = OLD_MODULE) -> None:
    """Make ``cls`` pickle under ``module`` (an importable module then, as it was)."""
    old = types.ModuleType(module)
    setattr(old, cls.__name__, cls)
    cls.__module__ = module
    sys.modules[module] = old


def _as_now(cls: type, module: str = HERE, old: str = OLD_MODULE) -> None:
    cls.__module__ = module
    del sys.modules[old]


@pytest.mark.parametrize("trust", [None, TrustPolicy(["tests"])], ids=["plain", "vetted"])
def test_a_record_stored_under_the_old_path_loads_as_the_class_now_there(
    tmp_path: Path, moved: None, trust: TrustPolicy | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store("file", tmp_path / "s0", 0)
    store.conn.root()[upgrades.SCHEMA_KEY] = 3  # as the release before this step wrote it
    _as_old(Kept)
    try:
        store.conn.root()["kept"] = Kept(7)
        store.commit()
        store.close()
    finally:
        _as_now(Kept)
    data = (tmp_path / "s0" / "data.fs").read_bytes()
    assert OLD_MODULE.encode() in data
    store = open_store("file", tmp_path / "s0", 0, trust)
    try:
        assert store.upgraded == [4]
        kept = store.conn.root()["kept"]
        assert type(kept) is Kept and kept.value == 7
    finally:
        store.close()
    # Rewritten: the current records name the class where it is now, without the table.
    monkeypatch.setattr(renames, "RENAMED", {})
    store = open_store("file", tmp_path / "s0", 0, trust)
    try:
        assert type(store.conn.root()["kept"]) is Kept
    finally:
        store.close()


def test_a_frame_tagged_with_the_old_path_decodes_as_the_class_now_there(moved: None) -> None:
    _as_old(Moved)
    try:
        frame = encode_note(Moved(5))
    finally:
        _as_now(Moved)
    assert f"{OLD_MODULE}:Moved".encode() in frame
    note = Codec().decode(frame)
    assert type(note) is Moved and note.value == 5


# -- the classes issue 45 moved into aaabus.mqtt --------------------------------------------------


def test_an_mqtt_session_stored_before_the_move_loads_and_is_rewritten(tmp_path: Path) -> None:
    old = "aaabus.node.mqttsessions"
    assert renames.RENAMED[f"{old}.SessionRecord"] == "aaabus.mqtt.sessions.SessionRecord"
    store = open_store("file", tmp_path / "s0", 0)
    del store.conn.root()[upgrades.SCHEMA_KEY]  # a store of the release before
    _as_old(SessionRecord, old)
    try:
        store.conn.root()["mqtt_sessions"] = OOBTree(
            {"c1": SessionRecord("c1", AgentId(0, 0, 20), "alice", True)}
        )
        store.commit()
        store.close()
    finally:
        _as_now(SessionRecord, "aaabus.mqtt.sessions", old)
    assert f"c{old}\nSessionRecord".encode() in (tmp_path / "s0" / "data.fs").read_bytes()
    store = open_store("file", tmp_path / "s0", 0, TrustPolicy())
    try:
        record = store.conn.root()["mqtt_sessions"]["c1"]
        assert type(record) is SessionRecord and (record.user, record.clean) == ("alice", True)
        assert 4 in store.upgraded
    finally:
        store.close()
    # The current record names the class where it is now.
    storage = FileStorage(str(tmp_path / "s0" / "data.fs"), read_only=True)
    try:
        current = [storage.load(oid)[0] for oid in _oids(storage)]
    finally:
        storage.close()
    assert not any(old.encode() in record for record in current)
    assert any(b"aaabus.mqtt.sessions\nSessionRecord" in record for record in current)


def _oids(storage: FileStorage) -> list[bytes]:
    oids, oid = [], ZODB.utils.z64
    while oid is not None:
        oid, _tid, _data, oid_next = storage.record_iternext(oid)
        oids.append(oid)
        oid = oid_next
    return oids


def test_a_roaming_note_tagged_before_the_move_decodes() -> None:
    frame = encode_note(Taken("c1"))
    # The old tag has the same length: the frame a server of the release before sends.
    old = frame.replace(b"aaabus.mqtt.roamnotes:Taken", b"aaabus.node.roamnotes:Taken")
    assert old != frame
    note = Codec().decode(old)
    assert type(note) is Taken and note == Taken("c1")
