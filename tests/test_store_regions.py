"""The same-host data plane: a Get written by the store straight into the caller's shared
memory region, against a real store process (store_service/regions.py)."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import pytest

from store_service import region_copy
from tandem_client import Checkpoint, StoreClient, Tensor
from tandem_client.bulk import RegionPut, put_messages
from tandem_client.errors import DataLoss, TandemError, Unavailable
from tandem_client.records import PutItem
from tandem_client.regions import Arrival, RegionHold, RegionReads, SharedRegion
from tandem_wire.auth import token_sha256
from tandem_wire.pb import store_pb2, store_pb2_grpc
from tests.conftest import flip_stored_byte
from tests.servers import ROOT, start_store, wait_until


def _record(key: bytes, blocks: int = 1500) -> Checkpoint:
    rng = secrets.SystemRandom()
    big = bytes(rng.getrandbits(8) for _ in range(1 << 12)) * blocks  # 6 MiB: several chunks
    small = b"tail bytes"
    return Checkpoint(
        key=key,
        kind="object",
        metadata={"note": "regions"},
        tensors=[
            Tensor("big", "uint8", (len(big),), big),
            Tensor("small", "uint8", (len(small),), small),
        ],
    )


def _code(exc: pytest.ExceptionInfo[TandemError]) -> grpc.StatusCode:
    return exc.value.code


def _f(request: store_pb2.RegisterRegionRequest) -> dict[str, Any]:
    return {"name": request.name, "size_bytes": request.size_bytes}


def test_a_get_into_a_region_equals_the_streamed_get_and_refuses_what_it_must(
    tmp_path: Path,
) -> None:
    store = start_store(tmp_path / "store")
    try:
        with StoreClient(store.address) as client, SharedRegion(16 << 20) as region:
            client.put(_record(b"r1"))
            client.register_region(region)
            streamed = client.get(b"r1")
            placed = client.get_into(b"r1", region)
            assert [bytes(t.data) for t in placed.tensors] == [
                bytes(t.data) for t in streamed.tensors
            ]
            assert placed.metadata == streamed.metadata and placed.key == b"r1"
            assert client.stats().regions == 1

            with pytest.raises(TandemError) as small:  # does not fit from this offset
                client.get_into(b"r1", region, offset=(16 << 20) - 1024)
            assert _code(small) == grpc.StatusCode.RESOURCE_EXHAUSTED
            # ...unless asked to stream what does not fit in the span.
            spilled = client.get_into(b"r1", region, span=1 << 20, stream_if_larger=True)
            assert [bytes(t.data) for t in spilled.tensors] == [
                bytes(t.data) for t in streamed.tensors
            ]
            with SharedRegion(1 << 20) as unregistered:
                with pytest.raises(TandemError) as unknown:
                    client.get_into(b"r1", unregistered)
                assert _code(unknown) == grpc.StatusCode.NOT_FOUND
            with grpc.insecure_channel(store.address) as channel:
                stub = store_pb2_grpc.StoreStub(channel)
                named = store_pb2.RegisterRegionRequest(name="tandem-by-name", size_bytes=1 << 20)
                with_proof = store_pb2.RegisterRegionRequest(proof=bytes(32), **_f(named))
                with pytest.raises(grpc.RpcError) as by_name:  # the store opens no file
                    stub.RegisterRegion(with_proof)
                assert by_name.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert "file descriptor" in str(by_name.value.details())
                # Without its fd a name is a ticket, nothing a Get can be written into.
                assert stub.RegisterRegion(named).ticket
                with pytest.raises(grpc.RpcError) as pending:
                    list(stub.Get(store_pb2.GetRequest(key=b"r1", region="tandem-by-name")))
                assert pending.value.code() == grpc.StatusCode.NOT_FOUND
            client.unregister_region(region)
            with pytest.raises(TandemError) as gone:
                client.get_into(b"r1", region)
            assert _code(gone) == grpc.StatusCode.NOT_FOUND
    finally:
        store.stop()


def test_prefixes_put_and_replaced_while_the_store_maps_their_pages_read_back_whole(
    tmp_path: Path,
) -> None:
    """With a region registered the store maps each new prefix's pages after its commit
    (map_warmer.py); records replaced and removed meanwhile must not disturb it or a Get."""
    store = start_store(tmp_path / "store")
    try:
        with StoreClient(store.address) as client, SharedRegion(16 << 20) as region:
            client.register_region(region)
            for round_ in range(6):
                record = _record(b"p")
                record.kind = "prefix"
                client.put(record)  # replaces the last round's while it may be mapped
                if round_ % 2:
                    client.delete(b"p")
                    continue
                placed = client.get_into(b"p", region)
                assert [bytes(t.data) for t in placed.tensors] == [
                    bytes(t.data) for t in record.tensors
                ]
                del placed
            with pytest.raises(TandemError) as gone:  # the last round removed it
                client.get(b"p")
            assert _code(gone) == grpc.StatusCode.NOT_FOUND
    finally:
        store.stop()


def _big_record(key: bytes, mib: int) -> Checkpoint:
    rng = secrets.SystemRandom()
    block = bytes(rng.getrandbits(8) for _ in range(1 << 16))
    halves = [block * (mib * 8), block[::-1] * (mib * 8)]  # mib MiB in two tensors
    return Checkpoint(
        key=key,
        kind="prefix",
        tensors=[Tensor(f"t{i}", "uint8", (len(h),), h) for i, h in enumerate(halves)],
    )


def test_a_progressive_get_announces_verified_parts_in_order_then_the_placement(
    tmp_path: Path,
) -> None:
    store = start_store(tmp_path / "store")
    try:
        with StoreClient(store.address) as client, SharedRegion(64 << 20) as region:
            record = _big_record(b"big", 40)  # 40 MiB: five parts of at least 8 MiB
            client.put(record)
            client.register_region(region)
            with grpc.insecure_channel(store.address) as channel:
                stub = store_pb2_grpc.StoreStub(channel)
                request = store_pb2.GetRequest(
                    key=b"big", region=region.name, region_offset=4096, progressive=True
                )
                answers = list(stub.Get(request))
            kinds = [a.WhichOneof("item") for a in answers]
            assert kinds[0] == "header" and kinds[-1] == "placed"
            verified = [a.progress.verified_bytes for a in answers if a.HasField("progress")]
            assert len(verified) >= 4 and verified == sorted(verified)
            assert verified[-1] == (40 << 20) == answers[-1].placed.payload_bytes
            # Through the client: the tensors view the region once their bytes arrived.
            client.attach_region(region)
            got, hold = client.get_held(b"big", size_hint=(40 << 20), progressive=True)
            assert hold is not None and hold.arrival is not None
            hold.arrival.wait(hold.arrival.total, timeout=30)
            assert [bytes(t.data) for t in got.tensors] == [bytes(t.data) for t in record.tensors]
            hold.release()
    finally:
        store.stop()


def test_a_damaged_chunk_in_a_late_part_stops_a_progressive_get_at_what_was_verified(
    tmp_path: Path,
) -> None:
    data = tmp_path / "store"
    store = start_store(data)
    record = _big_record(b"late", 40)
    with StoreClient(store.address) as client:
        client.put(record)
        client.flush()
    store.stop()
    flip_stored_byte(data, chunk=33, at=7)  # in the fifth 8 MiB part
    store = start_store(data)
    try:
        with StoreClient(store.address) as client, SharedRegion(64 << 20) as region:
            client.attach_region(region)
            got, hold = client.get_held(b"late", size_hint=(40 << 20), progressive=True)
            assert hold is not None and hold.arrival is not None
            hold.arrival.wait(8 << 20, timeout=30)  # the first part is good
            with pytest.raises(TandemError) as damaged:
                hold.arrival.wait(hold.arrival.total, timeout=30)
            assert _code(damaged) == grpc.StatusCode.DATA_LOSS
            assert hold.arrival.verified < 33 << 20  # nothing past the damage counts
            hold.release()
            with pytest.raises(TandemError) as after:  # quarantined: never served again
                client.get(b"late")
            assert _code(after) == grpc.StatusCode.DATA_LOSS
    finally:
        store.stop()


@pytest.mark.parametrize("mib", [6, 3], ids=["copy threads", "inline"])
def test_a_damaged_chunk_read_into_a_region_is_data_loss(tmp_path: Path, mib: int) -> None:
    """Whether the store copies the payload on its copy threads or (up to INLINE_BYTES) on
    the calling one."""
    assert (mib << 20 > region_copy.INLINE_BYTES) == (mib == 6)
    data = tmp_path / "store"
    store = start_store(data)
    with StoreClient(store.address) as client:
        client.put(_record(b"r2", blocks=mib * 256))
        client.flush()
    store.stop()
    flip_stored_byte(data, chunk=2, at=100)
    store = start_store(data)
    try:
        with StoreClient(store.address) as client, SharedRegion(16 << 20) as region:
            client.register_region(region)
            with pytest.raises(TandemError) as damaged:
                client.get_into(b"r2", region)
            assert _code(damaged) == grpc.StatusCode.DATA_LOSS
            assert "not to be used" in str(damaged.value)
            with pytest.raises(TandemError) as after:  # quarantined: never served again
                client.get(b"r2")
            assert _code(after) == grpc.StatusCode.DATA_LOSS
    finally:
        store.stop()


def test_regions_are_the_callers_own_and_lapse_when_the_caller_dies(tmp_path: Path) -> None:
    tokens = {n: secrets.token_urlsafe(24) for n in ("a", "b")}
    auth = tmp_path / "auth.json"
    roles = ["store", "admin"]
    principals = [
        {"name": n, "token_sha256": token_sha256(t), "namespaces": ["*"], "roles": roles}
        for n, t in tokens.items()
    ]
    auth.write_text(json.dumps({"principals": principals}))
    store = start_store(tmp_path / "store", "--auth-file", str(auth))
    try:
        with (
            StoreClient(store.address, token=tokens["a"]) as a,
            StoreClient(store.address, token=tokens["b"]) as b,
            SharedRegion(16 << 20) as region,
        ):
            a.put(_record(b"r3"))
            a.register_region(region)
            with pytest.raises(TandemError) as foreign:  # b names a's region
                b.get_into(b"r3", region)
            assert _code(foreign) == grpc.StatusCode.NOT_FOUND
            a.unregister_region(region)

            # A caller that registers a region and is killed: its lease lapses, the store
            # lets the region go.
            script = (
                "import sys, time; sys.path[:0] = sys.argv[3:]\n"
                "from tandem_client import StoreClient\n"
                "from tandem_client.regions import SharedRegion\n"
                "r = SharedRegion(1 << 20)\n"
                "with StoreClient(sys.argv[1], token=sys.argv[2]) as c:\n"
                "    c.register_region(r, ttl_s=1)\n"
                "print('registered', flush=True)\n"
                "time.sleep(600)\n"
            )
            child = subprocess.Popen(
                [sys.executable, "-c", script, store.address, tokens["a"],
                 str(ROOT), str(ROOT / "clients" / "python")],
                stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            assert child.stdout is not None and child.stdout.readline().strip() == "registered"
            assert a.stats().regions == 1
            child.send_signal(signal.SIGKILL)
            child.wait(10)
            child.stdout.close()
            deadline = time.monotonic() + 30
            while a.stats().regions:
                assert time.monotonic() < deadline, "the dead caller's region was never let go"
                time.sleep(0.2)
            for leftover in Path("/dev/shm").glob(f"tandem-{child.pid}-*"):
                leftover.unlink()  # the killed creator could not unlink its own
    finally:
        store.stop()


def test_a_progressive_holds_span_is_given_back_only_once_the_store_writes_no_more() -> None:
    """Released while the store still copies (a restore abandoned midway), the span stays
    taken until the stream ends: a new read must never share bytes the store still writes."""
    with SharedRegion(1 << 20) as region:
        reads = RegionReads(region, slots=1)
        before = reads.free_bytes
        span = reads.acquire(64 << 10)
        assert span is not None
        arrival = Arrival(64 << 10)
        hold = RegionHold(reads, span, arrival)
        arrival.advance(16 << 10)
        hold.release()
        assert reads.free_bytes == before - span.size
        with pytest.raises(TandemError) as early:  # what never arrived is never waited into
            arrival.end(None)
            arrival.wait(64 << 10, timeout=1)
        assert _code(early) == grpc.StatusCode.DATA_LOSS
        assert reads.free_bytes == before
        arrival.wait(16 << 10, timeout=1)  # what was verified stays usable


def test_puts_through_a_region_store_what_a_streamed_put_would_and_refuse_bad_placements(
    tmp_path: Path,
) -> None:
    store = start_store(tmp_path / "store")
    try:
        with (
            StoreClient(store.address) as near,
            StoreClient(store.address) as far,
            SharedRegion(32 << 20) as region,
        ):
            near.attach_region(region)
            copied = _record(b"copied")  # bytes of its own: copied into a span, then read
            near.put(copied)
            # Bytes already in the region (pushed there by the caller): read where they lie.
            pushed = _record(b"pushed")
            at = 8 << 20
            for tensor in pushed.tensors:
                region.buf[at : at + tensor.nbytes] = bytes(tensor.data)
                tensor.data = region.buf[at : at + tensor.nbytes]
                at += -(-tensor.nbytes // 64) * 64
            near.put_many([PutItem(pushed)])
            for record in (copied, pushed):
                got = far.get(record.key)  # streamed, checked end to end
                assert [bytes(t.data) for t in got.tensors] == [
                    bytes(t.data) for t in record.tensors
                ]

            with grpc.insecure_channel(store.address) as channel:
                stub = store_pb2_grpc.StoreStub(channel)
                header = store_pb2.PutHeader(checkpoint=_record(b"bad").header_pb())

                def put(name: str, offsets: list[int]) -> grpc.StatusCode:
                    h = store_pb2.PutHeader()
                    h.CopyFrom(header)
                    h.region = name
                    h.region_offsets.extend(offsets)
                    with pytest.raises(grpc.RpcError) as refused:
                        stub.Put(iter([store_pb2.PutRequest(header=h)]))
                    return refused.value.code()

                # A region nobody registered (another principal's is not found either:
                # test_regions_are_the_callers_own_and_lapse_when_the_caller_dies).
                assert put("tandem-no-such-region", [4096, 8 << 20]) == grpc.StatusCode.NOT_FOUND
            # Outside the region, the wrong count of offsets, bytes that are not the header's.
            tensors = _record(b"bad")
            for offsets in ([4096, 32 << 20], [4096], [(32 << 20) - 100, 0]):
                with pytest.raises(grpc.RpcError) as outside:
                    near._put(iter(_region_put(tensors, region.name, offsets)))
                assert outside.value.code() == grpc.StatusCode.INVALID_ARGUMENT, offsets
            with pytest.raises(grpc.RpcError) as mismatch:  # the region holds other bytes
                near._put(iter(_region_put(tensors, region.name, [4096, 12 << 20])))
            assert mismatch.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "checksum mismatch" in str(mismatch.value.details())
            with pytest.raises(TandemError) as gone:
                far.get(b"bad")
            assert _code(gone) == grpc.StatusCode.NOT_FOUND
    finally:
        store.stop()


def _region_put(record: Checkpoint, region: str, offsets: list[int]) -> list[Any]:
    return list(put_messages(record, False, 0, "", 1 << 20, RegionPut(region, offsets)))


def test_a_span_whose_get_was_cut_short_is_not_lent_again_until_the_store_is_new() -> None:
    """A Get that ended with a deadline or a lost connection may leave the store copying into
    its span: the span is retired, not freed, until the store is known to be a new process;
    one refused before copying or stopped on a damaged chunk is free at once."""
    with SharedRegion(1 << 20) as region:
        reads = RegionReads(region, slots=1)
        before = reads.free_bytes
        for error, settled in (
            (Unavailable("the store went away"), False),
            (TandemError("deadline", grpc.StatusCode.DEADLINE_EXCEEDED), False),
            (DataLoss("chunk 3 failed its checksum"), True),
        ):
            span = reads.acquire(64 << 10)
            assert span is not None
            arrival = Arrival(64 << 10)
            RegionHold(reads, span, arrival).release()  # before the stream is over
            retired_before = reads.retired_bytes
            arrival.end(error)
            grew = reads.retired_bytes - retired_before
            assert grew == (0 if settled else span.size), error
            assert reads.free_bytes + reads.retired_bytes == before, error
        assert reads.retired_bytes == 2 * (64 << 10)
        reads.reclaim_retired()
        assert reads.free_bytes == before and reads.retired_bytes == 0


def _mapped_bytes(pid: int, name: str) -> int:
    """The bytes of the region's memfd mapped into pid's page tables (its VMA's Rss)."""
    mapped, inside = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if line[:1] in "0123456789abcdef" and "-" in line.split(" ", 1)[0]:
            inside = f"memfd:{name}" in line
        elif inside and line.startswith("Rss:"):
            mapped += int(line.split()[1]) * 1024
    return mapped


def test_a_registered_regions_pages_are_mapped_in_both_processes_before_any_copy(
    tmp_path: Path,
) -> None:
    """store_service/region_prefault.py and SharedRegion: the pages of a region are mapped
    into the store and into the caller ahead of the first copy, which otherwise paid a page
    fault a page (tandem_wire/pages.py); nothing is copied meanwhile."""
    store = start_store(tmp_path / "store")
    try:
        with StoreClient(store.address) as client, SharedRegion(32 << 20) as region:
            wait_until(
                lambda: _mapped_bytes(os.getpid(), region.name) >= region.size,
                what="the caller's mapping of its region populated",
            )
            client.register_region(region)
            assert store.proc is not None
            pid = store.proc.pid
            wait_until(
                lambda: _mapped_bytes(pid, region.name) >= region.size,
                what="the store's mapping of the region populated",
            )
            assert bytes(region.buf[:4096]) == bytes(4096)  # mapped, not written
    finally:
        store.stop()
