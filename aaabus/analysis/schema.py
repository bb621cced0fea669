"""The schema of the timing traces: written by the perf suites, read by ``aaabus analyze``.

Two Parquet datasets under a traces directory, one file per measured point:

* ``rtt/``: one row per measured round trip;
* ``hops/``: one row per message hop (a stamp on send, a clock test on receive).

Every row carries the run's keys (run id, topology, servers, domain size, clock mode, test) so
that either dataset can be grouped on its own. ``schema_version`` changes whenever a column
changes meaning; readers refuse versions they do not know.

A third dataset, ``traffic/``, says who talks to whom: one row per (time window, source server,
destination server) with the notifications and bytes sent in that window. It is written by the
live servers (:class:`aaabus.core.traffic.TrafficRecorder`) and by ``perf synth-traffic``, and
read by ``aaabus plan``. It is kept compact (it may hold billions of rows): no run keys, and its
schema version lives in the file metadata only.

pyarrow is imported here at the top: the commands import this module inside the functions that
read or write traces, after checking that their extra is installed.
"""

from __future__ import annotations

import pyarrow as pa

from aaabus.core.traffic import traffic_schema

SCHEMA_VERSION = 1

#: Columns shared by both datasets: what identifies a measured point.
RUN_FIELDS = [
    pa.field("schema_version", pa.int32(), nullable=False),
    pa.field("run_id", pa.string(), nullable=False),  # one sweep point, e.g. "flat-50-delta-remote"
    pa.field("ts", pa.timestamp("us", tz="UTC"), nullable=False),  # when the point was measured
    pa.field("topology", pa.string(), nullable=False),  # flat | bus | star | tree | custom
    pa.field("servers", pa.int32(), nullable=False),
    pa.field("domain_size", pa.int32(), nullable=False),  # servers per domain (flat: all)
    pa.field("clock_mode", pa.string(), nullable=False),  # full | delta
    pa.field("test", pa.string(), nullable=False),  # local | remote | broadcast | stream
    pa.field("process_mode", pa.string(), nullable=False),  # process | inprocess
]

RTT_SCHEMA = pa.schema(
    [
        *RUN_FIELDS,
        pa.field("round", pa.int32(), nullable=False),
        pa.field("payload_bytes", pa.int32(), nullable=False),
        pa.field("rtt_ns", pa.int64(), nullable=False),
        pa.field("hops", pa.int32(), nullable=False),  # one way, to the farthest responder
    ],
    metadata={"aaabus.trace": "rtt", "aaabus.schema_version": str(SCHEMA_VERSION)},
)

HOP_SCHEMA = pa.schema(
    [
        *RUN_FIELDS,
        pa.field("server_id", pa.int32(), nullable=False),
        pa.field("domain", pa.string(), nullable=False),
        pa.field("event", pa.string(), nullable=False),  # send | receive
        pa.field("peer", pa.int32(), nullable=False),
        pa.field("stamp_bytes", pa.int32(), nullable=True),  # send only
        pa.field("verdict", pa.string(), nullable=True),  # receive only: deliver|wait|duplicate
        pa.field("clock_ns", pa.int64(), nullable=False),  # CPU time in the clock operation
        pa.field("commit_ns", pa.int64(), nullable=False),  # the commit of its group
        pa.field("clock_bytes", pa.int64(), nullable=False),  # clock bytes that commit persisted
        pa.field("group_hops", pa.int32(), nullable=False),  # hops sharing that commit
    ],
    metadata={"aaabus.trace": "hops", "aaabus.schema_version": str(SCHEMA_VERSION)},
)

#: The traffic rows are written by live servers too, so their schema lives in the runtime
#: (which never imports aaabus.analysis); the same object, for the readers and writers here.
TRAFFIC_SCHEMA = traffic_schema()
