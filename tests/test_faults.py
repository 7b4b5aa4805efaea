"""Fault injection: SIGKILL of the store at random moments under concurrent writers, and of
the engine at random moments under concurrent seeded checkpointed streams, at least once
between a checkpoint's capture and its Put reaching the store. Nothing acknowledged is lost,
nothing resumed differs.

The moments come from a seeded RNG (TANDEM_SOAK_SEED, printed with -s and in every failure):
a run is replayed with the same seed and kill count. `make test` runs a few kills; `make soak`
runs many (TANDEM_SOAK_KILLS) under a fresh seed.
"""

from __future__ import annotations

import os
import random
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from tandem_client import Checkpoint, EngineClient, StoreClient, Tensor
from tandem_client.errors import TandemError
from tests.servers import ServiceProcess, free_port, start_engine, start_store_on, wait_until

KILLS = int(os.environ.get("TANDEM_SOAK_KILLS", "3"))
SEED = int(os.environ.get("TANDEM_SOAK_SEED", "20261201"))


def test_store_sigkill_under_four_writers_loses_no_acknowledged_put(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    port = free_port()
    data = tmp_path / "store"
    store = [start_store_on(data, port, "--sync-mode", "commit")]
    address = f"127.0.0.1:{port}"
    acked: dict[bytes, int] = {}  # key -> CRC of the bytes the store acknowledged
    lock, stop = threading.Lock(), threading.Event()
    attempts = [0]

    def writer(w: int) -> None:
        local = random.Random(SEED + w)
        with StoreClient(address, timeout=10) as client:
            n = 0
            while not stop.is_set():
                n += 1
                key = f"w{w}-{n}".encode()
                data = local.randbytes(local.randrange(16 << 10, 512 << 10))
                record = Checkpoint(
                    key=key, kind="object", tensors=[Tensor("t", "uint8", (len(data),), data)]
                )
                with lock:
                    attempts[0] += 1
                try:
                    client.put(record)
                except TandemError:
                    time.sleep(0.05)  # the store is down or restarting
                    continue
                with lock:
                    acked[key] = zlib.crc32(data)

    writers = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in writers:
        t.start()

    def acknowledged_past(count: int) -> None:
        # A kill's moment is a seeded count of puts acknowledged since the last start: drawn
        # from the seed, observed, and never a guess at how long something takes.
        deadline = time.monotonic() + 60
        while True:
            with lock:
                if len(acked) >= count:
                    return
            assert time.monotonic() < deadline, f"seed {SEED}: fewer than {count} puts acked"
            time.sleep(0.01)

    try:
        for _ in range(KILLS):
            with lock:
                before = len(acked)
            acknowledged_past(before + rng.randint(1, 24))
            store[0].kill()
            store[0] = start_store_on(data, port, "--sync-mode", "commit")
        with lock:
            before = len(acked)
        acknowledged_past(before + 4)  # the writers reached the last store too
    finally:
        stop.set()
        for t in writers:
            t.join(30)
    lost = []
    try:
        with StoreClient(address, timeout=60) as client:
            for key, crc in acked.items():
                got = client.get(key)
                if zlib.crc32(memoryview(got.tensors[0].data)) != crc:
                    lost.append(key)
            records = client.stats().records
    finally:
        store[0].stop()
    print(
        f"\nstore faults: seed {SEED}, {KILLS} kills, {attempts[0]} puts tried, "
        f"{len(acked)} acknowledged, {len(acked) - len(lost)} verified byte-exact, lost {len(lost)}"
    )
    assert acked and not lost
    assert records >= len(acked)  # puts cut short by a kill may have landed too


STREAMS = 8
TOKENS = 48  # each stream's length, compared with its uninterrupted run
INTERVAL = 8  # tokens between a stream's checkpoints
# Kills per run (each costs an engine start): `make test` one, in the capture-before-Put
# window; `make soak` a third of TANDEM_SOAK_KILLS, at least one of them in that window.
ENGINE_KILLS = max(1, KILLS // 3)


@dataclass
class Kill:
    """One SIGKILL of the engine, at a moment drawn from the seeded RNG: once each stream's
    client holds `holds[i]` tokens and the engine generated `extra` tokens more (counted by
    its Stats). `frozen`: the store is SIGSTOPped first, and the kill waits for a checkpoint
    captured after that, which therefore sits in the spill queue un-Put."""

    frozen: bool
    holds: list[int]
    extra: int
    # Frozen kills: spill-queue bytes and dropped captures added since the freeze, at the kill.
    unstored: tuple[int, int] = (0, 0)
    resumed: int = 0  # streams resumed from a checkpoint that landed
    scratch: int = 0  # streams with none in the store, generated again from scratch

    @staticmethod
    def draw(rng: random.Random, frozen: bool) -> Kill:
        holds = [rng.randint(1, TOKENS - 8) for _ in range(STREAMS)]
        return Kill(frozen, holds, rng.randrange(0, STREAMS * 3 * INTERVAL))


def _checkpoint_state(address: str) -> tuple[int, int, int]:
    """(generated tokens, spill-queue bytes, dropped captures) from the engine's Stats."""
    with EngineClient(address) as client:
        s = client.stats()
    return s.generated_tokens_total, s.checkpoints.queued_bytes, s.checkpoints.dropped


def _wait_for_the_moment(address: str, kill: Kill, replay: str) -> None:
    """Returns once the engine generated `kill.extra` tokens more than now and, for a frozen
    kill (the store already SIGSTOPped), once its spill queue holds a capture made after
    the freeze: only a Put adds to the queue's bytes (or counts a drop), only a finished
    send takes them off, and no send finishes against a stopped store - more bytes than now
    are a capture whose Put has not reached the store."""
    generated, queued, dropped = _checkpoint_state(address)

    def moment() -> bool:
        now, now_queued, now_dropped = _checkpoint_state(address)
        if now < generated + kill.extra:
            return False
        if kill.frozen:
            kill.unstored = (now_queued - queued, now_dropped - dropped)
            return now_queued > queued or now_dropped > dropped
        return True

    wait_until(moment, 60, f"kill moment {kill} ({replay})")


def test_engine_sigkill_at_seeded_moments_resumes_each_stream_exactly(
    tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess
) -> None:
    """8 concurrent seeded streams with checkpoints every 8 tokens; the engine is SIGKILLed
    at seeded random moments, at least once between a checkpoint's capture and its Put
    reaching the store. Each stream is resumed on a fresh engine (from the last checkpoint
    that landed, or from scratch where none did) and must equal its uninterrupted run."""
    rng = random.Random(SEED)
    # Which kills land in the capture-before-Put window: one at a drawn index, the others
    # each with even odds.
    window = rng.randrange(ENGINE_KILLS)
    kills = [Kill.draw(rng, k == window or rng.random() < 0.5) for k in range(ENGINE_KILLS)]
    replay = f"replay with TANDEM_SOAK_SEED={SEED} TANDEM_SOAK_KILLS={KILLS}"
    print(f"\nengine faults: seed {SEED}, {ENGINE_KILLS} kills ({replay})")
    port = free_port()
    store = start_store_on(tmp_path / "store", port)
    address = f"127.0.0.1:{port}"

    def start() -> ServiceProcess:
        return start_engine(engine_data_dir, "--store", address, log_dir=tmp_path)

    def request(i: int, tag: str, max_tokens: int = TOKENS) -> dict[str, object]:
        return dict(
            max_tokens=max_tokens,
            ignore_eos=True,
            checkpoint_interval=INTERVAL,
            request_id=f"{tag}-{i}",
            temperature=0.9,
            top_p=0.95,
            seed=1000 + i,
        )

    prompts = [[(i * 7 + j * 13) % 1900 + 3 for j in range(30 + 5 * i)] for i in range(STREAMS)]
    proc = start()
    try:
        with EngineClient(proc.address) as client, ThreadPoolExecutor(STREAMS) as pool:
            full = list(
                pool.map(
                    lambda i: client.generate(prompts[i], **request(i, "ref")).token_ids,
                    range(STREAMS),
                )
            )
        for k, kill in enumerate(kills):
            tag = f"cut{k}"
            with EngineClient(proc.address) as client:
                # Long requests: the engine keeps generating for streams nobody reads, and
                # none ends (which would delete its checkpoint) before the kill.
                streams = [
                    client.stream_request(client.request(prompts[i], **request(i, tag, 4000)))
                    for i in range(STREAMS)
                ]
                got: list[list[int]] = [[] for _ in range(STREAMS)]
                for i, stream in enumerate(streams):
                    for chunk in stream:
                        got[i].extend(chunk.token_ids)
                        if len(got[i]) >= kill.holds[i]:
                            break
                if kill.frozen:
                    store.freeze()  # every store thread stopped: nothing more lands
                _wait_for_the_moment(proc.address, kill, replay)
                proc.kill()  # the streams still open: no cancel reaches the engine first
            if kill.frozen:
                store.thaw()
            proc = start()
            with EngineClient(proc.address) as client:
                for i in range(STREAMS):
                    try:
                        rest = client.generate(
                            prompts[i], resume=True, tokens_held=len(got[i]), **request(i, tag)
                        )
                    except TandemError as err:
                        # Killed before this stream's first checkpoint landed (not one
                        # that landed and went missing, nor a stream that ended).
                        assert err.code == grpc.StatusCode.NOT_FOUND, (err, replay)
                        assert "same request_id" in str(err), (err, replay)
                        ended = client.generate(prompts[i], **request(i, tag)).token_ids
                        assert ended[: len(got[i])] == got[i], (k, i, replay)
                        kill.scratch += 1
                    else:
                        # The checkpoint may lie past TOKENS (it is replayed whole): compare
                        # the stream the client ends up with against the uninterrupted run.
                        ended = got[i] + rest.token_ids
                        kill.resumed += 1
                    assert ended[:TOKENS] == full[i], (
                        f"kill {k} ({kill}) stream {i} differs; {replay}"
                    )
            mode = "capture-before-Put window" if kill.frozen else "running"
            print(
                f"  kill {k} ({mode}): holds {kill.holds}, +{kill.extra} tokens, "
                f"captured and not stored: {kill.unstored[0]} bytes queued, "
                f"{kill.unstored[1]} dropped; "
                f"{kill.resumed} resumed, {kill.scratch} from scratch"
            )
        # The frozen kills waited for their window; at least one was drawn.
        assert any(kill.unstored[0] > 0 or kill.unstored[1] > 0 for kill in kills), replay
        assert sum(kill.resumed for kill in kills) > 0, f"no stream resumed; {replay}"
    finally:
        proc.stop()
        store.thaw()
        store.stop()
