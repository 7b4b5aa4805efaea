"""Crashes, corruption, graceful shutdown, map growth and compaction.

Store processes where a kill -9 or a signal is the point; in-process stores elsewhere
(restarts after the crash, map growth, compaction)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tandem_client import DataLoss, NotFound, StoreClient
from tandem_client.store_client import payload_chunks
from tandem_wire.pb import store_pb2, store_pb2_grpc, tensors_pb2
from tests.conftest import flip_stored_byte, make_checkpoint
from tests.servers import serve_store, start_store

MiB = 1 << 20


def _slow_put(
    address: str, key: bytes, nbytes: int, release: threading.Event, first_bytes: int
) -> tuple[threading.Thread, dict[str, Any]]:
    """Streams a put, pausing after `first_bytes` until `release` is set."""
    ckpt = make_checkpoint(key, {"kv_int8": nbytes})
    outcome: dict[str, Any] = {}

    def requests() -> Iterator[store_pb2.PutRequest]:
        yield store_pb2.PutRequest(header=store_pb2.PutHeader(checkpoint=ckpt.header_pb()))
        for offset, data in payload_chunks(ckpt.tensors, MiB):
            if offset == first_bytes:
                release.wait(30)
            yield store_pb2.PutRequest(chunk=tensors_pb2.Chunk(offset=offset, data=bytes(data)))

    def run() -> None:
        with grpc.insecure_channel(address) as channel:
            try:
                outcome["response"] = store_pb2_grpc.StoreStub(channel).Put(requests(), timeout=60)
            except grpc.RpcError as exc:
                outcome["error"] = exc.code()

    thread = threading.Thread(target=run)
    thread.start()
    outcome["checkpoint"] = ckpt
    return thread, outcome


def _wait_for(predicate: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_sigkill_mid_put_leaves_earlier_records_and_no_orphans(store_dir: Path) -> None:
    proc = start_store(store_dir)
    client = StoreClient(proc.address)
    earlier = make_checkpoint(b"earlier", {"k_bf16": 6 * MiB, "v_int8": 3 * MiB + 7})
    client.put(earlier)
    baseline = client.stats().chunk_entries

    release = threading.Event()
    thread, outcome = _slow_put(proc.address, b"interrupted", 64 * MiB, release, 40 * MiB)
    # Wait until the interrupted put's chunks are really in LMDB.
    _wait_for(lambda: client.stats().chunk_entries >= baseline + 32)
    proc.kill()
    release.set()
    thread.join()
    client.close()
    assert outcome["error"] == grpc.StatusCode.UNAVAILABLE

    with serve_store(store_dir) as restarted, StoreClient(restarted.address) as client:
        stats = client.stats()
        assert stats.orphans_collected == 1
        assert stats.chunk_entries == baseline
        assert (stats.records, stats.pending_puts) == (1, 0)
        got = client.get(b"earlier")
        assert [bytes(t.data) for t in got.tensors] == [bytes(t.data) for t in earlier.tensors]
        with pytest.raises(NotFound):
            client.get(b"interrupted")


def test_corrupted_chunk_answers_data_loss_and_quarantines(store_dir: Path) -> None:
    victim = make_checkpoint(b"victim", {"k_bf16": 4 * MiB, "v_int8": 2 * MiB})
    healthy = make_checkpoint(b"healthy", {"k_bf16": 2 * MiB})
    proc = start_store(store_dir)
    with StoreClient(proc.address) as client:
        client.put(victim)
        client.put(healthy)
    assert proc.terminate() == 0

    # Flip a byte in the victim's third stored chunk, through lmdb, in the store's own file.
    flip_stored_byte(store_dir, chunk=2, at=1000)

    with serve_store(store_dir) as restarted, StoreClient(restarted.address) as client:
        # Nothing sent before the error may differ from what was stored.
        channel = grpc.insecure_channel(restarted.address)
        received = bytearray()
        with pytest.raises(grpc.RpcError) as failure:
            for message in store_pb2_grpc.StoreStub(channel).Get(
                store_pb2.GetRequest(key=b"victim")
            ):
                if message.HasField("chunk"):
                    received += message.chunk.data
        channel.close()
        assert failure.value.code() == grpc.StatusCode.DATA_LOSS
        original = b"".join(bytes(t.data) for t in victim.tensors)
        assert bytes(received) == original[: len(received)]
        assert len(received) < 3 * client.stats().chunk_bytes

        with pytest.raises(DataLoss, match="quarantined"):
            client.get(b"victim")
        stats = client.stats()
        assert (stats.quarantined, stats.records) == (1, 1)
        assert client.inspect(b"victim").summary.quarantined
        assert bytes(client.get(b"healthy").tensors[0].data) == bytes(healthy.tensors[0].data)
        client.delete(b"victim")
        assert client.stats().quarantined == 0


def test_sigterm_drains_an_in_flight_put_then_exits(store_dir: Path) -> None:
    proc = start_store(store_dir, "--grace", "30")
    release = threading.Event()
    thread, outcome = _slow_put(proc.address, b"in-flight", 12 * MiB, release, 4 * MiB)
    with StoreClient(proc.address) as client:
        _wait_for(lambda: client.stats().pending_puts == 1)
    assert proc.proc is not None
    proc.proc.send_signal(15)
    time.sleep(0.5)
    assert proc.proc.poll() is None  # still draining
    release.set()
    thread.join()
    assert "error" not in outcome and outcome["response"].payload_bytes == 12 * MiB
    assert proc.proc.wait(30) == 0

    with serve_store(store_dir) as restarted, StoreClient(restarted.address) as client:
        sent = outcome["checkpoint"]
        assert bytes(client.get(b"in-flight").tensors[0].data) == bytes(sent.tensors[0].data)


def test_map_grows_on_demand(store_dir: Path) -> None:
    with (
        serve_store(store_dir, map_size_bytes=4 * MiB) as served,
        StoreClient(served.address) as client,
    ):
        records = [make_checkpoint(b"g%d" % i, {"kv_int8": 8 * MiB}) for i in range(3)]
        for ckpt in records:
            client.put(ckpt)
        stats = client.stats()
        assert stats.map_resizes > 0 and stats.map_size_bytes > 24 * MiB
        for ckpt in records:
            assert bytes(client.get(ckpt.key).tensors[0].data) == bytes(ckpt.tensors[0].data)


def test_compact_shrinks_the_file_and_keeps_records(store_dir: Path) -> None:
    with serve_store(store_dir) as served, StoreClient(served.address) as client:
        records = [make_checkpoint(b"c%d" % i, {"kv_int8": 4 * MiB}) for i in range(10)]
        for ckpt in records:
            client.put(ckpt)
        for ckpt in records[2:]:
            client.delete(ckpt.key)
        before, after = client.compact()
        assert after < before / 2
        for ckpt in records[:2]:
            assert bytes(client.get(ckpt.key).tensors[0].data) == bytes(ckpt.tensors[0].data)
        extra = make_checkpoint(b"after-compact", {"kv_int8": MiB})
        client.put(extra)
        assert bytes(client.get(b"after-compact").tensors[0].data) == bytes(extra.tensors[0].data)
