"""A private Spark standalone cluster on 127.0.0.1: one master, one worker, from the jars and
scripts the installed pyspark package ships (``pyspark/bin/spark-class``; nothing downloaded).

It proves that the Spark jobs of ``aaabus plan`` and ``aaabus analyze`` run on a real cluster
(the driver in this machine's process, the executors in JVMs the worker launches), and serves the
tests that check it. ``with standalone_cluster(workdir) as cluster:`` gives ``cluster.url``
(``spark://127.0.0.1:PORT``) and ``cluster.env`` (what a driver process needs: the same
``SPARK_HOME`` and ``SPARK_LOCAL_IP``); both JVMs are stopped by PID when the block ends, also
on failure or Ctrl-C.

Everything runs on the caller's thread. The JVMs write their logs to ``workdir/master.log`` and
``workdir/worker.log``; a start that fails raises :class:`ClusterError` quoting the log's end.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aaabus.errors import AaabusError

#: Seconds a JVM may take to come up (a cold start on a loaded 2-core machine takes ~10).
START_TIMEOUT = 120.0
STOP_TIMEOUT = 20.0


class ClusterError(AaabusError):
    """The standalone cluster could not start (no java, port taken, JVM died...)."""

    exit_code = 1


@dataclass
class StandaloneCluster:
    """A running master and worker: where to reach them and what was started."""

    url: str  # spark://127.0.0.1:PORT, for --master
    web_url: str  # the master's web UI (its /json/ says which workers are alive)
    env: dict[str, str]
    pids: list[int] = field(default_factory=list)

    def status(self) -> dict[str, Any]:
        """The master's own view (``/json/``): status, workers, applications."""
        with urllib.request.urlopen(self.web_url + "/json/", timeout=5) as response:
            status: dict[str, Any] = json.load(response)
            return status


def spark_home() -> Path:
    """The Spark distribution inside the installed pyspark package."""
    import pyspark

    return Path(pyspark.__file__).resolve().parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the JVM binds it right after: a small race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def standalone_cluster(
    workdir: str | os.PathLike[str], *, cores: int = 2, memory: str = "1g"
) -> Iterator[StandaloneCluster]:
    """Start a master and one worker (``cores`` cores, ``memory`` for executors) on 127.0.0.1;
    stop both JVMs by PID when the block ends."""
    if shutil.which("java") is None and "JAVA_HOME" not in os.environ:
        raise ClusterError("no java on PATH and no JAVA_HOME: Spark needs a JVM (17 or later)")
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    home = spark_home()
    env = {
        **os.environ,
        "SPARK_HOME": str(home),
        "SPARK_LOCAL_IP": "127.0.0.1",  # every JVM binds and advertises 127.0.0.1 only
        "SPARK_LOG_DIR": str(work),
        "SPARK_WORKER_DIR": str(work / "work"),
    }
    port, web = free_port(), free_port()
    cluster = StandaloneCluster(
        url=f"spark://127.0.0.1:{port}",
        web_url=f"http://127.0.0.1:{web}",
        env={"SPARK_HOME": str(home), "SPARK_LOCAL_IP": "127.0.0.1"},
    )
    spark_class = str(home / "bin" / "spark-class")
    with ExitStack() as stack:
        master = stack.enter_context(
            _jvm(
                [
                    spark_class,
                    "org.apache.spark.deploy.master.Master",
                    *("--host", "127.0.0.1", "--port", str(port), "--webui-port", str(web)),
                ],
                env,
                work / "master.log",
            )
        )
        cluster.pids.append(master.pid)
        _wait(master, work / "master.log", "master", lambda: _alive(cluster) is not None)
        worker = stack.enter_context(
            _jvm(
                [
                    spark_class,
                    "org.apache.spark.deploy.worker.Worker",
                    *("--host", "127.0.0.1", "--port", str(free_port())),
                    *("--webui-port", str(free_port()), "--cores", str(cores)),
                    *("--memory", memory, "--work-dir", str(work / "work"), cluster.url),
                ],
                env,
                work / "worker.log",
            )
        )
        cluster.pids.append(worker.pid)
        _wait(worker, work / "worker.log", "worker", lambda: (_alive(cluster) or 0) >= 1)
        yield cluster


@contextmanager
def _jvm(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """One JVM (spark-class execs java: the PID is the JVM's), stopped by PID at the end."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    try:
        yield proc
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(STOP_TIMEOUT)


def _alive(cluster: StandaloneCluster) -> int | None:
    """Alive workers according to the master, or None while it does not answer."""
    try:
        status = cluster.status()
    except (OSError, urllib.error.URLError, ValueError):
        return None
    if status.get("status") != "ALIVE":
        return None
    return sum(1 for w in status.get("workers", []) if w.get("state") == "ALIVE")


def _wait(proc: subprocess.Popen[bytes], log: Path, what: str, ready: Callable[[], bool]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(
                f"the Spark {what} exited with status {proc.returncode}: {_tail(log)}"
            )
        if ready():
            return
        time.sleep(0.2)  # polling the master's web UI: nothing to wait on but time
    raise ClusterError(f"the Spark {what} was not ready after {START_TIMEOUT:.0f} s: {_tail(log)}")


def _tail(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return f"(no log at {log})"
    return f"{lines[-1].strip() if lines else 'empty log'} (log: {log})"
