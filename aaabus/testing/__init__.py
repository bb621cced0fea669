"""Tools to test a bus and what runs on it, shipped with the package.

* :mod:`aaabus.testing.checker` — an independent judge of recorded histories: exactly-once and
  causal delivery (it imports nothing else from ``aaabus``, so it cannot share a bug with it);
* :mod:`aaabus.testing.proxy` — a fault-injecting TCP proxy for 127.0.0.1 (delay, stall, cut,
  partition) to put between two servers;
* :mod:`aaabus.testing.workload` — agents that record their vector-clock history for the checker,
  and a ping-pong with an exact counter; server processes load them by name;
* :mod:`aaabus.testing.crash` — the crash-schedule machinery of any workload: layouts, seeded
  kills and restarts of real server processes, the end of a run read back exactly in-process;
* :mod:`aaabus.testing.torture` and :mod:`aaabus.testing.bankload` — crash schedules over the
  bank workload, and its agents (``python -m perf torture``);
* :mod:`aaabus.testing.fuzz` — wire fuzzing of live servers (``python -m perf torture
  --fuzz-frames N``);
* :mod:`aaabus.testing.shipping` and :mod:`aaabus.testing.chains` — a stream of bulky parcels
  (the disk-full tests), scripted causal chains (the theorem tests);
* :mod:`aaabus.testing.topicload` and :mod:`aaabus.testing.topictorture` — topic workloads, and
  crash schedules judging the causal topic contract (``python -m perf torture --workload
  topics``).

Nothing in the runtime imports this package.
"""

from aaabus.testing.checker import Report, Send, check
from aaabus.testing.proxy import FaultProxy
from aaabus.testing.workload import merge_and_tick

__all__ = ["FaultProxy", "Report", "Send", "check", "merge_and_tick"]
