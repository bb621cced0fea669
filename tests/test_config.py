"""Parsing and checking of a3.xml (aaabus.config.reader)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from aaabus.config.reader import (
    BusConfig,
    DomainConfig,
    NetworkConfig,
    ServerConfig,
    ServiceConfig,
    load_config,
    parse_config,
)
from aaabus.errors import AaabusError, ConfigError

VALID = """\
<?xml version="1.0"?>
<config>
  <!-- two domains joined by s2 -->
  <domain name="D1"/>
  <domain name="D2" network="tcp" order="fifo" stamps="full"/>
  <property name="timeout" value="30"/>
  <property name="mode" value="global"/>
  <server id="0" name="alpha" hostname="10.0.0.1">
    <network domain="D1" port="16300"/>
    <service class="aaabus.services:Echo" args="a b"/>
    <property name="mode" value="local"/>
  </server>
  <server id="1">
    <network domain="D2" port="16301"/>
  </server>
  <server id="2" name="s2" hostname="127.0.0.1">
    <network domain="D1" port="16302"/>
    <network domain="D2" port="16303"/>
    <service class="pkg:Thing"/>
  </server>
</config>
"""


def write(tmp_path: Path, text: str, name: str = "a3.xml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def refused(tmp_path: Path, text: str) -> ConfigError:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    err = info.value
    assert "\n" not in str(err)
    assert isinstance(err, AaabusError)
    return err


def test_valid_config_round_trips(tmp_path: Path) -> None:
    path = write(tmp_path, VALID)
    cfg = load_config(path)
    assert cfg == BusConfig(
        path=str(path),
        domains={
            "D1": DomainConfig("D1", "causal", "delta", None, 4),
            "D2": DomainConfig("D2", "fifo", "full", "tcp", 5),
        },
        servers={
            0: ServerConfig(
                0,
                "alpha",
                "10.0.0.1",
                (NetworkConfig("D1", 16300, 9),),
                (ServiceConfig("aaabus.services:Echo", "a b", 10),),
                {"mode": "local"},
                8,
            ),
            1: ServerConfig(1, "s1", "127.0.0.1", (NetworkConfig("D2", 16301, 14),), (), {}, 13),
            2: ServerConfig(
                2,
                "s2",
                "127.0.0.1",
                (NetworkConfig("D1", 16302, 17), NetworkConfig("D2", 16303, 18)),
                (ServiceConfig("pkg:Thing", "", 19),),
                {},
                16,
            ),
        },
        properties={"timeout": "30", "mode": "global"},
    )
    assert list(cfg.servers) == [0, 1, 2]
    assert list(cfg.domains) == ["D1", "D2"]
    assert cfg.server(2).port_in("D2") == 16303
    with pytest.raises(KeyError):
        cfg.server(0).port_in("D2")
    assert cfg.prop(0, "mode") == "local"
    assert cfg.prop(1, "mode") == "global"
    assert cfg.prop(None, "mode") == "global"
    assert cfg.prop(1, "timeout") == "30"
    assert cfg.prop(1, "missing") is None
    assert cfg.prop(1, "missing", "d") == "d"
    assert cfg.where(12) == f"{path}:12"


def test_parse_config_accepts_bytes_and_str() -> None:
    assert parse_config(VALID) == parse_config(VALID.encode(), "<string>")
    assert parse_config(VALID, "x.xml").path == "x.xml"


def test_unknown_server_id_lists_ids(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, VALID))
    with pytest.raises(ConfigError) as info:
        cfg.server(7)
    assert info.value.message == (
        "server id 7 is not in a3.xml (ids: 0, 1, 2); pass one of them to --id"
    )


def test_unreadable_file_names_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope.xml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert info.value.where == str(missing)
    assert str(missing) in str(info.value)


def doc(body: str) -> str:
    """A document whose line 2 starts ``body`` (line 1 is ``<config>``)."""
    return f"<config>\n{body}\n</config>\n"


OK_SERVER = '<domain name="D"/>\n<server id="0"><network domain="D" port="1000"/></server>'

# (body after "<config>\n", expected line, substrings of the message)
BAD: list[tuple[str, str, int, tuple[str, ...]]] = [
    ("malformed", '<domain name="D">\n', 4, ("malformed XML", "mismatched tag")),
    ("unknown element", OK_SERVER + "\n<domian/>", 4, ("unknown element <domian>",)),
    (
        "unknown element in server",
        '<domain name="D"/>\n<server id="0">\n<port/></server>',
        4,
        ("unknown element <port>", "<network>, <service>, <property>"),
    ),
    (
        "unknown attribute",
        '<domain name="D" colour="red"/>',
        2,
        ("<domain> has unknown attribute 'colour'", "allowed: name, network, order, stamps"),
    ),
    (
        "unknown server attribute",
        OK_SERVER + '\n<server id="1" nmae="x"/>',
        4,
        ("<server> has unknown attribute 'nmae'", "allowed: id, name, hostname"),
    ),
    ("missing domain name", "<domain/>", 2, ("<domain> lacks required attribute 'name'",)),
    ("missing server id", "<server/>", 2, ("<server> lacks required attribute 'id'",)),
    (
        "missing port",
        '<domain name="D"/>\n<server id="0">\n<network domain="D"/></server>',
        4,
        ("<network> lacks required attribute 'port'",),
    ),
    (
        "missing property value",
        OK_SERVER + '\n<property name="x"/>',
        4,
        ("<property> lacks required attribute 'value'",),
    ),
    ("non-integer id", '<server id="one"/>', 2, ("id='one' is not an integer",)),
    ("negative id", '<server id="-3"/>', 2, ("id='-3' is negative",)),
    ("id too big", '<server id="2147483648"/>', 2, ("id='2147483648' is too big",)),
    (
        "port not integer",
        '<domain name="D"/>\n<server id="0">\n<network domain="D" port="http"/></server>',
        4,
        ("port='http' is not an integer in 1..65535",),
    ),
    (
        "port zero",
        '<domain name="D"/>\n<server id="0">\n<network domain="D" port="0"/></server>',
        4,
        ("port='0' is not an integer in 1..65535",),
    ),
    (
        "port too big",
        '<domain name="D"/>\n<server id="0">\n<network domain="D" port="65536"/></server>',
        4,
        ("port='65536' is not an integer in 1..65535",),
    ),
    (
        "duplicate server id",
        OK_SERVER + '\n\n<server id="0" name="other"><network domain="D" port="1001"/></server>',
        5,
        ("server id 0 is used twice (lines 3 and 5)",),
    ),
    (
        "duplicate domain",
        '<domain name="D"/>\n<domain name="E"/>\n<domain name="D"/>',
        4,
        ("domain 'D' is declared twice (lines 2 and 4)",),
    ),
    (
        "duplicate host and port",
        OK_SERVER + '\n<server id="1">\n<network domain="D" port="1000"/></server>',
        5,
        ("port 1000 on host 127.0.0.1 is used twice", "s0 at line 3"),
    ),
    (
        "undeclared domain",
        '<domain name="D"/>\n<domain name="E"/>\n<server id="0">\n'
        '<network domain="F" port="1"/></server>',
        5,
        ("domain 'F', which is not declared (declared: D, E)",),
    ),
    (
        "two networks in one domain",
        '<domain name="D"/>\n<server id="0">\n<network domain="D" port="1"/>\n'
        '<network domain="D" port="2"/></server>',
        5,
        ("server s0 has two <network> elements in domain D (lines 4 and 5)",),
    ),
    ("bad order", '<domain name="D" order="total"/>', 2, ("order='total' is not valid",)),
    ("bad stamps", '<domain name="D" stamps="some"/>', 2, ("stamps='some' is not valid",)),
    (
        "bad service class",
        '<domain name="D"/>\n<server id="0">\n<service class="aaabus.services.Echo"/></server>',
        4,
        ("class='aaabus.services.Echo' is not of the form 'module:attr'",),
    ),
    (
        "bad service attr",
        '<domain name="D"/>\n<server id="0">\n<service class="mod:1x"/></server>',
        4,
        ("is not of the form 'module:attr'",),
    ),
    ("no server", '<domain name="D"/>', 1, ("no <server> in the configuration",)),
    (
        "text content",
        OK_SERVER + "\nhello",
        4,
        ("unexpected text 'hello' inside <config>",),
    ),
    (
        "duplicate property",
        OK_SERVER + '\n<property name="a" value="1"/>\n<property name="a" value="2"/>',
        5,
        ("property 'a' is set twice for the bus (lines 4 and 5)",),
    ),
    ("empty name", '<domain name=""/>', 2, ("<domain> has an empty 'name' attribute",)),
]


@pytest.mark.parametrize(("label", "body", "line", "parts"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_with_location(
    tmp_path: Path, label: str, body: str, line: int, parts: tuple[str, ...]
) -> None:
    err = refused(tmp_path, doc(body))
    assert err.where == f"{tmp_path / 'a3.xml'}:{line}", str(err)
    for part in parts:
        assert part in err.message, str(err)
    # Every message ends with a way out.
    assert ";" in err.message


def test_wrong_root_element(tmp_path: Path) -> None:
    err = refused(tmp_path, '<?xml version="1.0"?>\n\n<servers/>\n')
    assert err.where is not None and err.where.endswith("a3.xml:3")
    assert "root element is <servers>, expected <config>" in err.message


def test_malformed_xml_reports_expat_line(tmp_path: Path) -> None:
    err = refused(tmp_path, "<config>\n<domain name='D'/>\n<server id='0'\n</config>\n")
    assert err.where is not None and err.where.endswith(":4")
    assert err.message.startswith("malformed XML")


@pytest.mark.parametrize("encoding", ["UTF-7", "klingon-9", "cp932"])
def test_an_encoding_declaration_expat_cannot_read_is_one_line_through_check(
    tmp_path: Path, encoding: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from aaabus.tools.cli import main

    path = tmp_path / "a3.xml"
    path.write_text(f'<?xml version="1.0" encoding="{encoding}"?>\n<config/>\n')
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"{path}:1: unsupported encoding in the XML declaration" in err
    assert 'save the file as UTF-8 and declare encoding="UTF-8"' in err


BILLION_LAUGHS = """<?xml version="1.0"?>
<!DOCTYPE config [
  <!ENTITY lol "lol">
  <!ENTITY lol1 "&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;&lol;">
  <!ENTITY lol2 "&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;">
  <!ENTITY lol3 "&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;&lol2;">
  <!ENTITY lol4 "&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;&lol3;">
  <!ENTITY lol5 "&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;&lol4;">
  <!ENTITY lol6 "&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;&lol5;">
  <!ENTITY lol7 "&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;&lol6;">
  <!ENTITY lol8 "&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;&lol7;">
  <!ENTITY lol9 "&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;&lol8;">
]>
<config><domain name="&lol9;"/><server id="0"/></config>
"""

EXTERNAL_ENTITY = """<?xml version="1.0"?>
<!DOCTYPE config [<!ENTITY secret SYSTEM "file:///etc/passwd">]>
<config><domain name="&secret;"/><server id="0"/></config>
"""

EXTERNAL_DTD = """<?xml version="1.0"?>
<!DOCTYPE config SYSTEM "http://example.invalid/a3.dtd">
<config><domain name="D"/><server id="0"/></config>
"""


@pytest.mark.parametrize("text", [BILLION_LAUGHS, EXTERNAL_ENTITY, EXTERNAL_DTD])
def test_entity_attacks_are_refused(tmp_path: Path, text: str) -> None:
    start = time.monotonic()
    err = refused(tmp_path, text)
    assert time.monotonic() - start < 2
    assert err.message.startswith("refused ")
    assert "lol" not in err.message and "root:" not in err.message
    assert err.where is not None and err.where.endswith(":2")


def test_undefined_entity_is_malformed(tmp_path: Path) -> None:
    err = refused(tmp_path, "<config>\n<domain name='&x;'/></config>")
    assert "undefined entity" in err.message
    assert err.where is not None and err.where.endswith(":2")


def test_defaults(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, doc(OK_SERVER)))
    dom = cfg.domains["D"]
    assert (dom.order, dom.stamps, dom.network) == ("causal", "delta", None)
    srv = cfg.server(0)
    assert (srv.name, srv.hostname, srv.services, dict(srv.properties)) == (
        "s0",
        "127.0.0.1",
        (),
        {},
    )


def test_same_port_on_two_hosts_is_fine(tmp_path: Path) -> None:
    text = doc(
        '<domain name="D"/>\n'
        '<server id="0" hostname="a"><network domain="D" port="1000"/></server>\n'
        '<server id="1" hostname="b"><network domain="D" port="1000"/></server>'
    )
    cfg = load_config(write(tmp_path, text))
    assert [s.port_in("D") for s in cfg.servers.values()] == [1000, 1000]


def test_domain_may_be_declared_after_its_use(tmp_path: Path) -> None:
    text = doc('<server id="0"><network domain="D" port="1000"/></server>\n<domain name="D"/>')
    assert list(load_config(write(tmp_path, text)).domains) == ["D"]
