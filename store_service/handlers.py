"""The Store service's registration: the generated method table, with the bulk
(de)serializers on Put and Get (store_service/wire.py) instead of protobuf's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from store_service.servicer import StoreServicer
from store_service.wire import parse_put_request, serialize_response
from tandem_wire.pb import store_pb2


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
            "PutMany": grpc.stream_unary_rpc_method_handler(
                servicer.PutMany, parse_put_request, store_pb2.PutManyResponse.SerializeToString
            ),
            "PutRecords": unary(
                servicer.PutRecords, store_pb2.PutRecordsRequest, store_pb2.PutManyResponse
            ),
            "Get": grpc.unary_stream_rpc_method_handler(
                servicer.Get, store_pb2.GetRequest.FromString, serialize_response
            ),
            "GetHeaders": unary(
                servicer.GetHeaders, store_pb2.GetHeadersRequest, store_pb2.GetHeadersResponse
            ),
            "GetRecords": unary(
                servicer.GetRecords, store_pb2.GetRecordsRequest, store_pb2.GetRecordsResponse
            ),
            "Lookup": unary(servicer.Lookup, store_pb2.LookupRequest, store_pb2.LookupResponse),
            "Pin": unary(servicer.Pin, store_pb2.PinRequest, store_pb2.PinResponse),
            "Unpin": unary(servicer.Unpin, store_pb2.UnpinRequest, store_pb2.UnpinResponse),
            "Flush": unary(servicer.Flush, store_pb2.FlushRequest, store_pb2.FlushResponse),
            "Delete": unary(servicer.Delete, store_pb2.DeleteRequest, store_pb2.DeleteResponse),
            "DeleteMany": unary(
                servicer.DeleteMany, store_pb2.DeleteManyRequest, store_pb2.DeleteManyResponse
            ),
            "RegisterRegion": unary(
                servicer.RegisterRegion,
                store_pb2.RegisterRegionRequest,
                store_pb2.RegisterRegionResponse,
            ),
            "UnregisterRegion": unary(
                servicer.UnregisterRegion,
                store_pb2.UnregisterRegionRequest,
                store_pb2.UnregisterRegionResponse,
            ),
            "ReleaseDirect": unary(
                servicer.ReleaseDirect,
                store_pb2.ReleaseDirectRequest,
                store_pb2.ReleaseDirectResponse,
            ),
        },
    )
