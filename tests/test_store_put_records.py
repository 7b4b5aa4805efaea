"""Store.PutRecords: records whose payload is small, or in the caller's region already, in one
message (no stream). The Python client sends put() and put_many() that way when they can.

- Small records (attachments and leases included) read back byte for byte, counted on the
  `inline` path; a batch holding a record too large to go inline, or headers that would take
  the message past its bound, streams whole (PutMany).
- A bad record (a short payload, a checksum that does not match, a payload beside a region)
  is INVALID_ARGUMENT; the records before it are stored and counted in `tandem-stored`, none
  after it.
- A store of the release before (its servicer without PutRecords) is sent PutMany, by the
  sync and the asyncio client.
- The asyncio client's put_many keeps the same order and count on a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from store_service.metrics import TRANSFERS
from tandem_client import AsyncStoreClient, NotFound, PutResult, StoreClient
from tandem_client.bulk import INLINE_PAYLOAD_BYTES, fits_one_message, put_records_request
from tandem_client.errors import PutManyFailed
from tandem_client.records import Attachment, PutItem, Tensor
from tandem_wire.pb import store_pb2, store_pb2_grpc
from tests.conftest import make_checkpoint
from tests.older_store import serve_store_without
from tests.servers import InProcessStore


def _puts(path: str) -> float:
    """Puts the store has counted on a transfer path (one registry per process)."""
    value = TRANSFERS.registry.get_sample_value("tandem:store_put_bytes_count", {"path": path})
    return value or 0.0


def test_small_records_travel_inline_and_read_back_exact(client: StoreClient) -> None:
    records = [
        make_checkpoint(b"small-%d" % i, {"k_int8": 4000 + i, "v_bf16": 2048}) for i in range(5)
    ]
    records[1].attachments = [
        Attachment("image/v1", [Tensor("pixels", "uint8", (3, 64), bytes(range(192)))], {"a": "b"})
    ]
    inline, streamed = _puts("inline"), _puts("stream")
    results = client.put_many(
        [
            PutItem(r, pin_ttl_s=60, pin_holder="test") if i == 2 else PutItem(r)
            for i, r in enumerate(records)
        ]
    )
    alone = make_checkpoint(b"alone", {"k_int8": 100})
    assert client.put(alone).key == b"alone"
    assert _puts("inline") - inline == 6 and _puts("stream") == streamed
    assert [r.key for r in results] == [r.key for r in records]
    assert results[2].lease_id and not results[0].lease_id
    for record in [*records, alone]:
        got = client.get(record.key)
        assert [bytes(t.data) for t in got.all_tensors()] == [
            bytes(memoryview(t.data).cast("B")) for t in record.all_tensors()
        ]
    assert client.get(b"small-1").attachments[0].metadata == {"a": "b"}
    assert client.inspect(b"small-2").leases


def test_a_batch_holding_a_large_record_streams_whole(client: StoreClient) -> None:
    small = make_checkpoint(b"s", {"k_int8": 1000})
    large = make_checkpoint(b"l", {"k_int8": INLINE_PAYLOAD_BYTES + 1})
    assert not fits_one_message([PutItem(small), PutItem(large)], [None, None])
    inline, streamed = _puts("inline"), _puts("stream")
    client.put_many([PutItem(small), PutItem(large)])
    assert _puts("stream") - streamed == 2 and _puts("inline") == inline
    assert bytes(client.get(b"l").tensors[0].data) == bytes(large.tensors[0].data)


def test_records_whose_headers_overflow_one_message_stream(client: StoreClient) -> None:
    """Small payloads, but token-id lists that would take one message past the store's limit
    (a long generation's later segments carry all of its tokens)."""
    records = [make_checkpoint(b"long-%d" % i, {"k_int8": 64}) for i in range(4)]
    for record in records:
        record.token_ids = list(range(1 << 20, (1 << 20) + 600_000))
    assert fits_one_message([PutItem(r) for r in records], [None] * 4)
    assert put_records_request([PutItem(r) for r in records], [None] * 4) is None
    inline, streamed = _puts("inline"), _puts("stream")
    client.put_many([PutItem(r) for r in records])
    assert _puts("stream") - streamed == 4 and _puts("inline") == inline
    assert client.get(b"long-3").token_ids[-1] == (1 << 20) + 599_999


def _bad_records() -> dict[str, store_pb2.InlineRecord]:
    record = make_checkpoint(b"bad", {"k_int8": 512})
    request = put_records_request([PutItem(record)], [None])
    assert request is not None
    good = request.records[0]
    short, flipped, both = (store_pb2.InlineRecord() for _ in range(3))
    for bad in (short, flipped, both):
        bad.CopyFrom(good)
    short.payload = good.payload[:-1]
    flipped.payload = bytes([good.payload[0] ^ 1]) + good.payload[1:]
    both.header.region = "some-region"
    both.header.region_offsets.append(0)
    return {"short": short, "checksum": flipped, "region and payload": both}


@pytest.mark.parametrize("case", ["short", "checksum", "region and payload"])
def test_a_bad_record_is_invalid_argument_and_keeps_the_ones_before_it(
    store: InProcessStore, client: StoreClient, case: str
) -> None:
    before, after = (make_checkpoint(k, {"k_int8": 256}) for k in (b"before", b"after"))
    request = put_records_request([PutItem(before), PutItem(after)], [None, None])
    assert request is not None
    request.records.insert(1, _bad_records()[case])
    with grpc.insecure_channel(store.address) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            store_pb2_grpc.StoreStub(channel).PutRecords(request, timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
    assert dict(refused.value.trailing_metadata() or ())["tandem-stored"] == "1"
    assert client.get(b"before").key == b"before"
    for key in (b"bad", b"after"):
        with pytest.raises(NotFound):
            client.get(key)


@pytest.fixture
def older_store(tmp_path: Path) -> Iterator[str]:
    with serve_store_without(tmp_path / "old", "PutRecords") as address:
        yield address


def test_a_store_without_put_records_is_sent_put_many(older_store: str) -> None:
    records = [make_checkpoint(b"old-%d" % i, {"k_int8": 700 + i}) for i in range(5)]
    streamed = _puts("stream")
    with StoreClient(older_store) as client:
        client.put_many([PutItem(r) for r in records[:2]])
        client.put(records[2])

        async def asynchronously() -> None:
            async with AsyncStoreClient(older_store) as aclient:
                await aclient.put_many([PutItem(records[3])])
                await aclient.put(records[4])

        asyncio.run(asynchronously())
        assert _puts("stream") - streamed == 5
        for record in records:
            assert bytes(client.get(record.key).tensors[0].data) == bytes(record.tensors[0].data)


def test_the_asyncio_client_puts_many_alike(store: InProcessStore, client: StoreClient) -> None:
    small = [make_checkpoint(b"a-%d" % i, {"k_int8": 900 + i}) for i in range(3)]
    large = make_checkpoint(b"a-large", {"k_int8": INLINE_PAYLOAD_BYTES + 5})
    inline, streamed = _puts("inline"), _puts("stream")

    async def run() -> tuple[list[PutResult], PutResult, PutManyFailed]:
        async with AsyncStoreClient(store.address) as aclient:
            many = await aclient.put_many([PutItem(r) for r in small])
            alone = await aclient.put(large)
            again = [PutItem(make_checkpoint(b"a-new", {"k_int8": 8})), PutItem(small[1], True)]
            with pytest.raises(PutManyFailed) as refused:
                await aclient.put_many([*again, PutItem(make_checkpoint(b"a-never", {"k": 8}))])
            return many, alone, refused.value

    many, alone, refused = asyncio.run(run())
    assert [r.key for r in many] == [b"a-0", b"a-1", b"a-2"] and alone.key == b"a-large"
    assert refused.stored == 1 and refused.code is not None
    assert refused.code.name == "ALREADY_EXISTS"
    assert _puts("inline") - inline == 4 and _puts("stream") - streamed == 1
    for record in [*small, large]:
        assert bytes(client.get(record.key).tensors[0].data) == bytes(record.tensors[0].data)
    assert client.get(b"a-new").key == b"a-new"
    with pytest.raises(NotFound):
        client.get(b"a-never")
