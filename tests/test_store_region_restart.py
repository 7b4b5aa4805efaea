"""Spans of region Gets cut short come back (issue 32, item 1): a span the store may still
be copying into is retired, and freed once the store's answers show no copy can still
write into it: a new store process (SIGKILLed mid-copy and restarted), or an earlier
registration with no copy left running (tandem_client/regions.py, RegionReads.settle)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from tandem_client import Checkpoint, StoreClient, Tensor
from tandem_client.errors import TandemError
from tandem_client.regions import RegionReads, SharedRegion
from tests.servers import start_store

MiB = 1 << 20
PAYLOAD = 48 * MiB
WAIT_S = 30.0


def _record(key: bytes) -> Checkpoint:
    block = secrets.token_bytes(MiB)
    halves = [block * (PAYLOAD // MiB // 2)] * 2
    return Checkpoint(
        key=key,
        kind="prefix",
        tensors=[Tensor(f"t{i}", "uint8", (len(h),), h) for i, h in enumerate(halves)],
    )


def _wait_for(what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _reads(client: StoreClient) -> RegionReads:
    reads = client._reads
    assert reads is not None
    return reads


def test_a_get_cut_by_a_store_kill_gives_its_span_back_once_the_store_is_new(
    tmp_path: Path,
) -> None:
    store = start_store(tmp_path / "store", "--region-copy-threads", "1")
    port = int(store.address.rsplit(":", 1)[1])
    try:
        with StoreClient(store.address) as writer:
            writer.put(_record(b"big"))
            writer.flush()
        with StoreClient(store.address, timeout=30) as client, SharedRegion(64 * MiB) as region:
            client.attach_region(region, slots=1, ttl_s=3)  # renewed every second
            reads = _reads(client)
            whole = reads.free_bytes
            for _ in range(5):  # until the kill lands before the copy's end
                got, hold = client.get_held(b"big", size_hint=PAYLOAD, progressive=True)
                store.kill()
                assert hold is not None and hold.arrival is not None
                arrival = hold.arrival
                del got
                hold.release()
                _wait_for("the cut Get never ended", lambda a=arrival: a.ended)  # type: ignore[misc]
                if arrival.error is not None:
                    break
                store.start_on(port)  # the copy won the race: again
            else:
                pytest.fail("every copy finished before the store was killed")
            assert arrival.error.code == grpc.StatusCode.UNAVAILABLE
            assert reads.retired_bytes > 0  # the store may have been writing into it
            store.start_on(port)
            # The renewals meet a new store process: the old one's copies are over.
            _wait_for("the retired span never came back", lambda: not reads.retired_bytes)
            assert reads.free_bytes == whole
            got, hold = client.get_held(b"big", size_hint=PAYLOAD)
            assert hold is not None and got.payload_bytes == PAYLOAD
            del got
            hold.release()
    finally:
        store.stop()


def test_a_get_cut_by_its_deadline_gives_its_span_back_once_no_copy_runs(
    tmp_path: Path,
) -> None:
    """No restart: the client registers the region anew, so no Get naming the old
    registration can start copying, and frees the span once none still copies."""
    store = start_store(tmp_path / "store")
    try:
        with StoreClient(store.address, timeout=30) as client, SharedRegion(64 * MiB) as region:
            client.put(_record(b"big"))
            client.attach_region(region, slots=1, ttl_s=3)
            reads = _reads(client)
            whole, first = reads.free_bytes, region.registration
            client.timeout = 0.001
            with pytest.raises(TandemError) as cut:
                client.get_held(b"big", size_hint=PAYLOAD)
            client.timeout = 30
            assert cut.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert reads.retired_bytes > 0
            _wait_for("the retired span never came back", lambda: not reads.retired_bytes)
            assert reads.free_bytes == whole and region.registration != first
            got = client.get(b"big")
            assert got.payload_bytes == PAYLOAD and client.region_reads == 1
    finally:
        store.stop()


def test_retired_spans_settle_by_store_process_and_registration() -> None:
    with SharedRegion(MiB) as region:
        region.store_instance, region.registration = "one", 1
        reads = RegionReads(region, slots=4)
        whole = reads.free_bytes
        span = reads.acquire()
        assert span is not None
        reads.retire(span)  # named ("one", 1)
        assert reads.needs_new_registration()
        reads.settle("one", 1, 0)  # still the registration its Get named: may be copying
        reads.settle("one", 2, 1)  # superseded, but a copy into it still runs
        assert reads.retired_bytes == span.size
        reads.settle("one", 2, 0)
        assert reads.retired_bytes == 0 and reads.free_bytes == whole
        span = reads.acquire()
        assert span is not None
        reads.retire(span, ("one", 2))
        reads.settle("two", 2, 5)  # another store process: nothing of the old one runs
        assert reads.retired_bytes == 0 and reads.free_bytes == whole
