"""The node: the agent server wiring core and io together, the admin endpoint, status, metrics.

The only layer that starts threads of both sides; tools talk to it over the admin port."""
