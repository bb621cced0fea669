"""Arrow tables of a trace schema, for the tests of the tools that read traces."""

from __future__ import annotations

from typing import Any

import pyarrow as pa


def table_of(schema: pa.Schema, columns: dict[str, Any], rows: int) -> pa.Table:
    """``rows`` rows of ``schema``: a column given as an array as it is, any other value
    repeated on every row."""
    return pa.table(
        {
            f.name: v if isinstance(v, pa.Array) else pa.array([v] * rows, f.type)
            for f in schema
            for v in [columns[f.name]]
        }
    )
