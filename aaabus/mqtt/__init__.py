"""MQTT 3.1.1 and 5.0: the bus's front door for devices, and its bridge to another broker.

Two floors in one package. Sans-IO at the bottom (:mod:`~aaabus.mqtt.codec`,
:mod:`~aaabus.mqtt.protocol`, :mod:`~aaabus.mqtt.terms`, :mod:`~aaabus.mqtt.auth`,
:mod:`~aaabus.mqtt.acl`): bytes and values in, values out, no asyncio, socket, thread, ZODB or
core (enforced by import-linter). Above it the listener and its connections, the sessions in the
store, 5.0's message rules, shared subscriptions, roaming and the bridge, which use the core,
the I/O helpers and the topics. The server (:mod:`aaabus.node.server`) starts them; nothing
below imports this package. See docs/mqtt.md."""
