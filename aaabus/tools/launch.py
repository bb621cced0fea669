"""Starting and stopping real server processes: used by ``aaabus launch``, the perf suites and the
integration tests, so that there is one way to do it and it always cleans up.

Every process is started by us and stopped by PID: SIGTERM first (the server finishes its group
and closes its store), SIGKILL if it has not exited by the deadline.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from aaabus.config.admin_port import ADMIN_PORT_OFFSET
from aaabus.config.reader import BusConfig
from aaabus.errors import LaunchError
from aaabus.tools.readiness import READY_LINE, REPLICA_READY_LINE


class ServerProcess:
    """One ``aaabus-server`` process, its output relayed line by line.

    Output lines go to ``sink`` (default: kept in :attr:`lines` only), prefixed with the server.
    """

    def __init__(
        self,
        config: str | os.PathLike[str],
        server_id: int,
        storage: str | os.PathLike[str],
        *,
        env: dict[str, str] | None = None,
        sink: Callable[[str], None] | None = None,
        log_level: str = "WARNING",
        cwd: str | os.PathLike[str] | None = None,
        preexec: Callable[[], None] | None = None,
        replica: int | None = None,
    ) -> None:
        """``preexec``: run in the child between fork and exec (a benchmark raising the
        process's file limit: only async-signal-safe work, such as ``setrlimit``).
        ``replica``: run that replica of ``server_id`` rather than the server itself."""
        self.config = str(config)
        self.server_id = server_id
        self.storage = str(storage)
        self.env = env
        self.sink = sink
        self.log_level = log_level
        self.cwd = cwd
        self.preexec = preexec
        self.replica = replica
        self.proc: subprocess.Popen[str] | None = None
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self._terminated = False

    @property
    def name(self) -> str:
        """``s<id>``, or ``s<id>r<index>`` for a replica: what prefixes its relayed lines."""
        return f"s{self.server_id}" if self.replica is None else f"s{self.server_id}r{self.replica}"

    @property
    def title(self) -> str:
        """``server <id>``, or ``replica <index> of server <id>``: what its errors call it."""
        if self.replica is None:
            return f"server {self.server_id}"
        return f"replica {self.replica} of server {self.server_id}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("not started")
        return self.proc.pid

    def command(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "aaabus",
            "server",
            "--id",
            str(self.server_id),
            "--config",
            self.config,
            "--storage",
            self.storage,
            "--log-level",
            self.log_level,
            *(() if self.replica is None else ("--replica", str(self.replica))),
        ]

    def start(self) -> ServerProcess:
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        self._ready.clear()
        self._terminated = False
        self.proc = subprocess.Popen(
            self.command(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=self.cwd,
            start_new_session=True,  # Ctrl-C in a terminal reaches us, not our children twice
            preexec_fn=self.preexec,
        )
        self._reader = threading.Thread(
            target=self._relay, args=(self.proc,), name=f"relay-s{self.server_id}", daemon=True
        )
        self._reader.start()
        return self

    def _relay(self, proc: subprocess.Popen[str]) -> None:
        if self.replica is None:
            ready = READY_LINE.format(id=self.server_id)
        else:
            ready = REPLICA_READY_LINE.format(id=self.server_id, index=self.replica)
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            self.lines.append(line)
            if line == ready:
                self._ready.set()
            if self.sink is not None:
                self.sink(f"{self.name}| {line}")
        proc.stdout.close()

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc is None or self.proc.poll() is not None:
                if self._reader is not None:
                    self._reader.join(2.0)
                tail = " | ".join(list(self.lines)[-3:]) or "no output"
                code = self.proc.returncode if self.proc is not None else None
                raise LaunchError(f"{self.title} exited ({code}) before ready: {tail}")
            if time.monotonic() > deadline:
                # Its last lines say where the boot stands (it is still running: the caller
                # stops it).
                tail = " | ".join(list(self.lines)[-3:]) or "no output"
                raise LaunchError(
                    f"{self.title} not ready after {timeout:.0f}s; last output: {tail}"
                )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def is_ready(self) -> bool:
        """Running, and it printed its ready line since it was last started."""
        return self.running() and self._ready.is_set()

    def kill(self) -> None:
        """SIGKILL, as a crash would; waits for the process to be gone."""
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self._join_reader()

    def terminate(self) -> None:
        """Send SIGTERM once: a second one could land while the server is already exiting and
        turn a clean stop into death by signal."""
        if self.proc is not None and self.proc.poll() is None and not self._terminated:
            self._terminated = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait(10)
        self._join_reader()
        return self.proc.returncode

    def _join_reader(self) -> None:
        if self._reader is not None:
            self._reader.join(5.0)


class Bus:
    """Several server processes of one config, started together and always stopped together,
    with the replicas the config gives them (``<replica>``: stores ``s<id>r<index>`` beside
    ``s<id>``, :attr:`replicas`).

    Use as a context manager: leaving the block stops every process, also on error or Ctrl-C.
    """

    def __init__(
        self,
        config: str | os.PathLike[str],
        server_ids: Iterable[int],
        storage_root: str | os.PathLike[str],
        *,
        env: dict[str, str] | None = None,
        sink: Callable[[str], None] | None = None,
        log_level: str = "WARNING",
        cwd: str | os.PathLike[str] | None = None,
        replicas: Iterable[tuple[int, int]] | None = None,
    ) -> None:
        """``replicas``: the (server id, replica index) to run beside the servers, each on its
        own store ``s<id>r<index>`` (any server's, started here or not); default: every
        replica of the servers started."""
        root = Path(storage_root)
        self.config = str(config)
        self.servers = {
            sid: ServerProcess(
                config,
                sid,
                root / f"s{sid}",
                env=env,
                sink=sink,
                log_level=log_level,
                cwd=cwd,
            )
            for sid in server_ids
        }
        from aaabus.config.reader import load_config

        if replicas is None:
            specs = load_config(config).servers
            replicas = [(sid, rep.index) for sid in self.servers for rep in specs[sid].replicas]
        #: Replica processes, by (server id, replica index).
        self.replicas = {
            (sid, index): ServerProcess(
                config,
                sid,
                root / f"s{sid}r{index}",
                env=env,
                sink=sink,
                log_level=log_level,
                cwd=cwd,
                replica=index,
            )
            for sid, index in replicas
        }

    def processes(self) -> list[ServerProcess]:
        """Every process of the bus: the replicas, then the servers."""
        # Replicas first: a server whose commits wait for its replicas boots once they listen.
        return [*self.replicas.values(), *self.servers.values()]

    def __getitem__(self, server_id: int) -> ServerProcess:
        return self.servers[server_id]

    def start(self, timeout: float = 60.0) -> Bus:
        # Tools that start a whole bus make its secret when there is none yet.
        from aaabus.config.reader import load_config
        from aaabus.config.secret import ensure_secret, secret_path

        ensure_secret(secret_path(load_config(self.config)))
        try:
            for proc in self.processes():
                proc.start()
            deadline = time.monotonic() + timeout
            for proc in self.processes():
                proc.wait_ready(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 15.0) -> dict[int, int | None]:
        """Stop every process; the servers' exit statuses. Servers first: their last commits
        still reach their replicas."""
        for proc in self.servers.values():
            proc.terminate()  # all at once, so that they stop in parallel
        codes = {sid: proc.stop(timeout) for sid, proc in self.servers.items()}
        for proc in self.replicas.values():
            proc.terminate()
        for proc in self.replicas.values():
            proc.stop(timeout)
        return codes

    def __enter__(self) -> Bus:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


#: Environment variable ``lo-hi`` (inclusive): the ports ``free_port_base`` may hand out, admin
#: ports included. A test runner sets it per worker so that parallel workers never share a port.
PORT_RANGE_ENV = "AAABUS_PORT_RANGE"


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def parse_port_range(spec: str) -> tuple[int, int]:
    """``(lo, hi)`` from ``"lo-hi"``; LaunchError (naming the variable) when it is not one."""
    lo_text, sep, hi_text = spec.strip().partition("-")
    try:
        lo, hi = int(lo_text), int(hi_text)
    except ValueError:
        lo = hi = 0
    if not sep or not 1024 <= lo < hi <= 65535:
        raise LaunchError(
            f"{PORT_RANGE_ENV}={spec!r} is not a port range: write lo-hi with "
            "1024 <= lo < hi <= 65535 (e.g. 20000-29999), or unset it"
        )
    return lo, hi


def default_port_range(count: int = 1) -> tuple[int, int]:
    """The ports (inclusive) that buses get when ``$AAABUS_PORT_RANGE`` is not set.

    Below the kernel's ephemeral range: the servers' own outgoing connections draw their local
    ports from that range while a bus is still starting, and would take ports that later servers
    must listen on. Above it only when the room below cannot hold a run of ``count`` ports and
    their admin ports.
    """
    low, high = _ephemeral_range()
    if low - 1 - 1024 >= count + ADMIN_PORT_OFFSET:
        return 1024, low - 1
    return high + 1, 65535


def port_range(count: int = 1) -> tuple[int, int]:
    """The ports (inclusive) that ``free_port_base`` draws a run of ``count`` from:
    ``$AAABUS_PORT_RANGE`` when set (LaunchError when malformed), else ``default_port_range``."""
    spec = os.environ.get(PORT_RANGE_ENV)
    if spec:
        return parse_port_range(spec)
    return default_port_range(count)


def free_port_base(count: int, host: str = "127.0.0.1", attempts: int = 200) -> int:
    """A port ``base`` such that ``base .. base+count-1`` are all free on ``host`` right now.

    Generated configurations number their ports consecutively, so tools that start a bus need a
    whole free run; each server's default admin port (its first port + ``ADMIN_PORT_OFFSET``, see
    aaabus.config.admin_port) must be free too, so the run shifted by that offset is checked as
    well and stays inside ``port_range``. LaunchError when no such run is found.
    """
    lo, hi = port_range(count)
    top = hi - ADMIN_PORT_OFFSET - count + 1  # the last base whose admin ports stay <= hi
    if top < lo:
        raise LaunchError(
            f"no room for {count} consecutive ports and their admin ports (+{ADMIN_PORT_OFFSET}) "
            f"in {lo}-{hi}; widen {PORT_RANGE_ENV}"
        )
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randint(lo, top)
        ports = sorted(
            {*range(base, base + count)}
            | {*range(base + ADMIN_PORT_OFFSET, base + ADMIN_PORT_OFFSET + count)}
        )
        if ports_free(host, ports):
            return base
    raise LaunchError(f"no run of {count} free ports found on {host} in {lo}-{hi}")


def ports_free(host: str, ports: Iterable[int]) -> bool:
    """Whether every port can be bound on ``host`` now (all held together while checked)."""
    held: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for sock in held:
            sock.close()


def is_local(hostname: str) -> bool:
    """Whether ``hostname`` designates this machine (a loopback address, or its node name)."""
    return hostname in {"localhost", "::1", os.uname().nodename} or hostname.startswith("127.")


def local_server_ids(config_servers: Sequence[tuple[int, str]]) -> list[int]:
    """The ids of the servers whose hostname designates this machine."""
    return [sid for sid, host in config_servers if is_local(host)]


def local_members(config: BusConfig) -> tuple[list[int], list[tuple[int, int]]]:
    """The members of the config's servers that live on this machine: the ids of the servers
    whose own hostname is local (member 0), and the (server id, replica index) of the replicas
    whose hostname is local, whether or not their server's is (issue 42)."""
    servers = local_server_ids([(sid, spec.hostname) for sid, spec in config.servers.items()])
    replicas = [
        (sid, rep.index)
        for sid, spec in sorted(config.servers.items())
        for rep in spec.replicas
        if is_local(rep.hostname)
    ]
    return servers, replicas
