"""Slow readers: a stream whose client stopped reading gives its batch slot up (parked), comes
back exactly when read, and is cancelled when it stays away (engine_service/loop/preemption.py).

The unread clients here open their channel with a small HTTP/2 window (1 KiB, no BDP probe):
the engine sees a client stop reading only once that window is full, and a default gRPC
client's window is 64 KiB or more - the same test with it only takes longer.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest

from tandem_client import EngineClient
from tandem_client.engine_client import generate_request
from tandem_wire.pb import engine_pb2, engine_pb2_grpc
from tests.servers import ServiceProcess, start_engine, start_store

SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
MAX_TOKENS = 160


def _request(i: int, **extra: Any) -> engine_pb2.GenerateRequest:
    req = generate_request(
        [5, 6, 7, 8 + i % 50], max_tokens=MAX_TOKENS, request_id=f"unread-{i}", **extra
    )
    req.sampling.seed = 1000 + i
    req.sampling.temperature = 0.9
    req.sampling.ignore_eos = True
    return req


def _stats(address: str) -> engine_pb2.EngineStatsResponse:
    with EngineClient(address) as c:
        return c.stats()


def _wait(address: str, until: object, timeout: float = 120.0) -> engine_pb2.EngineStatsResponse:
    """Polls the engine's Stats until `until(stats)` (5 ms between calls at first, doubling
    to 100 ms): the state is seen soon after it holds, not at the next fixed tick."""
    deadline = time.monotonic() + timeout
    pause = 0.005
    with EngineClient(address) as c:
        while True:
            s = c.stats()
            if until(s):  # type: ignore[operator]
                return s
            assert time.monotonic() < deadline, f"engine never got there: {s}"
            time.sleep(pause)
            pause = min(pause * 2, 0.1)


@pytest.fixture(scope="module")
def parking_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """One engine for the tests that park unread rows in memory (32 slots, parked after 32
    unread tokens); each leaves it with nothing running or parked."""
    engine = start_engine(
        tmp_path_factory.mktemp("parking"), "--max-running", "32", "--park-after-tokens", "32"
    )
    try:
        yield engine
    finally:
        engine.stop()


def _read_all(call: object) -> list[int]:
    tokens: list[int] = []
    for message in call:  # type: ignore[attr-defined]
        tokens.extend(message.token_ids)
    return tokens


def test_32_unread_streams_give_their_slots_up_and_resume_exactly(
    parking_engine: ServiceProcess,
) -> None:
    engine = parking_engine
    before = _stats(engine.address)
    channel = grpc.insecure_channel(engine.address, options=SMALL_WINDOW)
    try:
        stub = engine_pb2_grpc.EngineStub(channel)
        unread = [stub.Generate(_request(i)) for i in range(32)]  # opened, never read (yet)
        s = _wait(engine.address, lambda s: s.parked == 32)
        assert s.running == 0 and s.preempted_total - before.preempted_total == 32
        assert s.parked_bytes > 0

        # Every slot was given up: a normal client is served within its deadline.
        with EngineClient(engine.address, timeout=30) as normal:
            g = normal.generate("a normal client", max_tokens=24, ignore_eos=True)
        assert len(g.token_ids) == 24

        # Read now: each stream comes back whole, and 8 of them end exactly as uninterrupted
        # runs (every codec's parked rows: test_parked_rows_of_every_kv_codec_come_back_exactly).
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(_read_all, unread))
        with EngineClient(engine.address, timeout=120) as c, ThreadPoolExecutor(8) as pool:
            want = list(
                pool.map(
                    lambda i: [t for m in c.stream_request(_request(i)) for t in m.token_ids],
                    range(8),
                )
            )
        assert got[:8] == want
        assert all(len(t) == MAX_TOKENS for t in got)
        s = _stats(engine.address)
        assert s.unparked_total - before.unparked_total >= 32
        assert s.parked == 0 and s.parked_bytes == 0
    finally:
        channel.close()


CODECS: list[dict[str, Any]] = [
    dict(kv_bits=0),
    dict(kv_bits=8),
    dict(kv_bits=3, kv_scheme="turboquant"),
    dict(kv_bits=4, kv_scheme="turboquant", kv_value_bits=2),
]


def test_parked_rows_of_every_kv_codec_come_back_exactly(parking_engine: ServiceProcess) -> None:
    """Parking captures a row's caches as they are (packed affine planes, TurboQuant codes)
    and puts them back in the batch: each codec's stream ends as its uninterrupted run (one
    row of each, parked together)."""
    engine = parking_engine
    requests = [_request(i, **codec) for i, codec in enumerate(CODECS)]
    channel = grpc.insecure_channel(engine.address, options=SMALL_WINDOW)
    try:
        stub = engine_pb2_grpc.EngineStub(channel)
        unread = [stub.Generate(r) for r in requests]
        _wait(engine.address, lambda s: s.parked == len(requests))
        with ThreadPoolExecutor(len(requests)) as pool:
            got = list(pool.map(_read_all, unread))
        with EngineClient(engine.address, timeout=120) as c:
            want = [[t for m in c.stream_request(r) for t in m.token_ids] for r in requests]
        assert got == want
        assert all(len(t) == MAX_TOKENS for t in got)
    finally:
        channel.close()


def test_a_stream_parked_past_the_idle_timeout_is_cancelled_and_resumable(tmp_path: Path) -> None:
    store = start_store(tmp_path / "store")
    engine = start_engine(
        tmp_path / "engine",
        "--store",
        store.address,
        "--park-after-tokens",
        "16",
        "--park-idle-timeout",
        "1",
        log_dir=tmp_path,
    )
    try:
        channel = grpc.insecure_channel(engine.address, options=SMALL_WINDOW)
        stub = engine_pb2_grpc.EngineStub(channel)
        call = stub.Generate(_request(0, checkpoint_interval=16))
        s = _wait(engine.address, lambda s: s.idle_cancelled_total == 1)
        assert s.preempted_total == 1 and s.parked == 0 and s.running == 0
        with pytest.raises(grpc.RpcError) as caught:
            _read_all(call)
        assert caught.value.code() == grpc.StatusCode.CANCELLED
        channel.close()

        # Its checkpoint was kept: the client resumes and gets the uninterrupted run.
        with EngineClient(engine.address, timeout=60) as c:
            resumed = [
                t
                for m in c.stream_request(_request(0, checkpoint_interval=16, resume=True))
                for t in m.token_ids
            ]
            again = _request(0)
            again.request_id = "reference"
            want = [t for m in c.stream_request(again) for t in m.token_ids]
        assert resumed == want
    finally:
        engine.stop()
        store.stop()


def test_over_the_park_budget_checkpointed_rows_park_in_the_store(tmp_path: Path) -> None:
    store = start_store(tmp_path / "store")
    engine = start_engine(
        tmp_path / "engine",
        "--store",
        store.address,
        "--max-running",
        "4",
        "--park-after-tokens",
        "16",
        "--park-bytes",
        "1",
        log_dir=tmp_path,
    )
    try:
        channel = grpc.insecure_channel(engine.address, options=SMALL_WINDOW)
        stub = engine_pb2_grpc.EngineStub(channel)
        unread = [stub.Generate(_request(i, checkpoint_interval=16)) for i in range(4)]
        s = _wait(engine.address, lambda s: s.parked == 4)
        assert s.parked_to_store_total == 4 and s.parked_bytes == 0 and s.running == 0
        with EngineClient(engine.address, timeout=30) as normal:
            assert len(normal.generate("a normal client", max_tokens=8).token_ids) > 0
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(_read_all, unread))
        with EngineClient(engine.address, timeout=120) as c:
            want = []
            for i in range(4):
                again = _request(i)
                again.request_id = f"reference-{i}"
                want.append([t for m in c.stream_request(again) for t in m.token_ids])
        assert got == want and all(len(t) == MAX_TOKENS for t in got)
        assert _stats(engine.address).unparked_total >= 4
        channel.close()
    finally:
        engine.stop()
        store.stop()


def test_a_full_park_budget_keeps_the_row_running(tmp_path: Path) -> None:
    engine = start_engine(tmp_path, "--park-after-tokens", "16", "--park-bytes", "1")
    try:
        channel = grpc.insecure_channel(engine.address, options=SMALL_WINDOW)
        stub = engine_pb2_grpc.EngineStub(channel)
        call = stub.Generate(_request(0))
        s = _wait(engine.address, lambda s: s.park_over_budget_total >= 1)
        assert s.preempted_total == 0 and s.parked == 0
        got = _read_all(call)
        with EngineClient(engine.address, timeout=60) as c:
            again = _request(0)
            again.request_id = "reference"
            want = [t for m in c.stream_request(again) for t in m.token_ids]
        assert got == want and len(got) == MAX_TOKENS
        channel.close()
    finally:
        engine.stop()
