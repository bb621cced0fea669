"""The engine-thread core: store, matrix clocks, channel, engine, transaction effects, failpoints.

Runs on the engine thread against ZODB and never touches a socket (``aaabus.io`` is forbidden)."""
