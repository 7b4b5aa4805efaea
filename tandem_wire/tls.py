"""Listening with or without TLS: one helper for both servers."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def bind(server: Any, listen: str, cert: str = "", key: str = "") -> int:
    """Adds the listening port (TLS when a certificate and key are given); returns it.

    Works for grpc.Server and grpc.aio.Server. Raises OSError when it cannot bind or when
    only one of cert/key is given.
    """
    import grpc

    if bool(cert) != bool(key):
        raise OSError("--tls-cert and --tls-key go together")
    try:
        if cert:
            credentials = grpc.ssl_server_credentials(
                [(Path(key).read_bytes(), Path(cert).read_bytes())]
            )
            port = server.add_secure_port(listen, credentials)
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError as exc:  # grpc >= 1.5x raises where older releases returned 0
        raise OSError(_cannot_bind(listen)) from exc
    if port == 0:
        raise OSError(_cannot_bind(listen))
    return int(port)


def _cannot_bind(listen: str) -> str:
    # Servers bind without SO_REUSEPORT (tandem_wire.service), so a port that is taken
    # refuses the bind instead of being shared.
    return f"cannot listen on {listen}: the address is in use (or not this host's)"
