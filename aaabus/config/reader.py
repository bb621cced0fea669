"""Reading and checking ``a3.xml``, the description of a bus.

The dialect follows the ``a3servers.xml`` file of the industrial kernel, adapted to Python::

    <config>
      <domain name="D0" [network="..."] [order="causal|fifo"] [stamps="delta|full"]/>
      <property name="..." value="..."/>                    <!-- global -->
      <server id="0" [name="s0"] [hostname="127.0.0.1"]>
        <network domain="D0" port="16300"/>
        <service class="package.module:attr" [args="..."]/>
        <property name="..." value="..."/>                  <!-- this server only -->
        <replica index="1" [hostname="127.0.0.1"] port="16400"/>  <!-- a copy of its store -->
      </server>
    </config>

The file comes from users, so it is parsed with :mod:`defusedxml`: documents declaring a DTD, an
entity or referring to an external resource are refused rather than expanded. Every element keeps
the line it starts on, and every problem is reported as one :class:`ConfigError` located at
``file:line`` and ending with how to fix it.

This module checks the file on its own. Whether the servers and domains form a tree (the condition
for global causal order) is checked by
:mod:`aaabus.config.domains`; service classes are imported by the server at boot, not here.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from xml.sax import SAXParseException
from xml.sax.handler import ContentHandler
from xml.sax.xmlreader import Locator

from aaabus.config import settings
from aaabus.config.guard import read_guarded
from aaabus.errors import ConfigError

__all__ = [
    "ORDERS",
    "STAMPS",
    "BusConfig",
    "DomainConfig",
    "Member",
    "NetworkConfig",
    "ReplicaConfig",
    "ServerConfig",
    "ServiceConfig",
    "load_config",
    "parse_config",
]

#: Ordering policies a domain may ask for.
ORDERS = ("causal", "fifo")
#: How a domain's matrix clock travels with messages: only the changed cells, or the whole matrix.
STAMPS = ("delta", "full")

DEFAULT_HOSTNAME = "127.0.0.1"
# Server ids travel as 32-bit fields in frames; from 2**31 up they are left to external clients
# (see aaabus.node.admin), so that a client never takes a server's id.
MAX_SERVER_ID = 2**31 - 1

# A dotted module path, a colon, one identifier: what ``importlib`` + ``getattr`` can resolve.
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_CLASS_RE = re.compile(rf"{_IDENT}(\.{_IDENT})*:{_IDENT}\Z")
_UINT_RE = re.compile(r"[0-9]+\Z")


@dataclass(frozen=True)
class DomainConfig:
    """A ``<domain>`` element: a causality domain."""

    name: str
    order: str
    stamps: str
    network: str | None
    line: int


@dataclass(frozen=True)
class NetworkConfig:
    """A ``<network>`` element: the server is a member of ``domain`` and listens on ``port``."""

    domain: str
    port: int
    line: int


@dataclass(frozen=True)
class ServiceConfig:
    """A ``<service>`` element: ``cls`` is ``module:attr``, started at boot with ``args``."""

    cls: str
    args: str
    line: int


@dataclass(frozen=True)
class ReplicaConfig:
    """A ``<replica>`` element: replica ``index`` of its server, a process of its own that keeps
    a copy of the server's store and listens for its primary on ``hostname:port``
    (:mod:`aaabus.node.replica`)."""

    index: int
    hostname: str
    port: int
    line: int


@dataclass(frozen=True)
class Member:
    """One member of a server (issue 42, failover): member 0 is the ``<server>`` itself, member
    K >= 1 its ``<replica index="K">``. Whichever member is primary serves the server's ports on
    its own ``hostname``; every member listens for a primary's replication link on
    ``replication_port`` (member 0: ``aaabus.replication.port``, K: the replica's ``port``)."""

    index: int
    hostname: str
    replication_port: int


@dataclass(frozen=True)
class ServerConfig:
    """A ``<server>`` element with its networks, services and own properties."""

    id: int
    name: str
    hostname: str
    networks: tuple[NetworkConfig, ...]
    services: tuple[ServiceConfig, ...]
    properties: Mapping[str, str]
    line: int
    #: Its replicas, in document order (none: the server's store is on its own disk only).
    replicas: tuple[ReplicaConfig, ...] = ()
    #: Member 0's replication port (``aaabus.replication.port``; 0 without replicas).
    replication_port: int = 0

    def members(self) -> tuple[Member, ...]:
        """Its members, member 0 (the server itself) first, then the replicas in document
        order."""
        return (
            Member(0, self.hostname, self.replication_port),
            *(Member(r.index, r.hostname, r.port) for r in self.replicas),
        )

    def member(self, index: int) -> Member:
        """Member ``index`` (0: the server itself), or the ConfigError of :meth:`replica`."""
        if index == 0:
            return self.members()[0]
        rep = self.replica(index)
        return Member(rep.index, rep.hostname, rep.port)

    def replica(self, index: int) -> ReplicaConfig:
        """Replica ``index``, or a :class:`ConfigError` listing the ones that exist."""
        for rep in self.replicas:
            if rep.index == index:
                return rep
        known = ", ".join(str(r.index) for r in self.replicas) or "none"
        raise ConfigError(
            f"server {self.name} (id {self.id}) has no replica {index} (replicas: {known}); add "
            f'<replica index="{index}" port="..."/> to it or fix --replica'
        )

    @property
    def domains(self) -> tuple[str, ...]:
        """Names of the domains this server belongs to, in document order."""
        return tuple(n.domain for n in self.networks)

    def port_in(self, domain: str) -> int:
        """The port this server listens on in ``domain``; ``KeyError`` if it is not a member."""
        for net in self.networks:
            if net.domain == domain:
                return net.port
        raise KeyError(f"server {self.name} (id {self.id}) is not in domain {domain}")


@dataclass(frozen=True)
class BusConfig:
    """A whole ``a3.xml``. Mappings keep document order.

    The mappings are plain dicts (so that the configuration pickles and compares simply); treat
    them as read-only.
    """

    path: str
    domains: Mapping[str, DomainConfig]
    servers: Mapping[int, ServerConfig]
    properties: Mapping[str, str] = field(default_factory=dict)

    def server(self, server_id: int) -> ServerConfig:
        """The server with this id, or a :class:`ConfigError` listing the ids that exist."""
        try:
            return self.servers[server_id]
        except KeyError:
            ids = ", ".join(str(i) for i in self.servers)
            raise ConfigError(
                f"server id {server_id} is not in {os.path.basename(self.path)} (ids: {ids}); "
                "pass one of them to --id",
                self.path,
            ) from None

    def prop(self, server_id: int | None, name: str, default: str | None = None) -> str | None:
        """Property ``name``: the server's own value if it has one, else the global one, else
        ``default``. ``server_id=None`` looks at global properties only."""
        if server_id is not None:
            own = self.server(server_id).properties
            if name in own:
                return own[name]
        return self.properties.get(name, default)

    def setting(self, server_id: int | None, name: str) -> Any:
        """The typed value of ``aaabus.*`` property ``name`` for ``server_id`` (its own value,
        else the bus's, else the declared default; see :mod:`aaabus.config.settings`). The file was
        checked when read, so this does not fail for a declared name."""
        raw = self.prop(server_id, name)
        return settings.find(name).default if raw is None else settings.parse(name, raw)

    def directory(self, server_id: int | None, name: str) -> Path | None:
        """A directory property (``aaabus.trace``, ``aaabus.traffic``): its value, relative to
        the config file's directory, or None when unset or empty."""
        value: str | None = self.setting(server_id, name)
        return None if not value else Path(self.path).resolve().parent / value

    def where(self, line: int) -> str:
        """``path:line``, the location format of every configuration error."""
        return f"{self.path}:{line}"

    def failover(self, server_id: int) -> bool:
        """Whether a follower of ``server_id`` may take over (``aaabus.failover``; default: on
        when the server has replicas). Never without replicas: there is no one to take over."""
        if not self.server(server_id).replicas:
            return False
        chosen: str | None = self.setting(server_id, "aaabus.failover")
        return chosen != "off"

    def voters(self, server_id: int) -> tuple[int, ...]:
        """The servers that vote on a takeover of ``server_id``: those sharing a domain with it.
        None (a one-server bus, or a server alone in its domains): its own members vote
        (docs/architecture.md, "Replicas and failover", the lone server)."""
        mine = set(self.server(server_id).domains)
        return tuple(
            sorted(
                sid
                for sid, srv in self.servers.items()
                if sid != server_id and mine.intersection(srv.domains)
            )
        )

    def lone_warning(self, server_id: int) -> str | None:
        """The one line saying that ``server_id`` cannot fail over (failover on, no other server
        shares a domain with it, and its members without the primary are no strict majority
        of them: one replica), or None."""
        members = len(self.server(server_id).members())
        if not self.failover(server_id) or self.voters(server_id) or 2 * (members - 1) > members:
            return None
        return (
            f"server {self.server(server_id).name} shares no domain with another server, so its "
            f"{members} members vote on a takeover and need a strict majority of them: with "
            f"{members - 1} replica(s) it cannot fail over without its primary; add a replica"
        )

    def as_member(self, server_id: int, index: int) -> BusConfig:
        """This configuration as member ``index`` of ``server_id`` sees it when it serves as the
        server's primary: the server's ``hostname`` is the member's, and so are
        ``aaabus.mqtt.host`` and ``aaabus.metrics.host`` where they were the server's hostname
        (every port of the server is then bound on the member's own address). Member 0: this
        configuration itself."""
        spec = self.server(server_id)
        if index == 0:
            return self
        host = spec.member(index).hostname
        props = dict(spec.properties)
        for name in ("aaabus.mqtt.host", "aaabus.metrics.host"):
            if self.setting(server_id, name) == spec.hostname:
                props[name] = host
        servers = dict(self.servers)
        servers[server_id] = replace(spec, hostname=host, properties=props)
        return replace(self, servers=servers)

    def member_warnings(self) -> list[str]:
        """What ``aaabus check`` warns of without refusing: members of a server with failover
        on that share a hostname (they can then serve only one at a time: the primary's ports
        are bound on its own hostname); a server that cannot fail over (:meth:`lone_warning`)."""
        out = []
        for srv in self.servers.values():
            if not self.failover(srv.id):
                continue
            seen: dict[str, int] = {}
            for member in srv.members():
                if member.hostname in seen:
                    out.append(
                        f"server {srv.name}: members {seen[member.hostname]} and {member.index} "
                        f"share hostname {member.hostname}; with aaabus.failover on, give each "
                        "member a hostname of its own (a member that takes over binds the "
                        "server's ports on it)"
                    )
                else:
                    seen[member.hostname] = member.index
        out.extend(w for sid in sorted(self.servers) if (w := self.lone_warning(sid)))
        return out


# ---------------------------------------------------------------------------------------------
# Parsing: SAX events -> a small tree of elements that know their line.


@dataclass
class _Element:
    tag: str
    attrs: dict[str, str]
    line: int
    children: list[_Element] = field(default_factory=list)


class _TreeBuilder(ContentHandler):
    """Builds :class:`_Element` nodes; refuses text and processing instructions on the spot."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.root: _Element | None = None
        self.stack: list[_Element] = []
        self.locator: Locator | None = None

    def setDocumentLocator(self, locator: Locator) -> None:
        self.locator = locator

    def line(self) -> int:
        line = self.locator.getLineNumber() if self.locator is not None else None
        return line or 0

    def startElement(self, name: str, attrs: Any) -> None:
        elem = _Element(name, {k: attrs[k] for k in attrs.getNames()}, self.line())
        if self.stack:
            self.stack[-1].children.append(elem)
        else:
            self.root = elem
        self.stack.append(elem)

    def endElement(self, name: str) -> None:
        self.stack.pop()

    def characters(self, content: str) -> None:
        if content.strip() and self.stack:
            snippet = content.strip()[:30]
            raise ConfigError(
                f"unexpected text {snippet!r} inside <{self.stack[-1].tag}>; a3.xml carries "
                "everything in attributes; remove the text or turn it into a comment",
                f"{self.path}:{self.line()}",
            )

    def processingInstruction(self, target: str, data: str) -> None:
        raise ConfigError(
            f"unexpected processing instruction <?{target} ...?>; remove it",
            f"{self.path}:{self.line()}",
        )


def _parse_xml(data: str | bytes, path: str) -> _Element:
    # Imported here: the expat reader pulls in urllib and http (a tenth of `import aaabus`),
    # for a parse made once per configuration read.
    from xml.sax.expatreader import ExpatLocator

    from defusedxml import DefusedXmlException
    from defusedxml.common import DTDForbidden, EntitiesForbidden, ExternalReferenceForbidden
    from defusedxml.expatreader import DefusedExpatParser

    # The dialect has no DTD, so refusing any DOCTYPE is the simplest safe policy; entity
    # declarations and external references are refused too in case a DOCTYPE ever slips through.
    parser = DefusedExpatParser(forbid_dtd=True, forbid_entities=True, forbid_external=True)
    builder = _TreeBuilder(path)
    parser.setContentHandler(builder)
    # parse() would install the locator itself, but it insists on a byte stream; feeding directly
    # lets str and bytes through unchanged, so the locator is installed by hand.
    builder.setDocumentLocator(ExpatLocator(parser))
    try:
        parser.feed(data)
        parser.close()
    except SAXParseException as exc:
        raise ConfigError(
            f"malformed XML: {exc.getMessage()} (column {(exc.getColumnNumber() or 0) + 1}); "
            "fix the XML syntax",
            f"{path}:{exc.getLineNumber()}",
        ) from None
    except DefusedXmlException as exc:
        what = {
            DTDForbidden: "a DOCTYPE/DTD",
            EntitiesForbidden: "an entity declaration",
            ExternalReferenceForbidden: "a reference to an external resource",
        }.get(type(exc), "an unsafe XML construct")
        raise ConfigError(
            f"refused {what}: a3.xml must be plain XML without DTD or entities (they allow "
            "entity-expansion and external-entity attacks); remove the <!DOCTYPE ...> part",
            f"{path}:{builder.line()}",
        ) from None
    except (LookupError, ValueError) as exc:  # after DefusedXmlException, a ValueError
        # Expat itself refuses an encoding it does not know (LookupError) or cannot decode one
        # byte at a time (ValueError: UTF-7, multi-byte codecs) before any element is read;
        # the handlers raise ConfigError only, so nothing else lands here.
        raise ConfigError(
            f"unsupported encoding in the XML declaration ({exc}); save the file as UTF-8 and "
            'declare encoding="UTF-8" (or leave the encoding out)',
            f"{path}:{builder.line() or 1}",
        ) from None
    if builder.root is None:  # pragma: no cover - expat reports "no element found" first
        raise ConfigError("empty document; write a <config> element", path)
    return builder.root


# ---------------------------------------------------------------------------------------------
# Validation of the element tree.

_ALLOWED_ATTRS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # tag: (required, optional)
    "domain": (("name",), ("network", "order", "stamps")),
    "server": (("id",), ("name", "hostname")),
    "network": (("domain", "port"), ()),
    "service": (("class",), ("args",)),
    "property": (("name", "value"), ()),
    "replica": (("index", "port"), ("hostname",)),
}
_CHILDREN = {
    "config": ("domain", "server", "property"),
    "server": ("network", "service", "property", "replica"),
}
#: Replica indexes: small, so that a replica's index fits in a byte wherever it travels.
MAX_REPLICA_INDEX = 255
#: Member 0's default replication port: the server's first network port plus this.
REPLICATION_PORT_OFFSET = 2000


class _Checker:
    """Validation of one document; keeps the path so that every error can point at a line."""

    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, message: str, line: int) -> ConfigError:
        return ConfigError(message, f"{self.path}:{line}")

    def attrs(self, elem: _Element) -> dict[str, str]:
        required, optional = _ALLOWED_ATTRS[elem.tag]
        allowed = required + optional
        for name in elem.attrs:
            if name not in allowed:
                raise self.error(
                    f"<{elem.tag}> has unknown attribute {name!r}; allowed: "
                    f"{', '.join(allowed)}: fix the spelling or remove it",
                    elem.line,
                )
        for name in required:
            if name not in elem.attrs:
                raise self.error(
                    f'<{elem.tag}> lacks required attribute {name!r}; add {name}="..."',
                    elem.line,
                )
        for name in ("name", "domain", "class"):
            if name in elem.attrs and not elem.attrs[name].strip():
                raise self.error(
                    f"<{elem.tag}> has an empty {name!r} attribute; give it a value", elem.line
                )
        return elem.attrs

    def children(self, elem: _Element) -> None:
        allowed = _CHILDREN.get(elem.tag, ())
        for child in elem.children:
            if child.tag not in allowed:
                inside = (
                    f"inside <{elem.tag}> only {', '.join(f'<{t}>' for t in allowed)} are allowed"
                    if allowed
                    else f"<{elem.tag}> takes no child element"
                )
                raise self.error(
                    f"unknown element <{child.tag}> ({inside}); remove it or fix its name",
                    child.line,
                )

    def choice(self, elem: _Element, attr: str, values: tuple[str, ...]) -> str:
        value = elem.attrs.get(attr, values[0])
        if value not in values:
            raise self.error(
                f"<{elem.tag}> {attr}={value!r} is not valid; use one of "
                f"{', '.join(repr(v) for v in values)} (default {values[0]!r})",
                elem.line,
            )
        return value

    def properties(self, elems: list[_Element], owner: str) -> dict[str, str]:
        props: dict[str, str] = {}
        lines: dict[str, int] = {}
        for elem in elems:
            attrs = self.attrs(elem)
            self.children(elem)
            name = attrs["name"]
            if name in props:
                raise self.error(
                    f"property {name!r} is set twice for {owner} (lines {lines[name]} and "
                    f"{elem.line}); keep only one",
                    elem.line,
                )
            if name.startswith(settings.PREFIX):
                # Checked here, with the line, so that `aaabus check` refuses what a server
                # would refuse at boot.
                try:
                    settings.parse(name, attrs["value"])
                except ValueError as exc:
                    raise self.error(f"{exc} (for {owner}); fix the value", elem.line) from None
            props[name] = attrs["value"]
            lines[name] = elem.line
        return props

    def domain(self, elem: _Element) -> DomainConfig:
        attrs = self.attrs(elem)
        self.children(elem)
        return DomainConfig(
            name=attrs["name"],
            order=self.choice(elem, "order", ORDERS),
            stamps=self.choice(elem, "stamps", STAMPS),
            network=attrs.get("network"),
            line=elem.line,
        )

    def server_id(self, elem: _Element, text: str) -> int:
        text = text.strip()
        if text.startswith("-") and _UINT_RE.match(text[1:]):
            raise self.error(
                f"<server> id={text!r} is negative; server ids are integers >= 0", elem.line
            )
        if not _UINT_RE.match(text):
            raise self.error(
                f'<server> id={text!r} is not an integer; use a number >= 0 such as id="0"',
                elem.line,
            )
        if int(text) > MAX_SERVER_ID:
            raise self.error(
                f"<server> id={text!r} is too big; server ids go up to {MAX_SERVER_ID}", elem.line
            )
        return int(text)

    def port(self, elem: _Element, text: str) -> int:
        stripped = text.strip()
        port = int(stripped) if _UINT_RE.match(stripped) else None
        if port is None or not 1 <= port <= 65535:
            raise self.error(
                f"<{elem.tag}> port={text!r} is not an integer in 1..65535; use a free TCP port "
                'such as port="16300"',
                elem.line,
            )
        return port

    def service(self, elem: _Element) -> ServiceConfig:
        attrs = self.attrs(elem)
        self.children(elem)
        cls = attrs["class"].strip()
        if not _CLASS_RE.match(cls):
            raise self.error(
                f"<service> class={attrs['class']!r} is not of the form 'module:attr'; write the "
                "dotted module path, a colon and the class name, e.g. "
                'class="aaabus.services:EchoService"',
                elem.line,
            )
        return ServiceConfig(cls=cls, args=attrs.get("args", ""), line=elem.line)

    def server(self, elem: _Element, domains: Mapping[str, DomainConfig]) -> ServerConfig:
        attrs = self.attrs(elem)
        self.children(elem)
        sid = self.server_id(elem, attrs["id"])
        name = attrs.get("name", f"s{sid}")
        networks: list[NetworkConfig] = []
        services: list[ServiceConfig] = []
        prop_elems: list[_Element] = []
        replicas: dict[int, ReplicaConfig] = {}
        seen: dict[str, int] = {}
        for child in elem.children:
            if child.tag == "network":
                nattrs = self.attrs(child)
                self.children(child)
                dname = nattrs["domain"]
                if dname not in domains:
                    declared = ", ".join(domains) or "none"
                    raise self.error(
                        f"<network> of server {name} names domain {dname!r}, which is not "
                        f'declared (declared: {declared}); add <domain name="{dname}"/> or '
                        "fix the name",
                        child.line,
                    )
                if dname in seen:
                    raise self.error(
                        f"server {name} has two <network> elements in domain {dname} (lines "
                        f"{seen[dname]} and {child.line}); a server joins a domain once, "
                        "remove one",
                        child.line,
                    )
                seen[dname] = child.line
                networks.append(NetworkConfig(dname, self.port(child, nattrs["port"]), child.line))
            elif child.tag == "service":
                services.append(self.service(child))
            elif child.tag == "replica":
                rep = self.replica(child, attrs.get("hostname", DEFAULT_HOSTNAME))
                if rep.index in replicas:
                    raise self.error(
                        f"server {name} has two replicas of index {rep.index} (lines "
                        f"{replicas[rep.index].line} and {rep.line}); give each its own index",
                        rep.line,
                    )
                replicas[rep.index] = rep
            else:
                prop_elems.append(child)
        return ServerConfig(
            id=sid,
            name=name,
            hostname=attrs.get("hostname", DEFAULT_HOSTNAME),
            networks=tuple(networks),
            services=tuple(services),
            properties=self.properties(prop_elems, f"server {name}"),
            line=elem.line,
            replicas=tuple(replicas.values()),
        )

    def replica(self, elem: _Element, server_host: str) -> ReplicaConfig:
        attrs = self.attrs(elem)
        self.children(elem)
        text = attrs["index"].strip()
        if not _UINT_RE.match(text) or not 1 <= int(text) <= MAX_REPLICA_INDEX:
            raise self.error(
                f"<replica> index={attrs['index']!r} is not an integer in "
                f'1..{MAX_REPLICA_INDEX}; number a server\'s replicas from 1, e.g. index="1"',
                elem.line,
            )
        return ReplicaConfig(
            index=int(text),
            hostname=attrs.get("hostname", server_host),
            port=self.port(elem, attrs["port"]),
            line=elem.line,
        )

    def member0_port(self, srv: ServerConfig, props: Mapping[str, str]) -> int:
        """Member 0's replication port: ``aaabus.replication.port``, else the first network
        port + :data:`REPLICATION_PORT_OFFSET`."""
        name = "aaabus.replication.port"
        text = srv.properties.get(name, props.get(name))
        if text is not None:
            port: int = settings.parse(name, text)
            return port
        port = srv.networks[0].port + REPLICATION_PORT_OFFSET if srv.networks else 0
        if not 1 <= port <= 65535:
            raise self.error(
                f"server {srv.name} has replicas and its default replication port ({port}: its "
                f"first network port + {REPLICATION_PORT_OFFSET}) is not a port; set {name}",
                srv.line,
            )
        return port

    def sync_counts(self, servers: Mapping[int, ServerConfig], props: Mapping[str, str]) -> None:
        """Each server with replicas asks for at most as many synchronous ones as it has."""
        name = "aaabus.replication.sync"
        for srv in servers.values():
            if not srv.replicas:
                continue
            text = srv.properties.get(name, props.get(name))
            sync = settings.parse(name, text) if text is not None else settings.find(name).default
            if sync > len(srv.replicas):
                raise self.error(
                    f"server {srv.name} asks for {sync} synchronous replica(s) "
                    f"({name}) but has {len(srv.replicas)} <replica>; add replicas or lower "
                    "the setting",
                    srv.line,
                )

    def config(self, root: _Element) -> BusConfig:
        if root.tag != "config":
            raise self.error(
                f"root element is <{root.tag}>, expected <config>; wrap the file in "
                "<config>...</config>",
                root.line,
            )
        if root.attrs:
            raise self.error(
                f"<config> takes no attribute (found {', '.join(root.attrs)}); remove them",
                root.line,
            )
        self.children(root)
        # Domains first, wherever they appear, so that a <network> may name a domain declared
        # further down the file.
        domains: dict[str, DomainConfig] = {}
        for elem in root.children:
            if elem.tag == "domain":
                dom = self.domain(elem)
                if dom.name in domains:
                    raise self.error(
                        f"domain {dom.name!r} is declared twice (lines {domains[dom.name].line} "
                        f"and {dom.line}); remove one or rename it",
                        dom.line,
                    )
                domains[dom.name] = dom
        servers: dict[int, ServerConfig] = {}
        names: dict[str, ServerConfig] = {}
        endpoints: dict[tuple[str, int], tuple[ServerConfig, NetworkConfig]] = {}

        def claim(srv: ServerConfig, host: str, port: int, line: int, what: str, fix: str) -> None:
            """Each (host, port) is used once in the whole file: ``what`` (the user of this
            one, in the message) takes it, or the one line names both users and ``fix``."""
            key = (host, port)
            if key in endpoints:
                osrv, onet = endpoints[key]
                raise self.error(
                    f"port {port} on host {host} is used twice (server {osrv.name} at line "
                    f"{onet.line} and {what}); {fix}",
                    line,
                )
            endpoints[key] = (srv, NetworkConfig("", port, line))

        for elem in root.children:
            if elem.tag != "server":
                continue
            srv = self.server(elem, domains)
            if srv.id in servers:
                raise self.error(
                    f"server id {srv.id} is used twice (lines {servers[srv.id].line} and "
                    f"{srv.line}); give each server its own id",
                    srv.line,
                )
            if srv.name in names:
                other = names[srv.name]
                raise self.error(
                    f"server name {srv.name!r} is used twice (ids {other.id} at line "
                    f"{other.line} and {srv.id}); give each server its own name",
                    srv.line,
                )
            for net in srv.networks:
                what = f"server {srv.name}"
                claim(
                    srv, srv.hostname, net.port, net.line, what, "give each <network> its own port"
                )
            for rep in srv.replicas:
                what = f"replica {rep.index} of server {srv.name}"
                claim(srv, rep.hostname, rep.port, rep.line, what, "give each replica its own port")
            servers[srv.id] = srv
            names[srv.name] = srv
        if not servers:
            raise self.error(
                "no <server> in the configuration; declare at least one "
                '<server id="0"><network domain="..." port="..."/></server>',
                root.line,
            )
        props = self.properties([e for e in root.children if e.tag == "property"], "the bus")
        self.sync_counts(servers, props)
        for sid, srv in servers.items():
            if srv.replicas:
                servers[sid] = srv = replace(srv, replication_port=self.member0_port(srv, props))
                claim(
                    srv,
                    srv.hostname,
                    srv.replication_port,
                    srv.line,
                    f"the replication port of server {srv.name}, aaabus.replication.port",
                    "set aaabus.replication.port to a free port",
                )
        return BusConfig(path=self.path, domains=domains, servers=servers, properties=props)


def parse_config(text: str | bytes, path: str = "<string>") -> BusConfig:
    """Parse and check an ``a3.xml`` document given as text; ``path`` is used in error places."""
    return _Checker(path).config(_parse_xml(text, path))


def load_config(path: str | os.PathLike[str]) -> BusConfig:
    """Read, parse and check the ``a3.xml`` file at ``path``; refused if someone else than its
    owner could change it (:mod:`aaabus.config.guard`)."""
    name = os.fspath(path)
    try:
        data = read_guarded(name, "configuration file")
    except OSError as exc:
        raise ConfigError(
            f"cannot read configuration file: {exc.strerror or exc}; check the path",
            name,
        ) from None
    return parse_config(data, name)
