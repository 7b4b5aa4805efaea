"""A checkpoint round in-process: its segments cut from the batch together
(checkpoints/segment_capture.py), a stacked tensor a row, restore to the very caches the
row-by-row path's records do (same chain positions and tokens, over rows of different
lengths, chains that start over, and rows it leaves out); its captures are staged as host
bytes together (checkpoints/host_staging.py)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as cache_lib

from engine_service.checkpoints.cache_records import (
    STACKED_CODEC_VERSION,
    capture,
    check_restorable,
    restore,
    restore_captured,
    settle,
    settle_all,
    to_host,
)
from engine_service.checkpoints.device_landing import PUSH_ALIGN, Landing
from engine_service.checkpoints.generation_meta import segment_key
from engine_service.checkpoints.generations import GenerationCheckpoints
from engine_service.checkpoints.host_staging import HostStaging
from engine_service.checkpoints.segment_capture import STACKED, capture_together
from engine_service.checkpoints.spill import SpillQueue
from engine_service.kv.batch_cache import BatchQuantizedKVCache
from engine_service.loop.jobs import Job, PendingSnapshot, ReadySnapshot
from engine_service.protocol.checkpoint_stats import CheckpointCounters
from engine_service.protocol.requests import GenerationRequest
from engine_service.protocol.sampling_options import SamplingOptions
from store_service.config import StoreConfig
from store_service.server import create_server
from store_service.store import CheckpointStore
from tandem_client import Checkpoint, StoreClient
from tandem_client.records import Lease, PutItem
from tandem_client.regions import SharedRegion

LAYERS, HEADS, WIDTH = 3, 2, 8
PLAIN = ["kv:plain"] * LAYERS


def _batch(lengths: list[int], seed: int, heads: Sequence[int] = ()) -> list[BatchQuantizedKVCache]:
    """One batch cache per layer over rows holding `lengths` positions (bfloat16); heads:
    each layer's KV heads (HEADS each by default)."""
    layers = []
    for layer in range(LAYERS):
        rows = []
        h = heads[layer] if heads else HEADS
        for row, n in enumerate(lengths):
            k1, k2 = mx.random.split(mx.random.key(1000 * seed + 100 * layer + row))
            cache = cache_lib.KVCache()
            cache.update_and_fetch(
                mx.random.normal((1, h, n, WIDTH), key=k1).astype(mx.bfloat16),
                mx.random.normal((1, h, n, WIDTH), key=k2).astype(mx.bfloat16),
            )
            rows.append(cache)
        layers.append(BatchQuantizedKVCache.merge(rows))
    return layers


def _step(layers: list[BatchQuantizedKVCache], rows: int, seed: int) -> None:
    """One decode step's new position for every row."""
    for layer, cache in enumerate(layers):
        k1, k2 = mx.random.split(mx.random.key(1000 * seed + layer))
        cache.update_and_fetch(
            mx.random.normal((rows, HEADS, 1, WIDTH), key=k1).astype(mx.bfloat16),
            mx.random.normal((rows, HEADS, 1, WIDTH), key=k2).astype(mx.bfloat16),
        )


def _jobs(lengths: list[int], layouts: list[list[str]]) -> list[Job]:
    jobs = []
    for uid, (n, layout) in enumerate(zip(lengths, layouts, strict=True)):
        request = GenerationRequest(
            f"r{uid}", list(range(n - 1)), 64, SamplingOptions(), "", layout=layout
        )
        job = Job(request, lambda events: None, uid=uid, tokens=[7])  # prompt + 1 token held
        job.checkpoint_key = bytes([uid]) * 32
        jobs.append(job)
    return jobs


def _grow(jobs: list[Job], steps: int) -> None:
    for job in jobs:
        job.tokens.extend([5] * steps)


def _same(together: PendingSnapshot, alone: PendingSnapshot) -> None:
    """A row cut together: one stacked tensor, whose record (through host bytes, and checked
    as a resume checks it) and capture restore to the caches the row-by-row path's do."""
    a, b = together.captured, alone.captured
    settle_all([a])
    settle(b)
    assert together.segment == alone.segment
    assert together.generated == alone.generated
    assert a.tokens == b.tokens and a.layout == b.layout
    assert list(a.arrays) == [STACKED] and a.meta()["codec"] == STACKED_CODEC_VERSION
    assert a.nbytes == b.nbytes
    check_restorable(a.meta(), to_host(a), PLAIN)
    restored = [
        restore_captured(a, PLAIN),
        restore(a.meta(), to_host(a), PLAIN),
        restore_captured(b, PLAIN),
    ]
    for layer in zip(*restored, strict=True):
        first = layer[0]
        for cache in layer[1:]:
            assert type(cache) is type(first) is cache_lib.KVCache
            assert cache.offset == first.offset == a.tokens - together.segment.start  # type: ignore[union-attr]
            for plane, want in ((cache.keys, first.keys), (cache.values, first.values)):
                assert plane is not None and want is not None
                assert plane.shape == want.shape and plane.dtype == want.dtype == mx.bfloat16
                assert mx.array_equal(plane, want).item()


def _row_by_row(
    gens: GenerationCheckpoints, jobs: list[Job], layers: list[Any]
) -> dict[int, PendingSnapshot]:
    return {job.uid: gens.capture(job, [c.extract(job.uid) for c in layers]) for job in jobs}


@pytest.mark.parametrize("pack", [False, True])
def test_segments_cut_together_are_the_records_cut_row_by_row(pack: bool) -> None:
    lengths = [5, 9, 3, 9]
    layouts = [PLAIN, PLAIN, PLAIN, ["kv:affine8"] * LAYERS]  # the last is not segmentable
    layers = _batch(lengths, seed=1)
    together_gens = GenerationCheckpoints("m", CheckpointCounters())
    alone_gens = GenerationCheckpoints("m", CheckpointCounters())
    together_jobs, alone_jobs = _jobs(lengths, layouts), _jobs(lengths, layouts)
    uids = list(range(len(lengths)))

    for round_ in range(4):
        if round_ == 2:  # row 1's chain starts over: its segment begins at another column
            together_jobs[1].chain.covered = alone_jobs[1].chain.covered = 0
        due = [0, 1, 2] if round_ != 3 else [0, 2]  # consecutive rows, then a gather
        got = capture_together(together_gens, [together_jobs[u] for u in due], uids, layers, pack)
        assert sorted(got) == due
        want = _row_by_row(alone_gens, [alone_jobs[u] for u in due], layers)
        for uid in due:
            _same(got[uid], want[uid])
        # The job it could not cut is untouched: its chain did not move.
        left_out = capture_together(together_gens, [together_jobs[3]], uids, layers)
        assert left_out == {} and together_jobs[3].chain.next_index == 0
        for _ in range(3):
            _step(layers, len(lengths), seed=10 * round_ + _)
        _grow(together_jobs, 3)
        _grow(alone_jobs, 3)

    # Segments after the first hold only what is new since the row's last one.
    assert [got[0].segment.start, got[0].captured.tokens] == [11, 14]  # type: ignore[union-attr]


def test_layers_of_other_shapes_are_cut_together_into_the_row_by_row_records() -> None:
    """Layers whose planes differ (here in KV heads) cannot stack into one tensor: each
    plane is named on its own, the very record (names, metadata, bytes) the row-by-row path
    writes."""
    lengths, heads = [5, 9], [2, 4, 1]
    layers = _batch(lengths, seed=2, heads=heads)
    together_gens = GenerationCheckpoints("m", CheckpointCounters())
    alone_gens = GenerationCheckpoints("m", CheckpointCounters())
    together_jobs, alone_jobs = _jobs(lengths, [PLAIN] * 2), _jobs(lengths, [PLAIN] * 2)
    got = capture_together(together_gens, together_jobs, [0, 1], layers)
    want = _row_by_row(alone_gens, alone_jobs, layers)
    for uid in (0, 1):
        a, b = got[uid].captured, want[uid].captured
        settle(a)
        settle(b)
        assert got[uid].segment == want[uid].segment and a.meta() == b.meta()
        assert list(a.arrays) == list(b.arrays) == [f"l{i}.{j}" for i in range(3) for j in (0, 1)]
        for name, array in a.arrays.items():
            assert np.array_equal(np.array(array), np.array(b.arrays[name])), name


class _HostPush(Landing):
    """PinnedLanding's contract without a GPU: the arrays' bytes copied into each span at
    PUSH_ALIGN steps; the pushes named in `refuse` are refused (None), as a span that does
    not fit is."""

    kind = "pinned"

    def __init__(self, refuse: set[int]) -> None:
        self.refuse = refuse
        self.calls = 0

    def push_many(
        self, pushes: list[tuple[list[mx.array], memoryview]]
    ) -> tuple[list[list[memoryview] | None], list[mx.array]]:
        self.calls += 1
        out: list[list[memoryview] | None] = []
        done: list[mx.array] = []
        for i, (arrays, span) in enumerate(pushes):
            if i in self.refuse:
                out.append(None)
                continue
            views, at = [], 0
            for array in arrays:
                data = np.array(mx.contiguous(array).reshape(-1).view(mx.uint8)).tobytes()
                span[at : at + len(data)] = data
                views.append(span[at : at + len(data)])
                at += -(-len(data) // PUSH_ALIGN) * PUSH_ALIGN
                done.append(mx.array([1], dtype=mx.uint8))  # the device's completion flag
            out.append(views)
        return out, done


def test_a_rounds_captures_are_staged_together_each_into_its_own_span(tmp_path: Path) -> None:
    """HostStaging.tensors_many: one push for the round, waited on by the caller; each
    capture's tensors hold its own bytes, a pushed one's in its span (held until sent), a
    refused one's viewing its arrays, its span given back."""
    store = CheckpointStore(StoreConfig(data_dir=tmp_path / "store"))
    server, port, _ = create_server(store, "127.0.0.1:0")
    server.start()
    layers = _batch([6, 4, 5], seed=3)
    captures = [capture([c.extract(row) for c in layers], 9) for row in range(3)]
    landing = _HostPush(refuse={1})
    try:
        with StoreClient(f"127.0.0.1:{port}") as client, SharedRegion(8 << 20) as region:
            client.attach_region(region)
            staging = HostStaging(landing, client)
            staged = staging.tensors_many(captures)
            assert landing.calls == 1 and staging.pushed == 2
            assert staged.pushes  # not waited on yet: the caller waits a step later
            staged.wait()
            assert not staged.pushes
            for captured, (tensors, _) in zip(captures, staged.tensors, strict=True):
                assert [t.name for t in tensors] == list(captured.arrays)
                for tensor, array in zip(tensors, captured.arrays.values(), strict=True):
                    assert bytes(tensor.data) == np.array(array).tobytes()
            assert [hold is None for _, hold in staged.tensors] == [False, True, False]
            usable = (8 << 20) // 4096 * 4096 - 4096  # all of it past the first page
            assert client.reserve_span(usable) is None  # two spans still held
            for _, hold in staged.tensors:
                if hold is not None:
                    hold.release()
            whole = client.reserve_span(usable)  # the refused capture's span came back too
            assert whole is not None
            whole.release()
    finally:
        server.stop(None).wait()
        store.close()


class _Recorder:
    """The spill queue's sink, recording what reaches it in order (kind and key)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, bytes]] = []

    def put(self, checkpoint: Checkpoint, **_: object) -> object:
        self.log.append((f"put {checkpoint.kind}", checkpoint.key))
        return None

    def put_many(self, items: Sequence[PutItem]) -> object:
        for item in items:
            self.put(item.checkpoint)
        return None

    def delete(self, key: bytes, namespace: str = "", *, force: bool = False) -> int:
        self.log.append(("delete", key))
        return 0

    def delete_many(self, keys: list[bytes], namespace: str = "", *, force: bool = False) -> int:
        for key in keys:
            self.delete(key)
        return 0

    def flush(self) -> bool:
        return True

    def pin(
        self,
        key: bytes,
        namespace: str = "",
        *,
        ttl_s: int = 0,
        holder: str = "",
        lease_id: str = "",
    ) -> Lease:
        raise AssertionError("these rows' chains rest on no prefix record")

    def unpin(self, key: bytes, lease_id: str, namespace: str = "") -> None:
        raise AssertionError("these rows' chains rest on no prefix record")


def test_a_round_reaches_the_store_a_step_later_and_before_anything_saved_after_it() -> None:
    """save_round stages a step's snapshots and queues them at the next step (so a GPU's push
    is waited on after the step behind it): before any later write of the same checkpoints
    (a save, a tombstone), so records reach the store in the order they were saved."""
    sink = _Recorder()
    spill = SpillQueue(sink, capacity_bytes=1 << 30, counters=CheckpointCounters())
    gens = GenerationCheckpoints("m", CheckpointCounters(), spill=spill)
    lengths = [5, 7]
    layers = _batch(lengths, seed=4)
    jobs = _jobs(lengths, [PLAIN, PLAIN])
    uids = [0, 1]

    def round_() -> None:
        got = capture_together(gens, jobs, uids, layers)
        gens.save_round([ReadySnapshot(job, got[job.uid], 5) for job in jobs])

    round_()
    assert all(job.checkpointed for job in jobs)  # a job ending now is forgotten
    assert spill.flush().flushed == 0 and sink.log == []  # staged, not queued
    gens.save_round([])  # the next step
    assert spill.flush().flushed == 4
    kinds = [kind for kind, _ in sink.log]
    assert kinds == ["put object", "put generation"] * 2  # each segment, then its manifest

    sink.log.clear()
    for step in range(2):
        _step(layers, len(lengths), seed=50 + step)
    _grow(jobs, 2)
    round_()
    gens.forget(jobs[0])  # ends before the next step: the round goes first
    assert spill.flush().durable
    # The round's segments (a chain's later ones: no manifest of their own) went first.
    tombstone = sink.log.index(("put object", jobs[0].checkpoint_key))
    for job in jobs:
        assert sink.log.index(("put object", segment_key(job.checkpoint_key, 1))) < tombstone
    assert "put generation" not in {kind for kind, _ in sink.log}
    segments = [segment_key(jobs[0].checkpoint_key, i) for i in (0, 1)]
    assert sink.log[-2:] == [("delete", key) for key in segments]


def test_a_rounds_segments_move_to_host_memory_as_one_buffer(tmp_path: Path) -> None:
    """Segments cut together share one stacked buffer: the round is pushed as that one array,
    into one span every row's tensors view (the span lives while any of them is unsent)."""
    store = CheckpointStore(StoreConfig(data_dir=tmp_path / "store"))
    server, port, _ = create_server(store, "127.0.0.1:0")
    server.start()
    lengths = [6, 8, 7]
    layers = _batch(lengths, seed=5)
    jobs = _jobs(lengths, [PLAIN] * 3)
    gens = GenerationCheckpoints("m", CheckpointCounters())
    first = capture_together(gens, jobs, [0, 1, 2], layers, pack=True)
    # Whole rows at first: three lengths, three columns they start at, three buffers. Then
    # the new positions of all three start at one column: one buffer.
    packed = [s.captured.packed for s in first.values()]
    assert len({id(p.buffer) for p in packed if p is not None}) == 3
    for step in range(3):
        _step(layers, len(lengths), seed=60 + step)
    _grow(jobs, 3)
    got = capture_together(gens, jobs, [0, 1, 2], layers, pack=True)
    captures = [got[uid].captured for uid in (0, 1, 2)]
    pushed: list[int] = []

    class _Counting(_HostPush):
        def push_many(
            self, pushes: list[tuple[list[mx.array], memoryview]]
        ) -> tuple[list[list[memoryview] | None], list[mx.array]]:
            pushed.extend(len(arrays) for arrays, _ in pushes)
            return super().push_many(pushes)

    try:
        with StoreClient(f"127.0.0.1:{port}") as client, SharedRegion(8 << 20) as region:
            client.attach_region(region)
            staged = HostStaging(_Counting(refuse=set()), client).tensors_many(captures)
            staged.wait()
            assert pushed == [1]  # one array for the whole round
            holds = {id(hold) for _, hold in staged.tensors}
            assert len(holds) == 1 and None not in {hold for _, hold in staged.tensors}
            for captured, (tensors, _) in zip(captures, staged.tensors, strict=True):
                assert [t.name for t in tensors] == list(captured.arrays)
                for tensor, array in zip(tensors, captured.arrays.values(), strict=True):
                    assert bytes(tensor.data) == np.array(array).tobytes()
    finally:
        server.stop(None).wait()
        store.close()
