"""aaabus: persistent agents reacting atomically to notifications, delivered exactly once and in
causal order across many servers, with causality domains joined by router servers.

The public surface is what this module exports; everything else is internal.
"""

from persistent.list import PersistentList
from persistent.mapping import PersistentMapping

from aaabus.errors import AaabusError, ConfigError, StoreError, UnknownNotificationError
from aaabus.model.agent import Agent
from aaabus.model.context import OutsideReactionError
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
from aaabus.node.server import AgentServer, BootContext
from aaabus.tools.client import Client

__all__ = [
    "AaabusError",
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
    "StoreError",
    "UnknownAgent",
    "UnknownNotificationError",
]
