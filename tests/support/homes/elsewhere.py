"""Another module re-exporting :class:`~tests.support.homes.Kept`: not the class's home."""

from tests.support.homes import Kept

__all__ = ["Kept"]
