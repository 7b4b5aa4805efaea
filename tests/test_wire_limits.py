"""The same limits on both sides of the wire: each bad field is INVALID_ARGUMENT naming it,
and nothing changes in the store."""

from __future__ import annotations

import grpc
import pytest

from tandem_client import Checkpoint, EngineClient, StoreClient, Tensor
from tandem_client.errors import InvalidArgument
from tandem_wire.pb import engine_pb2, engine_pb2_grpc, store_pb2, store_pb2_grpc, tensors_pb2
from tests.servers import InProcessStore


def _record(**fields: object) -> Checkpoint:
    fields.setdefault("tensors", [Tensor("t", "uint8", (4,), b"abcd")])
    return Checkpoint(key=b"limits", model_id="m", layout=["kv:plain"], **fields)  # type: ignore[arg-type]


def test_bad_records_and_queries_are_refused_by_the_store(
    store: InProcessStore, client: StoreClient
) -> None:
    refusals = {
        "dtype": _record(tensors=[Tensor("t", "complex1024", (1,), b"x" * 128)]),
        "token_ids": _record(token_ids=[5, -1, 7]),
        "metadata": _record(metadata={"big": "x" * (2 << 20)}),
    }
    for field, record in refusals.items():
        with pytest.raises(InvalidArgument, match=field):
            client.put(record)
    with grpc.insecure_channel(store.address) as channel:
        header = _record().header_pb()
        header.kind = 99  # type: ignore[assignment]
        put = store_pb2_grpc.StoreStub(channel).Put
        with pytest.raises(grpc.RpcError) as kind:
            put(iter([store_pb2.PutRequest(header=store_pb2.PutHeader(checkpoint=header))]))
        assert kind.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "kind" in (kind.value.details() or "")
    with pytest.raises(InvalidArgument, match="page_token"):
        client.list(page_token="ab" * (1 << 19))
    assert client.stats().records == 0  # nothing was stored
    client.put(_record(kind="object"))
    with pytest.raises(InvalidArgument, match="max_chunk_bytes"):
        client.get(b"limits", max_chunk_bytes=1)
    got = client.get(b"limits", max_chunk_bytes=64 << 10)
    assert bytes(got.tensors[0].data) == b"abcd"
    assert tensors_pb2.RECORD_KIND_OBJECT in tensors_pb2.RecordKind.values()


def test_bad_fields_are_refused_by_the_engine(engine_client: EngineClient) -> None:
    with grpc.insecure_channel(engine_client.address) as channel:
        generate = engine_pb2_grpc.EngineStub(channel).Generate
        bad = {
            "logprobs": engine_pb2.GenerateRequest(
                token_ids=[5, 6], max_tokens=2, sampling=engine_pb2.SamplingParams(logprobs=-1)
            ),
            "namespace": engine_pb2.GenerateRequest(
                token_ids=[5, 6], max_tokens=2, namespace="n" * (1 << 20)
            ),
            "tokens_held": engine_pb2.GenerateRequest(
                token_ids=[5, 6], max_tokens=64, tokens_held=1000
            ),
        }
        for field, request in bad.items():
            with pytest.raises(grpc.RpcError) as caught:
                list(generate(request, timeout=30))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field in (caught.value.details() or ""), field
