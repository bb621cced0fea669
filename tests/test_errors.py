"""One error hierarchy: every exception class of aaabus lives in aaabus.errors, in one family."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import aaabus
from aaabus import errors
from aaabus.tools.client import Client

FAMILIES = (errors.AaabusError, errors.AgentError, errors.InternalError, errors.FatalError)


def _all_modules() -> list[str]:
    names = [
        info.name
        for info in pkgutil.walk_packages(aaabus.__path__, "aaabus.")
        if not info.name.endswith("__main__")  # running it would start the CLI
    ]
    assert "aaabus.core.engine" in names and "aaabus.testing.torture" in names
    return ["aaabus", *names]


def _exception_classes() -> dict[str, type[BaseException]]:
    found: dict[str, type[BaseException]] = {}
    for name in _all_modules():
        module = importlib.import_module(name)
        for attr, value in vars(module).items():
            is_error = inspect.isclass(value) and issubclass(value, BaseException)
            if is_error and value.__module__.startswith("aaabus"):
                found[f"{name}.{attr}"] = value
    return found


def test_every_error_class_of_aaabus_is_defined_in_errors_and_belongs_to_a_family() -> None:
    classes = _exception_classes()
    assert len(classes) >= 27, sorted(classes)
    strays = {
        where: c.__module__ for where, c in classes.items() if c.__module__ != "aaabus.errors"
    }
    assert not strays, f"error classes defined outside aaabus.errors: {strays}"
    orphans = [c.__name__ for c in classes.values() if not issubclass(c, FAMILIES)]
    assert not orphans, f"not in any family of aaabus.errors: {orphans}"
    assert set(errors.__all__) == {c.__name__ for c in vars(errors).values() if inspect.isclass(c)}


def test_the_errors_client_raises_are_importable_from_aaabus() -> None:
    for name in ("AdminError", "ServerUnreachable", "RequestRefused", "ConfigError", "SecretError"):
        assert getattr(aaabus, name) is getattr(errors, name)
        assert name in aaabus.__all__
    assert Client.__module__ == "aaabus.tools.client"


def test_retryable_errors_are_transient_and_still_what_they_were() -> None:
    assert issubclass(errors.ServerUnreachable, errors.TransientError)
    assert issubclass(errors.ServerUnreachable, errors.AdminError)
    assert errors.ServerUnreachable.exit_code == 1
    assert not issubclass(errors.RequestRefused, errors.TransientError)
    assert not issubclass(errors.ConfigError, errors.TransientError)


@pytest.mark.parametrize(
    ("cls", "old_base"),
    [
        (errors.ClockError, ValueError),
        (errors.BadBody, ValueError),
        (errors.MalformedPickle, ValueError),
        (errors.OutsideReactionError, RuntimeError),
    ],
)
def test_errors_keep_the_builtin_base_old_handlers_catch(
    cls: type[Exception], old_base: type[Exception]
) -> None:
    with pytest.raises(old_base):
        raise cls("x")


def test_fatal_errors_get_past_except_exception_and_agent_errors_are_not_one_liners() -> None:
    for fatal in (errors.StoreWriteFailed, errors.EngineStopped):
        assert not issubclass(fatal, Exception)
    # `except AaabusError` (CLI, admin answers, boot services) must not start catching these.
    for cls in (errors.OutsideReactionError, errors.UnknownNotificationError, errors.WireError):
        assert not issubclass(cls, errors.AaabusError)
