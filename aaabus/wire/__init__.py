"""The wire protocol, sans-IO: frame codec, pickle vetting, message encoding.

Bytes in, values out: no sockets, no threads, no ZODB. Imports only ``aaabus.model``."""
