"""The I/O side: the network thread (selector loop, dialling, framing) and TLS contexts.

Moves bytes between servers and never touches ZODB (enforced by import-linter)."""
