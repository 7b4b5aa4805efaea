"""A checkpoint round in-process: its segments cut from the batch together
(checkpoints/segment_capture.py) are the very records the row-by-row path writes (same names,
metadata, bytes and chain positions, over rows of different lengths, chains that start over,
and rows it leaves out); its captures are staged as host bytes together
(checkpoints/host_staging.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as cache_lib

from engine_service.checkpoints.cache_records import capture, settle
from engine_service.checkpoints.device_landing import PUSH_ALIGN, Landing
from engine_service.checkpoints.generations import GenerationCheckpoints
from engine_service.checkpoints.host_staging import HostStaging
from engine_service.checkpoints.segment_capture import capture_together
from engine_service.kv.batch_cache import BatchQuantizedKVCache
from engine_service.loop.jobs import Job, PendingSnapshot
from engine_service.protocol.checkpoint_stats import CheckpointCounters
from engine_service.protocol.requests import GenerationRequest
from engine_service.protocol.sampling_options import SamplingOptions
from store_service.config import StoreConfig
from store_service.server import create_server
from store_service.store import CheckpointStore
from tandem_client import StoreClient
from tandem_client.regions import SharedRegion

LAYERS, HEADS, WIDTH = 3, 2, 8
PLAIN = ["kv:plain"] * LAYERS


def _batch(lengths: list[int], seed: int) -> list[BatchQuantizedKVCache]:
    """One batch cache per layer over rows holding `lengths` positions (bfloat16)."""
    layers = []
    for layer in range(LAYERS):
        rows = []
        for row, n in enumerate(lengths):
            k1, k2 = mx.random.split(mx.random.key(1000 * seed + 100 * layer + row))
            cache = cache_lib.KVCache()
            cache.update_and_fetch(
                mx.random.normal((1, HEADS, n, WIDTH), key=k1).astype(mx.bfloat16),
                mx.random.normal((1, HEADS, n, WIDTH), key=k2).astype(mx.bfloat16),
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


def _same(a: PendingSnapshot, b: PendingSnapshot) -> None:
    settle(a.captured)
    settle(b.captured)
    assert a.segment == b.segment
    assert a.generated == b.generated
    assert a.captured.meta() == b.captured.meta()
    assert a.captured.tokens == b.captured.tokens
    assert list(a.captured.arrays) == list(b.captured.arrays)
    for name, array in a.captured.arrays.items():
        other = b.captured.arrays[name]
        assert array.shape == other.shape and array.dtype == other.dtype
        assert np.array_equal(np.array(array), np.array(other)), name


def _row_by_row(
    gens: GenerationCheckpoints, jobs: list[Job], layers: list[Any]
) -> dict[int, PendingSnapshot]:
    return {job.uid: gens.capture(job, [c.extract(job.uid) for c in layers]) for job in jobs}


def test_segments_cut_together_are_the_records_cut_row_by_row() -> None:
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
        got = capture_together(together_gens, [together_jobs[u] for u in due], uids, layers)
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
    ) -> list[list[memoryview] | None]:
        self.calls += 1
        out: list[list[memoryview] | None] = []
        for i, (arrays, span) in enumerate(pushes):
            if i in self.refuse:
                out.append(None)
                continue
            views, at = [], 0
            for array in arrays:
                data = np.array(array).tobytes()
                span[at : at + len(data)] = data
                views.append(span[at : at + len(data)])
                at += -(-len(data) // PUSH_ALIGN) * PUSH_ALIGN
            out.append(views)
        return out


def test_a_rounds_captures_are_staged_together_each_into_its_own_span(tmp_path: Path) -> None:
    """HostStaging.tensors_many: one push for the round; each capture's tensors hold its own
    bytes, a pushed one's in its span (held until sent), a refused one's viewing its arrays,
    its span given back."""
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
            for captured, (tensors, _) in zip(captures, staged, strict=True):
                assert [t.name for t in tensors] == list(captured.arrays)
                for tensor, array in zip(tensors, captured.arrays.values(), strict=True):
                    assert bytes(tensor.data) == np.array(array).tobytes()
            assert [hold is None for _, hold in staged] == [False, True, False]
            usable = (8 << 20) // 4096 * 4096 - 4096  # all of it past the first page
            assert client.reserve_span(usable) is None  # two spans still held
            for _, hold in staged:
                if hold is not None:
                    hold.release()
            whole = client.reserve_span(usable)  # the refused capture's span came back too
            assert whole is not None
            whole.release()
    finally:
        server.stop(None).wait()
        store.close()
