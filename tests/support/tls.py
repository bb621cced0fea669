"""Throw-away TLS certificates for tests, made with the ``openssl`` command."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path


def make_certificate(directory: Path, name: str = "bus") -> tuple[Path, Path]:
    """A self-signed P-256 certificate for 127.0.0.1 and its key: ``(NAME.pem, NAME-key.pem)``."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("the tests need the openssl command to make a certificate")
    cert, key = directory / f"{name}.pem", directory / f"{name}-key.pem"
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"),
            *("-nodes", "-days", "1", "-subj", "/CN=localhost", "-addext"),
            *("subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return cert, key
