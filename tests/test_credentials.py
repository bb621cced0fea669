"""Key derivations and key files: each credential gives what it names and nothing else.

Fast lane (no server process): the one-way property is checked on real files made by the same
functions as ``aaabus secret``. The real-process attacks are in tests/test_security_scopes.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from aaabus.config.scopes import DEFAULT_SCOPE, Scope
from aaabus.config.secret import (
    Credential,
    ServerKeys,
    admin_key,
    link_key,
    load_credential,
    load_secret,
    load_server_keys,
    tool_key,
    write_secret,
    write_server_keys,
    write_tool_key,
)
from aaabus.errors import SecretError
from aaabus.tools.cli import main

SERVERS = range(4)


@pytest.fixture
def bus(tmp_path: Path) -> bytes:
    write_secret(tmp_path / "bus.key")
    return load_secret(tmp_path / "bus.key")


def hex_words(path: Path) -> list[bytes]:
    """Every 32-byte value written in a key file, whatever its line says it is."""
    return [bytes.fromhex(w) for w in re.findall(r"\b[0-9a-f]{64}\b", path.read_text())]


def test_admin_keys_are_per_server_and_per_scope_and_agree_everywhere(
    tmp_path: Path, bus: bytes
) -> None:
    keys = {
        (s, sid): ServerKeys.from_bus_key(bus, sid).admin_key(s) for s in Scope for sid in SERVERS
    }
    assert len(set(keys.values())) == len(keys)  # no two (scope, server) share a key
    for scope in Scope:
        write_tool_key(tmp_path / f"{scope.label}.key", tmp_path / "bus.key", scope)
        tool = load_credential(tmp_path / f"{scope.label}.key")
        assert tool.is_tool and tool.scope is scope
        assert (
            (tmp_path / f"{scope.label}.key")
            .read_text()
            .startswith(f"aaabus-tool-key-v2 {scope.label} ")
        )
        for sid in SERVERS:
            # What a tool derives, what the bus key derives, what a server reads from its file.
            assert tool.admin_key(sid) == keys[scope, sid]
            assert Credential(bus, scope).admin_key(sid) == keys[scope, sid]
            assert admin_key(tool_key(bus, scope), sid) == keys[scope, sid]
    write_server_keys(tmp_path / "s2.key", tmp_path / "bus.key", 2, SERVERS)
    from_file = load_server_keys(tmp_path / "s2.key", 2, SERVERS)
    assert all(from_file.admin_key(s) == keys[s, 2] for s in Scope)


def test_a_bus_key_held_by_a_tool_claims_operate_unless_asked(bus: bytes) -> None:
    assert DEFAULT_SCOPE is Scope.OPERATE
    assert Credential(bus).scope is Scope.OPERATE and not Credential(bus).is_tool
    assert Credential(bus).admin_key(1) == admin_key(tool_key(bus, Scope.OPERATE), 1)
    assert Credential(bus, Scope.CODE).admin_key(1) == admin_key(tool_key(bus, Scope.CODE), 1)


def test_a_server_key_file_gives_nothing_of_another_server_nor_a_tool_key(
    tmp_path: Path, bus: bytes
) -> None:
    write_server_keys(tmp_path / "s1.key", tmp_path / "bus.key", 1, SERVERS)
    captured = hex_words(tmp_path / "s1.key")
    assert len(captured) == 1 + len(Scope) + 3  # identity, admin keys, links to 0, 2, 3
    others = {ServerKeys.from_bus_key(bus, sid).admin_key(s) for s in Scope for sid in (0, 2, 3)}
    tools = {tool_key(bus, s) for s in Scope}
    foreign_links = {link_key(bus, a, b) for a in (0, 2, 3) for b in (0, 2, 3) if a < b}
    for key in captured:
        # Used as it is, or as the tool key an admin key is derived from, or as the bus key:
        # never another server's admin key, a tool key, a link that is not server 1's, the bus key.
        derived = {admin_key(key, sid) for sid in SERVERS} | {tool_key(key, s) for s in Scope}
        derived |= {link_key(key, a, b) for a in SERVERS for b in SERVERS}
        assert not ({key} | derived) & (others | tools | foreign_links | {bus})


def test_old_key_files_are_refused_in_one_line_with_the_command_to_run(
    tmp_path: Path, bus: bytes
) -> None:
    old_server = tmp_path / "s1.key"
    write_secret(old_server, f"aaabus-server-key-v1 1\ntool {'ab' * 32}\nidentity {'cd' * 32}\n")
    with pytest.raises(SecretError) as refused:
        load_server_keys(old_server, 1, SERVERS)
    line = str(refused.value)
    assert "older format" in line and "aaabus secret --server 1" in line and "\n" not in line
    old_tool = tmp_path / "tool.key"
    write_secret(old_tool, f"aaabus-tool-key-v1 {'ab' * 32}\n")
    with pytest.raises(SecretError, match=r"older format.*aaabus secret --tool --scope"):
        load_credential(old_tool)
    odd_scope = tmp_path / "odd.key"
    write_secret(odd_scope, f"aaabus-tool-key-v2 admin {'ab' * 32}\n")
    with pytest.raises(SecretError, match="unknown scope 'admin'; the scopes are read, operate"):
        load_credential(odd_scope)
    # A server key file is no tool's credential.
    write_server_keys(tmp_path / "s2.key", tmp_path / "bus.key", 2, SERVERS)
    with pytest.raises(SecretError, match="one server's key file"):
        load_credential(tmp_path / "s2.key")


def test_the_secret_command_makes_scoped_tool_keys(
    tmp_path: Path, bus: bytes, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["secret", "--tool", "--out", "default.key"]) == 0
    assert load_credential(tmp_path / "default.key").scope is Scope.OPERATE
    assert main(["secret", "--tool", "--scope", "read", "--out", "read.key"]) == 0
    assert load_credential(tmp_path / "read.key").scope is Scope.READ
    for args, says in (
        (["--tool", "--scope", "root", "--out", "x.key"], "unknown scope 'root'"),
        (["--scope", "read", "--out", "y.key"], "--scope is the scope of a tool key"),
    ):
        assert main(["secret", *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    assert not (tmp_path / "x.key").exists() and not (tmp_path / "y.key").exists()
