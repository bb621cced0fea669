"""What every Spark command shares: trace files checked with pyarrow before any JVM starts, a
quiet SparkSession whose JVM output goes to a log file, and Spark failures turned into one line
for the user.

Used by ``aaabus analyze`` (timing traces) and ``aaabus plan`` (traffic traces). Everything runs
on the caller's thread; pyarrow and pyspark are imported inside the functions, so that importing
this module costs nothing to the commands that do not start Spark, and works without them (the
commands then say which extra to install).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from aaabus.errors import SparkStartError, TraceError

if TYPE_CHECKING:
    import pyarrow as pa
    from pyspark.sql import DataFrame, SparkSession

#: Driver JVM options with a local master. An analysis is a short job on a small machine: the
#: C2 compiler's and G1's background threads cost more CPU than they give back (measured on
#: 2 cores: 1,000,000 rows in 25-30 s with them off, 40 s and more with the defaults).
LOCAL_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


# --------------------------------------------------------------------------------------------
# Trace files, checked with pyarrow before any JVM exists.


def _is_hidden(rel: str) -> bool:
    # Spark skips files and directories whose name starts with "_" or ".": so must we.
    return any(part.startswith(("_", ".")) for part in rel.split("/") if part)


def parquet_files(fs: Any, directory: str) -> list[str] | None:
    """Parquet files under ``directory`` (recursively), or None if it does not exist."""
    import pyarrow.fs as pafs

    info = fs.get_file_info(directory)
    if info.type == pafs.FileType.NotFound:
        return None
    if info.type != pafs.FileType.Directory:
        raise TraceError(f"{directory} is not a directory")
    selector = pafs.FileSelector(directory, recursive=True)
    files = []
    for entry in fs.get_file_info(selector):
        rel = entry.path[len(directory) :]
        if entry.type == pafs.FileType.File and rel.endswith(".parquet") and not _is_hidden(rel):
            files.append(entry.path)
    return sorted(files)


def check_footer(fs: Any, path: str, kind: str, expected: pa.Schema) -> int:
    """Check one file's footer against ``expected`` (one of :mod:`aaabus.analysis.schema`);
    return its row count. The version read is the one ``expected`` declares in its metadata."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ours = (expected.metadata or {}).get(b"aaabus.schema_version", b"").decode()
    try:
        with fs.open_input_file(path) as handle:
            meta = pq.read_metadata(handle)
            schema = meta.schema.to_arrow_schema()
    except (pa.ArrowException, OSError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TraceError(f"corrupted trace file {path}: {first}") from None
    kv = {k.decode(): v.decode() for k, v in (schema.metadata or {}).items()}
    trace = kv.get("aaabus.trace")
    if trace is not None and trace != kind:
        raise TraceError(f"{path} is a {trace!r} trace, found under {kind}/")
    version = kv.get("aaabus.schema_version")
    if version is not None and version != ours:
        raise TraceError(
            f"{path} has trace schema version {version}; this analyzer reads version {ours} only"
        )
    missing = [f.name for f in expected if f.name not in schema.names]
    if missing:
        raise TraceError(f"{path} lacks column(s) {', '.join(missing)}: not a {kind} trace")
    for f in expected:
        got = schema.field(f.name).type
        # Timestamps in another unit or zone read fine in Spark; anything else would not.
        same = got == f.type or (pa.types.is_timestamp(got) and pa.types.is_timestamp(f.type))
        if not same:
            raise TraceError(f"{path}: column {f.name} is {got}, expected {f.type}")
    if "schema_version" not in expected.names:  # compact traces carry it in metadata only
        return int(meta.num_rows)
    # The column's statistics give its range without reading a page.
    col = schema.get_field_index("schema_version")
    for g in range(meta.num_row_groups):
        stats = meta.row_group(g).column(col).statistics
        if stats is None or not stats.has_min_max:
            continue
        bad = [v for v in (stats.min, stats.max) if str(v) != ours]
        if bad:
            raise TraceError(
                f"{path} has rows of trace schema version {bad[0]}; this analyzer reads version "
                f"{ours} only"
            )
    return int(meta.num_rows)


def local_path(location: str) -> Path | None:
    """The local path ``location`` names, or None if it is a URI of another filesystem."""
    parsed = urlparse(location)
    if parsed.scheme == "file":
        return Path(parsed.path)
    if parsed.scheme == "" or len(parsed.scheme) == 1:  # a plain path (or "C:\\...")
        return Path(location)
    return None


def open_traces(location: str, master: str, holding: str) -> tuple[Any, str] | str:
    """The pyarrow filesystem and root directory of the traces at ``location``, or, when the
    driver cannot look at them, a note saying so (Spark's own checks then cover them).

    On a cluster, a path without a scheme means Spark's default filesystem (HDFS, say): it is
    only looked at here if it also exists locally. Raises TraceError if ``location`` does not
    exist or is not a directory (``holding`` says what it should hold).
    """
    import pyarrow.fs as pafs

    local = local_path(location)
    fs: Any
    if local is not None:
        on_cluster = not master.startswith("local") and urlparse(location).scheme == ""
        if on_cluster and not local.exists():
            return "traces not visible to the driver: checked by Spark only"
        fs, root = pafs.LocalFileSystem(), str(local.resolve())
    else:
        try:
            fs, root = pafs.FileSystem.from_uri(location)
        except (ValueError, OSError, ImportError):  # pyarrow lacks that filesystem: Spark checks
            return f"no pyarrow filesystem for {location}: checked by Spark only"
    info = fs.get_file_info(root)
    if info.type == pafs.FileType.NotFound:
        raise TraceError(f"traces directory {location} does not exist")
    if info.type != pafs.FileType.Directory:
        raise TraceError(f"{location} is not a directory (expected one holding {holding})")
    return fs, root


def add_spark_arguments(parser: argparse.ArgumentParser, *, default_master: str, log: str) -> None:
    """The Spark options every Spark command takes; ``log`` says where the JVM's log goes."""
    parser.add_argument(
        "--master", default=default_master, help=f"Spark master URL (default {default_master})"
    )
    parser.add_argument(
        "--shuffle-partitions",
        type=int,
        default=8,
        metavar="N",
        help="spark.sql.shuffle.partitions: the aggregates are small (default 8)",
    )
    parser.add_argument(
        "--spark-log-level", default="WARN", help=f"level of the JVM log kept in {log}"
    )
    parser.add_argument(
        "--jvm-options",
        default=LOCAL_JVM_OPTIONS,
        help=f"driver JVM options with a local master (default: {LOCAL_JVM_OPTIONS!r}; '' for "
        "the JVM's defaults, better for long jobs)",
    )


# --------------------------------------------------------------------------------------------
# Spark session: quiet, small shuffles, and its JVM's output in a log file, never on the terminal.


@contextmanager
def spark_session(
    master: str,
    shuffle_partitions: int,
    log_path: Path | None,
    log_level: str = "WARN",
    jvm_options: str = LOCAL_JVM_OPTIONS,
    app_name: str = "aaabus",
) -> Iterator[SparkSession]:
    """A SparkSession for one job, stopped on exit.

    The JVM's stdout and stderr go to ``log_path``: Spark prints warnings, progress and stack
    traces there even for failures we report ourselves as one line. If a JVM is already running
    in this process (a test session, a notebook), it is reused and left running.
    ``jvm_options`` are the driver JVM's options, applied with a local master only (where the
    driver's JVM does all the work).
    """
    from pyspark import SparkConf, SparkContext
    from pyspark.errors import PySparkException
    from pyspark.java_gateway import launch_gateway
    from pyspark.sql import SparkSession

    conf = (
        SparkConf()
        .setMaster(master)
        .setAppName(app_name)
        .set("spark.sql.shuffle.partitions", str(shuffle_partitions))
        .set("spark.ui.enabled", "false")  # no port to find, a second less at start
        .set("spark.ui.showConsoleProgress", "false")  # the progress bar writes to stderr
        .set("spark.sql.session.timeZone", "UTC")
    )
    if master.startswith("local") and jvm_options.strip():
        conf.set("spark.driver.extraJavaOptions", jvm_options)
    owned = SparkContext._active_spark_context is None
    log = open(log_path, "wb") if log_path is not None and owned else None  # noqa: SIM115
    try:
        if owned and SparkContext._gateway is None:
            try:
                gateway = launch_gateway(conf, popen_kwargs={"stdout": log, "stderr": log})
                SparkContext(conf=conf, gateway=gateway)
            except (PySparkException, OSError) as exc:
                where = f"; see {log_path}" if log_path else ""
                raise SparkStartError(f"could not start Spark ({exc}){where}") from None
        spark = SparkSession.builder.config(conf=conf).getOrCreate()
        if owned:
            spark.sparkContext.setLogLevel(log_level)
        try:
            yield spark
        finally:
            if owned:
                spark.stop()
    finally:
        if log is not None:
            log.close()


def command_session(
    args: argparse.Namespace, log_path: Path, app_name: str
) -> AbstractContextManager[SparkSession]:
    """:func:`spark_session` as a command's options (:func:`add_spark_arguments`) ask for it."""
    return spark_session(
        args.master,
        args.shuffle_partitions,
        log_path,
        args.spark_log_level,
        args.jvm_options,
        app_name=app_name,
    )


def java_messages(exc: BaseException) -> list[str]:
    """The messages of a Py4J Java exception and of its causes, outermost first."""
    java = getattr(exc, "java_exception", None)
    messages: list[str] = []
    try:
        while java is not None and len(messages) < 12:
            message = java.getMessage()
            if message:
                messages.append(str(message))
            java = java.getCause()
    except Exception:  # the JVM may be gone: the Python side message will do
        pass
    return messages


def spark_message(exc: BaseException) -> str:
    """One line saying what Spark failed at, without the JVM stack.

    A failed job's outer message embeds the whole executor stack; the first cause that carries a
    Spark error condition (``[FAILED_READ_FILE...] ...``) says what happened, the root cause why.
    """
    messages = java_messages(exc) or [str(exc)]
    lines = [ln.strip() for m in messages for ln in m.splitlines()[:1] if ln.strip()]
    conditioned = [ln for ln in lines if ln.startswith("[")]
    head = conditioned[0] if conditioned else lines[0] if lines else type(exc).__name__
    head = head.removeprefix("An error occurred while calling ").split(" SQLSTATE:")[0].strip()
    if len(lines) > 1 and lines[-1] not in head:
        head += f" (cause: {lines[-1]})"
    return head if len(head) <= 400 else head[:397] + "..."


@contextmanager
def spark_errors(what: str, log_path: Path | None) -> Iterator[None]:
    """Turn Spark and Py4J failures while doing ``what`` into one-line TraceErrors."""
    from py4j.protocol import Py4JError
    from pyspark.errors import PySparkException

    try:
        yield
    except (PySparkException, Py4JError) as exc:
        where = f" (Spark's log: {log_path})" if log_path else ""
        raise TraceError(f"{what}: {spark_message(exc)}{where}") from None


# --------------------------------------------------------------------------------------------
# The Spark job.


def spark_schema(schema: pa.Schema) -> Any:
    """The Spark StructType of one of our Parquet schemas (every column nullable, as read)."""
    from pyspark.sql import types as T

    mapping = {"int32": T.IntegerType(), "int64": T.LongType(), "string": T.StringType()}
    fields = []
    for f in schema:
        spark_type = T.TimestampType() if str(f.type).startswith("timestamp") else None
        fields.append(T.StructField(f.name, spark_type or mapping[str(f.type)], True))
    return T.StructType(fields)


def read_dataset(
    spark: SparkSession, location: str, kind: str, schema: pa.Schema
) -> DataFrame | None:
    """The dataset ``location/kind``; None if that directory does not exist."""
    from pyspark.errors import AnalysisException

    reader = (
        spark.read.schema(spark_schema(schema))
        .option("recursiveFileLookup", "true")
        .option("pathGlobFilter", "*.parquet")
    )
    try:
        return reader.parquet(location.rstrip("/") + "/" + kind)
    except AnalysisException as exc:
        condition = exc.getCondition() or ""
        if condition.startswith("PATH_NOT_FOUND"):
            return None
        raise


def spark_location(traces: str, spark: SparkSession) -> str:
    """What to hand Spark: a local path becomes a file: URI when Spark runs locally."""
    local = local_path(traces)
    master = spark.sparkContext.master or ""
    if local is not None and (master.startswith("local") or urlparse(traces).scheme == "file"):
        return local.resolve().as_uri()
    return traces  # a URI, or a cluster path on Spark's default filesystem
