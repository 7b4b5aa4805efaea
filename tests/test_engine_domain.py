"""The engine's domain in-process, without gRPC: the scheduler on the tiny model delivering
tokens directly, the spill queue against a fake sink, local prefix reuse, and generation
checkpoints against a store served in this process."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import lmdb
import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache

from engine_service.checkpoints.cache_records import (
    CODEC_VERSION,
    STACKED_CODEC_VERSION,
    restore,
    to_host,
)
from engine_service.checkpoints.chain_tokens import TOKENS_BEFORE, TokenDigest
from engine_service.checkpoints.generation_meta import (
    BASED_CODEC_VERSION,
    MAX_CHAIN,
    MERGE_FANOUT,
    BaseLease,
    GenerationMeta,
    segment_key,
)
from engine_service.checkpoints.manager import CheckpointManager, CheckpointSettings
from engine_service.checkpoints.prefix_cache import BLOCK_SIZE, PrefixCache
from engine_service.checkpoints.prefix_reuse import PrefixReuse
from engine_service.checkpoints.restore_cost import PROBE_EVERY, RestoreCost
from engine_service.checkpoints.spill import SpillQueue
from engine_service.checkpoints.spill_items import Pin, Put
from engine_service.core.plans import PrefixPlan, ResumePlan
from engine_service.errors import (
    AlreadyExists,
    Corrupt,
    NotFound,
    Overloaded,
    Precondition,
    Unavailable,
)
from engine_service.kv.batch_cache import BatchQuantizedKVCache
from engine_service.loop.admissions import gather_burst
from engine_service.loop.limits import Limits
from engine_service.loop.scheduler import Scheduler
from engine_service.model.loaded import LoadedModel
from engine_service.model.loading import load_model
from engine_service.protocol.checkpoint_stats import CheckpointCounters
from engine_service.protocol.events import Event, Started, Token
from engine_service.protocol.requests import GenerationRequest
from engine_service.protocol.sampling_options import SamplingOptions
from store_service.config import StoreConfig
from store_service.records import StoredRecord, chunk_key, record_key
from store_service.server import create_server
from store_service.store import CheckpointStore
from tandem_client import Checkpoint, StoreClient, Tensor
from tandem_client.direct import DirectHold
from tandem_client.errors import NotFound as StoreNotFound
from tandem_client.errors import PutManyFailed, TandemError
from tandem_client.errors import Unavailable as StoreUnavailable
from tandem_client.identity import prefix_key
from tandem_client.records import Lease, PutItem
from tests.conftest import flip_stored_byte
from tests.generation_rows import (
    Collector,
    continues_exactly,
    greedy,
    kept_generation,
    request_for,
    wait_for,
)


@pytest.fixture(scope="module")
def tiny(engine_data_dir: Path) -> LoadedModel:
    return load_model("", engine_data_dir)


@pytest.fixture
def scheduler(tiny: LoadedModel) -> Iterator[Scheduler]:
    s = Scheduler(tiny, Limits(max_running=4, max_queued=2))
    s.start()
    try:
        yield s
    finally:
        s.shutdown()


def test_scheduler_delivers_what_mlx_lm_generates(tiny: LoadedModel, scheduler: Scheduler) -> None:
    prompts = [[5, 6, 7, 8], list(range(20, 70)), [300, 301]]
    expected = [greedy(tiny, prompt, 12 + i) for i, prompt in enumerate(prompts)]  # idle loop
    sinks = [Collector() for _ in prompts]
    for i, (prompt, sink) in enumerate(zip(prompts, sinks, strict=True)):
        scheduler.submit(request_for(tiny, f"r{i}", prompt, 12 + i), sink)
    for i, (prompt, sink) in enumerate(zip(prompts, sinks, strict=True)):
        finished = sink.wait()
        assert finished.reason == "length"
        assert isinstance(sink.events[0], Started) and sink.events[0].prompt_tokens == len(prompt)
        assert sink.tokens == expected[i]
    stats = scheduler.stats()
    assert stats.requests_total == 3 and stats.generated_tokens_total == 12 + 13 + 14
    assert scheduler.pending() == 0


def test_a_first_token_leaves_before_the_step_after_it(
    tiny: LoadedModel, scheduler: Scheduler
) -> None:
    """A row's first token is delivered as soon as it is sampled, not with the next step's
    tokens (mlx-lm reports a token from the call that launches the step after it): when it
    arrives, no step has reported a token of it yet (the engine's step count is unchanged);
    the second token comes with the step that reports tokens."""
    deliveries: list[tuple[int, list[Event]]] = []
    sink = Collector()

    def recording(events: list[Event]) -> None:  # on the loop thread, as it delivers
        deliveries.append((scheduler.stats().steps_total, list(events)))
        sink(events)

    prompt = list(range(40, 90))
    expected = greedy(tiny, prompt, 3)
    before = scheduler.stats().steps_total
    scheduler.submit(request_for(tiny, "three", prompt, 3), recording)
    assert sink.wait().reason == "length"
    assert sink.tokens == expected
    with_token = [(steps, d) for steps, d in deliveries if any(isinstance(e, Token) for e in d)]
    assert with_token[0][0] == before  # the first token: before any step reported it
    assert with_token[1][0] > before


def test_scheduler_seeded_rows_are_reproducible(tiny: LoadedModel, scheduler: Scheduler) -> None:
    runs = []
    for rid in ("a", "b"):
        sink = Collector()
        scheduler.submit(request_for(tiny, rid, [9, 10, 11], 16, temperature=1.0, seed=7), sink)
        sink.wait()
        runs.append(sink.tokens)
    assert runs[0] == runs[1] and len(runs[0]) == 16


def test_scheduler_cancel_deadline_and_limits(tiny: LoadedModel, scheduler: Scheduler) -> None:
    long = Collector()
    scheduler.submit(request_for(tiny, "long", [1, 2, 3], 4000), long)
    with pytest.raises(AlreadyExists):
        scheduler.submit(request_for(tiny, "long", [1, 2, 3], 10), Collector())
    wait_for(lambda: bool(long.tokens), "the long row's first token")
    assert scheduler.cancel("long")
    assert long.wait().reason == "cancelled"
    assert not scheduler.cancel("long")  # finished: unknown now
    late = Collector()
    request = request_for(tiny, "late", [1, 2, 3], 4000)
    request.deadline = time.monotonic() - 1
    scheduler.submit(request, late)
    assert late.wait().reason == "deadline"
    assert scheduler.stats().cancelled_total == 2
    # 4 running + 2 queued fit; the 7th is refused, naming the limits.
    sinks = [Collector() for _ in range(6)]
    for i, sink in enumerate(sinks):
        scheduler.submit(request_for(tiny, f"fill{i}", [4, 5], 4000), sink)
    with pytest.raises(Overloaded, match="--max-running 4"):
        scheduler.submit(request_for(tiny, "one-too-many", [4, 5], 10), Collector())
    scheduler.shutdown()
    for sink in sinks:
        assert sink.wait().reason == "cancelled"
    with pytest.raises(Unavailable):
        scheduler.submit(request_for(tiny, "after", [4, 5], 10), Collector())


# -- the spill queue against a fake sink -------------------------------------------------------


class FakeSink:
    """Records what reaches it; `gate` holds puts back, `down` makes them fail. `entered` is
    set once a put has reached the sink (held there while the gate is shut); `log` is what
    landed, in order, with the store's Flush calls among them."""

    def __init__(self) -> None:
        self.puts: list[bytes] = []
        self.deletes: list[bytes] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.down = False
        self.flushes = 0
        self.batches: list[int] = []  # records per put_many call
        self.delete_batches: list[tuple[str, int]] = []  # (namespace, keys) per delete_many
        self.log: list[str] = []

    def put(
        self,
        checkpoint: Checkpoint,
        *,
        if_absent: bool = False,
        pin_ttl_s: int = 0,
        pin_holder: str = "",
    ) -> object:
        self.entered.set()
        assert self.gate.wait(30)
        if self.down:
            raise StoreUnavailable("store down")
        self.puts.append(checkpoint.key)
        self.log.append("put " + checkpoint.key.decode())
        return None

    def put_many(self, items: Sequence[PutItem]) -> object:
        self.batches.append(len(items))
        for stored, item in enumerate(items):
            try:
                self.put(item.checkpoint)
            except TandemError as exc:
                raise PutManyFailed(exc, stored) from None
        return None

    def delete(self, key: bytes, namespace: str = "", *, force: bool = False) -> int:
        self.deletes.append(key)
        self.log.append("delete " + key.decode())
        return 0

    def delete_many(self, keys: list[bytes], namespace: str = "", *, force: bool = False) -> int:
        self.delete_batches.append((namespace, len(keys)))
        for key in keys:
            self.delete(key, namespace, force=force)
        return 0

    def flush(self) -> bool:
        self.flushes += 1
        self.log.append("flush")
        return not self.down

    def pin(
        self,
        key: bytes,
        namespace: str = "",
        *,
        ttl_s: int = 0,
        holder: str = "",
        lease_id: str = "",
    ) -> Lease:
        self.log.append(f"pin {key.decode()} {lease_id}".rstrip())
        if key not in self.puts:
            raise StoreNotFound(f"no record {key!r}")
        return Lease(lease_id or f"lease-{len(self.log)}", holder, 0)

    def unpin(self, key: bytes, lease_id: str, namespace: str = "") -> None:
        self.log.append(f"unpin {key.decode()} {lease_id}")


def _put(key: bytes, nbytes: int, **kw: object) -> Put:
    record = Checkpoint(key=key, tensors=[Tensor("t", "uint8", (nbytes,), bytes(nbytes))])
    return Put(record, nbytes, **kw)  # type: ignore[arg-type]


def test_a_burst_is_gathered_from_its_arrival_not_from_its_planning() -> None:
    """The admission window runs from the newest arrival's reaching the engine: a request
    planned for longer than a window (a store read) is admitted without waiting again, one
    that just arrived waits for the rest of its burst."""
    drains: list[int] = []

    def drain() -> bool:
        drains.append(1)
        return True

    def gather(arrived_ago_s: float) -> None:
        arrival = time.monotonic() - arrived_ago_s
        assert gather_burst(
            window_s=0.002,
            windows=25,
            has_room=lambda: True,
            waiting=lambda: 1,
            drain=drain,
            newest_arrival=lambda: arrival,
        )

    gather(arrived_ago_s=10.0)  # planned for ten seconds: its window is long over
    assert drains == []
    gather(arrived_ago_s=0.0)  # just arrived: one window for the rest of its burst
    assert drains == [1]


def test_spill_queue_is_bounded_and_flush_is_a_barrier() -> None:
    sink, counters = FakeSink(), CheckpointCounters()
    spill = SpillQueue(sink, capacity_bytes=100, counters=counters)
    sink.gate.clear()  # the first put is held at the sink: the rest wait in the queue
    assert spill.put(_put(b"a", 60))
    assert not spill.put(_put(b"b", 60))  # 120 > 100 bytes: dropped, counted
    assert spill.put(_put(b"c", 40))
    spill.delete(b"a", "default")
    assert counters.snapshot().dropped == 1
    assert counters.snapshot().queued_bytes == 100
    result: list[object] = []
    barrier = threading.Thread(target=lambda: result.append(spill.flush(timeout=30)))
    barrier.start()
    # "a" is held inside the sink (observed, not slept for): nothing queued behind it, the
    # barrier included, can have been passed.
    wait_for(sink.entered.is_set, "the first put held at the sink")
    assert not result and barrier.is_alive()  # the barrier waits for what was queued before it
    assert sink.flushes == 0
    sink.gate.set()
    barrier.join(30)
    (flushed,) = result
    assert sink.puts == [b"a", b"c"] and sink.deletes == [b"a"] and sink.flushes == 1
    # The store's Flush came only after everything queued before the barrier had landed.
    assert sink.log == ["put a", "put c", "delete a", "flush"]
    assert flushed.flushed == 2 and flushed.missing == 1 and flushed.failed == 0  # type: ignore[attr-defined]
    assert not flushed.durable  # type: ignore[attr-defined]  # one was dropped
    assert spill.flush().durable  # nothing lost since the last barrier
    stats = counters.snapshot()
    assert stats.saved == 2 and stats.saved_bytes == 100 and stats.queued_bytes == 0


def test_puts_queued_together_leave_in_one_call_and_keep_their_order() -> None:
    sink, counters = FakeSink(), CheckpointCounters()
    spill = SpillQueue(sink, capacity_bytes=1 << 20, counters=counters)
    sink.gate.clear()
    spill.put(_put(b"first", 10))  # taken at once, held at the sink
    wait_for(sink.entered.is_set, "the first put held at the sink")  # alone in its call
    for i in range(5):
        spill.put(_put(b"p%d" % i, 10))
    spill.delete(b"p0", "default")  # a delete ends a batch: it keeps its place
    spill.put(_put(b"last", 10))
    # Deletes back to back of one namespace leave together, in order.
    for key, namespace in [(b"d0", "a"), (b"d1", "a"), (b"d2", "a"), (b"d3", "b")]:
        spill.delete(key, namespace)
    spill.put(_put(b"after", 10))
    sink.gate.set()
    result = spill.flush()
    assert sink.puts == [b"first", b"p0", b"p1", b"p2", b"p3", b"p4", b"last", b"after"]
    assert sink.batches == [5] and sink.deletes == [b"p0", b"d0", b"d1", b"d2", b"d3"]
    assert sink.delete_batches == [("a", 3)]  # p0 and d3 went alone
    assert sink.log.index("delete d3") < sink.log.index("put after")
    assert result.durable and result.flushed == 8


def test_spill_queue_counts_failures_and_skips_unwanted_puts() -> None:
    sink, counters = FakeSink(), CheckpointCounters()
    spill = SpillQueue(sink, capacity_bytes=1 << 20, counters=counters)
    failed: list[bytes] = []
    sink.down = True
    spill.put(_put(b"x", 10, on_failed=lambda: failed.append(b"x")))
    spill.put(_put(b"y", 10, on_failed=lambda: failed.append(b"y")))  # fails fast: backoff
    result = spill.flush()
    assert not result.durable and result.failed == 2 and failed == [b"x", b"y"]
    assert counters.snapshot().store_up is False
    sink.down = False

    # While the backoff lasts puts fail fast without reaching the sink; a probe a flush shows
    # when they are sent again (whatever the backoff's length).
    def a_probe_lands() -> bool:
        spill.put(_put(b"probe", 10))
        spill.flush()
        return b"probe" in sink.puts

    wait_for(a_probe_lands, "a put sent again after the backoff")
    assert counters.snapshot().store_up is True
    sink.puts.clear()
    spill.put(_put(b"skip", 10, still_wanted=lambda: False))
    spill.put(_put(b"z", 10))
    result = spill.flush()
    assert sink.puts == [b"z"] and result.failed == 1 and result.flushed == 1
    assert counters.snapshot().store_up is True


def test_a_lease_is_taken_renewed_and_given_back_in_queue_order() -> None:
    """A Pin goes out after the Puts queued before it (a chain's base is pinned once its
    record landed), renews the lease it was granted, and an Unpin gives that lease back. A
    Pin on a record the store lacks calls its on_failed, and what was queued behind it on
    that condition is not sent."""
    sink, counters = FakeSink(), CheckpointCounters()
    spill = SpillQueue(sink, capacity_bytes=1 << 20, counters=counters)
    lease = BaseLease(b"base", "default")
    spill.put(_put(b"base", 10, pinned=False))
    spill.pin(Pin(lease, "engine/test"))
    spill.pin(Pin(lease, "engine/test"))  # renewed: the same lease
    spill.unpin(lease)
    assert spill.flush().durable
    granted = lease.lease_id
    assert granted and sink.log == [
        "put base",
        "pin base",
        f"pin base {granted}",
        f"unpin base {granted}",
        "flush",
    ]

    broken: list[str] = []
    missing = BaseLease(b"gone", "default")
    spill.pin(Pin(missing, "engine/test", on_failed=lambda: broken.append("gone")))
    spill.put(_put(b"rests-on-it", 10, still_wanted=lambda: not broken))
    spill.unpin(missing)  # never granted: nothing to give back
    result = spill.flush()
    assert broken == ["gone"] and missing.lease_id == ""
    assert b"rests-on-it" not in sink.puts and result.failed == 1
    assert not any(entry.startswith("unpin gone") for entry in sink.log)


# -- prefix reuse: a local hit never leaves the device ------------------------------------------


def test_a_local_prefix_hit_reuses_the_captured_arrays(tiny: LoadedModel) -> None:
    reuse = PrefixReuse("m", PrefixCache(1 << 30), CheckpointCounters())
    prompt = [(i * 37) % 1900 + 3 for i in range(200)]
    caches = make_prompt_cache(tiny.model)
    tiny.model(mx.array([prompt[:129]]), cache=caches)  # a 128-token prompt + its first token
    reuse.saves.save(caches, prompt[:128], "ns", list(tiny.layout))
    plan = reuse.find(prompt, "ns", list(tiny.layout))
    assert isinstance(plan, PrefixPlan) and plan.source == "local" and plan.matched == 128
    assert plan.local is not None
    restored, unconfirmed = reuse.materialize(plan)
    assert restored is not None and unconfirmed is None
    # The very arrays the local tier holds: no copy through host memory.
    assert restored[0].keys is plan.local.arrays["l0.0"]
    assert reuse.counters.snapshot().local_hits == 1
    # ... and the same caches as the round trip through the record's bytes would give.
    through_bytes = restore(plan.local.meta(), to_host(plan.local), list(tiny.layout))
    trim_prompt_cache(through_bytes, plan.local.tokens - plan.matched)
    rest = mx.array([prompt[128:140]])
    got = tiny.model(rest, cache=restored)
    want = tiny.model(rest, cache=through_bytes)
    assert mx.array_equal(got, want).item()


# -- generation checkpoints: a resume reads exactly the segments its manifest lists ------------


def test_a_direct_hit_used_before_its_verdict_counts_only_once_confirmed(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """A direct store hit (docs/store.md, "Direct reads") materialized with confirm_later:
    its caches are usable at once and count nothing yet; after use, `confirm` counts the hit
    when the store's check passed and the lease held, and refuses it (the scheduler then
    recomputes the row) when the lease lapsed first."""
    store = CheckpointStore(StoreConfig(data_dir=tmp_path / "store", direct_read_ttl_s=60))
    server, port, _ = create_server(store, "127.0.0.1:0")
    server.start()
    address, layout = f"127.0.0.1:{port}", list(tiny.layout)
    prompt = [(i * 37) % 1900 + 3 for i in range(200)]
    writer = CheckpointManager(tiny, CheckpointSettings(store=address))
    reader = CheckpointManager(tiny, CheckpointSettings(store=address))  # nothing local
    try:
        caches = make_prompt_cache(tiny.model)
        tiny.model(mx.array([prompt[:129]]), cache=caches)
        writer.prefixes.saves.save(caches, prompt[:128], "ns", layout)
        assert writer.flush().durable
        rest = mx.array([prompt[128:140]])
        want = tiny.model(rest, cache=restore_from(writer, prompt, layout))

        plan = reader.prefixes.find(prompt, "ns", layout)
        assert isinstance(plan, PrefixPlan) and plan.route == "direct"
        restored, read = reader.prefixes.materialize(plan, confirm_later=True)
        assert restored is not None and read is not None
        # Landed with a batch step of room, the matched positions only (host_plane).
        assert restored[0].offset == plan.matched
        assert restored[0].keys.shape[2] == plan.matched + BatchQuantizedKVCache.step
        assert reader.counters.snapshot().store_hits == 0  # not yet
        got = tiny.model(rest, cache=restored)
        assert reader.prefixes.confirm(read)
        assert mx.array_equal(got, want).item()
        assert reader.counters.snapshot().store_hits == 1

        store.direct.ttl_s = 0.05  # the next lease lapses before it is confirmed
        plan = reader.prefixes.find(prompt, "ns", layout)
        assert isinstance(plan, PrefixPlan) and isinstance(plan.hold, DirectHold)
        arrival = plan.hold.arrival
        wait_for(lambda: arrival.verified == arrival.total, "the store's verdict")
        wait_for(lambda: store.direct.counts()[1] >= 1, "the lease's lapse")
        restored, read = reader.prefixes.materialize(plan, confirm_later=True)
        assert restored is not None and read is not None
        assert not reader.prefixes.confirm(read)
        stats = reader.counters.snapshot()
        assert stats.store_hits == 1 and stats.restore_failures == 1
    finally:
        reader.close()
        writer.close()
        server.stop(None).wait()
        store.close()


def restore_from(manager: CheckpointManager, prompt: list[int], layout: list[str]) -> list[Any]:
    """The prompt's prefix restored from the manager's own local tier."""
    plan = manager.prefixes.find(prompt, "ns", layout)
    assert isinstance(plan, PrefixPlan) and plan.local is not None
    caches, _ = manager.prefixes.materialize(plan)
    assert caches is not None
    return caches


def test_resume_reads_the_manifest_then_the_chain_as_far_as_it_runs(
    tiny: LoadedModel, inprocess_store: str
) -> None:
    """A chain's manifest names its first segment only; the later segments say their own
    state. A resume reads the chain on from the manifest, stops at a gap, and continues
    exactly from the last segment it could read."""
    checkpoints = CheckpointManager(tiny, CheckpointSettings(store=inprocess_store))
    request, key = kept_generation(tiny, checkpoints)
    gens = checkpoints.generations
    with StoreClient(inprocess_store) as store:
        manifest = store.get_header(key)
        first, listed = int(manifest.metadata["chain_first"]), int(manifest.metadata["chain_next"])
        assert listed == first + 1  # the chain's first segment, a whole snapshot
        engine_store = gens.loads.store
        assert engine_store is not None
        before, routes = store.stats(), engine_store.read_routes
        plan = gens.loads.load(key, "default", request.prompt, request.layout)
        after = store.stats()
        assert plan.chain_first == first and plan.chain_next - first >= 4  # later segments read
        assert len(plan.parts) == plan.chain_next - first
        assert after.misses - before.misses == MAX_CHAIN - len(plan.parts)  # probes past it
        # Headers first (the manifest's, a payload-less record, with them), then each
        # payload into a span of its size: every segment through the region, none streamed
        # for want of a free span.
        read = Counter(engine_store.read_routes) - Counter(routes)
        assert read == Counter(region=len(plan.parts))
        # The segments' tensors view their spans until the arrays are made, then give them
        # back: none is left lent.
        # (Other spans may come and go meanwhile: MLX-CUDA stages checkpoint captures there.)
        reads = engine_store._reads
        assert reads is not None and len(plan.holds) == len(plan.parts)
        lent = sum(h.span.size for h in plan.holds)
        free = reads.free_bytes
        continues_exactly(tiny, gens, plan, request.prompt)
        assert reads.free_bytes >= free + lent and all(h.released for h in plan.holds)

        # A gap (a later segment lost): the resume stops before it, from an older state.
        store.delete(segment_key(key, first + 2), "default", force=True)
        older = gens.loads.load(key, "default", request.prompt, request.layout)
    assert older.chain_next == first + 2 and len(older.replay) < len(plan.replay)
    continues_exactly(tiny, gens, older, request.prompt)


def test_a_later_segment_holds_its_own_tokens_and_a_digest_of_those_before(
    tiny: LoadedModel, inprocess_store: str
) -> None:
    """A later chain segment carries the tokens of its own positions and a digest of every
    token before them (chain_tokens.py), not the whole list; a resume rebuilds the list from
    the manifest's. An older engine's segment (the whole list, no digest) continues a chain
    too; one whose digest names other tokens is another run's: the chain ends before it."""
    checkpoints = CheckpointManager(tiny, CheckpointSettings(store=inprocess_store))
    request, key = kept_generation(tiny, checkpoints)
    gens = checkpoints.generations
    plan = gens.loads.load(key, "default", request.prompt, request.layout)
    plan.release()
    first = plan.chain_first
    assert plan.chain_next - first >= 4
    tokens = [*request.prompt, *plan.generated]

    def load() -> ResumePlan:
        return gens.loads.load(key, "default", request.prompt, request.layout)

    with StoreClient(inprocess_store) as store:
        end = len(store.get_header(key).token_ids)  # the manifest's: every token then
        for index in range(first + 1, plan.chain_next):
            header = store.get_header(segment_key(key, index))
            start = int(header.metadata["start"])
            assert start == end and len(header.token_ids) > 0
            assert header.token_ids == tokens[start : start + len(header.token_ids)]
            before = TokenDigest()
            before.feed(tokens[:start])
            assert header.metadata[TOKENS_BEFORE] == before.hexdigest()
            end = start + len(header.token_ids)
        assert end == len(tokens)

        later = segment_key(key, first + 2)
        older = store.get(later)  # as an engine before the digest wrote it
        start = int(older.metadata["start"])
        older.token_ids = tokens[: start + len(older.token_ids)]
        older.token_count = len(older.token_ids)
        del older.metadata[TOKENS_BEFORE]
        store.put(older)
        same = load()
        assert (same.chain_next, same.generated) == (plan.chain_next, plan.generated)
        continues_exactly(tiny, gens, same, request.prompt)

        other = store.get(later)  # another run's: other tokens before it
        other.metadata[TOKENS_BEFORE] = "0" * 32
        store.put(other)
        cut = load()
        assert cut.chain_next == first + 2 and len(cut.generated) < len(plan.generated)
        continues_exactly(tiny, gens, cut, request.prompt)


# Runs of 4 segments merging 3 at a time (the engine's 16 and 8): the same settling and
# merging in an eighth of the tokens.
SHORT_CHAIN, SHORT_FANOUT = 4, 3


@pytest.fixture
def short_chains(monkeypatch: pytest.MonkeyPatch) -> None:
    """SHORT_CHAIN and SHORT_FANOUT in every engine module that took the constants (the
    writer's policy and the reader's bound alike)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("engine_service."):
            if getattr(module, "MAX_CHAIN", None) == MAX_CHAIN:
                monkeypatch.setattr(module, "MAX_CHAIN", SHORT_CHAIN)
            if getattr(module, "MERGE_FANOUT", None) == MERGE_FANOUT:
                monkeypatch.setattr(module, "MERGE_FANOUT", SHORT_FANOUT)


@pytest.mark.usefixtures("short_chains")
def test_full_runs_settle_into_parts_that_merge_a_level_at_a_time(
    tiny: LoadedModel, inprocess_store: str
) -> None:
    """Past MAX_CHAIN segments a run settles: its first segment becomes a part of the chain
    and the next run starts after it (the prompt is not stored again), the run's later
    segments deleted once that manifest is queued. MERGE_FANOUT - 1 parts of one level and
    the run after them merge into one part of the next. The manifest names the parts under
    keys an engine that predates them does not read as a chain; a resume reads them and
    continues exactly. A chain whose whole snapshot is older than half its lease starts over
    with a whole snapshot instead. A prompt shorter than a block has no prefix record: its
    chain starts at position 0; a longer one's rests on its prompt's record (the chain's
    positions start after it)."""
    checkpoints = CheckpointManager(tiny, CheckpointSettings(store=inprocess_store))
    gens = checkpoints.generations
    every = 8 * SHORT_CHAIN  # tokens a run of segments holds (checkpoint_interval 8)

    def chain_of(prompt: list[int], runs: int) -> tuple[GenerationRequest, bytes, list[int]]:
        request, key = kept_generation(tiny, checkpoints, prompt, tokens=every * runs + 16)
        with StoreClient(inprocess_store) as store:
            meta = store.get_header(key).metadata
            # Only engines that know parts see a chain; older ones refuse it by its codec.
            assert "chain_first" not in meta
            based = len(prompt) >= BLOCK_SIZE
            assert meta["codec"] == (BASED_CODEC_VERSION if based else STACKED_CODEC_VERSION)
            parts = [int(i) for i in meta["base_parts" if based else "chain_parts"].split(",")]
            first = int(meta["run_first"])
            keys = [segment_key(key, i) for i in range(first + 1)]
            reads = [
                r for at in range(0, len(keys), 64) for r in store.get_headers(keys[at : at + 64])
            ]
        assert first == SHORT_CHAIN * runs
        live = [i for i, read in enumerate(reads) if read.checkpoint is not None]
        assert live == [*parts, first]  # the runs' later segments and merged parts are gone
        # Each holds the positions after the one before: the prompt is stored once.
        end = len(prompt) if based else 0
        for read in reads:
            if read.checkpoint is not None:
                assert int(read.checkpoint.metadata["start"]) == end
                end += len(read.checkpoint.token_ids)
        plan = gens.loads.load(key, "default", request.prompt, request.layout)
        assert plan.chain_parts == tuple(parts) and plan.chain_first == first
        assert (plan.base is not None) == based
        continues_exactly(tiny, gens, plan, request.prompt)
        return request, key, parts

    prompt = [(j * 37) % 500 + 3 for j in range(400)]
    # FANOUT - 1 runs: the whole snapshot, then the settled runs' first segments (level 1).
    runs = SHORT_FANOUT - 1
    _, _, parts = chain_of(prompt[: BLOCK_SIZE - 8], runs)
    assert parts == list(range(0, runs * SHORT_CHAIN, SHORT_CHAIN)) and len(parts) >= 2
    # FANOUT runs: the level-1 parts and the run after them merged into one.
    _, _, parts = chain_of(prompt[::-1], SHORT_FANOUT)
    assert parts == [0]

    gens.chains.base_lease_s = 0  # every whole snapshot too old to build on
    request, key = kept_generation(tiny, checkpoints, prompt[1:], tokens=every + 16)
    with StoreClient(inprocess_store) as store:
        meta = store.get_header(key).metadata
        base = prefix_key(checkpoints.prefixes.scope("default", request.layout), prompt[1:])
        assert len(store.inspect(base).leases) == 1  # taken, then renewed
    assert int(meta["run_first"]) == SHORT_CHAIN and meta["base_parts"] == ""
    plan = gens.loads.load(key, "default", request.prompt, request.layout)
    # A whole snapshot again, after the base (every position from the prompt's end on).
    assert plan.base is not None and plan.base.key == base
    assert int(plan.parts[1].metadata["start"]) == len(prompt) - 1
    continues_exactly(tiny, gens, plan, request.prompt)


def test_a_damaged_later_segment_ends_the_chain_before_it(
    tiny: LoadedModel, tmp_path: Path
) -> None:
    """A chain segment written after the manifest whose bytes are damaged on disk (the store
    answers DATA_LOSS and sets it aside): the resume starts from the segment before it,
    exactly, rather than failing. (One the manifest names is DATA_LOSS, as before.)"""
    data_dir = tmp_path / "store"
    store = CheckpointStore(StoreConfig(data_dir=data_dir))
    server, port, _ = create_server(store, "127.0.0.1:0")
    server.start()
    address = f"127.0.0.1:{port}"
    checkpoints = CheckpointManager(tiny, CheckpointSettings(store=address))
    request, key = kept_generation(tiny, checkpoints)
    gens = checkpoints.generations
    whole = gens.loads.load(key, "default", request.prompt, request.layout)
    assert whole.chain_next - whole.chain_first >= 4
    damaged = StoredRecord.decode(
        store.state.storage.read(
            lambda txn: txn.get(
                record_key("default", segment_key(key, whole.chain_first + 2)),
                db=store.state.storage.db["headers"],
            )
        )
    )
    checkpoints.close()
    server.stop(None).wait()
    store.close()
    chunks = _chunk_order(data_dir)
    flip_stored_byte(data_dir, chunks.index(chunk_key(damaged.record_id, 0)), 5)

    store = CheckpointStore(StoreConfig(data_dir=data_dir))
    server, port, _ = create_server(store, "127.0.0.1:0")
    server.start()
    checkpoints = CheckpointManager(tiny, CheckpointSettings(store=f"127.0.0.1:{port}"))
    try:
        gens = checkpoints.generations
        older = gens.loads.load(key, "default", request.prompt, request.layout)
        assert older.chain_next == whole.chain_first + 2
        continues_exactly(tiny, gens, older, request.prompt)
        # The segments read after the damaged one were given back, unused.
        assert gens.loads.store is not None
        reads = gens.loads.store._reads
        assert reads is not None and reads.free_bytes + reads.retired_bytes == reads.usable
        # Quarantined now: its header probe says so, and a resume still stops before it.
        (probe,) = gens.loads.store.get_headers([segment_key(key, whole.chain_first + 2)])
        assert probe.checkpoint is None and probe.damaged
        again = gens.loads.load(key, "default", request.prompt, request.layout)
        assert again.chain_next == whole.chain_first + 2
        again.release()
    finally:
        checkpoints.close()
        server.stop(None).wait()
        store.close()


def _chunk_order(data_dir: Path) -> list[bytes]:
    """A closed store's chunk keys in key order (flip_stored_byte's numbering)."""
    env = lmdb.open(str(data_dir), max_dbs=16, readonly=True, lock=False)
    try:
        with env.begin(db=env.open_db(b"chunks", create=False)) as txn:
            return [bytes(k) for k, _ in txn.cursor()]
    finally:
        env.close()


def test_a_damaged_generation_checkpoint_is_refused_with_a_status(
    tiny: LoadedModel, inprocess_store: str
) -> None:
    """Whatever the MLX thread could not restore is refused on the handler thread, each with
    the error that becomes its status (DATA_LOSS, FAILED_PRECONDITION, NOT_FOUND)."""
    gens = CheckpointManager(tiny, CheckpointSettings(store=inprocess_store)).generations
    prompt, layout = [7, 8, 9, 10], list(tiny.layout)
    key = gens.key("default", prompt, SamplingOptions(), "damaged", layout)
    state = GenerationMeta(
        prompt_tokens=4, generated=2, pending=5, seed=0, max_tokens=10, options="00"
    ).to_metadata()
    skeleton = [{"class": "KVCache", "meta": [], "state": {"l": [{"t": "l0.0"}]}}]
    cache = {"codec": CODEC_VERSION, "layout": "|".join(layout), "cache": json.dumps(skeleton)}
    valid = Tensor("l0.0", "float32", (2, 8), bytes(64))
    # A round's segment: its layers' planes inside one stacked tensor (segment_capture.py).
    stacked = Tensor("kv", "float32", (2, 1, 4, 2), bytes(64))

    def planes(*leaves: object) -> dict[str, str]:
        layer = {"class": "KVCache", "meta": [], "state": {"l": [{"s": leaf} for leaf in leaves]}}
        return {**cache, "codec": STACKED_CODEC_VERSION, "cache": json.dumps([layer])}

    cases: list[tuple[dict[str, str], list[Tensor], type[Exception]]] = [
        ({**state, "generated": "two"}, [], Corrupt),
        ({**state, **planes(["kv", 0], ["kv", 2])}, [stacked], Corrupt),  # past its planes
        ({**state, **planes(["kv", 0], ["kv"])}, [stacked], Corrupt),  # malformed
        ({**state, **planes(["kv", 0], ["vk", 1])}, [stacked], Corrupt),  # not held
        ({**state, **planes(["kv", 0], ["kv", 1]), "codec": CODEC_VERSION}, [stacked], Corrupt),
        ({**state, "segments_first": "0"}, [], Precondition),  # an older engine's chain
        ({**state, **cache}, [], Corrupt),  # the skeleton names a tensor it lacks
        ({**state, **cache, "codec": "tandem.cache.v0"}, [valid], Precondition),
        ({**state, "chain_first": "0", "chain_next": "2"}, [], NotFound),  # segments absent
        ({**state, "chain_first": "0", "chain_next": "99"}, [], Corrupt),
    ]
    with StoreClient(inprocess_store) as store:
        for metadata, tensors, error in cases:
            record = Checkpoint(
                key=key,
                kind="generation",
                model_id=gens.model_id,
                layout=layout,
                token_ids=[*prompt, 1, 2],
                trimmable=False,
                metadata=metadata,
                tensors=tensors,
            )
            store.put(record)
            with pytest.raises(error):
                gens.loads.load(key, "default", prompt, layout)


# -- restore or prefill -------------------------------------------------------------------------


def test_a_store_hit_is_restored_only_when_loading_beats_computing() -> None:
    cost = RestoreCost(fixed_s=0.001)
    assert cost.worth_restoring(4096)  # nothing measured yet: restore
    cost.observe_prefill(tokens=1000, seconds=1.0)  # a slow prefill: 1,000 tokens/s
    cost.observe_restore(nbytes=64 << 20, tokens=4096, seconds=0.065)  # ~1 GB/s
    assert cost.worth_restoring(4096)  # ~67 ms to load against ~4 s to compute
    fast = RestoreCost(fixed_s=0.001)
    fast.observe_prefill(tokens=8192, seconds=0.4)  # a GPU: ~20k tokens/s
    fast.observe_restore(nbytes=896 << 20, tokens=8192, seconds=1.5)  # a slow store path
    assert not fast.worth_restoring(8192)  # ~1.5 s to load against ~0.4 s to compute
    snap = fast.snapshot()
    assert (snap.restore_chosen, snap.prefill_chosen) == (0, 1)
    assert 0.5e9 < snap.restore_bytes_per_second < 0.7e9
    assert 19_000 < snap.prefill_tokens_per_second < 21_000


def test_after_a_run_of_prefills_one_hit_is_restored_to_measure_the_store_again() -> None:
    cost = RestoreCost(fixed_s=0.001)
    cost.observe_prefill(tokens=8192, seconds=0.4)
    cost.observe_restore(nbytes=896 << 20, tokens=8192, seconds=1.5)  # a cold first restore
    choices = [cost.worth_restoring(8192) for _ in range(PROBE_EVERY * 2)]
    assert choices == ([False] * (PROBE_EVERY - 1) + [True]) * 2
    cost.observe_restore(nbytes=896 << 20, tokens=8192, seconds=0.05)  # the probe was fast
    cost.observe_restore(nbytes=896 << 20, tokens=8192, seconds=0.05)
    cost.observe_restore(nbytes=896 << 20, tokens=8192, seconds=0.05)
    cost.observe_restore(nbytes=896 << 20, tokens=8192, seconds=0.05)
    assert cost.worth_restoring(8192)  # the store is trusted again


def test_the_default_region_is_sized_for_the_backend_within_shared_memory() -> None:
    import shutil

    from engine_service.checkpoints.manager import region_bytes
    from tandem_client.regions import SHM_DIR

    assert region_bytes(12 << 20) == 12 << 20 and region_bytes(0) == 0
    auto = region_bytes(-1)
    assert auto % 4096 == 0
    assert 0 < auto <= min(256 << 20, shutil.disk_usage(SHM_DIR).free // 2)  # no GPU here


def test_rate_histograms_place_each_transfer_by_its_gb_per_second() -> None:
    counters = CheckpointCounters()
    counters.observe_restore(1_000_000_000, 2.0)  # 0.5 GB/s: the 0.5 bucket, edges included
    counters.observe_restore(3_000_000_000, 1.0)  # 3 GB/s: the 4.0 bucket
    counters.observe_restore(10**12, 1.0)  # 1000 GB/s: above every bound
    counters.observe_restore(0, 1.0)  # nothing moved: not a transfer
    snapshot = counters.snapshot()
    counters.observe_restore(1, 1.0)  # the snapshot is a copy
    cumulative = dict(snapshot.restore_rate.cumulative())
    assert (cumulative["0.25"], cumulative["0.5"], cumulative["2.0"]) == (0, 1, 1)
    assert (cumulative["4.0"], cumulative["64.0"], cumulative["+Inf"]) == (2, 2, 3)
    assert snapshot.restore_rate.sum_gbps == pytest.approx(1003.5)
    assert snapshot.checkpoint_rate.cumulative()[-1] == ("+Inf", 0)
