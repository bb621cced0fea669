"""Stores opened, reopened and always closed by one test: real stores on disk, of one kind."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aaabus.core.store import Store, open_store


class Stores:
    """Opens (and reopens) the store of one test, closing whatever is open at the end."""

    def __init__(self, kind: str, path: Path) -> None:
        self.kind = kind
        self.path = path
        self.open: Store | None = None

    def __call__(self, **options: Any) -> Store:
        """The store, opened afresh (whatever was open is closed first)."""
        self.close()
        self.open = open_store(self.kind, self.path, 0, **options)
        return self.open

    def close(self) -> None:
        if self.open is not None:
            self.open.close()
            self.open = None
