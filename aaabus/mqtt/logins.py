"""The MQTT listener's password checks: a cache of verified passwords and a pool of threads.

Threads: every method but the pool's job runs on the listener's loop (``mqtt-<id>``), which
owns the cache and the queue: no lock. The scrypt checks (:meth:`Credentials.check`) run on a
pool of :data:`AUTH_THREADS` threads (``mqtt-auth-<id>``), never on the loop; the logins
waiting for them are the loop's (a :class:`~aaabus.io.loginqueue.LoginQueue`), two handed to
the pool at a time. A check's outcome comes back to the loop through its wake-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aaabus.io.loginqueue import LoginQueue
from aaabus.mqtt.auth import Credentials

__all__ = ["AUTH_CACHE", "AUTH_THREADS", "Logins"]

#: Verified passwords remembered (a reconnecting site does not pay scrypt again per device).
AUTH_CACHE = 4096
#: Threads checking passwords (scrypt releases the interpreter's lock while it computes).
AUTH_THREADS = 2

#: A login waiting for its password check: user, password, its key in the cache of verified
#: passwords, and what to call with the outcome.
_Login = tuple[str, str, tuple[str, bytes], Callable[[bool | None], None]]


class Logins:
    """The password checks of listener ``sid``'s devices against ``credentials`` (None: no
    credentials file, ``anonymous`` says whether a device is in). ``queue``/``per_address``
    bound the logins waiting (``aaabus.mqtt.login_queue``, ``login_per_address``);
    ``refused(where, reason)`` counts and logs one turned away."""

    def __init__(
        self,
        sid: int,
        credentials: Credentials | None,
        anonymous: bool,
        queue: int,
        per_address: int,
        refused: Callable[[str, str], None],
    ) -> None:
        self.credentials = credentials
        self.anonymous = anonymous
        self._refused = refused
        # Verified (user, keyed hash of the password): a reconnection skips scrypt.
        self._key = os.urandom(32)
        self._ok: OrderedDict[tuple[str, bytes], None] = OrderedDict()
        self._pool: ThreadPoolExecutor | None = None
        if credentials is not None:
            self._pool = ThreadPoolExecutor(AUTH_THREADS, thread_name_prefix=f"mqtt-auth-{sid}")
        # The logins waiting for the pool (loop thread), and the checks it ran.
        self._queue: LoginQueue[Any, _Login] = LoginQueue(queue, per_address, AUTH_THREADS)
        self.checked = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        """Logins waiting for their check."""
        return len(self._queue)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the outcomes go back to (before the first :meth:`authenticate`)."""
        self._loop = loop

    def shutdown(self) -> None:
        """Stop the pool (any thread); the checks not started are dropped."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def authenticate(
        self,
        conn: Any,
        address: str,
        user: str | None,
        password: bytes | None,
        then: Callable[[bool | None], None],
    ) -> None:
        """``then(ok)`` on the loop: at once without a credentials file or for a password
        verified lately, else after scrypt on the pool, or ``then(None)`` at once when too
        many logins wait (of ``address`` or in all: "server busy"). A user name the file
        does not hold costs the same check as one it does (:meth:`Credentials.check`): how long
        the answer takes does not tell which users exist."""
        if self.credentials is None:
            then(self.anonymous)
            return
        if user is None or password is None:
            then(False)
            return
        try:
            text = password.decode("utf-8")
        except UnicodeDecodeError:
            then(False)
            return
        key = (user, hmac.new(self._key, password, hashlib.sha256).digest())
        if key in self._ok:
            self._ok.move_to_end(key)
            then(True)
            return
        if not self._queue.add(address, conn, (user, text, key, then)):
            self._refused(
                address,
                f"user {user!r}: {len(self._queue)} logins wait for their password check "
                "(aaabus.mqtt.login_queue, login_per_address)",
            )
            then(None)
            return
        self._next()

    def remove(self, conn: Any) -> None:
        """``conn`` ended: its login, if not checked yet, costs nothing more."""
        self._queue.remove(conn)

    def _next(self) -> None:
        """Hand the pool the logins whose turn it is, while a thread is free (loop thread)."""
        pool, credentials, loop = self._pool, self.credentials, self._loop
        assert pool is not None and credentials is not None and loop is not None
        while (job := self._queue.take()) is not None:
            user, text, _key, _then = job

            def check(job: _Login = job, user: str = user, text: str = text) -> None:
                ok = credentials.check(user, text)  # pool thread
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(self._checked, job, ok)

            pool.submit(check)

    def _checked(self, job: _Login, ok: bool) -> None:
        _user, _text, key, then = job
        self._queue.release()
        self.checked += 1
        if ok:
            self._ok[key] = None
            while len(self._ok) > AUTH_CACHE:
                self._ok.popitem(last=False)
        then(ok)  # a connection that ended meanwhile ignores it
        self._next()
