"""aaabus: persistent agents reacting atomically to notifications, delivered exactly once and in
causal order across many servers, with causality domains joined by router servers.

The public surface is what this module exports; everything else is internal.
"""

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
from aaabus.node.server import AgentServer, BootContext
from aaabus.tools.client import Client

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
    "RequestRefused",
    "SecretError",
    "ServerUnreachable",
    "StoreError",
    "TransientError",
    "UnknownAgent",
    "UnknownNotificationError",
]
