"""The credentials file of MQTT devices (salted scrypt hashes) and the command that writes its
lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from aaabus.errors import ConfigError
from aaabus.mqtt import auth as mqttauth
from aaabus.mqtt.auth import Credentials, hash_password, main


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


def test_an_unknown_user_is_checked_at_the_cost_of_a_known_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whether a user exists does not show in how long its refusal takes: an unknown name runs
    scrypt with the parameters of the file's entries, as a wrong password does."""
    path = tmp_path / "mqtt.passwd"
    path.write_text(f"sensor:{hash_password('s3cret')}\n")
    creds = Credentials.load(path)
    costs: list[tuple[int, int, int]] = []
    derive = mqttauth._derive

    def counted(password: str, salt: bytes, n: int, r: int, p: int) -> bytes:
        costs.append((n, r, p))
        return derive(password, salt, n, r, p)

    monkeypatch.setattr(mqttauth, "_derive", counted)
    assert not creds.check("sensor", "wrong")
    assert not creds.check("ghost", "wrong")
    assert not creds.check("ghost", "s3cret")
    assert len(costs) == 3 and len(set(costs)) == 1, costs
