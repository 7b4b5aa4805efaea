"""The Python clients: asyncio twins, typed results and errors, retries while a server starts."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from tandem_client import (
    AsyncEngineClient,
    AsyncStoreClient,
    Checkpoint,
    EngineClient,
    Generation,
    GenerationChunk,
    NotFound,
    PutResult,
    RecordSummary,
    StoreClient,
    Unavailable,
)
from tandem_wire.pb import engine_pb2, store_pb2
from tests.conftest import make_checkpoint
from tests.servers import InProcessStore, ServiceProcess, free_port


def test_async_engine_client_matches_the_sync_one(
    engine: ServiceProcess, engine_client: EngineClient
) -> None:
    async def run() -> tuple[list[GenerationChunk], Generation, str, engine_pb2.ModelInfoResponse]:
        async with AsyncEngineClient(engine.address) as client:
            chunks = [c async for c in client.stream("Hello world", max_tokens=10, ignore_eos=True)]
            whole = await client.generate("Hello world", max_tokens=10, ignore_eos=True)
            ids = await client.tokenize("déjà vu")
            text = await client.detokenize(ids)
            info = await client.model_info()
            return chunks, whole, text, info

    chunks, whole, text, info = asyncio.run(run())
    sync = engine_client.generate("Hello world", max_tokens=10, ignore_eos=True)
    assert [t for c in chunks for t in c.token_ids] == sync.token_ids == whole.token_ids
    assert chunks[-1].finish_reason == "length" and chunks[-1].usage is not None
    assert text == "déjà vu" and info.model_id.startswith("tandem-tiny@")


def test_async_store_client_round_trip(client: StoreClient, store: InProcessStore) -> None:
    ckpt = make_checkpoint(b"async-key", {"k_bf16": 3 << 20, "v_int8": 12345})

    async def run() -> tuple[
        PutResult, Checkpoint, list[RecordSummary], store_pb2.StatsResponse, bool, int
    ]:
        async with AsyncStoreClient(store.address) as aclient:
            put = await aclient.put(ckpt)
            got = await aclient.get(b"async-key")
            listed, _ = await aclient.list()
            stats = await aclient.stats()
            durable = await aclient.flush()
            freed = await aclient.delete(b"async-key")
            with pytest.raises(NotFound):
                await aclient.get(b"async-key")
            return put, got, listed, stats, durable, freed

    put, got, listed, stats, durable, freed = asyncio.run(run())
    assert put.payload_bytes == (3 << 20) + 12345 and not put.replaced
    assert [bytes(t.data) for t in got.tensors] == [bytes(t.data) for t in ckpt.tensors]
    assert [r.key for r in listed] == [b"async-key"] and stats.records == 1
    assert durable and freed == put.payload_bytes


def test_errors_keep_their_status(store: InProcessStore) -> None:
    with StoreClient(store.address) as client:
        with pytest.raises(NotFound) as failure:
            client.inspect(b"missing")
    assert failure.value.code.name == "NOT_FOUND" and b"missing".hex() in str(failure.value)
    with StoreClient(f"127.0.0.1:{free_port()}", timeout=5) as client:
        with pytest.raises(Unavailable):
            client.put(make_checkpoint(b"k", {"a_int8": 10}))  # not idempotent: no retry


def test_idempotent_calls_retry_while_the_server_starts(tmp_path: Path) -> None:
    port = free_port()
    started: list[InProcessStore] = []
    # The store starts listening 0.1 s after the call is made: the first attempts fail. It
    # is served in this process, so it listens within the policy's backoffs (~1.5 s at
    # most) however busy the machine is (a store process can take longer to start).
    listen = f"127.0.0.1:{port}"
    starter = threading.Timer(
        0.1, lambda: started.append(InProcessStore(tmp_path / "s", listen=listen))
    )
    t0 = time.monotonic()
    starter.start()
    try:
        with StoreClient(listen, timeout=30) as client:
            stats = client.stats()  # UNAVAILABLE at first; gRPC retries with backoff
            assert stats.records == 0 and time.monotonic() - t0 >= 0.1
    finally:
        starter.join()
        for proc in started:
            proc.stop()


def test_a_new_client_of_a_server_restarted_on_its_address_is_served(tmp_path: Path) -> None:
    """An older client's connection to the server's previous life, still open and in
    reconnect backoff, is not the new client's: its first call is served."""
    listen = f"127.0.0.1:{free_port()}"
    first = InProcessStore(tmp_path / "first", listen=listen)
    with StoreClient(listen, timeout=30) as older:
        older.put(make_checkpoint(b"before", {"kv_int8": 64}))
        first.stop()
        with pytest.raises(Unavailable):
            older.put(make_checkpoint(b"lost", {"kv_int8": 64}))  # refused: now in backoff
        second = InProcessStore(tmp_path / "second", listen=listen)
        try:
            with StoreClient(listen, timeout=30) as newer:
                newer.put(make_checkpoint(b"after", {"kv_int8": 64}))  # not retried by gRPC
                assert {r.key for r in newer.list_all()} == {b"after"}
        finally:
            second.stop()


def test_the_package_names_load_on_first_use() -> None:
    """tandem_client's names are lazy (PEP 562): each listed one resolves to its module's."""
    import importlib

    import tandem_client

    assert set(tandem_client.__all__) == set(tandem_client._HOME)
    for name, home in tandem_client._HOME.items():
        module = importlib.import_module(f"tandem_client.{home}")
        assert getattr(tandem_client, name) is getattr(module, name)
    with pytest.raises(AttributeError):
        tandem_client.NoSuchName  # noqa: B018
