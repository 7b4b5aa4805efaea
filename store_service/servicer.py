"""Thin gRPC servicers: request -> typed domain call -> response, errors mapped to status."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from store_service.admin import StoreAdmin
from store_service.errors import Corrupt, InvalidRequest, status_on_error
from store_service.fair_share import GET, PUT, BulkCallLimit
from store_service.metrics import TRANSFERS, TransferPath
from store_service.put_session import IdleLimited
from store_service.put_spec import PutSpec
from store_service.records import RecordFilter, StoredRecord, all_tensors
from store_service.region_copy import region_payload
from store_service.same_host_gets import (
    caller,
    get_direct,
    get_into_region,
    get_records_into_region,
)
from store_service.storage import now_ms
from store_service.store import CheckpointStore
from store_service.wire import (
    LookupQuery,
    PutResult,
    PutStreams,
    get_piece_bytes,
    put_chunks,
    put_header,
    region_lease_pb,
    region_request,
)
from tandem_wire.auth import PermissionDenied, current, namespace_for
from tandem_wire.chunks import encode_chunk
from tandem_wire.pb import store_pb2, store_pb2_grpc
from tandem_wire.service import Access

F = TypeVar("F", bound=Callable[..., Any])

# Keys one GetHeaders call may name (a checkpoint chain probes 16).
MAX_HEADER_KEYS = 64


def rpc_errors(method: F) -> F:
    """Runs an RPC method (unary or streaming) under errors.status_on_error."""
    name = method.__name__
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with status_on_error(context, name):
                yield from method(self, request, context)

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        with status_on_error(context, name):
            return method(self, request, context)

    return unary  # type: ignore[return-value]


class StoreServicer(store_pb2_grpc.StoreServicer):
    def __init__(self, store: CheckpointStore, bulk_limit: BulkCallLimit) -> None:
        self.store = store
        self.bulk_limit = bulk_limit
        self.admin = StoreAdmin(store)  # for Flush

    @rpc_errors
    def Put(
        self, requests: Iterator[store_pb2.PutRequest], context: grpc.ServicerContext
    ) -> store_pb2.PutResponse:
        self.bulk_limit.enter(context, PUT)
        with self._idle_limited(requests, "Put") as messages:
            header = put_header(messages)
            header.checkpoint.namespace = namespace_for(header.checkpoint.namespace)
            return self._put_one(header, put_chunks(messages), context).to_pb()

    @contextlib.contextmanager
    def _idle_limited(
        self, requests: Iterator[store_pb2.PutRequest], rpc: str
    ) -> Iterator[Iterator[store_pb2.PutRequest]]:
        """The stream, ended with IdleStream (DEADLINE_EXCEEDED) when its client sends
        nothing for --put-idle-timeout-s, so a silent client cannot hold a worker."""
        idle_s = self.store.config.put_idle_timeout_s
        if idle_s <= 0:
            yield requests
            return
        limited = IdleLimited(requests, idle_s, rpc)
        try:
            yield limited
        finally:
            limited.close()

    def _put_one(
        self,
        header: store_pb2.PutHeader,
        chunks: Iterator[tuple[int, Any]],
        context: grpc.ServicerContext,
        inline: bool = False,
    ) -> PutResult:
        """One record: its chunks from the stream (or the message: inline), or read out of the
        caller's region."""
        started = time.perf_counter()
        result = self._put_payload(header, chunks, context)
        path = TransferPath.REGION if header.region else TransferPath.STREAM
        path = TransferPath.INLINE if inline and not header.region else path
        TRANSFERS.put(path, time.perf_counter() - started, result.payload_bytes)
        _mutation(
            "put",
            header.checkpoint.namespace,
            result.key,
            bytes=result.payload_bytes,
            replaced=result.replaced,
            evicted=result.evicted,
        )
        return result

    def _put_payload(
        self,
        header: store_pb2.PutHeader,
        chunks: Iterator[tuple[int, Any]],
        context: grpc.ServicerContext,
    ) -> PutResult:
        spec = PutSpec.from_pb(header)
        if not header.region:
            return self.store.put(spec, chunks)
        if next(chunks, None) is not None:
            raise InvalidRequest("a Put whose payload is in a region carries no chunks")
        region = self.store.regions.get(
            caller(context), header.region, now_ms(), header.region_registration
        )
        try:
            sizes = [t.nbytes for t in all_tensors(header.checkpoint)]
            payload = region_payload(
                region, header.region_offsets, sizes, self.store.config.chunk_bytes
            )
            return self.store.put(spec, payload)
        finally:
            self.store.regions.done(region)

    def PutMany(
        self, requests: Iterator[store_pb2.PutRequest], context: grpc.ServicerContext
    ) -> store_pb2.PutManyResponse:
        results = []
        with (
            status_on_error(context, "PutMany"),
            self._idle_limited(requests, "PutMany") as messages,
        ):
            self.bulk_limit.enter(context, PUT)
            try:
                for header, chunks in PutStreams(messages):
                    header.checkpoint.namespace = namespace_for(header.checkpoint.namespace)
                    results.append(self._put_one(header, chunks, context).to_pb())
            finally:
                # How many landed: a caller resends only the rest after a failure.
                context.set_trailing_metadata((("tandem-stored", str(len(results))),))
        return store_pb2.PutManyResponse(results=results)

    def PutRecords(
        self, request: store_pb2.PutRecordsRequest, context: grpc.ServicerContext
    ) -> store_pb2.PutManyResponse:
        """PutMany's records in one message: each payload inline or in the caller's region.
        One message needs no idle limit: it is all here before this runs."""
        results = []
        with status_on_error(context, "PutRecords"):
            self.bulk_limit.enter(context, PUT)
            try:
                for record in request.records:
                    header = record.header
                    header.checkpoint.namespace = namespace_for(header.checkpoint.namespace)
                    inline = [(0, record.payload)] if record.payload else []
                    result = self._put_one(header, iter(inline), context, inline=True)
                    results.append(result.to_pb())
            finally:
                context.set_trailing_metadata((("tandem-stored", str(len(results))),))
        return store_pb2.PutManyResponse(results=results)

    @rpc_errors
    def Get(
        self, request: store_pb2.GetRequest, context: grpc.ServicerContext
    ) -> Iterator[store_pb2.GetResponse]:
        piece = get_piece_bytes(request)
        namespace = namespace_for(request.namespace)
        self.bulk_limit.enter(context, GET)
        if request.region and not request.header_only:
            owner = caller(context)
            if request.direct:
                placed = yield from get_direct(self.store, request, namespace, owner)
                if placed:
                    return
            placed = yield from get_into_region(self.store, request, namespace, owner)
            if placed:
                return
        started = time.perf_counter()
        record = self.store.open_record(namespace, request.key)
        yield store_pb2.GetResponse(header=record.header)
        if not request.header_only:
            # Chunks leave as ready wire bytes; serialize_response passes them on.
            yield from self.store.read_payload(record, piece, encode_chunk)
            TRANSFERS.get(TransferPath.STREAM, time.perf_counter() - started, record.payload_bytes)

    @rpc_errors
    def GetHeaders(
        self, request: store_pb2.GetHeadersRequest, context: grpc.ServicerContext
    ) -> store_pb2.GetHeadersResponse:
        if len(request.keys) > MAX_HEADER_KEYS:
            raise InvalidRequest(f"at most {MAX_HEADER_KEYS} keys a call, not {len(request.keys)}")
        namespace = namespace_for(request.namespace)
        out = store_pb2.GetHeadersResponse()
        for record in self.store.open_records(namespace, list(request.keys)):
            found = out.headers.add()
            if isinstance(record, StoredRecord):
                found.header.CopyFrom(record.header)
                found.found = True
            else:
                found.damaged = isinstance(record, Corrupt)
        return out

    @rpc_errors
    def GetRecords(
        self, request: store_pb2.GetRecordsRequest, context: grpc.ServicerContext
    ) -> store_pb2.GetRecordsResponse:
        namespace = namespace_for(request.namespace)
        self.bulk_limit.enter(context, GET)
        return get_records_into_region(self.store, request, namespace, caller(context))

    @rpc_errors
    def ReleaseDirect(
        self, request: store_pb2.ReleaseDirectRequest, context: grpc.ServicerContext
    ) -> store_pb2.ReleaseDirectResponse:
        return store_pb2.ReleaseDirectResponse(held=self.store.direct.release(request.lease))

    @rpc_errors
    def Lookup(
        self, request: store_pb2.LookupRequest, context: grpc.ServicerContext
    ) -> store_pb2.LookupResponse:
        query = LookupQuery.from_pb(request)
        query = dataclasses.replace(query, namespace=namespace_for(query.namespace))
        return self.store.lookup(query).to_pb()

    @rpc_errors
    def Pin(
        self, request: store_pb2.PinRequest, context: grpc.ServicerContext
    ) -> store_pb2.PinResponse:
        r = request
        namespace = namespace_for(r.namespace)
        lease = self.store.pin(namespace, r.key, r.ttl_seconds, r.holder, r.lease_id)
        return store_pb2.PinResponse(lease_id=lease.lease_id, expires_at_unix_ms=lease.expires_ms)

    @rpc_errors
    def Unpin(
        self, request: store_pb2.UnpinRequest, context: grpc.ServicerContext
    ) -> store_pb2.UnpinResponse:
        self.store.unpin(namespace_for(request.namespace), request.key, request.lease_id)
        return store_pb2.UnpinResponse()

    @rpc_errors
    def Flush(
        self, request: store_pb2.FlushRequest, context: grpc.ServicerContext
    ) -> store_pb2.FlushResponse:
        return store_pb2.FlushResponse(durable=True, seconds=self.admin.flush())

    @rpc_errors
    def Delete(
        self, request: store_pb2.DeleteRequest, context: grpc.ServicerContext
    ) -> store_pb2.DeleteResponse:
        # A writer's own records (namespace_for refuses any other namespace): an engine
        # deletes its finished generations with the store role alone.
        return _delete(self.admin, request)

    @rpc_errors
    def DeleteMany(
        self, request: store_pb2.DeleteManyRequest, context: grpc.ServicerContext
    ) -> store_pb2.DeleteManyResponse:
        if len(request.keys) > MAX_DELETE_KEYS:
            raise InvalidRequest(f"{len(request.keys)} keys; DeleteMany takes {MAX_DELETE_KEYS}")
        namespace = namespace_for(request.namespace)
        gone = self.admin.delete_many(namespace, list(request.keys), request.force)
        for info in gone:
            _mutation("delete", namespace, info.key, freed_bytes=info.payload_bytes)
        return store_pb2.DeleteManyResponse(
            freed_bytes=sum(info.payload_bytes for info in gone),
            deleted=len(gone),
            missing=len(set(request.keys)) - len(gone),
        )

    @rpc_errors
    def RegisterRegion(
        self, request: store_pb2.RegisterRegionRequest, context: grpc.ServicerContext
    ) -> store_pb2.RegisterRegionResponse:
        principal = current()
        refused = (
            "the data file holds every namespace's records: only a principal of every "
            "namespace ('*') is given it"
            if principal is not None and not principal.sees_everything
            else ""
        )
        lease = self.store.regions.register(
            caller(context), region_request(request), now_ms(), data_file_refused=refused
        )
        return region_lease_pb(lease)

    @rpc_errors
    def UnregisterRegion(
        self, request: store_pb2.UnregisterRegionRequest, context: grpc.ServicerContext
    ) -> store_pb2.UnregisterRegionResponse:
        self.store.regions.unregister(caller(context), request.name)
        return store_pb2.UnregisterRegionResponse()


def _delete(admin: StoreAdmin, request: store_pb2.DeleteRequest) -> store_pb2.DeleteResponse:
    """Delete on either service: in the caller's namespace, logged as a mutation."""
    namespace = namespace_for(request.namespace)
    freed = admin.delete(namespace, request.key, request.force)
    _mutation("delete", namespace, request.key, freed_bytes=freed)
    return store_pb2.DeleteResponse(freed_bytes=freed)


class StoreAdminServicer(store_pb2_grpc.StoreAdminServicer):
    """Operators' RPCs. With auth every one needs the admin role (the guard checks it); an
    admin limited to some namespaces lists, inspects, deletes and purges only those, and
    the store-wide ones (Stats, Flush, Compact) need an admin of every namespace."""

    def __init__(self, admin: StoreAdmin, access: Access | None = None) -> None:
        self.admin = admin
        self.access = access

    def _visible(self, flt: RecordFilter) -> RecordFilter:
        principal = current()
        if principal is None or principal.sees_everything:
            return flt
        if flt.namespace:
            principal.namespace(flt.namespace)  # PermissionDenied unless allowed
            return flt
        return dataclasses.replace(flt, allowed=principal.may_use)

    @staticmethod
    def _store_wide(rpc: str) -> None:
        principal = current()
        if principal is not None and not principal.sees_everything:
            raise PermissionDenied(f"{rpc} covers every namespace: it needs an admin of '*'")

    @rpc_errors
    def List(
        self, request: store_pb2.ListRequest, context: grpc.ServicerContext
    ) -> store_pb2.ListResponse:
        flt = self._visible(RecordFilter.from_pb(request.filter))
        return self.admin.list_records(flt, request.page_size, request.page_token).to_pb()

    @rpc_errors
    def Inspect(
        self, request: store_pb2.InspectRequest, context: grpc.ServicerContext
    ) -> store_pb2.InspectResponse:
        return self.admin.inspect(namespace_for(request.namespace), request.key).to_pb()

    @rpc_errors
    def Delete(
        self, request: store_pb2.DeleteRequest, context: grpc.ServicerContext
    ) -> store_pb2.DeleteResponse:
        return _delete(self.admin, request)

    @rpc_errors
    def Purge(
        self, request: store_pb2.PurgeRequest, context: grpc.ServicerContext
    ) -> store_pb2.PurgeResponse:
        flt = self._visible(RecordFilter.from_pb(request.filter))
        purged = self.admin.purge(flt, request.include_pinned, request.dry_run)
        if not request.dry_run:
            _mutation(
                "purge",
                flt.namespace or "*",
                b"",
                records=len(purged.removed),
                freed_bytes=purged.freed_bytes,
            )
        return purged.to_pb()

    @rpc_errors
    def Stats(
        self, request: store_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> store_pb2.StatsResponse:
        self._store_wide("Stats")
        stats = self.admin.stats()
        if self.access is not None:
            stats = dataclasses.replace(
                stats, auth_failures=self.access.authenticator.failures_total
            )
        return stats.to_pb()

    @rpc_errors
    def Flush(
        self, request: store_pb2.FlushRequest, context: grpc.ServicerContext
    ) -> store_pb2.FlushResponse:
        self._store_wide("Flush")
        return store_pb2.FlushResponse(durable=True, seconds=self.admin.flush())

    @rpc_errors
    def Compact(
        self, request: store_pb2.CompactRequest, context: grpc.ServicerContext
    ) -> store_pb2.CompactResponse:
        self._store_wide("Compact")
        return self.admin.compact().to_pb()


mutations_log = logging.getLogger("tandem.store.mutations")
MAX_DELETE_KEYS = 4096  # one DeleteMany: one transaction, one hold of the index's mutex


def _mutation(action: str, namespace: str, key: bytes, **fields: Any) -> None:
    """One line per change to the store: what, where, which key (its first 16 hex digits,
    what `tandem ckpt ls` shows), and sizes. Never a payload or metadata value."""
    mutations_log.info(
        action,
        extra={
            "fields": {"action": action, "namespace": namespace, "key": key.hex()[:16], **fields}
        },
    )
