"""The store process: ports, health, reflection, signals."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from store_service import salvage
from store_service.admin import StoreAdmin
from store_service.config import StoreConfig, parse_args
from store_service.errors import StorageError
from store_service.fair_share import BulkCallLimit, BulkLimits
from store_service.handlers import store_handler
from store_service.servicer import StoreAdminServicer, StoreServicer
from store_service.store import CheckpointStore
from tandem_wire.auth import Authenticator, AuthFileError, Role
from tandem_wire.lifetime import follow_supervisor
from tandem_wire.logs import configure_logging
from tandem_wire.pb import store_pb2, store_pb2_grpc
from tandem_wire.service import SERVER_OPTIONS, Access, guarded
from tandem_wire.tls import bind, check_exposure

log = logging.getLogger("tandem.store")

STORE_SERVICE = store_pb2.DESCRIPTOR.services_by_name["Store"].full_name
ADMIN_SERVICE = store_pb2.DESCRIPTOR.services_by_name["StoreAdmin"].full_name
# Chunks are at most 4 MiB of payload; leave room for the envelope.
MAX_MESSAGE_BYTES = 8 << 20


# What each RPC needs when the store runs with --auth-file.
ROLES = {"/tandem.v1.Store/*": Role.STORE, "/tandem.v1.StoreAdmin/*": Role.ADMIN}


def create_server(
    store: CheckpointStore,
    listen: str,
    max_workers: int = 32,
    tls_cert: str = "",
    tls_key: str = "",
    bulk_calls_per_connection: int = 0,
    *,
    max_bulk_calls: int = 0,
    bulk_calls_per_principal: int = 0,
    tls_client_ca: str = "",
    access: Access | None = None,
    data_plane: bool = True,
    admin: bool = True,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Builds (not starts) a server for `store` serving its data plane, its admin RPCs or
    both; returns it, its bound port and its health."""
    server = grpc.server(
        ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="store-rpc"),
        options=[
            *SERVER_OPTIONS,
            # A fixed 4 MiB receive window per stream: gRPC's BDP probing grew each Put's
            # window until 16 concurrent 64 MiB Puts held ~1 GiB in its buffers (480 MiB
            # peak with this; single-Put bandwidth unchanged within noise).
            ("grpc.http2.bdp_probe", 0),
            ("grpc.http2.lookahead_bytes", 4 << 20),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    # Malformed requests: INVALID_ARGUMENT on every RPC; with access, callers authenticated.
    registrar = guarded(server, access)
    names = []
    if data_plane:
        # 0s: from the workers (fair_share.py), so no caller and no kind holds them all.
        limits = BulkLimits.for_workers(
            max_workers, bulk_calls_per_connection, max_bulk_calls, bulk_calls_per_principal
        )
        bulk_limit = BulkCallLimit(limits)
        registrar.add_generic_rpc_handlers((store_handler(StoreServicer(store, bulk_limit)),))
        names.append(STORE_SERVICE)
    if admin:
        store_pb2_grpc.add_StoreAdminServicer_to_server(
            StoreAdminServicer(StoreAdmin(store), access), registrar
        )
        names.append(ADMIN_SERVICE)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, registrar)
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    port = bind(server, listen, tls_cert, tls_key, tls_client_ca)
    return server, port, health_servicer


def _serve_metrics(listen: str, store: CheckpointStore, access: Access | None) -> None:
    from store_service.metrics import TRANSFERS, StoreCollector
    from tandem_wire.metrics import serve_metrics

    admin = StoreAdmin(store)
    registry = TRANSFERS.registry  # the Put/Get histograms, and the stats read at scrape time
    failures = (lambda: access.authenticator.failures_total) if access is not None else (lambda: 0)
    registry.register(StoreCollector(admin.stats, failures))
    port = serve_metrics(listen, registry)
    log.info("metrics on %s:%d/metrics", listen.rsplit(":", 1)[0], port)


def serve(config: StoreConfig) -> None:
    check_exposure(
        "tandem-store",
        [config.listen, config.admin_listen],
        bool(config.auth_file),
        config.insecure_no_auth,
    )
    access = None
    if config.auth_file:
        try:
            access = Access(Authenticator(Path(config.auth_file)), ROLES)
        except AuthFileError as exc:
            raise OSError(str(exc)) from None
    if config.tier is not None:
        from store_service.tier.tiered_store import TieredStore  # valkey only with --tier

        store: CheckpointStore = TieredStore(config)
    else:
        store = CheckpointStore(config)
    split = bool(config.admin_listen)
    servers = [
        create_server(
            store,
            config.listen,
            config.max_workers,
            config.tls_cert,
            config.tls_key,
            config.bulk_calls_per_connection,
            max_bulk_calls=config.max_bulk_calls,
            bulk_calls_per_principal=config.bulk_calls_per_principal,
            tls_client_ca=config.tls_client_ca,
            access=access,
            admin=not split,
        )
    ]
    if split:
        servers.append(
            create_server(
                store,
                config.admin_listen,
                4,
                config.tls_cert,
                config.tls_key,
                tls_client_ca=config.tls_client_ca,
                access=access,
                data_plane=False,
            )
        )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    if access is not None:
        authenticator = access.authenticator
        signal.signal(signal.SIGHUP, lambda *_: authenticator.reload())
    for server, _, _ in servers:
        server.start()
    if config.metrics_listen:
        _serve_metrics(config.metrics_listen, store, access)
    host = config.listen.rsplit(":", 1)[0]
    # One parseable line: tests and `tandem up` read the port from it.
    print(f"tandem-store listening on {host}:{servers[0][1]}", flush=True)
    if split:
        # The log, not stdout: stdout carries the one banner line (a reader may close it after).
        admin_host = config.admin_listen.rsplit(":", 1)[0]
        log.info("StoreAdmin listening on %s:%d", admin_host, servers[1][1])
    # Woken every half second: a SIGTERM the kernel delivers to another of the store's
    # threads only sets CPython's flag, and a main thread blocked in a lock without a
    # timeout would never run the handler (a store that ignored its SIGTERM, seen in CI).
    while not stop.wait(0.5):
        pass
    log.info("draining (grace %.0fs)", config.grace_s)
    for _, _, health_servicer in servers:
        health_servicer.enter_graceful_shutdown()
    for server, _, _ in servers:
        server.stop(config.grace_s).wait()
    store.close()
    log.info("stopped cleanly")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["verify"], ["salvage"]):  # an operator's tools, with the store stopped
        configure_logging()
        sys.exit(salvage.main(argv))
    config = parse_args(argv)
    configure_logging(config.log_level, config.log_format)
    follow_supervisor()  # started by `tandem up`: ends with it
    try:
        serve(config)
    except (StorageError, OSError) as exc:
        print(f"tandem-store: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
