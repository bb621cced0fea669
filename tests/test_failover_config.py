"""The members of a server and the failover settings (issue 42): member 0's replication port
(its default and the clash check), ``aaabus.failover`` on by default with replicas, a member's
view of the configuration when it serves, and ``aaabus check``'s warning for members that share
a hostname."""

from __future__ import annotations

from pathlib import Path

import pytest

from aaabus.config.reader import Member, parse_config
from aaabus.errors import ConfigError
from tests.support.harness import aaabus_cli


def bus(replicas: str = "", props: str = "", server_props: str = "") -> str:
    return f"""<config>
  <domain name="D0"/>
  {props}
  <server id="0" hostname="127.0.0.1">
    <network domain="D0" port="16300"/>
    {replicas}
    {server_props}
  </server>
  <server id="1"><network domain="D0" port="16301"/></server>
</config>"""


TWO = '<replica index="1" hostname="127.0.0.2" port="16400"/>' + (
    '<replica index="2" hostname="127.0.0.3" port="16400"/>'
)


def test_members_are_the_server_then_its_replicas() -> None:
    config = parse_config(bus(TWO))
    assert config.server(0).members() == (
        Member(0, "127.0.0.1", 18300),
        Member(1, "127.0.0.2", 16400),
        Member(2, "127.0.0.3", 16400),
    )
    assert config.server(0).member(2) == Member(2, "127.0.0.3", 16400)
    assert config.server(1).members() == (Member(0, "127.0.0.1", 0),)


def test_member_zero_port_is_the_property_when_set() -> None:
    own = '<property name="aaabus.replication.port" value="17000"/>'
    config = parse_config(bus(TWO, server_props=own))
    assert config.server(0).members()[0].replication_port == 17000


def test_member_zero_port_clashing_is_one_line() -> None:
    clash = '<property name="aaabus.replication.port" value="16301"/>'
    with pytest.raises(ConfigError, match=r"port 16301 on host 127.0.0.1 is used twice") as err:
        parse_config(bus(TWO, server_props=clash), "a3.xml")
    assert str(err.value).startswith("a3.xml:") and "\n" not in str(err.value)


def test_failover_is_on_with_replicas_unless_turned_off() -> None:
    config = parse_config(bus(TWO))
    assert config.failover(0) and not config.failover(1)
    off = parse_config(bus(TWO, props='<property name="aaabus.failover" value="off"/>'))
    assert not off.failover(0)
    assert off.setting(0, "aaabus.failover.delay_ms") == 1000
    with pytest.raises(ConfigError, match="expected one of on, off"):
        parse_config(bus(TWO, props='<property name="aaabus.failover" value="yes"/>'))


def test_a_member_serving_binds_on_its_own_hostname() -> None:
    config = parse_config(bus(TWO))
    as1 = config.as_member(0, 1)
    assert as1.server(0).hostname == "127.0.0.2"
    assert as1.setting(0, "aaabus.mqtt.host") == "127.0.0.2"
    assert as1.setting(1, "aaabus.mqtt.host") == "127.0.0.1"  # other servers unchanged
    assert as1.server(0).networks == config.server(0).networks
    assert config.as_member(0, 0) is config


def test_check_warns_of_members_sharing_a_hostname(tmp_path: Path) -> None:
    shared = '<replica index="1" port="16400"/>'  # the server's hostname
    assert parse_config(bus(TWO)).member_warnings() == []
    config = tmp_path / "a3.xml"
    config.write_text(bus(shared))
    check = aaabus_cli("check", str(config))
    assert check.returncode == 0, check.stderr
    assert check.stderr.count("warning:") == 1
    assert "members 0 and 1 share hostname 127.0.0.1" in check.stderr
    config.write_text(bus(shared, props='<property name="aaabus.failover" value="off"/>'))
    quiet = aaabus_cli("check", str(config))
    assert quiet.returncode == 0 and "warning" not in quiet.stderr, quiet.stderr
