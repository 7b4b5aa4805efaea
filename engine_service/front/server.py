"""The engine's front process: gRPC (aio) server, health, reflection, signals.

The model runs in the engine core, a second process this one starts and watches
(front/core_link.py, core/process.py): the MLX loop never shares a GIL with gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine_service.config import EngineConfig, parse_args
from engine_service.front.announce import announce_target, start_announcer
from engine_service.front.core_spawn import CoreProcess, spawn_core
from tandem_wire.auth import Authenticator, AuthFileError, Role
from tandem_wire.health import HealthServicer
from tandem_wire.lifetime import follow_supervisor
from tandem_wire.logs import configure_logging
from tandem_wire.pb import engine_pb2, engine_pb2_grpc
from tandem_wire.registry import ValkeyTarget
from tandem_wire.service import SERVER_OPTIONS, Access, guarded
from tandem_wire.tls import bind, check_exposure

log = logging.getLogger("tandem.engine")
SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name


# What each RPC needs when the engine runs with --auth-file (health and reflection: open).
ROLES = {
    "/tandem.v1.Engine/*": Role.GENERATE,
    "/tandem.v1.Engine/Stats": Role.ADMIN,
    "/tandem.v1.Engine/Flush": Role.ADMIN,
}


def _access(config: EngineConfig) -> Access | None:
    check_exposure(
        "tandem-engine", [config.listen], bool(config.auth_file), config.insecure_no_auth
    )
    if not config.auth_file:
        return None
    try:
        return Access(Authenticator(Path(config.auth_file)), ROLES)
    except AuthFileError as exc:
        raise OSError(str(exc)) from None


async def serve(
    config: EngineConfig,
    argv: list[str],
    access: Access | None,
    spawned: CoreProcess,
    registry: ValkeyTarget | None = None,
) -> None:
    # Imported here, after the core was spawned: mlx-lm and the tokenizer stack take seconds
    # to import, and the core loads its model meanwhile.
    from engine_service.front.core_link import CoreLink
    from engine_service.front.policy import RequestPolicy
    from engine_service.front.servicer import EngineServicer
    from engine_service.model.loaded import without_weights
    from engine_service.protocol.requests import DraftSupport

    health_servicer = HealthServicer()

    async def set_serving(up: bool) -> None:
        serving = health_pb2.HealthCheckResponse
        status = serving.SERVING if up else serving.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, status)

    core = CoreLink(argv, set_serving)
    ready = await core.start(spawned)  # the model loaded there; CoreStartFailed (an OSError)
    loaded = await asyncio.to_thread(without_weights, ready.facts)
    context = min(config.max_context or loaded.context_length, loaded.context_length)
    policy = RequestPolicy(
        loaded,
        context,
        config.default_max_tokens,
        has_store=ready.has_store,
        default_checkpoint_interval=config.checkpoint_interval,
        default_kv=config.kv_codec,
        drafts=DraftSupport(ready.draft_model_id, config.num_draft_tokens),
        deterministic=config.deterministic,
    )
    metrics = _serve_metrics(config.metrics_listen, core) if config.metrics_listen else None
    server = grpc.aio.server(options=SERVER_OPTIONS)
    # Malformed requests: INVALID_ARGUMENT on every RPC; with access, callers authenticated.
    registrar = guarded(server, access)
    servicer = EngineServicer(
        policy, core, config.park_after_tokens, access, metrics, config.log_prompts
    )
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, registrar)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, registrar)
    await set_serving(True)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    # The handlers before the banner: a SIGTERM sent as soon as it is printed drains.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if access is not None:
        loop.add_signal_handler(signal.SIGHUP, access.authenticator.reload)
    port = bind(server, config.listen, config.tls_cert, config.tls_key, config.tls_client_ca)
    await server.start()
    host = config.listen.rsplit(":", 1)[0]
    print(f"tandem-engine listening on {host}:{port}", flush=True)
    log.info("serving %s on %s:%d (core pid %d)", loaded.model_id, host, port, ready.pid)
    announcer = start_announcer(registry, config, f"{host}:{port}", loaded, core)
    await stop.wait()
    if announcer is not None:
        await announcer.stop()  # gateways stop sending work here before the drain

    # Stop admitting, let in-flight generations finish within the grace period, then the
    # core cancels what is left (their streams end with finish reason CANCELLED) and
    # flushes the checkpoints already queued (a prefix, a generation's last snapshot).
    log.info("draining: %d requests in flight (grace %.0fs)", core.pending, config.grace_s)
    core.stop_accepting()
    await health_servicer.shut_down()  # open Watch streams see NOT_SERVING, then end
    deadline = time.monotonic() + config.grace_s
    while core.pending and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await core.shutdown(max(1.0, deadline - time.monotonic()))
    await server.stop(2.0)
    log.info("stopped")


def _serve_metrics(listen: str, core: Any) -> Any:
    """/metrics on its own thread; the core's counters are read when it is scraped."""
    from prometheus_client import CollectorRegistry

    from engine_service.front.metrics import CoreCollector, RequestMetrics
    from tandem_wire.metrics import serve_metrics

    loop = asyncio.get_running_loop()

    def read() -> Any:
        try:  # on the metrics thread: the core is asked on the event loop
            answer = asyncio.run_coroutine_threadsafe(core.stats(), loop).result(5.0)
        except Exception:  # noqa: BLE001 - a core that is down or restarting: up 0
            return None
        return answer.engine, answer.checkpoints

    registry = CollectorRegistry()
    metrics = RequestMetrics(registry)
    registry.register(CoreCollector(read))
    port = serve_metrics(listen, registry)
    log.info("metrics on %s:%d/metrics", listen.rsplit(":", 1)[0], port)
    return metrics


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    config = parse_args(args)
    configure_logging(config.log_level, config.log_format)
    follow_supervisor()  # started by `tandem up`: ends with it
    try:
        access = _access(config)
        registry = announce_target(config)  # its password file read before the core starts
        spawned = spawn_core(args)  # it loads the model while this process imports the rest
        asyncio.run(serve(config, args, access, spawned, registry))
    except OSError as exc:
        print(f"tandem-engine: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
