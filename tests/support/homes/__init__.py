"""A package that publishes a class defined in a private submodule, as ``pathlib`` does from
3.13 (``pathlib._local.Path``): the class's home is this package (aaabus/config/trust.py)."""

from tests.support.homes._defined import Kept

__all__ = ["Kept"]
