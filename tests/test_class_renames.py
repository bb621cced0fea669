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
from persistent import Persistent

from aaabus.config.trust import TrustPolicy
from aaabus.core import upgrades
from aaabus.core.store import open_store
from aaabus.model import renames
from aaabus.model.notifications import Notification
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


def _as_old(cls: type) -> types.ModuleType:
    """Make ``cls`` pickle under OLD_MODULE (an importable module then, as it was)."""
    old = types.ModuleType(OLD_MODULE)
    setattr(old, cls.__name__, cls)
    cls.__module__ = OLD_MODULE
    sys.modules[OLD_MODULE] = old
    return old


def _as_now(cls: type) -> None:
    cls.__module__ = HERE
    del sys.modules[OLD_MODULE]


@pytest.mark.parametrize("trust", [None, TrustPolicy(["tests"])], ids=["plain", "vetted"])
def test_a_record_stored_under_the_old_path_loads_as_the_class_now_there(
    tmp_path: Path, moved: None, trust: TrustPolicy | None
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
    renames.RENAMED.clear()
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
