"""Declaring topics at boot, from ``a3.xml``: retained values and named client subscriptions.

A boot service (the existing ``<service>`` mechanism) whose ``args`` is a JSON object::

    <service class="aaabus.topics.declare:declare"
             args='{"retain": {"site/mode": "normal"}, "mailboxes": {"audit": "site/#"}}'/>

* ``retain``: topic -> payload (any JSON value), published retained from ``#s.s.0`` at the
  server's **first** boot only (later boots would overwrite values published since);
* ``mailboxes``: name -> filter: a named client subscription created at every boot if missing,
  so that its backlog collects publications before any consumer attaches
  (``aaabus subscribe a3.xml FILTER --name NAME`` then reads from the start).

Agents declare their own subscriptions with the class attribute
:attr:`aaabus.Agent.subscriptions`. Runs on the engine thread in the boot transaction; a bad
``args`` raises :class:`~aaabus.errors.ConfigError` (one line) and the server does not start.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

from aaabus.errors import ConfigError, TopicError
from aaabus.model.ids import AgentId
from aaabus.model.notifications import Notification
from aaabus.model.pubsub import Publish
from aaabus.model.topicnames import check_filter, check_topic
from aaabus.topics.messages import OpenMailbox

__all__ = ["declare"]


class _Boot(Protocol):
    """What this service uses of :class:`aaabus.BootContext` (a layer above this one)."""

    @property
    def server_id(self) -> int: ...

    @property
    def send(self) -> Callable[[AgentId, Notification], None]: ...


def declare(ctx: _Boot, args: str, first_time: bool) -> None:
    """The boot service (see the module docstring)."""
    spec = _parse(args, ctx.server_id)
    rep = AgentId.topics_of(ctx.server_id)
    if first_time:
        for topic, payload in spec["retain"].items():
            ctx.send(rep, Publish(topic, payload, retain=True))
    for name, topic_filter in spec["mailboxes"].items():
        ctx.send(rep, OpenMailbox(name, topic_filter))


def _parse(args: str, server_id: int) -> dict[str, dict[str, Any]]:
    where = f"service aaabus.topics.declare:declare of server {server_id}"
    try:
        spec = json.loads(args or "{}")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: args is not JSON ({exc.msg} at {exc.pos})") from None
    if not isinstance(spec, dict) or set(spec) - {"retain", "mailboxes"}:
        raise ConfigError(f'{where}: args must be a JSON object with "retain" and/or "mailboxes"')
    retain = spec.get("retain", {})
    mailboxes = spec.get("mailboxes", {})
    if not isinstance(retain, dict) or not isinstance(mailboxes, dict):
        raise ConfigError(f'{where}: "retain" and "mailboxes" map names to values')
    try:
        for topic in retain:
            check_topic(topic)
        for name, topic_filter in mailboxes.items():
            if not name:
                raise TopicError("a mailbox name is not empty")
            check_filter(topic_filter)
    except TopicError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return {"retain": retain, "mailboxes": mailboxes}
