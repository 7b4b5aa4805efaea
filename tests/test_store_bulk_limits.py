"""Bulk calls no caller can pile up (issue 32: "two connections holding 16 Put streams each
that never send take all 32 store workers"; store_service/fair_share.py): Puts that never
send are refused past their kind's share and the store-wide bulk cap, so Get, Lookup, Stats
and health still answer, with the idle timeout far away; with auth, a principal past its
share is refused while another is served."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

from tandem_client import Checkpoint, StoreClient, Tensor
from tandem_wire.auth import token_sha256
from tandem_wire.pb import store_pb2, store_pb2_grpc
from tests.servers import start_store
from tests.test_store_idle_puts import small_calls_answer

WORKERS = 32  # the store's default --max-workers
PER_CONNECTION = WORKERS // 2  # its default --max-bulk-calls-per-connection
PUT_SHARE = 16  # default: the 24 bulk calls (32 less 8 kept for small ones) less a third
OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1)]
ANSWER_WITHIN_S = 8.0
WAIT_S = 30.0


def _silent(release: threading.Event) -> Iterator[store_pb2.PutRequest]:
    """A Put's request stream that sends nothing until the test ends."""
    release.wait()
    yield from ()


def _refused(calls: list[grpc.Future]) -> list[grpc.RpcError]:
    errors = [c.exception() for c in calls if c.done()]
    return [e for e in errors if isinstance(e, grpc.RpcError)]


def _wait_refused(calls: list[grpc.Future], count: int) -> list[grpc.RpcError]:
    deadline = time.monotonic() + WAIT_S
    while len(_refused(calls)) < count:
        assert time.monotonic() < deadline, f"{len(_refused(calls))} refused, not {count}"
        time.sleep(0.05)
    return _refused(calls)


def test_idle_put_streams_leave_get_lookup_stats_and_health_answering(tmp_path: Path) -> None:
    store = start_store(tmp_path / "store", "--put-idle-timeout-s", "300")
    release = threading.Event()
    channels = [grpc.insecure_channel(store.address, options=OWN_CONNECTION) for _ in range(2)]
    try:
        with StoreClient(store.address) as client:
            small = Checkpoint(
                key=b"small", kind="object", tensors=[Tensor("t", "uint8", (4,), b"abcd")]
            )
            client.put(small)
        silent = [
            store_pb2_grpc.StoreStub(channel).Put.future(_silent(release), timeout=120)
            for channel in channels
            for _ in range(PER_CONNECTION)
        ]
        refused = _wait_refused(silent, 2 * PER_CONNECTION - PUT_SHARE)
        for error in refused:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            assert "--max-bulk-calls" in (error.details() or ""), error.details()
        assert sum(not c.done() for c in silent) == PUT_SHARE  # held, each a worker

        assert small_calls_answer(store.address).records == 1
        with StoreClient(store.address, timeout=ANSWER_WITHIN_S) as client:
            assert bytes(client.get(b"small").tensors[0].data) == b"abcd"
    finally:
        release.set()
        for channel in channels:
            channel.close()
        store.stop()


def test_a_principal_past_its_share_is_refused_while_another_is_served(tmp_path: Path) -> None:
    tokens = {n: secrets.token_urlsafe(24) for n in ("greedy", "other")}
    principals = [
        {"name": n, "token_sha256": token_sha256(t), "namespaces": ["*"], "roles": ["store"]}
        for n, t in tokens.items()
    ]
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"principals": principals}))
    store = start_store(
        tmp_path / "store",
        "--auth-file",
        str(auth),
        "--max-bulk-calls-per-principal",
        "3",
        "--put-idle-timeout-s",
        "300",
    )
    release = threading.Event()
    greedy = [StoreClient(store.address, token=tokens["greedy"]) for _ in range(2)]
    try:
        silent = [
            client._put.future(_silent(release), timeout=120) for client in greedy for _ in range(2)
        ]
        (refused,) = _wait_refused(silent, 1)  # 4 over two connections: one too many
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-bulk-calls-per-principal" in (refused.details() or "")
        with StoreClient(store.address, token=tokens["other"], timeout=ANSWER_WITHIN_S) as other:
            data = b"other's"
            other.put(
                Checkpoint(key=b"o", kind="object", tensors=[Tensor("t", "uint8", (7,), data)])
            )
            assert bytes(other.get(b"o").tensors[0].data) == data
    finally:
        release.set()
        for client in greedy:
            client.close()
        store.stop()
