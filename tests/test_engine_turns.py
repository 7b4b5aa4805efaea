"""Turns: streams whose clients never read cannot starve the readers beside them.

The never-reading clients here use default gRPC channels: BDP probing grows their HTTP/2
windows to megabytes, so the engine's writes never block and their rows are never parked as
slow readers (test_engine_backpressure.py shows those, with a 1 KiB window). Turns bound
them anyway: while requests wait for a full batch, a row gives its slot up every
`--turn-tokens` tokens and queues again (engine_service/loop/turns.py), and comes back exactly.
Without turns the readers wait until the never-reading streams end.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem_client import EngineClient
from tandem_client.engine_client import generate_request
from tandem_wire.pb import engine_pb2, engine_pb2_grpc
from tests.servers import ServiceProcess, start_engine
from tests.test_engine_backpressure import _read_all, _stats, _wait

UNREAD, READERS = 24, 64  # more unread streams than slots, and readers for 4 full batches
MAX_RUNNING = 16
TURN_TOKENS = 16
UNREAD_TOKENS = 8 * TURN_TOKENS  # 8 turns each: none can end while the readers go first
CHECKED = 8  # never-reading streams compared with an uninterrupted run (the rest: lengths)
READER_TOKENS = 16


@pytest.fixture(scope="module")
def turns_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    """One engine for both tests: MAX_RUNNING slots, a turn every TURN_TOKENS tokens."""
    engine = start_engine(
        tmp_path_factory.mktemp("turns"),
        "--max-running",
        str(MAX_RUNNING),
        "--turn-tokens",
        str(TURN_TOKENS),
    )
    try:
        yield engine
    finally:
        engine.stop()


def _request(i: int, max_tokens: int, tag: str) -> engine_pb2.GenerateRequest:
    req = generate_request([5, 6, 7, 8 + i % 50], max_tokens=max_tokens, request_id=f"{tag}-{i}")
    req.sampling.seed = 2000 + i
    req.sampling.temperature = 0.9
    req.sampling.ignore_eos = True
    return req


def test_24_never_reading_streams_leave_64_readers_served(turns_engine: ServiceProcess) -> None:
    engine = turns_engine
    before = _stats(engine.address).turns_yielded_total
    unread_channel = grpc.insecure_channel(engine.address)  # default windows, BDP on
    stub = engine_pb2_grpc.EngineStub(unread_channel)
    unread = [stub.Generate(_request(i, UNREAD_TOKENS, "unread")) for i in range(UNREAD)]
    _wait(engine.address, lambda s: s.running == MAX_RUNNING)

    # The readers, all asked at once, each read as it comes.
    readers_channel = grpc.insecure_channel(engine.address)
    readers_stub = engine_pb2_grpc.EngineStub(readers_channel)
    readers = [
        readers_stub.Generate(_request(i, READER_TOKENS, "reader"), timeout=120)
        for i in range(READERS)
    ]
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(_read_all, readers))
    assert all(len(tokens) == READER_TOKENS for tokens in got)

    # Every reader is done, and none of the unread has ended: each runs, waits or is
    # parked.
    s = _stats(engine.address)
    assert s.running + s.queued + s.parked == UNREAD, s
    assert s.turns_yielded_total - before >= UNREAD - MAX_RUNNING

    # Read now: each is whole, and CHECKED of them end exactly as uninterrupted runs
    # (CHECKED at once: no turns).
    with ThreadPoolExecutor(UNREAD) as pool:
        unread_got = list(pool.map(_read_all, unread))
    with EngineClient(engine.address, timeout=300) as c, ThreadPoolExecutor(CHECKED) as pool:
        want = list(
            pool.map(
                lambda i: [
                    t
                    for m in c.stream_request(_request(i, UNREAD_TOKENS, "reference"))
                    for t in m.token_ids
                ],
                range(CHECKED),
            )
        )
    assert unread_got[:CHECKED] == want
    assert all(len(tokens) == UNREAD_TOKENS for tokens in unread_got)
    readers_channel.close()
    unread_channel.close()


def test_no_turns_while_nobody_waits(turns_engine: ServiceProcess) -> None:
    """A batch with room never moves a row, however long it runs (4 rows in MAX_RUNNING
    slots, each 4 turns long)."""
    engine = turns_engine
    before = _wait(engine.address, lambda s: s.running == 0 and s.queued == 0)
    with EngineClient(engine.address, timeout=120) as c, ThreadPoolExecutor(4) as pool:
        got = list(
            pool.map(
                lambda i: [
                    t for m in c.stream_request(_request(i, 64, "alone")) for t in m.token_ids
                ],
                range(4),
            )
        )
    assert all(len(tokens) == 64 for tokens in got)
    s = _stats(engine.address)
    assert s.turns_yielded_total == before.turns_yielded_total
    assert s.preempted_total == before.preempted_total
