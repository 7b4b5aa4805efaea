"""Listening with or without TLS (and mTLS), and where a server may listen: both servers."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def bind(server: Any, listen: str, cert: str = "", key: str = "", client_ca: str = "") -> int:
    """Adds the listening port (TLS when a certificate and key are given; client certificates
    signed by client_ca required when it is given); returns it.

    Works for grpc.Server and grpc.aio.Server. Raises OSError when it cannot bind, when only
    one of cert/key is given, or client_ca without them.
    """
    import grpc

    if bool(cert) != bool(key):
        raise OSError("--tls-cert and --tls-key go together")
    if client_ca and not cert:
        raise OSError("--tls-client-ca needs --tls-cert and --tls-key")
    try:
        if cert:
            credentials = grpc.ssl_server_credentials(
                [(Path(key).read_bytes(), Path(cert).read_bytes())],
                root_certificates=Path(client_ca).read_bytes() if client_ca else None,
                require_client_auth=bool(client_ca),
            )
            port = server.add_secure_port(listen, credentials)
        else:
            port = server.add_insecure_port(listen)
    except RuntimeError as exc:  # grpc >= 1.5x raises where older releases returned 0
        raise OSError(_cannot_bind(listen)) from exc
    if port == 0:
        raise OSError(_cannot_bind(listen))
    return int(port)


def is_loopback(listen: str) -> bool:
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def is_loopback_peer(peer: str) -> bool:
    """Whether a gRPC peer string ("ipv4:127.0.0.1:5555", "ipv6:[::1]:5555", "unix:...")
    is on this host."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind not in ("ipv4", "ipv6"):
        return False
    return is_loopback(rest)


def check_exposure(prog: str, listens: list[str], auth: bool, insecure_no_auth: bool) -> None:
    """Without --auth-file a server listens on loopback only, unless told otherwise.

    Raises OSError naming the address and the two ways out.
    """
    exposed = [x for x in listens if x and not is_loopback(x)]
    if not exposed or auth:
        return
    if not insecure_no_auth:
        raise OSError(
            f"refusing to listen on {exposed[0]} without --auth-file: anyone who reaches it "
            "could use it; give --auth-file PATH, or --insecure-no-auth to accept that"
        )
    log.warning("%s: listening on %s with no authentication (--insecure-no-auth)", prog, exposed)


def _cannot_bind(listen: str) -> str:
    # Servers bind without SO_REUSEPORT (tandem_wire.service), so a port that is taken
    # refuses the bind instead of being shared.
    return f"cannot listen on {listen}: the address is in use (or not this host's)"
