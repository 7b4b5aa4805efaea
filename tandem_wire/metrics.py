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
    """Serves the registry on listen (HOST:PORT; port 0 = any); returns the port.

    Always in the classic text format (0.0.4). A Prometheus 2 scraper asks for OpenMetrics
    1.0 first, and prometheus-client then escapes every `:` of a name to `_` unless the
    scraper allows UTF-8 names: `tandem:time_to_first_token_seconds` would be stored as
    `tandem_time_to_first_token_seconds` and no vLLM-style dashboard would find it. The
    text format carries the names as they are, and every Prometheus reads it."""
    import socket
    import threading
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    app = make_wsgi_app(registry)

    class Quiet(WSGIRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
            pass  # a line per scrape on stderr is noise

    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def classic_text(environ: dict[str, Any], start_response: Any) -> Any:
        environ["HTTP_ACCEPT"] = "text/plain; version=0.0.4"
        return app(environ, start_response)

    try:
        server = make_server(host, int(port or 0), classic_text, Server, handler_class=Quiet)
    except OSError as exc:
        raise OSError(f"cannot listen on {listen} for metrics: {exc.strerror}") from None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return int(server.server_port)
