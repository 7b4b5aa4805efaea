"""Put streams that send nothing cannot hold the store's workers: after
`--put-idle-timeout-s` without a message the store ends each one with DEADLINE_EXCEEDED
(naming the setting) and its worker serves others again (store_service/put_session.py).

Two connections open as many silent Puts as the store lets each have (half the default 32
workers each: all of them, were it not for the Puts' share of bulk calls, which refuses the
second 16 at once: tests/test_store_bulk_limits.py); Get, Lookup, Stats and health still
answer within a deadline, the silent Puts that were let in end with the documented status,
and a Put on one of those connections works afterwards (their bulk-call slots were given
back)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem_client import Checkpoint, StoreClient, Tensor
from tandem_wire.pb import store_pb2, store_pb2_grpc, tensors_pb2
from tests.servers import serve_store, start_store

WORKERS = 32  # the store's default --max-workers
PER_CONNECTION = WORKERS // 2  # its default --max-bulk-calls-per-connection
# Each its own connection, not the process-wide subchannel pool.
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
ANSWER_WITHIN_S = 8.0
MiB = 1 << 20  # far over the 1 s idle timeout; without it the workers stay held


def _silent(release: threading.Event) -> Iterator[store_pb2.PutRequest]:
    """A Put's request stream that sends nothing until the test ends."""
    release.wait()
    yield from ()


def test_silent_puts_time_out_and_give_their_workers_back(tmp_path: Path) -> None:
    store = start_store(tmp_path / "store", "--put-idle-timeout-s", "1")
    release = threading.Event()
    channels = [grpc.insecure_channel(store.address, options=OWN_CONNECTION) for _ in range(2)]
    try:
        with StoreClient(store.address) as client:
            client.put(
                Checkpoint(
                    key=b"small", kind="object", tensors=[Tensor("t", "uint8", (4,), b"abcd")]
                )
            )
        silent = [
            store_pb2_grpc.StoreStub(channel).Put.future(_silent(release), timeout=60)
            for channel in channels
            for _ in range(PER_CONNECTION)
        ]

        assert small_calls_answer(store.address).records >= 1

        # Every silent Put let in (it held a worker) was ended by the store, not by the
        # client's own 60 s deadline: DEADLINE_EXCEEDED naming the setting. Those past the
        # Puts' share of bulk calls were refused at once.
        codes = []
        for call in silent:
            error = call.exception(timeout=ANSWER_WITHIN_S)
            assert isinstance(error, grpc.RpcError), error
            codes.append(error.code())
            if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                continue
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
            assert "--put-idle-timeout-s" in (error.details() or ""), error.details()
        assert codes.count(grpc.StatusCode.DEADLINE_EXCEEDED) >= PER_CONNECTION, codes

        # The connection's bulk-call slots came back: a whole Put on one of them works.
        payload = bytes(range(256)) * 64
        ckpt = Checkpoint(
            key=b"after", kind="object", tensors=[Tensor("t", "uint8", (len(payload),), payload)]
        )
        messages = [
            store_pb2.PutRequest(header=store_pb2.PutHeader(checkpoint=ckpt.header_pb())),
            store_pb2.PutRequest(chunk=tensors_pb2.Chunk(offset=0, data=payload)),
        ]
        put = store_pb2_grpc.StoreStub(channels[0]).Put
        assert put(iter(messages), timeout=ANSWER_WITHIN_S).key == b"after"
        with StoreClient(store.address) as client:
            assert bytes(client.get(b"after").tensors[0].data) == payload
    finally:
        release.set()
        for channel in channels:
            channel.close()
        store.stop()


def small_calls_answer(address: str) -> store_pb2.StatsResponse:
    """Get, Lookup, Stats and health each answer within ANSWER_WITHIN_S on a connection of
    their own (the record b"small" must exist); returns the Stats."""
    with grpc.insecure_channel(address, options=OWN_CONNECTION) as other:
        stub = store_pb2_grpc.StoreStub(other)
        got = list(stub.Get(store_pb2.GetRequest(key=b"small"), timeout=ANSWER_WITHIN_S))
        assert got[0].HasField("header")
        stub.Lookup(
            store_pb2.LookupRequest(
                model_id="m", block_size=16, block_hashes=[bytes(32)], token_count=16
            ),
            timeout=ANSWER_WITHIN_S,
        )
        stats: store_pb2.StatsResponse = store_pb2_grpc.StoreAdminStub(other).Stats(
            store_pb2.StatsRequest(), timeout=ANSWER_WITHIN_S
        )
        health = health_pb2_grpc.HealthStub(other).Check(
            health_pb2.HealthCheckRequest(), timeout=ANSWER_WITHIN_S
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    return stats


def _stalled_after(
    messages: list[store_pb2.PutRequest], release: threading.Event
) -> Iterator[store_pb2.PutRequest]:
    """Sends `messages`, then nothing until the test ends."""
    yield from messages
    release.wait()


def _readers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "store-put-reader"]


def test_an_ended_silent_put_leaves_no_thread_behind(tmp_path: Path) -> None:
    """The store's reader of a silent stream ends with the call, though the client still
    holds its side open; a silent PutMany ends the same way; a Put that stops halfway is
    discarded as any aborted Put is (its reservation and written chunks go)."""
    release = threading.Event()
    with (
        serve_store(tmp_path / "store", max_workers=8, put_idle_timeout_s=0.5) as store,
        grpc.insecure_channel(store.address, options=OWN_CONNECTION) as channel,
    ):
        try:
            stub = store_pb2_grpc.StoreStub(channel)
            payload = bytes(range(256)) * (40 << 12)  # 10 MiB: over one 8 MiB write group
            half = [
                store_pb2.PutRequest(
                    header=store_pb2.PutHeader(
                        checkpoint=Checkpoint(
                            key=b"half",
                            kind="object",
                            tensors=[Tensor("t", "uint8", (len(payload),), payload)],
                        ).header_pb()
                    )
                ),
                *(
                    store_pb2.PutRequest(
                        chunk=tensors_pb2.Chunk(offset=offset, data=payload[offset : offset + MiB])
                    )
                    for offset in range(0, 9 * MiB, MiB)
                ),
            ]
            calls = [
                stub.Put.future(_silent(release), timeout=60),
                stub.PutMany.future(_silent(release), timeout=60),
                stub.Put.future(_stalled_after(half, release), timeout=60),
            ]
            for call in calls:
                error = call.exception(timeout=ANSWER_WITHIN_S)
                assert isinstance(error, grpc.RpcError), error
                assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
            deadline = time.monotonic() + ANSWER_WITHIN_S
            while _readers():
                assert time.monotonic() < deadline, f"readers still blocked: {_readers()}"
                time.sleep(0.05)
            state = store.store.state
            chunks = state.storage.db["chunks"]
            deadline = time.monotonic() + ANSWER_WITHIN_S
            while store.store.capacity.pending_bytes or state.storage.read(
                lambda txn: txn.stat(chunks)["entries"]
            ):
                assert time.monotonic() < deadline, "the stopped Put was not discarded"
                time.sleep(0.05)
            with pytest.raises(grpc.RpcError) as missing:
                list(stub.Get(store_pb2.GetRequest(key=b"half"), timeout=ANSWER_WITHIN_S))
            assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            release.set()
