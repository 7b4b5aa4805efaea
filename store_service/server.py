"""The store process: ports, health, reflection, signals."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from store_service import salvage
from store_service.admin import StoreAdmin
from store_service.config import StoreConfig, parse_args
from store_service.errors import StorageError
from store_service.fair_share import BulkCallLimit
from store_service.servicer import StoreAdminServicer, StoreServicer, store_handler
from store_service.store import CheckpointStore
from tandem_wire.pb import store_pb2, store_pb2_grpc
from tandem_wire.service import SERVER_OPTIONS, configure_logging, guarded
from tandem_wire.tls import bind

log = logging.getLogger("tandem.store")

SERVICE_NAMES = [
    store_pb2.DESCRIPTOR.services_by_name["Store"].full_name,
    store_pb2.DESCRIPTOR.services_by_name["StoreAdmin"].full_name,
]
# Chunks are at most 4 MiB of payload; leave room for the envelope.
MAX_MESSAGE_BYTES = 8 << 20


def create_server(
    store: CheckpointStore,
    listen: str,
    max_workers: int = 32,
    tls_cert: str = "",
    tls_key: str = "",
    bulk_calls_per_connection: int = 0,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Builds (not starts) a server for `store`; returns it, its bound port and its health."""
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
    registrar = guarded(server)  # malformed requests: INVALID_ARGUMENT on every RPC
    # 0: half the workers, so one connection never holds them all.
    bulk_limit = BulkCallLimit(bulk_calls_per_connection or max(1, max_workers // 2))
    registrar.add_generic_rpc_handlers((store_handler(StoreServicer(store, bulk_limit)),))
    admin = StoreAdminServicer(StoreAdmin(store))
    store_pb2_grpc.add_StoreAdminServicer_to_server(admin, registrar)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, registrar)
    for name in ["", *SERVICE_NAMES]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    port = bind(server, listen, tls_cert, tls_key)
    return server, port, health_servicer


def serve(config: StoreConfig) -> None:
    store = CheckpointStore(config)
    server, port, health_servicer = create_server(
        store,
        config.listen,
        config.max_workers,
        config.tls_cert,
        config.tls_key,
        config.bulk_calls_per_connection,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    server.start()
    host = config.listen.rsplit(":", 1)[0]
    # One parseable line: tests and `tandem up` read the port from it.
    print(f"tandem-store listening on {host}:{port}", flush=True)
    stop.wait()
    log.info("draining (grace %.0fs)", config.grace_s)
    health_servicer.enter_graceful_shutdown()
    server.stop(config.grace_s).wait()
    store.close()
    log.info("stopped cleanly")


def main(argv: list[str] | None = None) -> None:
    configure_logging()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["verify"], ["salvage"]):  # an operator's tools, with the store stopped
        sys.exit(salvage.main(argv))
    config = parse_args(argv)
    try:
        serve(config)
    except (StorageError, OSError) as exc:
        print(f"tandem-store: {exc}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
