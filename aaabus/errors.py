"""Typed errors of aaabus.

Every error a user can cause by bad input derives from :class:`AaabusError` and renders as one line
saying what is wrong, where, and how to fix it. The command-line entry points print that line and
exit with status 2; they never show a traceback for these.
"""

from __future__ import annotations


class AaabusError(Exception):
    """Base class of every error aaabus reports to its user as one line."""

    exit_code = 2


class ConfigError(AaabusError):
    """A configuration file or command-line argument is invalid.

    ``where`` is ``file:line`` (or ``file``) when the problem has a place.
    """

    def __init__(self, message: str, where: str | None = None) -> None:
        self.message = message
        self.where = where
        super().__init__(f"{where}: {message}" if where else message)


class StoreError(AaabusError):
    """The server's store cannot be opened, read or written."""


class SecretError(AaabusError):
    """The bus secret is missing or unreadable."""


class UnknownNotificationError(Exception):
    """Raised by the default :meth:`Agent.react` for a notification it does not handle.

    The engine turns it, like any exception escaping ``react``, into an
    ``ExceptionNotification`` sent back to the sender.
    """
