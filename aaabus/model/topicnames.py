"""Topic names and topic filters, with MQTT's rules: pure functions, no state.

A **topic name** is a UTF-8 text of ``/``-separated levels (``site/3/temp``); levels may be
empty (``a//b``, ``/a``) but the name may not, and it contains neither wildcard nor NUL.

A **topic filter** is a name whose levels may be wildcards: ``+`` stands for exactly one level,
``#`` for any number of levels (zero included) and must be the last level: ``site/#`` matches
``site``, ``site/3`` and ``site/3/temp``; ``site/+/temp`` matches ``site/3/temp`` only. A
wildcard is a whole level: ``site+`` or ``a/#b`` are refused. As in MQTT, names that start with
``$`` are not matched by a filter that starts with a wildcard (they are reserved for the bus's
own use), so ``#`` does not see ``$sys/...``.

Every check raises :class:`~aaabus.errors.TopicError` with one line saying what is wrong and
how it should look. The limits are MQTT's: 65535 bytes of UTF-8.
"""

from __future__ import annotations

from functools import lru_cache

from aaabus.errors import TopicError

__all__ = ["MAX_BYTES", "check_filter", "check_topic", "matches"]

#: Longest topic name or filter, in bytes of UTF-8 (MQTT's limit).
MAX_BYTES = 65535


def _check_text(kind: str, text: object) -> str:
    if not isinstance(text, str):
        raise TopicError(f"a topic {kind} is a text, not {type(text).__name__}")
    if not text:
        raise TopicError(f"empty topic {kind}: give at least one level, e.g. site/temp")
    if "\0" in text:
        raise TopicError(f"topic {kind} {text!r} contains a NUL character")
    if len(text.encode("utf-8", "surrogatepass")) > MAX_BYTES:
        raise TopicError(f"topic {kind} {text[:40]!r}... is longer than {MAX_BYTES} bytes")
    return text


def check_topic(topic: object) -> str:
    """``topic`` if it is a valid topic name (no wildcard), else :class:`TopicError`."""
    text = _check_text("name", topic)
    if "+" in text or "#" in text:
        raise TopicError(
            f"topic name {text!r} contains a wildcard: + and # belong in filters "
            "(subscribe), not in the name a publication is published on"
        )
    return text


def check_filter(topic_filter: object) -> str:
    """``topic_filter`` if it is a valid filter, else :class:`TopicError` (one line)."""
    text = _check_text("filter", topic_filter)
    levels = text.split("/")
    for i, level in enumerate(levels):
        if level == "#":
            if i != len(levels) - 1:
                raise TopicError(f"topic filter {text!r}: # must be the last level (e.g. site/#)")
        elif "#" in level or ("+" in level and level != "+"):
            raise TopicError(
                f"topic filter {text!r}: a wildcard must be a whole level "
                f"({level!r} mixes one with text; write e.g. site/+/temp or site/#)"
            )
    return text


@lru_cache(maxsize=4096)
def _levels(text: str) -> tuple[str, ...]:
    # Filters are matched against every publication: splitting each once saves that work.
    return tuple(text.split("/"))


def matches(topic_filter: str, topic: str) -> bool:
    """Whether valid filter ``topic_filter`` selects valid topic name ``topic``."""
    pattern = _levels(topic_filter)
    name = _levels(topic)
    if name[0].startswith("$") and pattern[0] in ("+", "#"):
        return False
    for i, level in enumerate(pattern):
        if level == "#":
            return True  # the rest, including nothing: site/# matches site
        if i >= len(name):
            return False
        if level != "+" and level != name[i]:
            return False
    return len(name) == len(pattern)
