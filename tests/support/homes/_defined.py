"""Where :class:`Kept` is defined; its package re-exports it."""

from __future__ import annotations


class Kept:
    """Plain data an application keeps; what a pickle of it names is this module."""

    def __init__(self, value: int) -> None:
        self.value = value
