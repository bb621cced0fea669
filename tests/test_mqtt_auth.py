"""The credentials file of MQTT devices (salted scrypt hashes) and the command that writes its
lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from aaabus.errors import ConfigError
from aaabus.io.mqttauth import Credentials, hash_password, main


def test_credentials_accept_the_right_password_only(tmp_path: Path) -> None:
    path = tmp_path / "mqtt.passwd"
    path.write_text(f"# devices\nsensor:{hash_password('s3cret')}\n\n")
    creds = Credentials.load(path)
    assert creds.check("sensor", "s3cret")
    assert not creds.check("sensor", "s3cret ")
    assert not creds.check("other", "s3cret")
    assert not creds.check(None, None)


def test_a_malformed_credentials_line_is_one_config_error_naming_the_line(tmp_path: Path) -> None:
    path = tmp_path / "mqtt.passwd"
    path.write_text(f"sensor:{hash_password('x')}\nbroken line\n")
    with pytest.raises(ConfigError, match=r"line 2 is not user:scrypt"):
        Credentials.load(path)
    with pytest.raises(ConfigError, match="unreadable"):
        Credentials.load(tmp_path / "missing")


def test_the_hashing_command_prints_a_line_the_file_accepts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO("pw\n"))
    assert main(["meter"]) == 0
    path = tmp_path / "f"
    path.write_text(capsys.readouterr().out)
    assert Credentials.load(path).check("meter", "pw")
