"""A store of the release before: the current servicer less the RPCs that release did not
have, so the clients' fallbacks (PutRecords -> PutMany, GetHeaders -> a Get a key) are tested
against a real server."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from store_service.config import StoreConfig, SyncMode
from store_service.fair_share import BulkCallLimit, BulkLimits
from store_service.handlers import store_handler
from store_service.servicer import StoreServicer
from store_service.store import CheckpointStore


class _Without(grpc.GenericRpcHandler):  # type: ignore[misc]  # grpc is untyped
    """The store's own handlers less some methods (UNIMPLEMENTED, as on an older store)."""

    def __init__(self, inner: grpc.GenericRpcHandler, methods: tuple[str, ...]) -> None:
        self.inner = inner
        self.methods = methods

    def service(self, details: grpc.HandlerCallDetails) -> Any:
        if details.method.rsplit("/", 1)[-1] in self.methods:
            return None
        return self.inner.service(details)


@contextmanager
def serve_store_without(data_dir: Path, *methods: str) -> Iterator[str]:
    """A store on an ephemeral loopback port without `methods` (Store RPC names); its
    address."""
    store = CheckpointStore(StoreConfig(data_dir=data_dir, sync_mode=SyncMode.COMMIT))
    server = grpc.server(ThreadPoolExecutor(8))
    handler = store_handler(StoreServicer(store, BulkCallLimit(BulkLimits.for_workers(8, 0, 0, 0))))
    server.add_generic_rpc_handlers((_Without(handler, methods),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(grace=5).wait()
        store.close()
