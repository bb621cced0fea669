"""Topics built from agents: one representative per server, mailboxes for outside consumers.

Imports only ``aaabus.model`` and ``aaabus.errors`` (and ``persistent``/``BTrees``): these agents
are ordinary agents, run by the engine like any other, and know nothing of how the bus carries
their notifications. The servers install a representative at boot (``aaabus.node``); the tools
reach mailboxes through the admin port. See docs/architecture.md, "Topics".
"""
