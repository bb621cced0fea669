"""Files that say what a server trusts are refused when someone else could change them.

``a3.xml`` decides whether a server loads code (``aaabus.trust.by_value``, ``aaabus.wire.pickle``),
which modules it imports, which peers it links to; the MQTT ACL file and the credentials file
decide who may connect and what they may read or publish. Whoever can write one of them holds
what it grants. So, as OpenSSH's ``StrictModes`` does for ``authorized_keys`` and sudo for
``sudoers``, such a file is read only when:

* it belongs to the user who reads it, or to root;
* others may not write it, and its group may not either unless that group is the owner's own:
  its primary group, listing no other member (the "user private group" that a umask of 002
  assumes; sshd makes the same exception);
* the same holds for the directory that holds it (whoever may write the directory can replace
  the file), except that a directory with the sticky bit (``/tmp``) may be writable by all: there
  only a file's owner may rename or remove it.

A file is checked on the open descriptor (``fstat``), so a file swapped between the check and the
read cannot slip through. Key files have stricter rules of their own (:func:`aaabus.config.secret.
read_private`: nobody but the owner may even read them). A refusal is one :class:`ConfigError`
line naming the file, what is wrong with it and the command that fixes it.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat

from aaabus.errors import ConfigError

__all__ = ["read_guarded"]


def read_guarded(path: str | os.PathLike[str], what: str) -> bytes:
    """The bytes of ``path``, ``what`` naming it in errors (``configuration file``, ...).

    :class:`ConfigError` (one line, naming the file) if someone other than its owner could
    change it; :class:`OSError` as it comes when it cannot be read (each caller words that).
    """
    name = os.fspath(path)
    with open(name, "rb") as file:
        _check(name, os.fstat(file.fileno()), what)
        directory = os.path.dirname(name) or "."
        info = os.stat(directory)
        if not info.st_mode & stat.S_ISVTX:
            _check(directory, info, f"directory of {what} {name}")
        return file.read()


def _check(where: str, info: os.stat_result, what: str) -> None:
    """Refuse ``where`` (a file or a directory, ``what`` in the line) if someone other than its
    owner could change it (see the module docstring)."""
    me = os.geteuid()
    if info.st_uid not in (me, 0):
        raise ConfigError(
            f"{what} belongs to user {_user(info.st_uid)}, not to {_user(me)} (who reads it) "
            f"nor to root: its owner decides what this bus trusts; run `chown {_user(me)} {where}`",
            where,
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & stat.S_IWOTH:
        writers = "anyone"
    elif mode & stat.S_IWGRP and not _private_group(info):
        writers = f"group {_group(info.st_gid)}"
    else:
        return
    raise ConfigError(
        f"{what} is writable by {writers} (mode {mode:o}): whoever writes it decides what this "
        f"bus trusts; run `chmod go-w {where}`",
        where,
    )


def _private_group(info: os.stat_result) -> bool:
    """Whether the file's group is its owner's own: the owner's primary group, which lists no
    other member."""
    try:
        owner = pwd.getpwuid(info.st_uid)
        group = grp.getgrgid(info.st_gid)
    except KeyError:
        return False  # an owner or a group the system does not know: nobody vouches for it
    return owner.pw_gid == info.st_gid and set(group.gr_mem) <= {owner.pw_name}


def _user(uid: int) -> str:
    """The user's name, or its number where the system has no name for it (as chown takes)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    """The group's name, or its number where the system has no name for it."""
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)
