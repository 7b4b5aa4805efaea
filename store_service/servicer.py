"""Thin gRPC servicers: wire messages in, domain calls, wire messages out."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError

from store_service.errors import InvalidRequest, StoreError
from store_service.records import RecordFilter
from store_service.store import CheckpointStore
from tandem_wire.chunks import decode_chunk, encode_chunk
from tandem_wire.pb import store_pb2, store_pb2_grpc

log = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


def store_handler(servicer: StoreServicer) -> grpc.GenericRpcHandler:
    """The generated registration, with the bulk (de)serializers on Put and Get."""

    def unary(method: Callable[..., Any], request: Any, response: Any) -> Any:
        return grpc.unary_unary_rpc_method_handler(
            method, request.FromString, response.SerializeToString
        )

    return grpc.method_handlers_generic_handler(
        "tandem.v1.Store",
        {
            "Put": grpc.stream_unary_rpc_method_handler(
                servicer.Put, parse_put_request, store_pb2.PutResponse.SerializeToString
            ),
            "Get": grpc.unary_stream_rpc_method_handler(
                servicer.Get, store_pb2.GetRequest.FromString, serialize_response
            ),
            "Lookup": unary(servicer.Lookup, store_pb2.LookupRequest, store_pb2.LookupResponse),
            "Pin": unary(servicer.Pin, store_pb2.PinRequest, store_pb2.PinResponse),
            "Unpin": unary(servicer.Unpin, store_pb2.UnpinRequest, store_pb2.UnpinResponse),
        },
    )


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    if isinstance(exc, StoreError):
        context.abort(exc.code, str(exc))
    log.exception("%s failed", method)
    context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}: {exc}")


def rpc_errors(method: F) -> F:
    """Maps domain errors to status codes; anything unknown is logged and becomes INTERNAL."""
    if inspect.isgeneratorfunction(method):

        @functools.wraps(method)
        def stream(self: Any, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            try:
                yield from method(self, request, context)
            except Exception as exc:  # noqa: BLE001 - mapped to a status
                _abort(context, exc, method.__name__)

        return stream  # type: ignore[return-value]

    @functools.wraps(method)
    def unary(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status
            _abort(context, exc, method.__name__)

    return unary  # type: ignore[return-value]


MALFORMED = object()


def parse_put_request(raw: bytes) -> Any:
    """PutRequest deserializer: a bare chunk becomes (offset, view) without protobuf's copies.

    Never raises: a message that cannot be parsed becomes MALFORMED, which the servicer
    answers with INVALID_ARGUMENT (grpc would turn a raising deserializer into INTERNAL).
    """
    try:
        chunk = decode_chunk(raw)
        return chunk if chunk is not None else store_pb2.PutRequest.FromString(raw)
    except (ValueError, DecodeError):
        return MALFORMED


def serialize_response(message: Any) -> bytes:
    """Passes pre-encoded bytes through; serializes protobuf messages."""
    return message if isinstance(message, bytes) else message.SerializeToString()


class StoreServicer(store_pb2_grpc.StoreServicer):
    def __init__(self, store: CheckpointStore) -> None:
        self.store = store

    @rpc_errors
    def Put(
        self, requests: Iterator[store_pb2.PutRequest], context: grpc.ServicerContext
    ) -> store_pb2.PutResponse:
        first = next(requests, None)
        if not isinstance(first, store_pb2.PutRequest) or not first.HasField("header"):
            raise InvalidRequest("the first message of a Put must be its header")
        session = self.store.begin_put(first.header)
        try:
            for message in requests:
                if isinstance(message, tuple):  # the fast path: see parse_put_request
                    session.write(*message)
                elif isinstance(message, store_pb2.PutRequest) and message.HasField("chunk"):
                    session.write(message.chunk.offset, message.chunk.data)
                elif message is MALFORMED:
                    raise InvalidRequest("a Put message could not be parsed")
                else:
                    raise InvalidRequest("a Put carries one header, then only chunks")
            result = self.store.commit_put(session)
        except BaseException:
            self.store.abort_put(session)
            raise
        return store_pb2.PutResponse(
            key=result.key,
            payload_bytes=result.payload_bytes,
            replaced=result.replaced,
            evicted=result.evicted,
            lease_id=result.lease_id,
        )

    @rpc_errors
    def Get(
        self, request: store_pb2.GetRequest, context: grpc.ServicerContext
    ) -> Iterator[store_pb2.GetResponse]:
        record = self.store.open_record(request.namespace, request.key)
        yield store_pb2.GetResponse(header=record.header)
        if request.header_only:
            return
        # Chunks leave as ready wire bytes (see wire.py); serialize_response passes them on.
        yield from self.store.read_payload(record, request.max_chunk_bytes, encode_chunk)

    @rpc_errors
    def Lookup(
        self, request: store_pb2.LookupRequest, context: grpc.ServicerContext
    ) -> store_pb2.LookupResponse:
        r = self.store.lookup(request)
        return store_pb2.LookupResponse(
            found=r.found,
            key=r.key,
            matched_tokens=r.matched_tokens,
            record_tokens=r.record_tokens,
            trimmable=r.trimmable,
        )

    @rpc_errors
    def Pin(
        self, request: store_pb2.PinRequest, context: grpc.ServicerContext
    ) -> store_pb2.PinResponse:
        lease = self.store.pin(
            request.namespace, request.key, request.ttl_seconds, request.holder, request.lease_id
        )
        return store_pb2.PinResponse(lease_id=lease.lease_id, expires_at_unix_ms=lease.expires_ms)

    @rpc_errors
    def Unpin(
        self, request: store_pb2.UnpinRequest, context: grpc.ServicerContext
    ) -> store_pb2.UnpinResponse:
        self.store.unpin(request.namespace, request.key, request.lease_id)
        return store_pb2.UnpinResponse()


class StoreAdminServicer(store_pb2_grpc.StoreAdminServicer):
    def __init__(self, store: CheckpointStore) -> None:
        self.store = store

    @rpc_errors
    def List(
        self, request: store_pb2.ListRequest, context: grpc.ServicerContext
    ) -> store_pb2.ListResponse:
        records, token = self.store.list_records(
            RecordFilter.from_pb(request.filter), request.page_size, request.page_token
        )
        return store_pb2.ListResponse(records=[r.to_pb() for r in records], next_page_token=token)

    @rpc_errors
    def Inspect(
        self, request: store_pb2.InspectRequest, context: grpc.ServicerContext
    ) -> store_pb2.InspectResponse:
        record, info, leases = self.store.inspect(request.namespace, request.key)
        return store_pb2.InspectResponse(
            summary=info.to_pb(),
            header=record.header,
            leases=[
                store_pb2.Lease(
                    lease_id=x.lease_id, holder=x.holder, expires_at_unix_ms=x.expires_ms
                )
                for x in leases
            ],
            chunk_count=len(record.chunk_crcs),
            chunk_bytes=record.chunk_bytes,
        )

    @rpc_errors
    def Delete(
        self, request: store_pb2.DeleteRequest, context: grpc.ServicerContext
    ) -> store_pb2.DeleteResponse:
        freed = self.store.delete(request.namespace, request.key, request.force)
        return store_pb2.DeleteResponse(freed_bytes=freed)

    @rpc_errors
    def Purge(
        self, request: store_pb2.PurgeRequest, context: grpc.ServicerContext
    ) -> store_pb2.PurgeResponse:
        gone = self.store.purge(
            RecordFilter.from_pb(request.filter), request.include_pinned, request.dry_run
        )
        return store_pb2.PurgeResponse(
            records=len(gone),
            freed_bytes=sum(x.payload_bytes for x in gone),
            removed=[x.to_pb() for x in gone],
        )

    @rpc_errors
    def Stats(
        self, request: store_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> store_pb2.StatsResponse:
        return self.store.stats()

    @rpc_errors
    def Flush(
        self, request: store_pb2.FlushRequest, context: grpc.ServicerContext
    ) -> store_pb2.FlushResponse:
        return store_pb2.FlushResponse(durable=True, seconds=self.store.flush())

    @rpc_errors
    def Compact(
        self, request: store_pb2.CompactRequest, context: grpc.ServicerContext
    ) -> store_pb2.CompactResponse:
        import time

        start = time.perf_counter()
        before, after = self.store.compact()
        return store_pb2.CompactResponse(
            file_bytes_before=before, file_bytes_after=after, seconds=time.perf_counter() - start
        )
