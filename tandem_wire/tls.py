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
    if cert:
        credentials = grpc.ssl_server_credentials(
            [(Path(key).read_bytes(), Path(cert).read_bytes())]
        )
        port = server.add_secure_port(listen, credentials)
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    return int(port)
