"""Griffe extension of the API reference: the docstrings' Sphinx roles become checked links.

The docstrings cross-reference in Sphinx's roles (``:class:`~aaabus.core.channel.Channel```,
``:meth:`Dial.next_delay```, ``:mod:`aaabus.node.admin```), which mkdocstrings would print as
they are. Once the package is loaded, every role is looked up the way Python would look the name
up where the docstring is (the object's own members, then each enclosing class and module,
imports included, or from ``aaabus`` for a dotted path) and becomes:

* a link (``[Channel][aaabus.core.channel.Channel]``) when it names a public object of the
  package, which the reference renders; MkDocs's autorefs then resolves it, in strict mode;
* code when it names something the reference does not render: a private object of the package,
  a builtin, the standard library or another project (``threading.Thread``, ``ZODB.DB``);
* a warning, which fails the strict build, when it names nothing: a class renamed, a method
  gone, a module moved.
"""

from __future__ import annotations

import builtins
import importlib.util
import logging
import re
from typing import Any

import griffe

log = logging.getLogger("mkdocs.plugins.aaabus.crossrefs")

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):`(~?)([^`<]+)`")
PACKAGE = "aaabus"
#: What a lookup finds when it meets an import of another project's object.
EXTERNAL = object()


def _final(obj: Any) -> Any:
    """The object an alias (an import) stands for, or EXTERNAL when it leaves the package."""
    while isinstance(obj, griffe.Alias):
        try:
            obj = obj.target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            return EXTERNAL
    return obj


def _members(obj: Any) -> dict[str, Any]:
    if isinstance(obj, griffe.Class):
        return dict(obj.all_members)  # inherited ones too
    if isinstance(obj, griffe.Module):
        return dict(obj.members)
    return {}


def _walk(start: Any, parts: list[str]) -> Any:
    obj = start
    for part in parts:
        obj = _final(obj)
        if obj is EXTERNAL:
            return EXTERNAL
        obj = _members(obj).get(part)
        if obj is None:
            return None
    return _final(obj)


def _lookup(scope: Any, target: str, root: Any) -> Any:
    """The object ``target`` names in a docstring of ``scope``, or None: a dotted path from the
    package; ``.name``, from the package of the docstring's module; else a name in scope, as
    Python would find it (the object's members, then each enclosing class and module)."""
    parts = target.split(".")
    if parts[0] == PACKAGE:
        return _walk(root, parts[1:])
    if target.startswith("."):
        module = scope.module
        package = module if module.filepath.name == "__init__.py" else module.parent
        return _walk(package, target.lstrip(".").split("."))
    obj = scope
    while obj is not None:
        if isinstance(obj, (griffe.Class, griffe.Module)) and parts[0] in _members(obj):
            return _walk(obj, parts)
        obj = obj.parent
    # A module's docstring naming a method of one of its classes (``:meth:`take```).
    classes = [c for c in scope.module.classes.values() if parts[0] in c.members]
    return _walk(classes[0], parts) if len(classes) == 1 else None


def _index(obj: Any, names: dict[str, list[Any]]) -> dict[str, list[Any]]:
    """Every object of the package (imports aside), by its last name."""
    names.setdefault(obj.name, []).append(obj)
    for member in obj.members.values():
        if not isinstance(member, griffe.Alias):
            _index(member, names)
    return names


def _rendered(obj: Any) -> bool:
    """Whether the reference renders ``obj``: public, in the package, and so are its parents."""
    path = obj.path.split(".")
    return path[0] == PACKAGE and not any(p.startswith("_") for p in path[1:])


def _outside(target: str) -> bool:
    """A builtin, or a dotted path into an importable module that is not ours."""
    first = target.split(".")[0]
    if first == PACKAGE:
        return False
    if hasattr(builtins, first):
        return True
    try:
        return importlib.util.find_spec(first) is not None
    except (ImportError, ValueError):
        return False


class SphinxRoles(griffe.Extension):
    """Turn the roles of every docstring of the package into links (see the module)."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name == PACKAGE:
            self._names = _index(pkg, {})
            self._convert(pkg, pkg)

    def _unique(self, target: str) -> Any:
        """The one object of the package whose path ends with ``target`` (a method named from
        its module's docstring, a class of a sibling module), or None if none or several."""
        found = [
            obj
            for obj in self._names.get(target.rsplit(".", 1)[-1], [])
            if obj.path.endswith("." + target)
        ]
        return found[0] if len(found) == 1 else None

    def _convert(self, obj: Any, root: griffe.Module) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(lambda m: self._role(obj, root, m), obj.docstring.value)
        for member in obj.members.values():
            if not isinstance(member, griffe.Alias):
                self._convert(member, root)

    def _role(self, obj: Any, root: griffe.Module, match: re.Match[str]) -> str:
        short, written = match[1] == "~", match[2].strip()
        target = written.removesuffix("()")
        shown = f"`{written.rsplit('.', 1)[-1] if short else written}`"
        found = _lookup(obj, target, root)
        if found is None and _outside(target):
            return shown
        if found is None and not target.startswith((".", PACKAGE + ".")):
            found = self._unique(target)
        if found is EXTERNAL:
            return shown
        if found is not None:
            return f"[{shown}][{found.path}]" if _rendered(found) else shown
        log.warning("%s: the docstring names %s, which does not exist", obj.path, written)
        return shown
