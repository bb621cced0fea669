"""Least privilege for pickles: a `__reduce__` payload is refused at every entry point.

Each test aims a pickle that runs ``touch <marker>`` when loaded at a real server process on
127.0.0.1 (through a peer link, the admin port's send and deploy, and a planted store) and checks
that the server refuses it by naming the global (``posix.system``) and that the marker never
appears. On a server without the restricted loader every one of them creates the marker.
"""

from __future__ import annotations

import base64
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import transaction
import ZODB
import ZODB.FileStorage

from aaabus import AgentId, AgentServer
from aaabus.config.admin_port import admin_address
from aaabus.config.reader import load_config
from aaabus.config.secret import load_secret
from aaabus.config.trust import TrustPolicy
from aaabus.core.logstorage import LogStorage
from aaabus.core.store import FILE_NAME, LOG_DIR
from aaabus.errors import UntrustedClass
from aaabus.io.link import Link
from aaabus.model.notifications import AgentCreateReply, ExceptionNotification
from aaabus.tools.launch import Bus
from tests.support.harness import REPO_ROOT, Inbox
from tests.support.hostile import Inject, Injector, Planted, planted_pickle

SYSTEM = f"{__import__('os').system.__module__}.system"  # posix.system on this machine


@pytest.mark.slow
def test_peer_frames_naming_untrusted_globals_are_refused_before_construction(
    tmp_path: Path, make_config: Any
) -> None:
    config = make_config(servers=2)
    marker = tmp_path / "pwned-by-peer"
    with Bus(config, [1], tmp_path / "store", cwd=REPO_ROOT):
        # Server 0 holds the key and links to the real server 1: whatever it sends is a peer
        # frame, exactly what a stolen key or a compromised peer can produce.
        server0 = AgentServer(load_config(config), 0, storage=tmp_path / "s0")
        server0.start()
        inbox = Inbox()
        server0.add_listener(inbox)
        try:
            injector = server0.deploy(Injector())
            server0.send(injector, Inject(1, str(marker)))
            report = inbox.get(timeout=30)
            assert isinstance(report, ExceptionNotification), report
            assert report.error_type == "UntrustedClass"
            assert SYSTEM in report.error_message
            # An agent deployed through the factory is a pickle inside the pickle.
            server0.send(injector, Inject(1, str(marker), via_factory=True))
            reply = inbox.get(timeout=30)
            assert isinstance(reply, AgentCreateReply) and not reply.ok, reply
            assert SYSTEM in reply.error and "UntrustedClass" in reply.error
        finally:
            server0.stop()
    assert not marker.exists()


@pytest.mark.slow
def test_admin_send_and_deploy_of_untrusted_globals_are_refused(
    tmp_path: Path, make_config: Any
) -> None:
    config = make_config(servers=1)
    marker = tmp_path / "pwned-by-tool"
    payload = base64.b64encode(planted_pickle(marker)).decode()
    with Bus(config, [0], tmp_path / "store", cwd=REPO_ROOT):
        cfg = load_config(config)
        address, _ = admin_address(cfg, 0)
        assert address is not None
        link = Link.connect(address, load_secret(tmp_path / "bus.key"), 0)
        try:
            sent = link.request({"op": "send", "id": "s", "to": "#0.0.1", "note": payload})
            assert sent["ok"] is False and SYSTEM in sent["error"], sent
            deployed = link.request({"op": "deploy", "id": "d", "agent": payload})
            assert deployed["ok"] is False and SYSTEM in deployed["error"], deployed
            assert link.request({"op": "status"})["ok"]
        finally:
            link.close()
    assert not marker.exists()


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
