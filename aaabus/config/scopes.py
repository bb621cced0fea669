"""The scopes of a tool credential: how much a tool may do on an admin port.

A tool key is made for one scope (``aaabus secret --tool --scope S``), and each scope covers the
ones below it::

    read     status, subscribe, fetch: look at the bus, change nothing in it but the backlogs
             of the subscriptions read keys opened (aaabus.node.mailboxes)
    operate  read + send, publish, request, deploy an agent of a class the servers import,
             unsubscribe, stop a server, arm failpoints
    code     operate + whatever may carry code: on a server that loads code (properties
             ``aaabus.trust.by_value`` or ``aaabus.wire.pickle``), every request carrying a
             notification, a payload or an agent, deploying an agent *by value* included

The scope is a key property, not a claim: the admin key of scope S is derived from the tool key
of S (:mod:`aaabus.config.secret`), and the scope travels in the handshake, inside every MAC
(:mod:`aaabus.wire.frames`), so a read key cannot pass for an operate one. Which request needs
which scope is :mod:`aaabus.node.rights`.

Its values are the ``role`` byte of the handshake (0 is a server's link, so scopes start at 1).
"""

from __future__ import annotations

import enum

from aaabus.errors import SecretError

__all__ = ["DEFAULT_SCOPE", "Scope", "parse_scope"]


class Scope(enum.IntEnum):
    """A tool's rights, ordered: a higher scope covers every lower one."""

    READ = 1
    OPERATE = 2
    CODE = 3

    @property
    def label(self) -> str:
        """The name in key files, on the command line and in refusals: ``read`` and so on."""
        return self.name.lower()

    def covers(self, needed: Scope) -> bool:
        return self >= needed


#: What ``aaabus secret --tool`` makes, and what a tool holding the bus key claims.
DEFAULT_SCOPE = Scope.OPERATE


def parse_scope(text: str, where: str = "scope") -> Scope:
    """The scope named ``text``; :class:`SecretError` (one line) for anything else."""
    for scope in Scope:
        if text == scope.label:
            return scope
    names = ", ".join(s.label for s in Scope)
    raise SecretError(f"{where}: unknown scope {text!r}; the scopes are {names}")
