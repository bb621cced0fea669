"""One thread per server that reads its status through its admin port, once a second.

Each :class:`Poller` owns its server's :class:`~aaabus.io.adminlink.AdminLink` (kept open between
readings: one handshake per connection, not per reading) and hands every outcome to ``deliver``
as a :class:`Reading`: the status, or why there is none. A server that does not answer costs its
own thread a timeout and nobody else anything, so a bus of 150 servers of which most are down is
read as fast as one of four. The credential is ``read``-scoped (the command refuses any other):
a reading is the admin request ``status`` with ``"detail": true``, which changes nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aaabus.config.admin_port import member_admin_addresses
from aaabus.config.reader import BusConfig
from aaabus.config.secret import Credential
from aaabus.errors import AdminError, ServerBusy, ServerUnreachable, WireError
from aaabus.io.adminlink import AdminLink
from aaabus.io.tls import tls_contexts

__all__ = ["INTERVAL", "TIMEOUT", "Poller", "Reading"]

#: Seconds between two readings of a server.
INTERVAL = 1.0
#: Seconds a server has to connect and answer one reading: a server that stops answering is
#: shown down within INTERVAL + TIMEOUT (3 s; one that crashed, within INTERVAL: its socket
#: closes at once).
TIMEOUT = 2.0


@dataclass(frozen=True, slots=True)
class Reading:
    """What one reading of server ``server`` found, at ``at`` (``time.monotonic()``).

    ``state``: ``up`` (``status`` is its answer), ``down`` (nothing answers), ``busy`` (it
    accepted and dropped the connection), ``refused`` (it turned the key away, or refused the
    request): ``error`` says why in one line.
    """

    server: int
    at: float
    state: str
    status: dict[str, Any] | None = None
    error: str | None = None


class Poller:
    """Reads one server (see the module docstring). ``deliver`` runs on this poller's thread
    and must only hand the reading over (the console's loop owns what it feeds)."""

    def __init__(
        self,
        config: BusConfig,
        server_id: int,
        credential: Credential,
        deliver: Callable[[Reading], None],
        interval: float = INTERVAL,
        timeout: float = TIMEOUT,
    ) -> None:
        self.server_id = server_id
        # Each member's admin address: only the server's primary member listens (issue 42).
        self._addresses = [address for _m, address in member_admin_addresses(config, server_id)]
        self._at = 0  # the member that answered last, tried first
        self._tls = tls_contexts(config, server_id)[1] if self._addresses else None
        self._credential = credential
        self._deliver = deliver
        self._interval = interval
        self._timeout = timeout
        self._link: AdminLink | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"console-poll-{server_id}", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end; it does within one reading's timeout (it is a daemon thread,
        so a console that exits does not wait for it)."""
        self._stop.set()

    def _run(self) -> None:
        while True:
            self._deliver(self.read())
            if self._stop.wait(self._interval):
                break
        if self._link is not None:
            self._link.close()

    def read(self) -> Reading:
        """One reading (this poller's thread; never raises).

        A session kept open from an earlier reading that fails at once is tried again once on
        a new connection: the server ends admin sessions at their lifetime and after an idle
        time (``aaabus.admin.lifetime``), which is no reason to show it down. One that failed
        by waiting (a server that stopped answering) is not: that would double the time a hung
        server takes to show."""
        reused = self._link is not None
        started = time.monotonic()
        reading = self._attempt()
        if reused and reading.state == "down" and time.monotonic() - started < self._timeout / 2:
            reading = self._attempt()
        return reading

    def _attempt(self) -> Reading:
        sid = self.server_id
        if not self._addresses:
            return Reading(
                sid, time.monotonic(), "down", error="no admin port (aaabus.admin.port=off)"
            )
        try:
            if self._link is None:
                self._link, self._at = AdminLink.connect_any(
                    self._addresses,
                    self._credential,
                    sid,
                    first=self._at,
                    timeout=self._timeout,
                    tls=self._tls,
                )
            self._link.sock.settimeout(self._timeout)
            answer = self._link.request({"op": "status", "detail": True})
        except ServerUnreachable as exc:
            return self._failed("down", str(exc))
        except ServerBusy as exc:
            return self._failed("busy", str(exc))
        except AdminError as exc:  # the handshake failed: another key, another bus, TLS
            return self._failed("refused", str(exc))
        except (WireError, OSError) as exc:  # it answered before; now it does not
            return self._failed(
                "down", f"server {sid} stopped answering ({exc or type(exc).__name__})"
            )
        if not answer.get("ok"):
            error = str(answer.get("error", "refused"))
            # Every admin session taken: running, and turning this one away.
            state = "busy" if error.startswith("busy") else "refused"
            return self._failed(state, f"server {sid}: {error}")
        return Reading(sid, time.monotonic(), "up", status=answer.get("status"))

    def _failed(self, state: str, error: str) -> Reading:
        if self._link is not None:
            self._link.close()
            self._link = None
        return Reading(self.server_id, time.monotonic(), state, error=error)
