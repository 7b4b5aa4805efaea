"""tandem-gateway: the process. Reads the engines' health and load, serves the gRPC and the
HTTP fronts on one event loop, and stops on SIGTERM / SIGINT (open streams are cancelled;
their checkpoints stay for a resume)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from gateway_service.backends import BackendPool
from gateway_service.config import GatewayConfig, parse_args
from gateway_service.conversations import Conversations
from gateway_service.discovery import Discovery, DnsEngines, EngineSource
from gateway_service.grpc_front import GatewayServicer
from gateway_service.metrics import GatewayMetrics, PoolCollector
from gateway_service.openai_app import OpenAIFront
from gateway_service.relay import Relay, RelaySettings
from tandem_client.credentials import bearer_token, tls_credentials
from tandem_wire.auth import Authenticator, AuthFileError, Role
from tandem_wire.health import HealthServicer
from tandem_wire.lifetime import follow_supervisor
from tandem_wire.logs import configure_logging
from tandem_wire.metrics import serve_metrics
from tandem_wire.pb import engine_pb2, engine_pb2_grpc
from tandem_wire.registry import ValkeyTarget
from tandem_wire.service import SERVER_OPTIONS, Access, guarded
from tandem_wire.tls import bind, check_exposure

log = logging.getLogger("tandem.gateway")
SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
# With --auth-file the gateway checks callers itself as an engine would (docs/security.md).
ROLES = {
    "/tandem.v1.Engine/*": Role.GENERATE,
    "/tandem.v1.Engine/Stats": Role.ADMIN,
    "/tandem.v1.Engine/Flush": Role.ADMIN,
}


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handlers: this process stops both fronts itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _http_socket(listen: str, send_buffer_bytes: int) -> socket.socket:
    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer_bytes:
        # Inherited by accepted connections. A fixed buffer stops the kernel's autotuning
        # (megabytes), which hid a client that stopped reading from the relay for thousands
        # of tokens (docs/gateway.md, "Clients that stop reading").
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    try:
        sock.bind((host, int(port or 0)))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {listen}: {exc.strerror}") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve(
    config: GatewayConfig, authenticator: Authenticator | None, discover: ValkeyTarget | None
) -> None:
    credentials = tls_credentials(config.engine_tls_ca) if config.engine_tls_ca else None
    sources: list[EngineSource] = []
    if discover is not None:
        sources.append(Discovery(discover))
    if config.engines_dns:
        sources.append(DnsEngines(config.engines_dns))
    pool = BackendPool(
        config.engines,
        config.engines_file,
        credentials,
        bearer_token(config.engine_token_file) if config.engine_token_file else "",
        config.poll_interval_s,
        config.engine_window_bytes,
        sources,
    )
    await pool.start()
    settings = RelaySettings(
        config.checkpoint_interval,
        config.failover_wait_s,
        config.max_failovers,
        config.affinity_slack,
    )
    registry = CollectorRegistry()
    relay = Relay(pool, settings, GatewayMetrics(registry))
    if config.metrics_listen:
        registry.register(PoolCollector(pool, relay))
        port = serve_metrics(config.metrics_listen, registry)
        log.info("metrics on %s:%d/metrics", config.metrics_listen.rsplit(":", 1)[0], port)
    grpc_server, health_servicer, health_task = None, None, None
    # The handlers before the banners: a SIGTERM sent as soon as they are printed stops cleanly.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if authenticator is not None:
        loop.add_signal_handler(signal.SIGHUP, authenticator.reload)
    if config.grpc_listen:
        access = Access(authenticator, ROLES) if authenticator is not None else None
        grpc_server = grpc.aio.server(options=SERVER_OPTIONS)
        registrar = guarded(grpc_server, access)
        engine_pb2_grpc.add_EngineServicer_to_server(GatewayServicer(pool, relay), registrar)
        health_servicer = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, registrar)
        health_task = asyncio.create_task(_publish_health(pool, health_servicer))
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], grpc_server
        )
        port = bind(grpc_server, config.grpc_listen)
        await grpc_server.start()
        print(
            f"tandem-gateway grpc listening on {config.grpc_listen.rsplit(':', 1)[0]}:{port}",
            flush=True,
        )
    http_server, http_task = None, None
    if config.http_listen:
        sock = _http_socket(config.http_listen, config.http_send_buffer_bytes)
        conversations = Conversations(config.store, credentials) if config.store else None
        front = OpenAIFront(
            pool,
            relay,
            authenticator,
            config.max_body_bytes,
            config.cors_origins,
            conversations,
        )
        http_server = _HttpServer(
            uvicorn.Config(front.app, log_level="warning", lifespan="off", access_log=False)
        )
        http_task = asyncio.create_task(http_server.serve(sockets=[sock]))
        host, port = sock.getsockname()[:2]
        print(
            f"tandem-gateway http listening on {config.http_listen.rsplit(':', 1)[0]}:{port}",
            flush=True,
        )
    log.info("serving %d engines: %s", len(pool.backends), ", ".join(pool.backends))

    await stop.wait()
    log.info("stopping")
    if http_server is not None and http_task is not None:
        http_server.should_exit = True
        await asyncio.wait({http_task}, timeout=5.0)
    if health_task is not None and health_servicer is not None:
        health_task.cancel()
        await health_servicer.shut_down()  # open Watch streams see NOT_SERVING, then end
    if grpc_server is not None:
        await grpc_server.stop(2.0)
    await pool.close()
    log.info("stopped")


async def _publish_health(pool: BackendPool, servicer: HealthServicer) -> None:
    """The gateway's gRPC health follows its engines: SERVING while one of them serves,
    NOT_SERVING while none does (a readiness probe then stops sending it traffic)."""
    serving = health_pb2.HealthCheckResponse
    while True:
        changed = pool.changed  # taken before reading: a change meanwhile is not missed
        status = serving.SERVING if pool.healthy() else serving.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await servicer.set(name, status)
        await changed.wait()


def main(argv: list[str] | None = None) -> None:
    config = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging(config.log_level, config.log_format)
    follow_supervisor()  # started by `tandem up`: ends with it
    try:
        listens = [x for x in (config.http_listen, config.grpc_listen) if x]
        check_exposure("tandem-gateway", listens, bool(config.auth_file), config.insecure_no_auth)
        try:
            authenticator = Authenticator(Path(config.auth_file)) if config.auth_file else None
        except AuthFileError as exc:
            raise OSError(str(exc)) from None
        discover = None
        if config.discover:  # the password file read now: unreadable, the gateway exits
            discover = ValkeyTarget.from_flags(
                config.discover, config.discover_password_file, "--discover"
            )
        asyncio.run(serve(config, authenticator, discover))
    except OSError as exc:
        print(f"tandem-gateway: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
