"""Private brokers for the peer benchmarks: RabbitMQ and Mosquitto started on 127.0.0.1.

Each broker runs in a temporary directory of the caller, on free loopback ports, in its own
process group whose id is its PID; :func:`stop_group` stops exactly that group (SIGTERM, then
SIGKILL). The start functions append every process they start to the caller's ``procs`` list
*before* waiting for it, so a caller that stops ``procs`` in a ``finally`` never leaks one, also
when a start fails. They run in the caller's thread and raise ``FileNotFoundError`` (binary not
installed), ``RuntimeError`` (the broker exited) or ``TimeoutError`` (it never listened).
With ``nofile`` they start the broker with its soft file limit raised (``perf mqtt --devices``
holds thousands of connections): in the child, before exec, capped at the hard limit.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import resource
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Seconds a broker gets to come up / to shut down cleanly before it is killed.
START_TIMEOUT = 90.0
STOP_TIMEOUT = 30.0


def stop_group(proc: subprocess.Popen[Any], timeout: float = STOP_TIMEOUT) -> None:
    """Stop a child started with ``start_new_session=True``: SIGTERM its group, then SIGKILL.

    The group id is the child's own PID, so this only reaches processes we started (the
    RabbitMQ start script and the Erlang VM it forks).
    """
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    else:
        # The leader is gone; anything left in its group is still ours to clean.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


#: ``nofile`` value meaning "as high as the hard limit allows".
NOFILE_HARD = -1


def nofile_raiser(limit: int | None) -> Callable[[], None]:
    """A ``preexec_fn`` that raises the child's soft RLIMIT_NOFILE to ``limit`` (None or
    :data:`NOFILE_HARD`: to the hard limit), capped at the hard limit: a process of ours, never a
    change to the system. It only calls setrlimit (no lock taken between fork and exec)."""

    def raise_limit() -> None:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = hard if limit is None or limit == NOFILE_HARD else limit
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
        if want > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))

    return raise_limit


def free_ports(count: int) -> list[int]:
    from aaabus.tools.launch import free_port_base

    base = free_port_base(count)
    return list(range(base, base + count))


def reachable(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def tail(path: Path, lines: int = 5) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def find_binary(name: str, *extra: str) -> str | None:
    """``name`` on PATH, else in the usual sbin places (they are not on a user's PATH)."""
    found = shutil.which(name)
    if found:
        return found
    for candidate in (*extra, f"/usr/sbin/{name}", f"/usr/local/sbin/{name}"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


@dataclass
class Endpoint:
    host: str
    port: int


@dataclass
class RabbitNode:
    """One started RabbitMQ node: its Erlang node name, directory, environment (what
    ``rabbitmqctl`` needs to reach it) and process (the leader of its process group)."""

    name: str
    base: Path
    env: dict[str, str]
    amqp: Endpoint
    mqtt: Endpoint | None
    proc: subprocess.Popen[Any]


def start_rabbitmq(
    work: Path,
    procs: list[subprocess.Popen[Any]],
    mqtt: bool = False,
    nofile: int | None = None,
) -> tuple[Endpoint, Endpoint | None]:
    """A private RabbitMQ node: own node name, data dir, cookie and epmd, loopback only.

    Returns its AMQP endpoint and, with ``mqtt``, the endpoint of its MQTT plugin (enabled in the
    node's private plugin list; MQTT sessions with clean_session=False get durable queues).
    """
    base = work / "rabbitmq"
    epmd_port = start_epmd(base, procs)
    node = start_rabbitmq_node(
        base, procs, f"aaabus-peers-{os.getpid()}@localhost", epmd_port, mqtt=mqtt, nofile=nofile
    )
    return node.amqp, node.mqtt


def _rabbit_script(name: str) -> str:
    # Debian's /usr/sbin/rabbitmq-server (and rabbitmqctl) re-execute themselves as the
    # 'rabbitmq' user through su, which drops our environment; the scripts they wrap take the
    # environment as it is.
    direct = Path("/usr/lib/rabbitmq/bin") / name
    script = str(direct) if direct.exists() else find_binary(name)
    if script is None:
        raise FileNotFoundError(f"{name} is not installed (`make peers` installs it)")
    return script


def start_epmd(base: Path, procs: list[subprocess.Popen[Any]]) -> int:
    """Our own epmd on a free loopback port, in the foreground (one the VM spawned would
    daemonize and outlive the run); returns its port. Nodes registered there cannot collide
    with another run's nodes of the same name."""
    epmd = find_binary("epmd", "/usr/lib/erlang/bin/epmd")
    if epmd is None:
        raise FileNotFoundError("epmd is not installed (`make peers` installs rabbitmq-server)")
    (epmd_port,) = free_ports(1)
    base.mkdir(parents=True, exist_ok=True)
    with (base / "epmd.log").open("wb") as epmd_log:
        procs.append(
            subprocess.Popen(
                [epmd, "-address", "127.0.0.1", "-port", str(epmd_port)],
                stdin=subprocess.DEVNULL,
                stdout=epmd_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    wait_port("epmd", "127.0.0.1", epmd_port, base / "epmd.log", procs[-1], 10.0)
    return epmd_port


def start_rabbitmq_node(
    base: Path,
    procs: list[subprocess.Popen[Any]],
    name: str,
    epmd_port: int,
    *,
    cookie: str | None = None,
    mqtt: bool = False,
    nofile: int | None = None,
    wait: bool = True,
) -> RabbitNode:
    """A RabbitMQ node named ``name`` in ``base``, registered with the epmd on ``epmd_port``.

    ``cookie``: the Erlang cookie (nodes of one cluster share it; by default the node makes up
    its own). Without ``wait`` the caller waits for :attr:`RabbitNode.amqp` itself (several nodes
    then boot side by side)."""
    script = _rabbit_script("rabbitmq-server")
    amqp, dist, mqtt_port = free_ports(3)
    base.mkdir(parents=True, exist_ok=True)
    if cookie is not None:
        cookie_file = base / ".erlang.cookie"
        cookie_file.write_text(cookie)
        cookie_file.chmod(0o400)  # Erlang refuses a cookie file others can read
    conf = (
        f"listeners.tcp.default = 127.0.0.1:{amqp}\n"
        "loopback_users = none\n"
        # A small free-disk alarm threshold: a busy CI disk must not block publishers.
        "disk_free_limit.absolute = 50MB\n"
    )
    if mqtt:
        conf += f"mqtt.listeners.tcp.default = 127.0.0.1:{mqtt_port}\nmqtt.allow_anonymous = true\n"
    (base / "rabbitmq.conf").write_text(conf)
    (base / "enabled_plugins").write_text("[rabbitmq_mqtt].\n" if mqtt else "[].\n")
    env = dict(os.environ)
    env.update(
        # The Erlang cookie goes to $HOME: keep it out of the real home directory.
        HOME=str(base),
        RABBITMQ_NODENAME=name,
        RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
        RABBITMQ_NODE_PORT=str(amqp),
        RABBITMQ_DIST_PORT=str(dist),
        RABBITMQ_CONFIG_FILE=str(base / "rabbitmq.conf"),
        RABBITMQ_ADVANCED_CONFIG_FILE=str(base / "advanced.config"),
        RABBITMQ_CONF_ENV_FILE=str(base / "rabbitmq-env.conf"),  # absent: ignore /etc's
        RABBITMQ_ENABLED_PLUGINS_FILE=str(base / "enabled_plugins"),
        RABBITMQ_MNESIA_BASE=str(base / "mnesia"),
        RABBITMQ_LOG_BASE=str(base / "log"),
        RABBITMQ_LOGS="-",
        RABBITMQ_PID_FILE=str(base / "rabbitmq.pid"),
        RABBITMQ_FEATURE_FLAGS_FILE=str(base / "feature_flags"),
        # Erlang distribution listens on loopback too, and talks to our own epmd.
        RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}",
        ERL_EPMD_ADDRESS="127.0.0.1",
        ERL_EPMD_PORT=str(epmd_port),
    )
    with (base / "rabbitmq.log").open("wb") as log:
        procs.append(
            subprocess.Popen(
                [script],
                env=env,
                cwd=base,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=None if nofile is None else nofile_raiser(nofile),
            )
        )
    node = RabbitNode(
        name,
        base,
        env,
        Endpoint("127.0.0.1", amqp),
        Endpoint("127.0.0.1", mqtt_port) if mqtt else None,
        procs[-1],
    )
    if wait:
        wait_rabbitmq(node)
    return node


def wait_rabbitmq(node: RabbitNode) -> None:
    """Until ``node`` listens for AMQP (and MQTT when enabled)."""
    log = node.base / "rabbitmq.log"
    wait_port("rabbitmq", "127.0.0.1", node.amqp.port, log, node.proc)
    if node.mqtt is not None:
        wait_port("rabbitmq mqtt", "127.0.0.1", node.mqtt.port, log, node.proc)


def rabbitmqctl(node: RabbitNode, *args: str, timeout: float = 120.0) -> str:
    """``rabbitmqctl -n NODE ARGS`` with the node's environment (cookie, epmd); its output.
    Raises ``RuntimeError`` with the tool's last lines when it fails."""
    proc = subprocess.run(
        [_rabbit_script("rabbitmqctl"), "-n", node.name, *args],
        env=node.env,
        cwd=node.base,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        err = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} on {node.name}: {err}")
    return proc.stdout


def start_mosquitto(
    work: Path,
    procs: list[subprocess.Popen[Any]],
    window: int,
    name: str = "mosquitto",
    extra_conf: str = "",
    nofile: int | None = None,
    port: int | None = None,
) -> Endpoint:
    """A private Mosquitto in ``work/name``; ``extra_conf`` is appended to its configuration
    (bridges, for instance: their sections must come after the listener's settings). ``port``:
    listen there (a broker restarted after a kill comes back where its clients and bridges look
    for it, with its persistence file); by default a free one."""
    binary = find_binary("mosquitto")
    if binary is None:
        raise FileNotFoundError("mosquitto is not installed (`make peers` installs it)")
    if port is None:
        (port,) = free_ports(1)
    base = work / name
    base.mkdir(parents=True, exist_ok=True)
    conf = base / "mosquitto.conf"
    conf.write_text(
        f"listener {port} 127.0.0.1\n"
        "allow_anonymous true\n"
        "persistence true\n"
        f"persistence_location {base}/\n"
        # The default (1000) silently drops QoS 1/2 messages queued for a slow subscriber.
        "max_queued_messages 0\n"
        # RabbitMQ disables Nagle by default; mosquitto only when asked.
        "set_tcp_nodelay true\n"
        # Same delivery window as RabbitMQ's prefetch.
        f"max_inflight_messages {window}\n"
        # Started as root, mosquitto would switch to user 'mosquitto', who cannot write here.
        f"user {getpass.getuser()}\n" + extra_conf
    )
    with (base / "mosquitto.log").open("wb") as log:
        procs.append(
            subprocess.Popen(
                [binary, "-c", str(conf)],
                cwd=base,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=None if nofile is None else nofile_raiser(nofile),
            )
        )
    wait_port(name, "127.0.0.1", port, base / "mosquitto.log", procs[-1], 20.0)
    return Endpoint("127.0.0.1", port)


def wait_port(
    name: str,
    host: str,
    port: int,
    log: Path,
    proc: subprocess.Popen[Any],
    timeout: float = START_TIMEOUT,
) -> None:
    deadline = time.monotonic() + timeout
    while not reachable(host, port, 0.5):
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with status {proc.returncode}: {tail(log)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} not listening on {port} after {timeout:.0f}s: {tail(log)}")
        time.sleep(0.2)  # no readiness signal from the broker but its port
