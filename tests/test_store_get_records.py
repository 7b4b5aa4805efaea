"""Store.GetRecords: several records read into the caller's region in one call (a resume reads
a checkpoint chain's segments with it, tests/test_engine_domain.py and test_checkpoints.py).

- Each record found lies in its span, bytes equal to a Get's; a missing one says so; the
  spans of records not found come back at once, the others when their holds are released.
- A damaged record is reported damaged (and quarantined: a Get then is DATA_LOSS) beside
  the others, which are served.
- A record larger than the span its hint took is read by a Get of its own, with the same bytes.
- More than 64 reads is INVALID_ARGUMENT; a region the store does not know is NOT_FOUND.
- A store of the release before (no GetRecords) is asked a Get a key, with the same answers.
- Tenancy and role: tests/test_store_writer_role.py.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from store_service.same_host_gets import MAX_RECORD_READS
from tandem_client import StoreClient
from tandem_client.errors import DataLoss
from tandem_client.regions import SharedRegion
from tandem_wire.pb import store_pb2, store_pb2_grpc
from tests.conftest import flip_stored_byte, make_checkpoint
from tests.older_store import serve_store_without
from tests.servers import start_store

REGION_BYTES = 32 << 20
SIZES = {b"small": 300_000, b"two chunks": 1_500_000, b"larger": 6 << 20}


def _put_records(client: StoreClient) -> dict[bytes, list[bytes]]:
    """The records of SIZES, and each one's tensors' bytes."""
    stored = {}
    for key, nbytes in SIZES.items():
        record = make_checkpoint(key, {"a_int8": nbytes // 2, "b_bf16": nbytes - nbytes // 2})
        client.put(record)
        stored[key] = [bytes(t.data) for t in record.tensors]
    return stored


def _read_in_one_call(client: StoreClient, stored: dict[bytes, list[bytes]]) -> None:
    keys = [b"larger", b"missing", b"small", b"two chunks"]
    reads = client.get_held_many(keys, "", [SIZES.get(k, 4096) for k in keys])
    assert [r.checkpoint is not None for r in reads] == [True, False, True, True]
    assert not any(r.damaged for r in reads)
    for key, read in zip(keys, reads, strict=True):
        if read.checkpoint is None:
            continue
        assert read.checkpoint.key == key
        assert [bytes(t.data) for t in read.checkpoint.tensors] == stored[key]
        assert read.hold is not None  # viewing the region until released
        read.hold.release()


def _whole_region_free(client: StoreClient) -> bool:
    span = client.reserve_span(REGION_BYTES - (1 << 20))
    if span is None:
        return False
    span.release()
    return True


def test_records_read_in_one_call_equal_their_gets(tmp_path: Path) -> None:
    store = start_store(tmp_path / "store")
    try:
        with StoreClient(store.address) as client, SharedRegion(REGION_BYTES) as region:
            stored = _put_records(client)
            client.attach_region(region, slots=8)
            _read_in_one_call(client, stored)
            assert client.read_routes == {"region": 3}
            assert _whole_region_free(client)  # every span came back
            # A hint short of the payload: that record is read by a Get of its own.
            (short,) = client.get_held_many([b"larger"], "", [1 << 20])
            assert short.checkpoint is not None
            assert [bytes(t.data) for t in short.checkpoint.tensors] == stored[b"larger"]
            if short.hold is not None:
                short.hold.release()
            assert _whole_region_free(client)
    finally:
        store.stop()


def test_a_damaged_record_is_reported_beside_the_ones_served(tmp_path: Path) -> None:
    data = tmp_path / "store"
    store = start_store(data)
    with StoreClient(store.address) as client:
        stored = _put_records(client)  # record ids in put order: "small" holds chunk 0
        client.flush()
    store.stop()
    flip_stored_byte(data, chunk=0, at=11)
    store = start_store(data)
    try:
        with StoreClient(store.address) as client, SharedRegion(REGION_BYTES) as region:
            client.attach_region(region, slots=8)
            keys = [b"small", b"two chunks"]
            reads = client.get_held_many(keys, "", [SIZES[k] for k in keys])
            assert (reads[0].checkpoint, reads[0].damaged) == (None, True)
            good = reads[1]
            assert good.checkpoint is not None and good.hold is not None
            assert [bytes(t.data) for t in good.checkpoint.tensors] == stored[b"two chunks"]
            good.hold.release()
            with pytest.raises(DataLoss):  # quarantined: never served again
                client.get(b"small")
            assert _whole_region_free(client)
    finally:
        store.stop()


def test_too_many_reads_or_an_unknown_region_are_refused(tmp_path: Path) -> None:
    store = start_store(tmp_path / "store")
    try:
        with grpc.insecure_channel(store.address) as channel:
            stub = store_pb2_grpc.StoreStub(channel)
            read = store_pb2.RegionRead(key=b"k", region_offset=4096, region_bytes=4096)
            too_many = store_pb2.GetRecordsRequest(
                region="nobody", reads=[read] * (MAX_RECORD_READS + 1)
            )
            with pytest.raises(grpc.RpcError) as caught:
                stub.GetRecords(too_many)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(grpc.RpcError) as caught:
                stub.GetRecords(store_pb2.GetRecordsRequest(region="nobody", reads=[read]))
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            assert "no region" in str(caught.value.details())
    finally:
        store.stop()


def test_a_store_without_get_records_is_asked_a_get_a_key(tmp_path: Path) -> None:
    with (
        serve_store_without(tmp_path / "old", "GetRecords") as address,
        StoreClient(address) as client,
        SharedRegion(REGION_BYTES) as region,
    ):
        stored = _put_records(client)
        client.attach_region(region, slots=8)
        _read_in_one_call(client, stored)
        assert not client._get_records_known
        assert _whole_region_free(client)
