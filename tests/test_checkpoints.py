"""Prefix reuse, generation checkpoints and exact resume, with real store and engine processes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from engine_service.checkpoints.generation_meta import ENDED as ENDED_KEY
from engine_service.checkpoints.logprob_pages import PAGE_TOKENS, page_key
from tandem_client import EngineClient, StoreClient, TandemError
from tests.conftest import flip_stored_byte
from tests.servers import (
    ServiceProcess,
    free_port,
    generation_progress,
    start_engine,
    start_store_on,
)

# 300 scattered token ids: four full 64-token blocks and a partial one
PROMPT = [(i * 977) % 2000 + 3 for i in range(300)]


class Stack:
    """A store on a fixed port (so it can come back) and an engine pointed at it."""

    def __init__(self, root: Path, engine_data: Path) -> None:
        self.root = root
        self.engine_data = engine_data
        self.port = free_port()
        self.store = start_store_on(root / "store", self.port)
        self.engine = self.start_engine()

    def start_engine(self, *extra: str) -> ServiceProcess:
        return start_engine(
            self.engine_data, "--store", f"127.0.0.1:{self.port}", *extra, log_dir=self.root
        )

    def restart_store(self) -> None:
        self.store = start_store_on(self.root / "store", self.port)

    def stop(self) -> None:
        self.engine.stop()
        self.store.stop()


@pytest.fixture
def stack(tmp_path: Path, engine_data_dir: Path, engine: ServiceProcess) -> Iterator[Stack]:
    """A stack of the test's own: for tests that damage the store's files."""
    s = Stack(tmp_path, engine_data_dir)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def shared(
    tmp_path_factory: pytest.TempPathFactory, engine_data_dir: Path, engine: ServiceProcess
) -> Iterator[Stack]:
    """One stack for the tests that leave its files whole: each keeps to its own prompts,
    request ids or namespace, and a test that kills a process leaves a new one in its place
    (an engine start is seconds of CPU on two cores)."""
    s = Stack(tmp_path_factory.mktemp("checkpoints"), engine_data_dir)
    try:
        yield s
    finally:
        s.stop()


def _wait_for(predicate, timeout: float = 30.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_shared_prefix_is_reused_and_survives_an_engine_restart(shared: Stack) -> None:
    with EngineClient(shared.engine.address) as engine:
        cold = engine.generate(PROMPT, max_tokens=12, ignore_eos=True, namespace="cold")
        assert cold.usage is not None
        assert cold.usage.cached_prompt_tokens == 0
        first = engine.generate(PROMPT, max_tokens=12, ignore_eos=True)
        assert first.token_ids == cold.token_ids
        repeat = engine.generate(PROMPT, max_tokens=12, ignore_eos=True)
        assert repeat.usage is not None and repeat.token_ids == cold.token_ids
        assert repeat.usage.cached_prompt_tokens == len(PROMPT) - 1  # a local hit
        variant = PROMPT[:260] + [7, 8, 9, 10, 11]
        baseline = engine.generate(variant, max_tokens=12, ignore_eos=True, namespace="cold2")
        again = engine.generate(variant, max_tokens=12, ignore_eos=True)
        assert again.usage is not None
        assert again.usage.cached_prompt_tokens == 256  # the last block boundary it shares
        assert again.token_ids == baseline.token_ids
        stats = engine.stats().checkpoints
        assert stats.prefix_hits_local >= 1
    # A fresh engine has an empty memory: the prefix comes from the store.
    shared.engine.stop()
    shared.engine = shared.start_engine()
    with EngineClient(shared.engine.address) as engine:
        warm = engine.generate(PROMPT, max_tokens=12, ignore_eos=True)
        assert warm.usage is not None
        # The same prompt again: all of it but the one token that must be fed.
        assert warm.usage.cached_prompt_tokens == len(PROMPT) - 1
        assert warm.token_ids == cold.token_ids
        stats = engine.stats().checkpoints
        assert stats.prefix_hits_store == 1 and stats.restored_bytes > 0


def test_a_flush_after_the_first_token_covers_the_prompts_prefix(shared: Stack) -> None:
    """The prefix is saved just after the first token leaves; a Flush asked once that token
    has arrived still waits for it, so another engine finds it in the store."""
    other = shared.start_engine()
    try:
        prompts = [[(i * 31 + k) % 2000 + 3 for i in range(300)] for k in range(3)]
        with EngineClient(shared.engine.address) as engine, EngineClient(other.address) as peer:
            for prompt in prompts:
                first = engine.generate(prompt, max_tokens=1, ignore_eos=True)
                assert engine.flush().durable
                again = peer.generate(prompt, max_tokens=1, ignore_eos=True)
                assert again.usage is not None
                assert again.usage.cached_prompt_tokens == len(prompt) - 1
                assert again.token_ids == first.token_ids
            assert peer.stats().checkpoints.prefix_hits_store == len(prompts)
    finally:
        other.stop()


LONG_RUN = 400


def _long_run(request_id: str, namespace: str, **options: Any) -> dict[str, Any]:
    """A request of LONG_RUN tokens checkpointed every 8."""
    return dict(
        max_tokens=LONG_RUN,
        ignore_eos=True,
        checkpoint_interval=8,
        request_id=request_id,
        namespace=namespace,
        **options,
    )


def _interrupted_then_resumed(
    stack: Stack, options: dict[str, Any], kill_at: int, namespace: str
) -> tuple[list[int], list[int]]:
    """Streams a checkpointed generation, SIGKILLs the engine once a checkpoint past kill_at
    is in the store, resumes on a fresh engine; returns (received + resumed, uninterrupted)."""
    # Long enough that the engine, which goes on generating while the unread tokens fill the
    # client's flow-control window, is killed before it finishes (a finished generation has
    # nothing to resume: this raced at 64 tokens on a loaded machine).
    request = _long_run("job-1", namespace, **options)
    received: list[int] = []
    store = StoreClient(f"127.0.0.1:{stack.port}")
    engine = EngineClient(stack.engine.address)
    stream = engine.stream_request(engine.request(PROMPT, **request))
    for chunk in stream:
        received.extend(chunk.token_ids)
        if len(received) >= kill_at:
            break
    # Segments carry the generation's state; wait until one covers most of what was read.
    _wait_for(
        lambda: any(
            n >= len(PROMPT) + kill_at - 16 for n in generation_progress(store, namespace).values()
        )
    )
    # Plain KV caches checkpoint as an append-only chain: a tensor-less manifest under the
    # generation key, and segments holding only what each checkpoint added: past the whole
    # first snapshot, each starts past position 0 and holds fewer positions than come before
    # it. (The engine goes on meanwhile: a full run's later segments may go between the
    # listing and the headers, and a run's first one holds the run's positions, so sizes
    # alone do not tell.)
    (manifest,) = store.list_all(kind="generation", namespace=namespace)
    segments = store.list_all(kind="object", namespace=namespace)
    assert manifest.payload_bytes == 0 and len(segments) >= 2
    # The chain rests on the prompt's prefix record: the prompt is stored once.
    based = store.get_header(manifest.key, namespace).metadata
    assert based["base_tokens"] == str(len(PROMPT))
    reads = store.get_headers([s.key for s in segments], namespace)
    held = [r.checkpoint for r in reads if r.checkpoint is not None]
    deltas = [c for c in held if int(c.metadata["start"]) > 0]
    assert deltas and all(len(c.token_ids) < int(c.metadata["start"]) for c in deltas)
    # What the checkpoints took of the step loop, in Stats (the decode cost bench reads it).
    assert engine.stats().checkpoints.capture_seconds > 0
    stack.engine.kill()
    engine.close()
    stack.engine = stack.start_engine()
    with EngineClient(stack.engine.address) as engine:
        resumed = engine.generate(
            PROMPT, resume=True, tokens_held=len(received), **{k: v for k, v in request.items()}
        )
        assert resumed.usage is not None
        assert resumed.usage.cached_prompt_tokens == len(PROMPT)
        full = engine.generate(PROMPT, **{**request, "request_id": "reference"})
    store.close()
    return received + resumed.token_ids, full.token_ids


@pytest.mark.parametrize(
    "options", [{}, {"temperature": 0.9, "top_p": 0.95, "seed": 77}], ids=["greedy", "seeded"]
)
def test_resume_after_sigkill_equals_the_uninterrupted_run(
    shared: Stack, options: dict[str, Any], request: pytest.FixtureRequest
) -> None:
    namespace = "resume-" + request.node.callspec.id  # its own generation and segments
    combined, full = _interrupted_then_resumed(shared, options, kill_at=37, namespace=namespace)
    assert len(full) == LONG_RUN
    assert combined == full


def _logprobs(chunks: list[Any]) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Each token's log-probability and alternatives, as the stream carried them."""
    return [
        (lp.token_id, lp.logprob, [(t, v) for t, v, _ in lp.top])
        for chunk in chunks
        for lp in chunk.logprobs
    ]


def test_a_resume_sends_the_logprobs_of_the_tokens_its_client_lost(shared: Stack) -> None:
    """A client that asked for logprobs and lost chunks with the engine resumes holding fewer
    tokens than the checkpoint replays: the replayed tokens come with the log-probabilities
    they were first sent with, bit for bit, across a page of them (pages beside the
    checkpoint: checkpoints/logprob_pages.py). The resumed run writes its own in the same
    pages: a resume of the finished generation holding nothing gets every token's."""
    namespace = "logprob-pages"
    request = _long_run("lp", namespace, temperature=0.9, seed=5, logprobs=2)
    store = StoreClient(f"127.0.0.1:{shared.port}")
    first: list[Any] = []
    with EngineClient(shared.engine.address) as engine:
        for chunk in engine.stream_request(engine.request(PROMPT, **request)):
            first.append(chunk)
            if sum(len(c.token_ids) for c in first) >= 176:
                break
        _wait_for(lambda: max(generation_progress(store, namespace).values(), default=0) > 440)
        shared.engine.kill()
    # The checkpoint's replay: its generated tokens and the pending one.
    replayed = max(generation_progress(store, namespace).values()) - len(PROMPT) + 1
    assert replayed > 4 * PAGE_TOKENS  # across pages
    sent = _logprobs(first)
    shared.engine = shared.start_engine()
    with EngineClient(shared.engine.address) as engine:
        held = 5
        resumed = engine.generate(PROMPT, resume=True, tokens_held=held, **request)
        got = _logprobs(resumed.chunks)
        assert len(got) == LONG_RUN - held == len(resumed.token_ids)
        both = min(replayed, len(sent))
        assert got[: both - held] == sent[held:both]
        whole = sent[:held] + got
        engine.flush()  # the tombstone and the last page are queued like any checkpoint
        tail = engine.generate(PROMPT, resume=True, tokens_held=0, **request)
        assert tail.finish_reason == "length"
        assert _logprobs(tail.chunks) == whole
        # A page gone from the store (evicted once its lease lapsed): a resume that needs it
        # is refused, one holding its tokens is answered.
        key = next(
            r.key
            for r in store.list_all(kind="object", namespace=namespace)
            if ENDED_KEY in store.get_header(r.key, namespace).metadata
        )
        store.delete(page_key(key, 0), namespace, force=True)
        with pytest.raises(TandemError) as refused:
            engine.generate(PROMPT, resume=True, tokens_held=0, **request)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "holds no log-probabilities for tokens 0 to" in str(refused.value)
        later = engine.generate(PROMPT, resume=True, tokens_held=PAGE_TOKENS, **request)
        assert _logprobs(later.chunks) == whole[PAGE_TOKENS:]
    store.close()


def test_a_resume_asking_for_logprobs_its_checkpoint_does_not_hold_is_refused(
    shared: Stack,
) -> None:
    """A generation that did not ask for logprobs keeps none: a resume that asks for them of
    tokens it does not hold is FAILED_PRECONDITION, never tokens without them; holding them,
    or asking none, it is answered."""
    request = dict(
        max_tokens=20,
        ignore_eos=True,
        checkpoint_interval=8,
        request_id="no-logprobs",
        namespace="logprob-pages",
    )
    with EngineClient(shared.engine.address) as engine:
        done = engine.generate(PROMPT[:40], **request)
        engine.flush()
        with pytest.raises(TandemError) as refused:
            engine.generate(PROMPT[:40], resume=True, tokens_held=10, logprobs=0, **request)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "holds no log-probabilities for tokens 10 to 19" in str(refused.value)
        held_all = engine.generate(PROMPT[:40], resume=True, tokens_held=20, logprobs=0, **request)
        assert held_all.token_ids == [] and held_all.finish_reason == "length"
        bare = engine.generate(PROMPT[:40], resume=True, tokens_held=10, **request)
        assert bare.token_ids == done.token_ids[10:]


def test_store_down_does_not_stop_generation_and_flush_reports_durability(shared: Stack) -> None:
    shared.store.kill()
    with EngineClient(shared.engine.address) as engine:
        got = engine.generate(
            PROMPT, max_tokens=40, ignore_eos=True, checkpoint_interval=4, request_id="while-down"
        )
        assert len(got.token_ids) == 40 and got.finish_reason == "length"
        _wait_for(lambda: engine.stats().checkpoints.failed > 0)
        stats = engine.stats().checkpoints
        assert not stats.store_up
        assert not engine.flush().durable
        shared.restart_store()

        def checkpoints_flow_again() -> bool:
            engine.generate(PROMPT[:90], max_tokens=24, ignore_eos=True, checkpoint_interval=4)
            engine.flush()  # a barrier: its checkpoints were sent (or failed fast, backing off)
            return engine.stats().checkpoints.store_up

        _wait_for(checkpoints_flow_again, timeout=60)
        engine.flush()  # reports (and resets) what failed while the store came back
        engine.generate(PROMPT[:90], max_tokens=12, ignore_eos=True, checkpoint_interval=4)
        flushed = engine.flush()
        assert flushed.durable and flushed.flushed > 0
        assert (flushed.failed, flushed.missing) == (0, 0)
        # The prompt's prefix, kept only locally while the store was down, reaches the store
        # once the prompt runs again: a fresh engine restores it from there.
        engine.generate(PROMPT, max_tokens=4, ignore_eos=True)
        assert engine.flush().durable
    fresh = shared.start_engine()
    try:
        with EngineClient(fresh.address) as engine:
            again = engine.generate(PROMPT, max_tokens=4, ignore_eos=True)
        assert again.usage is not None and again.usage.prefix_source == "store: region"
    finally:
        fresh.stop()


def test_checkpoint_of_another_model_is_refused(shared: Stack) -> None:
    request = dict(
        max_tokens=64, ignore_eos=True, checkpoint_interval=8, request_id="moved", namespace="moved"
    )
    with EngineClient(shared.engine.address) as engine:
        stream = engine.stream_request(engine.request(PROMPT, **request))
        for i, _ in enumerate(stream):
            if i >= 20:
                break
        stream.close()  # a disconnect keeps the checkpoint for a resume
        store = StoreClient(f"127.0.0.1:{shared.port}")
        _wait_for(lambda: bool(store.list_all(kind="generation", namespace="moved")))
        # A new chain rewrites the manifest: let the row go and the spill queue drain before
        # tampering with it, or a later manifest would undo the change.
        _wait_for(lambda: engine.stats().running == 0)
        engine.flush()
        (record,) = store.list_all(kind="generation", namespace="moved")
        ckpt = store.get(record.key, record.namespace)
        ckpt.model_id = "some-other-model@sha256:0000/float32"
        store.put(ckpt)
        with pytest.raises(TandemError) as failure:
            engine.generate(PROMPT, resume=True, **request)
        assert failure.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "some-other-model" in str(failure.value)
        with pytest.raises(TandemError) as missing:
            engine.generate(PROMPT, resume=True, **{**request, "request_id": "never-ran"})
        assert missing.value.code == grpc.StatusCode.NOT_FOUND
        store.close()


def test_a_corrupted_prefix_checkpoint_falls_back_to_prefill(stack: Stack) -> None:
    """Read straight out of the store's data file (docs/store.md, "Direct reads"), a prefix
    whose chunk fails the store's check is never used: the same tokens as a cold run. (The
    region route's damage: the next test.)"""
    with EngineClient(stack.engine.address) as engine:
        reference = engine.generate(PROMPT, max_tokens=10, ignore_eos=True)
        assert engine.flush().durable
    stack.engine.stop()
    stack.store.terminate()
    flip_stored_byte(stack.root / "store", chunk=0, at=10)
    stack.restart_store()
    stack.engine = stack.start_engine("--store-direct-reads", "on")
    with EngineClient(stack.engine.address) as engine:
        got = engine.generate(PROMPT, max_tokens=10, ignore_eos=True)
        stats = engine.stats().checkpoints
    assert got.token_ids == reference.token_ids
    assert got.usage is not None and got.usage.cached_prompt_tokens == 0
    assert stats.restore_failures >= 1 and stats.prefix_hits_store == 0
    assert dict(stats.store_reads_by_route) == {"direct": 1}


def test_damage_in_a_late_part_of_a_progressive_restore_falls_back_to_prefill(
    stack: Stack,
) -> None:
    """A prefix of ~10 MiB arrives in two parts: the engine starts pulling the first while
    the store copies the second, whose last chunk is damaged. The restore is dropped whole
    (DATA_LOSS from the store) and the prompt prefilled: the same tokens as a cold run."""
    long_prompt = [(i * 613) % 2000 + 3 for i in range(2600)]
    with EngineClient(stack.engine.address) as engine:
        reference = engine.generate(long_prompt, max_tokens=6, ignore_eos=True)
        assert engine.flush().durable
    stack.engine.stop()
    stack.store.terminate()
    flip_stored_byte(stack.root / "store", chunk=-1, at=10)  # the last chunk: in part two
    stack.restart_store()
    stack.engine = stack.start_engine()
    with EngineClient(stack.engine.address) as engine:
        got = engine.generate(long_prompt, max_tokens=6, ignore_eos=True)
        stats = engine.stats().checkpoints
    assert got.token_ids == reference.token_ids
    assert got.usage is not None and got.usage.cached_prompt_tokens == 0
    assert stats.restore_failures >= 1 and stats.prefix_hits_store == 0
    assert stats.shared_memory_reads == 1  # it did go through the region


def test_resume_of_an_ended_generation_says_how_it_ended(shared: Stack) -> None:
    """A generation that finished (or was cancelled) leaves a tombstone. A resume of a
    finished one gets the tokens past those it holds, replayed from the tombstone, and the
    end (a client whose gateway died with the last tokens in its buffer), nothing computed;
    of a cancelled one, FAILED_PRECONDITION with how it ended and its token count, never
    NOT_FOUND nor tokens; one claiming to hold more tokens than it emitted is
    INVALID_ARGUMENT."""
    with EngineClient(shared.engine.address) as engine:
        ended_in = dict(namespace="ended")
        request = dict(
            max_tokens=40, ignore_eos=True, checkpoint_interval=8, request_id="done", **ended_in
        )
        done = engine.generate(PROMPT[:80], **request)
        assert len(done.token_ids) == 40
        engine.flush()  # the tombstone is queued on the spill thread like any checkpoint
        computed = engine.stats().generated_tokens_total
        for held in (30, 0, 40):
            tail = engine.generate(PROMPT[:80], resume=True, tokens_held=held, **request)
            assert tail.token_ids == done.token_ids[held:], held
            assert tail.finish_reason == "length", held
        assert engine.stats().generated_tokens_total == computed  # replayed, not computed

        request = dict(
            max_tokens=400, ignore_eos=True, checkpoint_interval=8, request_id="cut", **ended_in
        )
        stream = engine.stream_request(engine.request(PROMPT[:80], **request))
        chunks = []
        for i, chunk in enumerate(stream):
            chunks.append(chunk)
            if i == 20:
                engine.cancel("cut")
        assert chunks[-1].finish_reason == "cancelled"
        engine.flush()
        with pytest.raises(TandemError) as cancelled:
            engine.generate(PROMPT[:80], resume=True, **request)
        assert cancelled.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "this generation was cancelled;" in str(cancelled.value)
        # Holding more than it ever emitted is the request's error, ended or not.
        emitted = int(str(cancelled.value).split("cancelled; ")[1].split(" ")[0])
        with pytest.raises(TandemError) as overclaimed:
            engine.generate(PROMPT[:80], resume=True, tokens_held=emitted + 5, **request)
        assert overclaimed.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"tokens_held {emitted + 5} exceeds the {emitted} tokens" in str(overclaimed.value)

        # Tombstones are not generations in flight, and carry no cache.
        with StoreClient(f"127.0.0.1:{shared.port}") as store:
            assert store.list_all(kind="generation", **ended_in) == []
            objects = store.list_all(kind="object", **ended_in)
            tombstones = [r for r in objects if r.payload_bytes == 0]
            assert len(tombstones) == 2


def test_a_same_host_restore_equals_a_streamed_one(shared: Stack) -> None:
    """Through the shared-memory region or over gRPC, a store hit restores the same cache:
    the same tokens and the same logprobs. Each hit says how its bytes came, and a hit
    that could not use the region says why (Usage.prefix_source, Stats by route); a
    restore read directly out of the store's data file equals them too."""
    request = dict(max_tokens=12, ignore_eos=True, logprobs=3)
    with EngineClient(shared.engine.address) as engine:
        engine.generate(PROMPT, **request)  # saves the prompt's prefix
        assert engine.flush().durable
        again = engine.generate(PROMPT, **request)  # the engine's own memory tier
        assert again.usage is not None and again.usage.prefix_source == "local"
        assert again.usage.cached_prompt_tokens >= 256
    results = {}
    routes = {
        # Read by the engine out of the store's data file (docs/store.md, "Direct reads").
        "direct": (("--store-direct-reads", "on"), "direct"),
        "region": ((), "region"),  # the CPU's default (auto)
        "streamed": (("--store-region-bytes", "0"), "no region"),
        # 64 KiB: the prefix's ~1 MiB record cannot fit the region at all.
        "too small": (("--store-region-bytes", str(64 << 10)), "larger than the region"),
    }
    for name, (extra, route) in routes.items():
        fresh = shared.start_engine(*extra)  # an empty local tier: the hit is the store's
        try:
            with EngineClient(fresh.address) as engine:
                got = engine.generate(PROMPT, **request)
                stats = engine.stats().checkpoints
            assert got.usage is not None and got.usage.cached_prompt_tokens >= 256, name
            assert stats.prefix_hits_store == 1, name
            # The restore-or-prefill choice: restored (nothing says prefill is cheaper yet),
            # and the restore's bandwidth measured for the next choice.
            assert stats.restore_chosen == 1 and stats.restore_bytes_per_second > 0, name
            logprobs = [(lp.token_id, lp.logprob) for c in got.chunks for lp in c.logprobs]
            assert len(logprobs) == 12, name
            results[name] = (got.token_ids, logprobs)
            assert (stats.shared_memory_reads > 0) == (name == "region"), name
            assert got.usage.prefix_source == f"store: {route}", name
            assert dict(stats.store_reads_by_route) == {route: 1}, name
            assert stats.capture_seconds == 0, name  # no generation checkpoints here
        finally:
            fresh.stop()
    assert results["direct"] == results["region"] == results["streamed"] == results["too small"]


def test_a_compressed_prefix_record_serves_only_requests_that_ask_for_it(shared: Stack) -> None:
    """prefix_record_bits=8 keeps the prompt's prefix in the store as 8-bit KV codes (and
    prefix_record_scheme="turboquant" as TurboQuant codes): a fraction of the exact record's
    bytes, restored by a fresh engine for a request of the same format, and never for one
    that asked for the exact prefix or for another format."""
    prompt = [(i * 389) % 1900 + 11 for i in range(320)]
    where = dict(namespace="packed", max_tokens=4, ignore_eos=True)
    turboquant = dict(prefix_record_bits=4, prefix_record_scheme="turboquant")
    with EngineClient(shared.engine.address) as engine:
        engine.generate(prompt, prefix_record_bits=8, **where)
        engine.generate(prompt, **turboquant, **where)  # 4-bit TurboQuant codes
        assert engine.flush().durable
        with pytest.raises(TandemError) as refused:
            engine.generate(prompt, prefix_record_bits=3, **where)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(TandemError) as no_codebook:  # TurboQuant takes 4, 3 or 2 bits
            engine.generate(prompt, prefix_record_bits=8, prefix_record_scheme="turboquant")
        assert no_codebook.value.code == grpc.StatusCode.INVALID_ARGUMENT
    fresh = shared.start_engine()  # an empty local tier: any hit is the store's
    try:
        with EngineClient(fresh.address) as engine:
            exact = engine.generate(prompt, **where)
            assert exact.usage is not None and exact.usage.cached_prompt_tokens == 0
            assert exact.usage.prefix_miss_reason == "no stored prefix"
            affine4 = engine.generate(prompt, prefix_record_bits=4, **where)  # not TurboQuant's
            assert affine4.usage is not None and affine4.usage.cached_prompt_tokens == 0
            assert engine.flush().durable  # now the exact record is kept too
        again = shared.start_engine()
        try:
            with EngineClient(again.address) as engine:
                packed = engine.generate(prompt, prefix_record_bits=8, **where)
                rotated = engine.generate(prompt, **turboquant, **where)
            assert packed.usage is not None and packed.usage.cached_prompt_tokens >= 256
            assert packed.usage.prefix_source == "store: region"
            assert rotated.usage is not None and rotated.usage.cached_prompt_tokens >= 256
        finally:
            again.stop()
    finally:
        fresh.stop()
    with StoreClient(f"127.0.0.1:{shared.port}") as store:
        sizes = sorted(r.payload_bytes for r in store.list_all(kind="prefix", namespace="packed"))
    # float32 KV: 4-bit TurboQuant ~1/8 of the exact bytes (a 4-byte norm per head vector),
    # 4-bit affine ~1/6, 8-bit affine 1 byte a value plus a scale and bias per 64, of 4 bytes
    assert len(sizes) == 4 and sizes[2] < 0.3 * sizes[3], sizes
    assert sizes[0] < 0.15 * sizes[3], sizes
