"""Every error aaabus raises, in one hierarchy (a leaf module: it imports nothing of aaabus).

Four families, by who sees them and what may catch them::

    Exception
    ├── AaabusError            a user caused it (bad file, flag, port, request): one line
    │   ├── TransientError     ... and retrying the same operation later may succeed
    │   ├── ConfigError → ExtraMissing
    │   ├── SecretError, NetworkError, ServiceFailed, LaunchError, MetricsError, TrafficError
    │   ├── TraceError, SparkStartError (aaabus.analysis: ``aaabus plan``, ``aaabus analyze``)
    │   ├── StoreError → StoreInUse, LogStoreDamaged
    │   ├── UntrustedClass (also a pickle.UnpicklingError)
    │   ├── TopicError (also a ValueError)
    │   └── AdminError
    │       ├── RequestRefused → UndecodableRequest
    │       └── ServerUnreachable, ServerBusy (also TransientErrors)
    ├── AgentError             raised into or by agent code, handled like any agent exception
    │   ├── OutsideReactionError (also a RuntimeError)
    │   └── UnknownNotificationError
    └── InternalError          raised and handled inside the bus; never reaches a user as such
        ├── WireError → FrameTooLarge, AuthError
        ├── MalformedPickle, BadBody, ClockError, FormatError (also ValueErrors)
        ├── UnreadableRecord, PassStopped (the log store's garbage pass)
        ├── ReactionFailed
        └── FailpointError
    BaseException
    └── FatalError             the engine thread must stop: never swallowed by ``except Exception``
        ├── StoreWriteFailed
        └── EngineStopped

Every :class:`AaabusError` renders as one line saying what is wrong, where, and how to fix it. The
command-line entry points print that line and exit with its ``exit_code`` (2, or 1 for a server
that does not answer); they never show a traceback for these.

Why the other families are not AaabusErrors: code catches ``AaabusError`` to turn it into that one
line as it is (the CLI, the admin endpoint's answers, a boot service's failure), while any other
exception is wrapped with its type name. Agent errors and internal errors keep that treatment.
The classes that were ``ValueError``/``RuntimeError``/``UnpicklingError`` still are, so every
``except`` that caught them still does.
"""

from __future__ import annotations

import pickle

__all__ = [
    "AaabusError",
    "AdminError",
    "AgentError",
    "AuthError",
    "BadBody",
    "ClockError",
    "ConfigError",
    "DependencyLost",
    "EngineStopped",
    "ExtraMissing",
    "FailpointError",
    "FatalError",
    "FormatError",
    "FrameTooLarge",
    "IllegalTransition",
    "InternalError",
    "LaunchError",
    "LogStoreDamaged",
    "MalformedPickle",
    "MetricsError",
    "MqttProtocolError",
    "NetworkError",
    "OutsideReactionError",
    "PassStopped",
    "ReactionFailed",
    "ReplicationStopped",
    "RequestRefused",
    "SecretError",
    "ServerBusy",
    "ServerUnreachable",
    "ServiceFailed",
    "SessionLeft",
    "SparkStartError",
    "StoreError",
    "StoreInUse",
    "StoreWriteFailed",
    "TopicError",
    "TraceError",
    "TrafficError",
    "TransientError",
    "UndecodableRequest",
    "UnknownNotificationError",
    "UnreadableRecord",
    "UntrustedClass",
    "WireError",
]


# -- user-facing ------------------------------------------------------------------------------


class AaabusError(Exception):
    """Base class of every error aaabus reports to its user as one line."""

    exit_code = 2


class TransientError(AaabusError):
    """The operation failed for a reason that may go away: retrying it later may succeed.

    Like ZODB's ``TransientError``: callers that retry catch this base, not a list of classes.
    """


class ConfigError(AaabusError):
    """A configuration file or command-line argument is invalid.

    ``where`` is ``file:line`` (or ``file``) when the problem has a place.
    """

    def __init__(self, message: str, where: str | None = None) -> None:
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class ExtraMissing(ConfigError):
    """A feature was asked for (a property, a command) whose library is an optional dependency
    that is not installed; the message names the extra that brings it (see aaabus.extras)."""


class StoreError(AaabusError):
    """The server's store cannot be opened, read or written."""


class StoreInUse(StoreError):
    """Another process has the store directory open."""


class LogStoreDamaged(StoreError):
    """Committed data or a segment header of a log store fails its checks."""


class UntrustedClass(AaabusError, pickle.UnpicklingError):
    """A pickle named a global this server does not trust; nothing was constructed from it.

    Also an ``UnpicklingError``: every ``except`` that catches a bad pickle still catches it."""


class SecretError(AaabusError):
    """The bus secret is missing or unreadable."""


class TopicError(AaabusError, ValueError):
    """A topic name or a topic filter is malformed (``+`` or ``#`` misplaced, empty, too long).

    Raised by ``publish``/``subscribe`` in a reaction (which then fails like any agent error),
    by :class:`~aaabus.tools.client.Client` and by the ``aaabus publish``/``subscribe`` commands.
    Also a ``ValueError``: it is bad input."""


class NetworkError(AaabusError):
    """The network layer cannot start (e.g. a listen port is taken)."""


class ServiceFailed(AaabusError):
    """A boot-time service raised; the server does not start."""


class LaunchError(AaabusError):
    """A server process did not become ready, or died."""


class MetricsError(AaabusError):
    """The metrics port cannot be served."""


class TrafficError(AaabusError):
    """Traffic recording cannot start (bad window sizes, directory not writable)."""


class TraceError(AaabusError):
    """Traces that ``aaabus plan`` or ``aaabus analyze`` cannot read or analyse (missing,
    another schema, corrupted), or a result they cannot write."""


class SparkStartError(AaabusError):
    """Spark itself could not start (no Java, bad master URL...)."""

    exit_code = 1


class AdminError(AaabusError):
    """An admin request could not be made or was refused."""


class ServerUnreachable(AdminError, TransientError):
    """Nothing answers on the server's admin port (the server is down or unreachable).
    ``reason``: why, without the address (the whole message when not given)."""

    exit_code = 1

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = message if reason is None else reason


class ServerBusy(AdminError, TransientError):
    """The server accepted the connection and dropped it before authenticating: it is up but
    turning connections away (overloaded, or under a flood of unauthenticated connections)."""

    exit_code = 1


class RequestRefused(AdminError):
    """The server received the request and refused it (bad target, undecodable notification)."""


class UndecodableRequest(RequestRefused):
    """A request whose notification, payload or agent does not decode (or is code this server
    does not load): refused in one line, and the server ends that connection after answering."""


# -- agent code -------------------------------------------------------------------------------


class AgentError(Exception):
    """Raised into or by agent code; the engine handles it like any exception of a reaction."""


class OutsideReactionError(AgentError, RuntimeError):
    """An agent operation was called while no reaction or service is running on this thread."""


class UnknownNotificationError(AgentError):
    """Raised by the default :meth:`Agent.react` for a notification it does not handle.

    The engine turns it, like any exception escaping ``react``, into an
    ``ExceptionNotification`` sent back to the sender.
    """


# -- internal ---------------------------------------------------------------------------------


class InternalError(Exception):
    """Raised and caught inside aaabus: a bad peer, a bad record, a replay; users never see it."""


class IllegalTransition(InternalError):
    """A state machine was given an event its state does not allow (a connection of the
    network, :mod:`aaabus.io.states`): a bug of its owner, never a peer's doing."""

    def __init__(self, message: str, state: object, event: object) -> None:
        super().__init__(message)
        self.state = state
        self.event = event


class WireError(InternalError):
    """The byte stream of a connection violates the protocol; the connection must be dropped."""


class FrameTooLarge(WireError):
    """A frame's length prefix exceeds the allowed maximum."""


class AuthError(WireError):
    """The peer failed to authenticate, or a session frame failed verification."""


class MalformedPickle(InternalError, ValueError):
    """Bytes that are not one well-formed pickle (the message says what is wrong, and where)."""


class BadBody(InternalError, ValueError):
    """A notification body that is not a pickle this server is willing to load."""


class ClockError(InternalError, ValueError):
    """A stamp (or call) the clock refuses. The clock is left exactly as it was."""


class ReactionFailed(InternalError):
    """Internal: a reaction raised inside a group; the group must be replayed carefully."""


class DependencyLost(InternalError):
    """Internal: a group applied a frame its sender sent before that frame was durable, and the
    sender's connection ended before vouching for it (see :mod:`aaabus.core.early`). The group
    is aborted and replayed without the frame; a durable one is sent again by its sender."""


class FailpointError(InternalError):
    """Raised by a failpoint armed with the ``raise`` action."""


class FormatError(InternalError, ValueError):
    """Log-store bytes that are not what the format says; ``offset`` is where they fail."""

    def __init__(self, offset: int, what: str) -> None:
        super().__init__(what)
        self.offset = offset
        self.what = what


class UnreadableRecord(InternalError):
    """A current log-store record whose references cannot be read (not a ZODB pickle)."""


class PassStopped(InternalError):
    """The log store is closing: a garbage pass was given up before dropping anything."""


# -- fatal to the engine thread ---------------------------------------------------------------


class FatalError(BaseException):
    """The engine thread cannot go on; the server stops (its process exits non-zero).

    A ``BaseException``, like ``SystemExit``: the engine treats an ``Exception`` raised inside a
    group as a bad input, drops it and goes on, which for these would mean retrying the same
    commit forever. They travel up to the engine thread's last-resort handler instead.
    """


class StoreWriteFailed(FatalError):
    """A commit could not be written (disk full, I/O error): the server must stop."""


class EngineStopped(FatalError):
    """The engine cannot make progress: the same group failed to commit again and again."""


class SessionLeft(TransientError):
    """An MQTT step (a publication, a QoS 2 release) of a connection whose roaming session has
    just moved to another server: not answered (the connection is closed), so the device
    repeats it where the session is now, whose record knows the packet id."""

    def __init__(self, client_id: str) -> None:
        super().__init__(f"session {client_id!r} moved to another server")


class MqttProtocolError(AaabusError):
    """A device sent what MQTT does not allow (malformed, oversized, out of order); the listener
    closes that connection. ``code``: the CONNACK return code to send first, if any."""

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.code = code


class ReplicationStopped(FatalError):
    """A commit was waiting for its server's synchronous replicas (issue 42) when the server
    stopped: it was never acknowledged, and the server stops with it."""
