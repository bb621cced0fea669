"""Least privilege for pickles: what is left of them, the store's records, loads nothing else.

The wire carries data only (tests/test_security_wire.py aims the same payloads at the admin
port and at peer frames). Here a pickle that runs ``touch <marker>`` when loaded is planted in
a stopped server's store, and the server must refuse to boot naming the global (``posix.system``)
while the marker never appears; the policy's own rules are tested in-process.
"""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import transaction
import ZODB
import ZODB.FileStorage

from aaabus import AgentId
from aaabus.config.trust import TrustPolicy
from aaabus.core.logstorage import LogStorage
from aaabus.core.store import FILE_NAME, LOG_DIR
from aaabus.errors import UntrustedClass
from tests.support.harness import REPO_ROOT
from tests.support.hostile import Planted, planted_pickle

SYSTEM = f"{__import__('os').system.__module__}.system"  # posix.system on this machine


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["log", "file"])
def test_a_planted_store_is_refused_at_boot_with_one_line(
    tmp_path: Path, make_config: Any, kind: str
) -> None:
    config = make_config(servers=1, properties={"aaabus.store": kind})
    marker = tmp_path / "pwned-by-store"
    storage = tmp_path / "s0"
    storage.mkdir(mode=0o700)
    planted = (
        LogStorage(storage / LOG_DIR)
        if kind == "log"
        else ZODB.FileStorage.FileStorage(str(storage / FILE_NAME))
    )
    db = ZODB.DB(planted)
    with db.transaction() as conn:
        conn.root()["planted"] = Planted(marker)
    db.close()
    transaction.abort()
    run = subprocess.run(
        [sys.executable, "-m", "aaabus", "server", "--id", "0", "--config", str(config),
         "--storage", str(storage)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert run.returncode == 2, (run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and SYSTEM in lines[0] and "Traceback" not in run.stderr, run.stderr
    assert not marker.exists()


def test_the_policy_trusts_classes_of_named_modules_and_plain_data_only() -> None:
    policy = TrustPolicy(["tests.support.agents"])
    from tests.support.agents import Seen

    seen = Seen(AgentId(0, 0, 5), AgentId(0, 1, 9), {"a": [1, 2.5, b"x", {3}]})
    assert policy.loads(pickle.dumps(seen)) == seen
    for refused in (Planted("/nonexistent"), len):
        try:
            policy.loads(pickle.dumps(refused))
        except UntrustedClass as exc:
            assert "refused to unpickle" in str(exc)
        else:
            raise AssertionError(f"{refused!r} was loaded")
    # A function of a trusted module is not a class: refused too.
    try:
        TrustPolicy(["tests.support"]).loads(pickle.dumps(planted_pickle))
    except UntrustedClass as exc:
        assert "not a class" in str(exc)
    else:
        raise AssertionError("a function of a trusted module was loaded")
    assert TrustPolicy(by_value=True).loads(pickle.dumps(len)) is len


def test_each_policy_unpickles_under_its_own_list_and_stays_usable_after_a_refusal() -> None:
    from tests.support.agents import Seen

    lenient, strict = TrustPolicy(["tests.support.agents"]), TrustPolicy([])
    seen = Seen(AgentId(0, 0, 5), AgentId(0, 1, 9), "x")
    data = pickle.dumps(seen)
    assert lenient.loads(data) == seen
    with pytest.raises(UntrustedClass):
        strict.loads(data)  # the other policy's list is not shared
    with pytest.raises(UntrustedClass):
        lenient.loads(pickle.dumps(Planted("/nonexistent")))
    assert lenient.loads(data) == seen  # nothing of the refused load lingers
