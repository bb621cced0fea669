"""aaabus: persistent agents reacting atomically to notifications, delivered exactly once and in
causal order across many servers, with causality domains joined by router servers.

The public surface is what this module exports; everything else is internal. The server
(``AgentServer``, ``BootContext``) and the ``Client`` are imported when first named: agent modules
import aaabus for the programming model, and must not pay for the engine, the store, the network
and the data codec (three quarters of the import time of the whole) in every process that loads
them; a client does not load the server either.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from persistent.list import PersistentList
from persistent.mapping import PersistentMapping

from aaabus.errors import (
    AaabusError,
    AdminError,
    ConfigError,
    OutsideReactionError,
    RequestRefused,
    SecretError,
    ServerUnreachable,
    StoreError,
    TopicError,
    TransientError,
    UnknownNotificationError,
)
from aaabus.model.agent import Agent
from aaabus.model.ids import AgentId
from aaabus.model.notifications import (
    AgentCreateReply,
    AgentCreateRequest,
    AgentDeleteAck,
    AgentDeleteRequest,
    ExceptionNotification,
    Notification,
    UnknownAgent,
)
from aaabus.model.pubsub import Publication

if TYPE_CHECKING:
    from aaabus.node.server import AgentServer, BootContext
    from aaabus.tools.client import Client

#: Exported names imported on first use, and their module.
_LATER = {
    "AgentServer": "aaabus.node.server",
    "BootContext": "aaabus.node.server",
    "Client": "aaabus.tools.client",
}

# The errors: the programming model's, and every one Client raises (besides TypeError for a
# wrong argument): ConfigError and SecretError reading the config, AdminError and its
# subclasses talking to the server; ServerUnreachable is the TransientError worth retrying.
__all__ = [
    "AaabusError",
    "AdminError",
    "Agent",
    "AgentCreateReply",
    "AgentCreateRequest",
    "AgentDeleteAck",
    "AgentDeleteRequest",
    "AgentId",
    "AgentServer",
    "BootContext",
    "Client",
    "ConfigError",
    "ExceptionNotification",
    "Notification",
    "OutsideReactionError",
    "PersistentList",
    "PersistentMapping",
    "Publication",
    "RequestRefused",
    "SecretError",
    "ServerUnreachable",
    "StoreError",
    "TopicError",
    "TransientError",
    "UnknownAgent",
    "UnknownNotificationError",
]


def __getattr__(name: str) -> Any:
    """``aaabus.AgentServer``, ``from aaabus import Client``...: imported at first use."""
    module = _LATER.get(name)
    if module is None:
        raise AttributeError(f"module 'aaabus' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookups find it without coming here
    return value
