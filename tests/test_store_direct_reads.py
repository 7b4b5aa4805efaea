"""Direct Gets: a same-host caller of every namespace reads a record's chunks straight out of
the store's data file while a lease keeps them there (store_service/direct_reads.py,
tandem_client/direct.py), against a real store process."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import grpc
import pytest

from tandem_client import Checkpoint, StoreClient, Tensor
from tandem_client.direct import DirectHold
from tandem_client.errors import TandemError
from tandem_client.regions import SharedRegion
from tandem_wire.auth import token_sha256
from tests.conftest import flip_stored_byte
from tests.servers import start_store


def _record(key: bytes, mib: int = 6) -> Checkpoint:
    rng = secrets.SystemRandom()
    big = bytes(rng.getrandbits(8) for _ in range(1 << 12)) * (256 * mib)
    return Checkpoint(
        key=key,
        kind="object",
        metadata={"note": "direct"},
        tensors=[
            Tensor("big", "uint8", (len(big),), big),
            Tensor("small", "uint8", (10,), b"tail bytes"),
            Tensor("empty", "uint8", (0,), b""),
        ],
    )


def _direct(
    client: StoreClient, key: bytes, size: int, namespace: str = ""
) -> tuple[Checkpoint, DirectHold]:
    read = client.get_routed(key, namespace, size_hint=size, progressive=True)
    assert read.route == "direct", read.route
    assert isinstance(read.hold, DirectHold)
    return read.checkpoint, read.hold


def _until(predicate, what: str, deadline_s: float = 30.0) -> None:  # noqa: ANN001
    end = time.monotonic() + deadline_s
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_direct_get_reads_the_records_bytes_and_releases_its_lease(tmp_path: Path) -> None:
    store = start_store(tmp_path / "store")
    try:
        with StoreClient(store.address) as client, SharedRegion(32 << 20) as region:
            record = _record(b"d1")
            client.put(record)
            client.attach_region(region, direct=True)
            got, hold = _direct(client, b"d1", record.payload_bytes)
            assert got.metadata == record.metadata
            assert client.stats().direct_reads == 1  # the lease holds its pages
            hold.arrival.wait(hold.arrival.total, timeout=30)  # every chunk checked
            for stored, read in zip(record.tensors, got.tensors, strict=True):
                assert hold.copy(read).tobytes() == bytes(stored.data)
            assert len(hold.segments(got.tensors[0])) == 6  # 1 MiB chunks, in order
            assert hold.release() is True and hold.release() is True  # once
            assert client.stats().direct_reads == 0
            assert client.read_routes == {"direct": 1}
            # Replaced meanwhile: the next direct Get reads the new bytes, not the old pages.
            newer = _record(b"d1", mib=2)
            client.put(newer)
            got, hold = _direct(client, b"d1", newer.payload_bytes)
            hold.arrival.wait(hold.arrival.total, timeout=30)
            assert hold.copy(got.tensors[0]).tobytes() == bytes(newer.tensors[0].data)
            assert hold.release() is True
    finally:
        store.stop()


def test_a_damaged_chunk_read_directly_is_data_loss_and_quarantined(tmp_path: Path) -> None:
    data = tmp_path / "store"
    store = start_store(data)
    record = _record(b"bad")
    with StoreClient(store.address) as client:
        client.put(record)
        client.flush()
    store.stop()
    flip_stored_byte(data, chunk=3, at=11)
    store = start_store(data)
    try:
        with StoreClient(store.address) as client, SharedRegion(32 << 20) as region:
            client.attach_region(region, direct=True)
            _, hold = _direct(client, b"bad", record.payload_bytes)
            with pytest.raises(TandemError) as damaged:
                hold.arrival.wait(hold.arrival.total, timeout=30)
            assert damaged.value.code == grpc.StatusCode.DATA_LOSS
            assert "not to be used" in str(damaged.value)
            assert hold.release() is False  # the store ended the lease with the verdict
            with pytest.raises(TandemError) as after:  # quarantined: never served again
                client.get(b"bad")
            assert after.value.code == grpc.StatusCode.DATA_LOSS
    finally:
        store.stop()


def test_a_lapsed_lease_says_so_and_the_store_keeps_no_pages_for_it(tmp_path: Path) -> None:
    store = start_store(tmp_path / "store", "--direct-read-ttl", "0.2")
    try:
        with StoreClient(store.address) as client, SharedRegion(32 << 20) as region:
            record = _record(b"slow", mib=2)
            client.put(record)
            client.attach_region(region, direct=True)
            _, hold = _direct(client, b"slow", record.payload_bytes)
            _until(lambda: client.stats().direct_reads_lapsed == 1, "the lease to lapse")
            assert client.stats().direct_reads == 0
            assert hold.release() is False  # what was read is not to be used
    finally:
        store.stop()


def test_only_a_principal_of_every_namespace_is_given_the_data_file(tmp_path: Path) -> None:
    tenant, engine = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    auth = tmp_path / "auth.json"
    principals = [
        {
            "name": "t",
            "token_sha256": token_sha256(tenant),
            "namespaces": ["t"],
            "roles": ["store"],
        },
        {
            "name": "e",
            "token_sha256": token_sha256(engine),
            "namespaces": ["*"],
            "roles": ["store"],
        },
    ]
    auth.write_text(json.dumps({"principals": principals}))
    store = start_store(tmp_path / "store", "--auth-file", str(auth))
    try:
        record = _record(b"k", mib=2)
        with StoreClient(store.address, token=tenant) as client, SharedRegion(16 << 20) as region:
            client.put(record)
            client.attach_region(region, direct=True)
            read = client.get_routed(b"k", size_hint=record.payload_bytes, progressive=True)
            assert read.route == "region"  # no data file: its Gets are copied into its region
            assert read.hold is not None
            read.hold.release()
        with StoreClient(store.address, token=engine) as client, SharedRegion(16 << 20) as region:
            client.attach_region(region, direct=True)
            got, hold = _direct(client, b"k", record.payload_bytes, namespace="t")
            hold.arrival.wait(hold.arrival.total, timeout=30)
            assert hold.copy(got.tensors[0]).tobytes() == bytes(record.tensors[0].data)
            assert hold.release() is True
    finally:
        store.stop()


def test_after_a_compaction_reads_go_through_the_region_until_registered_again(
    tmp_path: Path,
) -> None:
    store = start_store(tmp_path / "store")
    try:
        with StoreClient(store.address) as client, SharedRegion(32 << 20) as region:
            record = _record(b"c", mib=2)
            client.put(record)
            client.attach_region(region, direct=True)
            _, hold = _direct(client, b"c", record.payload_bytes)
            assert hold.release() is True
            client.compact()  # another data file now
            read = client.get_routed(b"c", size_hint=record.payload_bytes, progressive=True)
            assert read.route == "region"  # the placement named the new file: not read
            assert read.hold is not None and read.hold.arrival is not None
            read.hold.arrival.wait(read.hold.arrival.total, timeout=30)
            assert bytes(read.checkpoint.tensors[0].data) == bytes(record.tensors[0].data)
            read.hold.release()
            client.register_region(region)  # a fresh handover: the new file comes with it
            got, hold = _direct(client, b"c", record.payload_bytes)
            hold.arrival.wait(hold.arrival.total, timeout=30)
            assert hold.copy(got.tensors[0]).tobytes() == bytes(record.tensors[0].data)
            assert hold.release() is True
    finally:
        store.stop()
