"""TLS contexts from a server's properties (``aaabus.tls.cert``, ``key``, ``ca``).

One pair per server: the context that accepts (links from peers, admin clients) and the one that
dials (links to peers; and, for a client on the same machine, the admin port). Both present the
certificate and require the other side's, checked against ``ca``. Names are not checked: TLS here
authenticates machines holding a certificate of the bus's authority, the bus secret proves
membership and the server id.
"""

from __future__ import annotations

import ssl
from pathlib import Path

from aaabus.config.reader import BusConfig
from aaabus.errors import ConfigError


def tls_contexts(
    config: BusConfig, server_id: int
) -> tuple[ssl.SSLContext | None, ssl.SSLContext | None]:
    """``(accepting, dialing)`` contexts for ``server_id``; ``(None, None)`` without a cert.

    Paths are relative to the configuration file. Raises :class:`ConfigError` (one line) when
    a file is missing or unreadable.
    """
    cert: str | None = config.setting(server_id, "aaabus.tls.cert")
    if not cert:
        return None, None
    base = Path(config.path).resolve().parent
    key: str | None = config.setting(server_id, "aaabus.tls.key")
    ca: str = config.setting(server_id, "aaabus.tls.ca") or cert
    try:
        accepting = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(base / ca))
        accepting.load_cert_chain(str(base / cert), str(base / key) if key else None)
        accepting.verify_mode = ssl.CERT_REQUIRED
        dialing = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(base / ca))
        dialing.load_cert_chain(str(base / cert), str(base / key) if key else None)
        dialing.check_hostname = False  # membership is proven by the bus secret
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"TLS set-up failed ({exc}); check properties aaabus.tls.cert/key/ca", config.path
        ) from None
    return accepting, dialing
