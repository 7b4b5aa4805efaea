"""/metrics over HTTP for every server (`--metrics-listen HOST:PORT`): prometheus-client's own
server on a thread of its own."""

from __future__ import annotations

from typing import Any

# Time to first token, in seconds: the engine's and the gateway's histograms alike (vLLM's).
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


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
