"""Typed settings: every aaabus.* property checked once, when the file is read, with one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from aaabus.config import settings
from aaabus.config.reader import load_config, parse_config
from aaabus.errors import ConfigError
from aaabus.tools.cli import main
from tests.support.harness import REPO_ROOT


def config_with(prop: str, value: str, *, on_server: bool = False) -> str:
    line = f'<property name="{prop}" value="{value}"/>'
    return (
        "<config>\n"
        '<domain name="D"/>\n'
        '<server id="0"><network domain="D" port="1000"/>\n'
        + (f"  {line}\n" if on_server else "")
        + "</server>\n"
        + ("" if on_server else f"{line}\n")
        + "</config>\n"
    )


@pytest.mark.parametrize(
    ("prop", "value", "expected"),
    [
        ("aaabus.admin.port", "abc", "expected a port in 1..65535 or off"),
        ("aaabus.admin.port", "70000", "expected a port in 1..65535 or off"),
        ("aaabus.engine.max_batch", "-3", "expected an integer in 1..1000000"),
        ("aaabus.engine.max_group_ms", "0", "expected an integer in 1..60000"),
        ("aaabus.max_frame", "12", "expected an integer in 1024.."),
        ("aaabus.client.remember", "many", "expected an integer"),
        ("aaabus.metrics.port", "-1", "expected an integer in 0..65535"),
        ("aaabus.metrics.host", "", "expected a host name"),
        ("aaabus.test.allow_cycles", "yes", "expected true or false"),
        ("aaabus.store", "disk", "expected one of log, file, memory"),
        ("aaabus.dial.3", "nowhere", "expected host:port"),
        ("aaabus.secret", " ", "expected a file name"),
        ("aaabus.gc.thresholds", "700,10", "expected three integers g0,g1,g2"),
        ("aaabus.gc.thresholds", "0,10,10", "expected g0 in 100..10000000"),
    ],
)
@pytest.mark.parametrize("on_server", [False, True])
def test_a_bad_value_is_one_line_with_the_place(
    prop: str, value: str, expected: str, on_server: bool
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(config_with(prop, value, on_server=on_server), "a3.xml")
    message = str(info.value)
    assert "\n" not in message
    line = 4 if on_server else 5
    owner = "server s0" if on_server else "the bus"
    assert message.startswith(f"a3.xml:{line}: property {prop}={value!r}: {expected}"), message
    assert message.endswith(f"(for {owner}); fix the value"), message


def test_an_unknown_aaabus_property_is_refused_with_the_closest_name() -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown property 'aaabus\.engine\.max_bach'; "
        r"did you mean aaabus\.engine\.max_batch\?",
    ):
        parse_config(config_with("aaabus.engine.max_bach", "3"), "a3.xml")
    # The application's own properties are not the bus's business.
    cfg = parse_config(config_with("myapp.colour", "blue"), "a3.xml")
    assert cfg.prop(0, "myapp.colour") == "blue"


def test_typed_values_defaults_and_server_overrides() -> None:
    text = config_with("aaabus.engine.max_batch", "8").replace(
        '<network domain="D" port="1000"/>',
        '<network domain="D" port="1000"/><property name="aaabus.engine.max_batch" value="2"/>'
        '<property name="aaabus.dial.1" value="10.0.0.9:4000"/>',
    )
    cfg = parse_config(text, "a3.xml")
    assert cfg.setting(0, "aaabus.engine.max_batch") == 2  # the server's own wins
    assert cfg.setting(None, "aaabus.engine.max_batch") == 8
    assert cfg.setting(0, "aaabus.engine.max_group_ms") == 5  # declared default
    assert cfg.setting(0, "aaabus.dial.1") == ("10.0.0.9", 4000)
    assert cfg.setting(0, "aaabus.admin.port") is None and cfg.setting(0, "aaabus.trace") is None
    assert cfg.setting(0, "aaabus.test.allow_cycles") is False


def test_aaabus_check_refuses_what_a_server_would_refuse_at_boot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "a3.xml"
    path.write_text(config_with("aaabus.admin.port", "abc"))
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "aaabus.admin.port='abc'" in err, err
    path.write_text(config_with("aaabus.admin.port", "off"))
    assert main(["check", str(path)]) == 0
    assert load_config(path).setting(0, "aaabus.admin.port") is None


def test_the_reference_in_the_docs_is_the_declarations() -> None:
    text = (REPO_ROOT / "docs" / "config.md").read_text()
    assert settings.reference_table() in text, "regenerate it: python -m aaabus.config.settings"
    for setting in settings.SETTINGS:
        assert setting.doc and setting.doc.endswith((".", ")")), setting.name
