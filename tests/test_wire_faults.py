"""Bytes no request parses as are INVALID_ARGUMENT on every RPC of both servers, and a second
server on a busy port refuses to start."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem_wire.pb import engine_pb2, store_pb2
from tests.servers import InProcessStore, ServiceProcess, run_module

GARBAGE = b"\xff\xff\xff"  # a truncated varint: no message parses from it


def _methods(descriptor: object, service: str) -> Iterator[tuple[str, bool, bool]]:
    for method in descriptor.services_by_name[service].methods:  # type: ignore[attr-defined]
        yield (
            f"/tandem.v1.{service}/{method.name}",
            method.client_streaming,
            method.server_streaming,
        )


def _call(channel: grpc.Channel, path: str, client_streams: bool, server_streams: bool) -> None:
    if client_streams:
        channel.stream_unary(path)(iter([GARBAGE]), timeout=10)
    elif server_streams:
        list(channel.unary_stream(path)(GARBAGE, timeout=10))
    else:
        channel.unary_unary(path)(GARBAGE, timeout=10)


def _all_invalid(address: str, methods: list[tuple[str, bool, bool]]) -> None:
    with grpc.insecure_channel(address) as channel:
        for path, client_streams, server_streams in methods:
            with pytest.raises(grpc.RpcError) as caught:
                _call(channel, path, client_streams, server_streams)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, path
        health = "/grpc.health.v1.Health/Check"
        with pytest.raises(grpc.RpcError) as caught:
            _call(channel, health, False, False)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_malformed_requests_are_invalid_argument_on_every_store_rpc(
    store: InProcessStore,
) -> None:
    methods = [
        *_methods(store_pb2.DESCRIPTOR, "Store"),
        *_methods(store_pb2.DESCRIPTOR, "StoreAdmin"),
    ]
    # 15 Store (PutMany, PutRecords, GetHeaders, GetRecords, Flush, Delete, DeleteMany, the
    # regions pair, ReleaseDirect) + 7 StoreAdmin
    assert len(methods) == 22
    _all_invalid(store.address, methods)


def test_malformed_requests_are_invalid_argument_on_every_engine_rpc(
    engine: ServiceProcess,
) -> None:
    methods = list(_methods(engine_pb2.DESCRIPTOR, "Engine"))
    assert len(methods) == 7
    _all_invalid(engine.address, methods)


def _second(module: str, address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return run_module(module, "--listen", address, *args)


def test_a_second_server_on_a_busy_port_exits_clearly(
    store: InProcessStore, engine: ServiceProcess, tmp_path: Path, engine_data_dir: Path
) -> None:
    second_store = _second("store_service", store.address, "--data-dir", str(tmp_path / "s2"))
    assert second_store.returncode != 0
    assert f"cannot listen on {store.address}: the address is in use" in second_store.stderr
    second_engine = _second("engine_service", engine.address, "--data-dir", str(engine_data_dir))
    assert second_engine.returncode != 0
    assert f"cannot listen on {engine.address}: the address is in use" in second_engine.stderr
    # The first ones still serve.
    with grpc.insecure_channel(store.address) as channel:
        channel.unary_unary(
            "/tandem.v1.StoreAdmin/Stats",
            request_serializer=store_pb2.StatsRequest.SerializeToString,
            response_deserializer=store_pb2.StatsResponse.FromString,
        )(store_pb2.StatsRequest(), timeout=10)
