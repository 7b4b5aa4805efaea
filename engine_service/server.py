"""The engine process: model, MLX thread, gRPC (aio) server, health, reflection, signals."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine_service import blas
from engine_service.checkpoints import CheckpointManager, CheckpointSettings
from engine_service.config import EngineConfig, parse_args
from engine_service.model import IncompatibleDraft, load_draft, load_model
from engine_service.preemption import ParkSettings
from engine_service.requests import DraftSupport, RequestPolicy
from engine_service.response_stream import loop_deliver
from engine_service.scheduler import Limits, Scheduler
from engine_service.servicer import EngineServicer
from tandem_client.credentials import bearer_token, tls_credentials
from tandem_wire.auth import Authenticator, AuthFileError, Role
from tandem_wire.pb import engine_pb2, engine_pb2_grpc
from tandem_wire.service import SERVER_OPTIONS, Access, configure_logging, guarded
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


def _store_settings(config: EngineConfig) -> tuple[grpc.ChannelCredentials | None, str]:
    """TLS credentials and token for the engine's store client (files read once, here)."""
    tls = config.store_tls_ca or config.store_tls_cert
    try:
        credentials = (
            tls_credentials(config.store_tls_ca, config.store_tls_cert, config.store_tls_key)
            if tls
            else None
        )
        token = bearer_token(config.store_token_file) if config.store_token_file else ""
    except (OSError, ValueError) as exc:
        raise OSError(f"store credentials: {exc}") from None
    return credentials, token


async def serve(config: EngineConfig) -> None:
    access = _access(config)
    store_credentials, store_token = _store_settings(config)
    log.info("BLAS: %s", blas.in_use())
    # The MLX thread holds the GIL while it builds each step's graph; with the default 5 ms
    # switch interval every hand-off to the gRPC thread can wait that long, and a request
    # needs several, which showed up as 4-5x the direct time to first token on a GPU.
    sys.setswitchinterval(config.switch_interval_s)
    loaded = load_model(config.model, config.data_dir, config.dtype)
    draft = (
        load_draft(config.draft_model, config.data_dir, loaded, config.dtype)
        if config.draft_model
        else None
    )
    context = min(config.max_context or loaded.context_length, loaded.context_length)
    limits = Limits(
        config.max_running,
        config.max_queued,
        config.prefill_batch_size,
        config.prefill_step_size,
        config.admission_window_s,
        ParkSettings(config.park_after_tokens, config.park_bytes, config.park_idle_timeout_s),
    )
    checkpoints = CheckpointManager(
        loaded,
        CheckpointSettings(
            store=config.store,
            local_cache_bytes=config.prefix_cache_bytes,
            spill_queue_bytes=config.spill_queue_bytes,
            store_credentials=store_credentials,
            store_token=store_token,
            store_region_bytes=config.store_region_bytes,
            spill_batch_records=config.spill_batch_records,
        ),
    )
    problem = await asyncio.to_thread(checkpoints.check_store)
    if problem:
        log.error("%s: checkpoints will not reach it until that is fixed", problem)
    scheduler = Scheduler(
        loaded, limits, loop_deliver(asyncio.get_running_loop()), checkpoints, draft
    )
    scheduler.start()
    policy = RequestPolicy(
        loaded,
        context,
        config.default_max_tokens,
        has_store=checkpoints.has_store,
        default_checkpoint_interval=config.checkpoint_interval,
        default_kv=config.kv_codec,
        drafts=DraftSupport(draft.model_id if draft else "", config.num_draft_tokens),
    )
    server = grpc.aio.server(options=SERVER_OPTIONS)
    # Malformed requests: INVALID_ARGUMENT on every RPC; with access, callers authenticated.
    registrar = guarded(server, access)
    servicer = EngineServicer(policy, scheduler, checkpoints, access)
    engine_pb2_grpc.add_EngineServicer_to_server(servicer, registrar)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, registrar)
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    port = bind(server, config.listen, config.tls_cert, config.tls_key, config.tls_client_ca)
    await server.start()
    host = config.listen.rsplit(":", 1)[0]
    print(f"tandem-engine listening on {host}:{port}", flush=True)
    log.info("serving %s on %s:%d (BLAS: %s)", loaded.model_id, host, port, blas.in_use())

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    if access is not None:
        loop.add_signal_handler(signal.SIGHUP, access.authenticator.reload)
    await stop.wait()

    # Stop admitting, let in-flight generations finish within the grace period, then
    # cancel what is left (their streams end with finish reason CANCELLED).
    log.info("draining: %d requests in flight (grace %.0fs)", scheduler.pending(), config.grace_s)
    scheduler.stop_accepting()
    await health_servicer.enter_graceful_shutdown()
    deadline = time.monotonic() + config.grace_s
    while scheduler.pending() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    scheduler.shutdown()
    # Checkpoints already queued (a prefix, a generation's last snapshot) still reach the
    # store, within the grace period.
    await asyncio.to_thread(checkpoints.flush, max(1.0, deadline - time.monotonic()))
    checkpoints.close()
    await server.stop(2.0)
    log.info("stopped")


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    config = parse_args(argv)
    try:
        asyncio.run(serve(config))
    except (OSError, IncompatibleDraft) as exc:
        print(f"tandem-engine: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
