"""Optional dependencies: the features behind an extra check here that their library is
installed, so that a missing one costs one line naming the extra, never a traceback.

``pip install aaabus`` brings what a server needs to run agents (pyproject's ``dependencies``).
The rest is in extras (``pip install 'aaabus[EXTRA]'``), each imported by its feature when
first used and never by ``import aaabus``: a server recording traffic (``traffic``: pyarrow),
the Prometheus endpoint (``metrics``: prometheus_client), a server's MQTT bridge to another
broker (``bridge``: paho-mqtt), the ``aaabus plan`` and
``aaabus analyze`` commands (``spark``: pyspark, pyarrow, numpy, networkx, matplotlib).
:func:`require` runs where the feature is asked for (a server's start for a property, a command
before it reads anything), before any work that would be lost.
"""

from __future__ import annotations

import importlib.util

from aaabus.errors import ExtraMissing

__all__ = ["missing", "require"]


def missing(*modules: str) -> list[str]:
    """The ``modules`` that cannot be imported here, in the order given.

    Found, not imported: pyarrow or pyspark cost a second or more to import, paid only by the
    code that uses them.
    """
    absent = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # ValueError: set to None in sys.modules (blocked)
            found = False
        if not found:
            absent.append(name)
    return absent


def require(feature: str, extra: str, *modules: str) -> None:
    """Raise :class:`~aaabus.errors.ExtraMissing` if one of ``modules`` is not installed:
    ``feature`` (e.g. ``property aaabus.traffic``) needs it and ``aaabus[extra]`` brings it."""
    absent = missing(*modules)
    if absent:
        raise ExtraMissing(
            f"{feature} needs {', '.join(absent)}, not installed here: "
            f"pip install 'aaabus[{extra}]'"
        )
