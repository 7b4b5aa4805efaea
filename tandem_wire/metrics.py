"""/metrics over HTTP for every server (`--metrics-listen HOST:PORT`): prometheus-client's own
server on a thread of its own."""

from __future__ import annotations

from typing import Any


def serve_metrics(listen: str, registry: Any) -> int:
    """Serves the registry on listen (HOST:PORT; port 0 = any); returns the port."""
    from prometheus_client import start_http_server

    host, _, port = listen.rpartition(":")
    try:
        server, _ = start_http_server(
            int(port or 0), addr=host.strip("[]") or "127.0.0.1", registry=registry
        )
    except OSError as exc:
        raise OSError(f"cannot listen on {listen} for metrics: {exc.strerror}") from None
    return int(server.server_port)
