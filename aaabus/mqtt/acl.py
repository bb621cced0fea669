"""MQTT access control: an operator's ACL file in Mosquitto's ``acl_file`` dialect (property
``aaabus.mqtt.acl``), checked on PUBLISH, SUBSCRIBE and will topics.

The file, one rule a line (a line starting with ``#`` is a comment, blank lines are skipped;
there is no comment after a rule, since ``#`` ends filters)::

    # anonymous devices: the lines before any `user` line
    topic read public/#
    # alice's rules, up to the next `user` line; deny wins over every grant
    user alice
    topic readwrite alice/#
    topic deny alice/secret
    # every device: %u its user name, %c its client id
    pattern read devices/%u/in/#
    pattern write devices/%c/out

* ``user NAME``: the ``topic`` lines that follow are NAME's (the rest of the line is the name).
* ``topic [read|write|readwrite|deny] FILTER``: a grant (``read``: subscribe and receive;
  ``write``: publish, will topics included; bare ``topic F`` is ``readwrite``) or a denial of both.
* ``pattern [read|write|readwrite|deny] FILTER``: the same for every device, anonymous ones
  included, wherever it stands in the file, with ``%u`` (the user name) and ``%c`` (the client
  id) substituted.

Decisions where Mosquitto is vague (docs/mqtt.md, "Access control", says why):

* A SUBSCRIBE filter is granted only if one ``read`` grant **covers** it (every topic the filter
  can match, the grant matches: grant ``sensors/#`` covers ``sensors/+/t``, not ``#``) and no
  deny line **overlaps** it (some topic matched by both): the check is made once, at SUBSCRIBE,
  never per message, so it must hold for every message the filter can bring.
* A ``%u`` or ``%c`` whose value contains ``+``, ``#`` or ``/`` would change the filter's
  shape: a grant line so substituted grants nothing, and a deny line so substituted denies
  everything to that device (fails closed both ways). A ``%u`` line does not apply to an
  anonymous device (it has no name to put there).
* ``%u``/``%c`` in a ``topic`` line, an unknown keyword or access, a filter MQTT refuses: the
  file is refused, naming the line (``ConfigError``, ``file:line``), and the server does not
  start.

Threads: a loaded :class:`Acl` is used by one thread, the MQTT listener's loop (its caches
are not locked). A check costs a few dict lookups once the device's rules are compiled (on its
first check) and the topic was seen (a bounded cache per device).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from aaabus.config.guard import read_guarded
from aaabus.errors import ConfigError, TopicError
from aaabus.model.topicnames import check_filter, matches

__all__ = ["READ", "WRITE", "Acl", "covers", "overlaps"]

READ, WRITE = 1, 2
_ACCESS = {"read": READ, "write": WRITE, "readwrite": READ | WRITE, "deny": 0}
#: Devices whose compiled rules are kept, and topics whose write decision each keeps.
PRINCIPALS = 10000
DECISIONS = 1024
_UNSAFE = ("+", "#", "/")


@dataclass(frozen=True, slots=True)
class Rule:
    """One ``topic``/``pattern`` line: ``access`` (READ|WRITE bits; 0 for deny), its filter."""

    access: int
    topic_filter: str
    line: int


class _Principal:
    """The rules of one (user, client id), substituted: what a check reads."""

    __slots__ = ("deny", "deny_all", "read", "write", "written")

    def __init__(self, read: list[str], write: list[str], deny: list[str], deny_all: bool):
        self.read = read
        self.write = write
        self.deny = deny
        self.deny_all = deny_all
        self.written: dict[str, bool] = {}  # topic -> may publish (cache)

    def may_write(self, topic: str) -> bool:
        if self.deny_all or any(matches(d, topic) for d in self.deny):
            return False
        return any(matches(g, topic) for g in self.write)

    def may_read(self, topic_filter: str) -> bool:
        if self.deny_all or any(overlaps(d, topic_filter) for d in self.deny):
            return False
        return any(covers(g, topic_filter) for g in self.read)


class Acl:
    """The rules of one ACL file (see the module docstring): ``anonymous`` (``topic`` lines
    before any ``user`` line), ``users`` (by name) and ``patterns`` (every device)."""

    def __init__(
        self, anonymous: list[Rule], users: dict[str, list[Rule]], patterns: list[Rule]
    ) -> None:
        self.anonymous = anonymous
        self.users = users
        self.patterns = patterns
        self._by_client = any("%c" in p.topic_filter for p in patterns)
        self._principals: dict[tuple[str | None, str | None], _Principal] = {}

    # -- reading the file ----------------------------------------------------------------------

    @classmethod
    def load(cls, path: Path) -> Acl:
        """Read ``path``; :class:`ConfigError` naming ``file:line`` for a bad line, or the file
        when someone else than its owner could change it (:mod:`aaabus.config.guard`)."""
        try:
            text = read_guarded(path, "MQTT ACL file").decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"MQTT ACL file unreadable ({exc}); check aaabus.mqtt.acl", str(path)
            ) from None
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, where: str = "<acl>") -> Acl:
        """The rules of ``text``; :class:`ConfigError` at ``where:line`` for a bad line."""
        anonymous: list[Rule] = []
        users: dict[str, list[Rule]] = {}
        patterns: list[Rule] = []
        current = anonymous
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            keyword, *others = line.split(None, 1)
            rest = others[0].strip() if others else ""
            if keyword == "user":
                if not rest:
                    raise ConfigError(
                        "`user` without a name: write `user NAME`", _at(where, number)
                    )
                current = users.setdefault(rest, [])
            elif keyword in ("topic", "pattern"):
                rule = _rule(keyword, rest, number, where)
                (patterns if keyword == "pattern" else current).append(rule)
            else:
                raise ConfigError(
                    f"unknown keyword {keyword[:40]!r}: a line is `user NAME`, "
                    "`topic [read|write|readwrite|deny] FILTER` or `pattern [...] FILTER`",
                    _at(where, number),
                )
        return cls(anonymous, users, patterns)

    # -- checks (the listener's loop thread) ---------------------------------------------------

    def may_publish(self, user: str | None, client_id: str, topic: str) -> bool:
        """Whether the device may publish on ``topic`` (a write grant matches it, no deny)."""
        principal = self._principal(user, client_id)
        written = principal.written
        allowed = written.get(topic)
        if allowed is None:
            allowed = principal.may_write(topic)
            if len(written) >= DECISIONS:
                written.clear()
            written[topic] = allowed
        return allowed

    def may_subscribe(self, user: str | None, client_id: str, topic_filter: str) -> bool:
        """Whether the device may subscribe to ``topic_filter``: one read grant covers it and
        no deny line overlaps it."""
        return self._principal(user, client_id).may_read(topic_filter)

    def _principal(self, user: str | None, client_id: str) -> _Principal:
        key = (user, client_id if self._by_client else None)
        principal = self._principals.get(key)
        if principal is None:
            principal = self._compile(user, client_id)
            if len(self._principals) >= PRINCIPALS:
                del self._principals[next(iter(self._principals))]  # the oldest compiled
            self._principals[key] = principal
        return principal

    def _compile(self, user: str | None, client_id: str) -> _Principal:
        read: list[str] = []
        write: list[str] = []
        deny: list[str] = []
        deny_all = False
        own = self.anonymous if user is None else self.users.get(user, [])
        for rule, substituted in [(r, r.topic_filter) for r in own] + [
            (p, _substitute(p.topic_filter, user, client_id)) for p in self.patterns
        ]:
            if substituted is None:  # an unsafe (or, for %u, absent) value
                if rule.access == 0 and not ("%u" in rule.topic_filter and user is None):
                    deny_all = True
                continue
            if rule.access == 0:
                deny.append(substituted)
            if rule.access & READ:
                read.append(substituted)
            if rule.access & WRITE:
                write.append(substituted)
        return _Principal(read, write, deny, deny_all)


def _at(where: str, number: int) -> str:
    return f"{where}:{number}"


def _rule(keyword: str, rest: str, number: int, where: str) -> Rule:
    """A ``topic``/``pattern`` line's rule (``rest``: what follows the keyword)."""
    words = rest.split(None, 1)
    if words and words[0] in _ACCESS:
        access, topic_filter = _ACCESS[words[0]], words[1].strip() if len(words) > 1 else ""
    elif len(words) > 1:
        # Mosquitto would take `rw a/#` as the filter "rw a/#": a typo must not become a grant.
        raise ConfigError(
            f"unknown access {words[0][:40]!r}: expected read, write, readwrite or deny "
            "(a filter with spaces is not accepted in this file)",
            _at(where, number),
        )
    else:
        access, topic_filter = READ | WRITE, rest  # bare `topic F`: readwrite
    if not topic_filter:
        raise ConfigError(
            f"`{keyword}` without a topic filter: write `{keyword} [read|write|readwrite|deny] "
            "FILTER`",
            _at(where, number),
        )
    if keyword == "topic" and ("%u" in topic_filter or "%c" in topic_filter):
        raise ConfigError(
            f"{topic_filter[:60]!r}: %u and %c are substituted in `pattern` lines only "
            "(a `topic` line would take them literally)",
            _at(where, number),
        )
    probe = topic_filter.replace("%u", "u").replace("%c", "c")
    try:
        check_filter(probe)
    except TopicError as exc:
        raise ConfigError(str(exc), _at(where, number)) from None
    return Rule(access, topic_filter, number)


def _substitute(topic_filter: str, user: str | None, client_id: str) -> str | None:
    """``topic_filter`` with %u and %c replaced; None if a value is missing or unsafe."""
    if "%u" in topic_filter:
        if user is None or any(c in user for c in _UNSAFE):
            return None
        topic_filter = topic_filter.replace("%u", user)
    if "%c" in topic_filter:
        if any(c in client_id for c in _UNSAFE):
            return None
        topic_filter = topic_filter.replace("%c", client_id)
    try:
        # A substituted value may still make a bad filter (a NUL, over 65535 bytes): no match.
        return check_filter(topic_filter)
    except TopicError:
        return None


def covers(grant: str, topic_filter: str) -> bool:
    """Whether every topic name ``topic_filter`` matches, ``grant`` matches too (both valid
    filters; MQTT's rule that a first-level wildcard does not match ``$`` names included)."""
    g, f = grant.split("/"), topic_filter.split("/")
    for depth, level in enumerate(g):
        if level == "#":
            # The rest of any name, none included; but not a $ name from the first level.
            return not (depth == 0 and f[0][:1] == "$" and f[0] not in ("+", "#"))
        if depth >= len(f):
            return False  # the filter matches names that stop here; the grant wants more
        mine = f[depth]
        if mine == "#":
            # The filter reaches any depth, none included; the grant, from here, does not,
            # except `+/#` from the first level: a name has at least one level, so it is `#`.
            return depth == 0 and g == ["+", "#"]
        if level == "+":
            if depth == 0 and mine[:1] == "$":
                return False  # + does not match a $ name at the first level
            continue
        if mine != level:
            return False  # a literal grant level covers only the same literal
    # A longer filter matches names deeper than the grant reaches.
    return len(f) == len(g)


def overlaps(first: str, second: str) -> bool:
    """Whether some topic name is matched by both valid filters."""
    a, b = first.split("/"), second.split("/")
    for depth in range(max(len(a), len(b))):
        x = a[depth] if depth < len(a) else None
        y = b[depth] if depth < len(b) else None
        if x is None or y is None:
            # One stops here: only a `#` (standing for no level) on the other side meets it,
            # unless the name would be the empty one (a single empty level).
            if depth == 1 and "" in (a[0], b[0]):
                return False
            return (x if y is None else y) == "#"
        if x == "#" or y == "#":
            other = y if x == "#" else x
            return not (depth == 0 and other[:1] == "$" and other not in ("+", "#"))
        if x == "+" or y == "+":
            other = y if x == "+" else x
            if depth == 0 and other[:1] == "$" and other != "+":
                return False
            continue
        if x != y:
            return False
    return True
