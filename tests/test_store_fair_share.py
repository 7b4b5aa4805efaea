"""One connection cannot hold the store's workers: Gets opened and never read count against
their connection's bulk-call limit, the next one is RESOURCE_EXHAUSTED, and a client on
another connection is served meanwhile (store_service/fair_share.py)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from tandem_client import Checkpoint, StoreClient, Tensor
from tandem_wire.pb import store_pb2, store_pb2_grpc
from tests.servers import start_store

# Its own connection (not the process-wide subchannel pool) and a small receive window, so
# unread Gets block the store's workers early.
STALLED_CLIENT = [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", 64 << 10),
]
LIMIT = 4


def test_unread_gets_hold_only_their_connections_share(tmp_path: Path) -> None:
    store = start_store(
        tmp_path / "store", "--max-workers", "16", "--max-bulk-calls-per-connection", str(LIMIT)
    )
    try:
        big = bytes(range(256)) * (16 << 12)  # 16 MiB
        with StoreClient(store.address) as client:
            client.put(
                Checkpoint(
                    key=b"big", kind="object", tensors=[Tensor("t", "uint8", (len(big),), big)]
                )
            )
            client.put(
                Checkpoint(
                    key=b"small", kind="object", tensors=[Tensor("t", "uint8", (4,), b"abcd")]
                )
            )

        channel = grpc.insecure_channel(store.address, options=STALLED_CLIENT)
        get = store_pb2_grpc.StoreStub(channel).Get
        request = store_pb2.GetRequest(key=b"big", max_chunk_bytes=64 << 10)
        stalled = [get(request, timeout=60) for _ in range(LIMIT)]  # opened, never read
        for call in stalled:
            next(call)  # each is being served (its header arrived)
        with pytest.raises(grpc.RpcError) as refused:
            next(get(request, timeout=60))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-bulk-calls-per-connection" in (refused.value.details() or "")

        # Another connection is served within a 1 s deadline.
        with StoreClient(store.address, timeout=1) as other:
            assert bytes(other.get(b"small").tensors[0].data) == b"abcd"

        # The stalled calls end: their slots are free again.
        for call in stalled:
            call.cancel()
        deadline = time.monotonic() + 30
        while True:
            try:
                got = list(get(request, timeout=60))
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the cancelled calls never released"
                time.sleep(0.1)
        assert len(got) > 1
        channel.close()
    finally:
        store.stop()
