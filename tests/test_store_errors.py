"""Bad input gets the right status and changes nothing."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

import grpc
import pytest

from tandem_client import StoreClient
from tandem_wire.pb import store_pb2, tensors_pb2
from tests.conftest import make_checkpoint

MiB = 1 << 20


def _messages(ckpt, chunks):  # noqa: ANN001, ANN202
    yield store_pb2.PutRequest(header=store_pb2.PutHeader(checkpoint=ckpt.header_pb()))
    for offset, data in chunks:
        yield store_pb2.PutRequest(chunk=tensors_pb2.Chunk(offset=offset, data=data))


def _status(client: StoreClient, requests: Iterator[store_pb2.PutRequest]) -> grpc.StatusCode:
    try:
        client._store.Put(requests, timeout=30)  # the raw stub: these are protocol errors
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


@pytest.fixture
def seeded(client: StoreClient) -> StoreClient:
    client.put(make_checkpoint(b"existing", {"kv_int8": 2 * MiB}))
    client.flush()
    return client


def _unchanged(client: StoreClient, before: store_pb2.StatsResponse) -> None:
    client.flush()  # aborted puts clean up on the writer thread; wait for it
    after = client.stats()
    assert (after.records, after.payload_bytes, after.chunk_entries, after.pending_puts) == (
        before.records,
        before.payload_bytes,
        before.chunk_entries,
        0,
    )


def test_bad_puts_are_rejected_and_change_nothing(seeded: StoreClient) -> None:
    client = seeded
    before = client.stats()
    ckpt = make_checkpoint(b"new", {"a_int8": 3 * MiB, "b_int8": MiB})
    data = b"".join(bytes(t.data) for t in ckpt.tensors)
    chunk = [(i, data[i : i + MiB]) for i in range(0, len(data), MiB)]
    bad = tensors_pb2.Chunk(offset=0, data=b"x")

    cases = {
        "chunk before header": iter([store_pb2.PutRequest(chunk=bad)]),
        "empty stream": iter([]),
        "missing chunk": _messages(ckpt, chunk[:1] + chunk[2:]),
        "more bytes than declared": _messages(ckpt, [*chunk, (len(data), b"extra")]),
        "short payload": _messages(ckpt, chunk[:-1]),
        "two headers": iter(
            [*_messages(ckpt, chunk[:1]), store_pb2.PutRequest(header=store_pb2.PutHeader())]
        ),
    }
    for name, requests in cases.items():
        assert _status(client, requests) == grpc.StatusCode.INVALID_ARGUMENT, name
        _unchanged(client, before)

    corrupt = bytearray(data)
    corrupt[5] ^= 1
    flipped = [(i, bytes(corrupt[i : i + MiB])) for i in range(0, len(data), MiB)]
    assert _status(client, _messages(ckpt, flipped)) == grpc.StatusCode.INVALID_ARGUMENT
    _unchanged(client, before)

    lying = make_checkpoint(b"new", {"a_int8": 100})
    lying.tensors[0].crc32 = zlib.crc32(b"something else")
    assert (
        _status(client, _messages(lying, [(0, bytes(lying.tensors[0].data))]))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    _unchanged(client, before)


def test_bad_headers_are_invalid_argument(seeded: StoreClient) -> None:
    client = seeded
    before = client.stats()
    empty_key = make_checkpoint(b"", {"a_int8": 10})
    long_key = make_checkpoint(b"k" * 65, {"a_int8": 10})
    wrong_size = make_checkpoint(b"w", {"a_bf16": 10})
    wrong_size.tensors[0].shape = (7,)
    no_kind = make_checkpoint(b"n", {"a_int8": 10}, kind="")
    bad_chain = make_checkpoint(
        b"c", {"a_int8": 10}, token_ids=[1, 2, 3], block_size=2, block_hashes=[b"h" * 32]
    )
    for ckpt in (empty_key, long_key, wrong_size, no_kind, bad_chain):
        assert _status(client, _messages(ckpt, [])) == grpc.StatusCode.INVALID_ARGUMENT
    _unchanged(client, before)


def test_if_absent_answers_already_exists(seeded: StoreClient) -> None:
    client = seeded
    before = client.stats()
    with pytest.raises(Exception) as failure:
        client.put(make_checkpoint(b"existing", {"kv_int8": MiB}), if_absent=True)
    assert failure.value.code == grpc.StatusCode.ALREADY_EXISTS
    _unchanged(client, before)


def test_unknown_keys_and_bad_queries(seeded: StoreClient) -> None:
    client = seeded
    unknown = b"no-such-key"
    for call in (
        lambda: client.get(unknown),
        lambda: client.inspect(unknown),
        lambda: client.delete(unknown),
        lambda: client.pin(unknown),
        lambda: client.get_header(unknown),
    ):
        with pytest.raises(Exception) as failure:
            call()
        assert failure.value.code == grpc.StatusCode.NOT_FOUND
    invalid = (
        lambda: client.get(b""),
        lambda: client.list(page_size=-1),
        lambda: client.list(page_token="not-hex"),
        lambda: client.lookup(
            namespace="",
            model_id="m",
            layout=[],
            block_size=0,
            block_hashes=[b"x" * 32],
            token_count=3,
        ),
        lambda: client.lookup(
            namespace="", model_id="m", layout=[], block_size=16, block_hashes=[], token_count=0
        ),
        lambda: client.get(b"k", namespace="bad\nnamespace"),
    )
    for call in invalid:
        with pytest.raises(Exception) as failure:
            call()
        assert failure.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert client.stats().records == 1
