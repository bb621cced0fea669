"""Classes that moved: the dotted path an earlier version named each by, and where it is now.

A class is named by its module path in two places that outlive the code that wrote them: a
store's records (ZODB pickles name the class of every object, and of every object an object
refers to) and frames on the wire (a notification or an agent travels under its tag,
``module:QualName``, :func:`aaabus.wire.codec.tag_of`). When a class moves, its old path stays
valid in both through this table: the store's class factory
(:meth:`aaabus.config.trust.TrustPolicy.find_class`, and the plain factory of an untrusted
store) and the codec's tag lookup resolve an old path to the class now there.

A store upgrade (:mod:`aaabus.core.upgrades`) rewrites every record that names an old path, so
a store needs the table only at that first boot; the table stays for the wire, where a peer of
the version before may still name a class by its old path. Entries are never removed while a
release that used the old path may still talk to this one.
"""

from __future__ import annotations

__all__ = ["RENAMED", "current_path", "current_tag", "old_modules"]

#: Old dotted path (``module.Class``) -> the class's dotted path now.
RENAMED: dict[str, str] = {
    # Issue 45: MQTT became a package of its own. Its classes that are stored (sessions,
    # retained ledger, roaming and shared-subscription records) or travel (the notifications
    # of roaming and shared subscriptions).
    "aaabus.node.mqttsessions.SessionRecord": "aaabus.mqtt.sessions.SessionRecord",
    "aaabus.node.mqttsessions.RetainedLedger": "aaabus.mqtt.sessions.RetainedLedger",
    "aaabus.node.mqttroam.AnchorRecord": "aaabus.mqtt.roaming.AnchorRecord",
    "aaabus.node.mqttroam.Pending": "aaabus.mqtt.roaming.Pending",
    "aaabus.node.mqttshared.ShareWake": "aaabus.mqtt.shared.ShareWake",
    "aaabus.node.mqttshared.Member": "aaabus.mqtt.shared.Member",
    "aaabus.node.mqttshared.Group": "aaabus.mqtt.shared.Group",
    "aaabus.node.mqttshared.SharedTable": "aaabus.mqtt.shared.SharedTable",
    "aaabus.node.roamnotes.Claim": "aaabus.mqtt.roamnotes.Claim",
    "aaabus.node.roamnotes.Created": "aaabus.mqtt.roamnotes.Created",
    "aaabus.node.roamnotes.Refused": "aaabus.mqtt.roamnotes.Refused",
    "aaabus.node.roamnotes.Roam": "aaabus.mqtt.roamnotes.Roam",
    "aaabus.node.roamnotes.Handover": "aaabus.mqtt.roamnotes.Handover",
    "aaabus.node.roamnotes.SessionMoved": "aaabus.mqtt.roamnotes.SessionMoved",
    "aaabus.node.roamnotes.MovedItems": "aaabus.mqtt.roamnotes.MovedItems",
    "aaabus.node.roamnotes.Restored": "aaabus.mqtt.roamnotes.Restored",
    "aaabus.node.roamnotes.Settled": "aaabus.mqtt.roamnotes.Settled",
    "aaabus.node.roamnotes.Taken": "aaabus.mqtt.roamnotes.Taken",
    "aaabus.node.roamnotes.AnchorSubscribe": "aaabus.mqtt.roamnotes.AnchorSubscribe",
    "aaabus.node.roamnotes.AnchorUnsubscribe": "aaabus.mqtt.roamnotes.AnchorUnsubscribe",
    "aaabus.node.roamnotes.Drop": "aaabus.mqtt.roamnotes.Drop",
    "aaabus.node.roamnotes.Unregister": "aaabus.mqtt.roamnotes.Unregister",
}


def old_modules() -> frozenset[str]:
    """The modules that old paths name (what a store upgrade looks for in a record)."""
    return frozenset(old.rpartition(".")[0] for old in RENAMED)


def current_path(module: str, name: str) -> tuple[str, str]:
    """Where the class an earlier version named ``module.name`` is now (itself if it never
    moved)."""
    moved = RENAMED.get(f"{module}.{name}")
    if moved is None:
        return module, name
    new_module, _, new_name = moved.rpartition(".")
    return new_module, new_name


def current_tag(tag: str) -> str:
    """A wire tag (``module:QualName``) with the class's current path (itself if it never
    moved)."""
    module, _, name = tag.partition(":")
    new_module, new_name = current_path(module, name)
    return f"{new_module}:{new_name}"
