"""A checkpoint round's segments, cut from the running batch together (MLX thread).

Every due row of a checkpoint round snapshots its newest positions. Cut row by row (extract
the row, slice its segment, copy), each row costs a copy per layer for keys and for values,
each a kernel launch on a GPU, and the Python around them: 8 rows of a 28-layer model made 448
copies a round. Here the rows whose segments start at the same batch column (the common case:
rows checkpointed on the same steps) share one copy per layer and plane
(BatchQuantizedKVCache.cut_plain), every row's tensors are views of it, built without the
generic walk of cache state, and one async_eval schedules the whole round. The records are
the very ones the row-by-row path writes.

Rows this cannot cut (a layout that is not plain KV, a row not held plain, a layer cache of
another kind) are left to the row-by-row path (loop/step_checkpoints.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as cache_lib

from engine_service.checkpoints.cache_records import CapturedCache, dtype_name
from engine_service.checkpoints.device_landing import WORD_VIEWS
from engine_service.checkpoints.generation_meta import segmentable
from engine_service.checkpoints.generations import GenerationCheckpoints
from engine_service.kv.batch_cache import BatchQuantizedKVCache
from engine_service.loop.jobs import Job, PendingSnapshot
from engine_service.model.loading import layout_codec

# What capture() records of a KVCache layer beside its planes (its meta state, its codec).
_KV_META = list(getattr(cache_lib.KVCache(), "meta_state", ()) or ())
_KV_LAYOUT = layout_codec(cache_lib.KVCache())


def capture_together(
    generations: GenerationCheckpoints, jobs: list[Job], uids: list[int], layer_caches: list[Any]
) -> dict[int, PendingSnapshot]:
    """Snapshots of the jobs this can cut, by uid; uids and layer_caches: the running batch's
    rows and its cache per layer. The jobs left out have not been touched."""
    if not layer_caches or not all(isinstance(c, BatchQuantizedKVCache) for c in layer_caches):
        return {}
    where = {uid: row for row, uid in enumerate(uids)}
    first = layer_caches[0]
    chosen = [
        job
        for job in jobs
        if job.uid in where
        and segmentable(job.request.layout)
        and first.row_offset(where[job.uid]) == generations.held(job)
    ]
    rows = [where[job.uid] for job in chosen]
    if not chosen or not all(c.holds_plain(rows) for c in layer_caches):
        return {}
    segments = [generations.next_segment(job) for job in chosen]
    starts = [segment.start for segment in segments]
    cuts = [c.cut_plain(rows, starts) for c in layer_caches]
    snapshots: dict[int, PendingSnapshot] = {}
    scheduled: list[mx.array] = []
    for k, (job, segment) in enumerate(zip(chosen, segments, strict=True)):
        pairs = []
        for cut in cuts:
            assert cut is not None  # holds_plain said so
            pairs.append(cut[k])
        captured = plain_capture(pairs, generations.held(job))
        scheduled.extend(captured.arrays.values())
        snapshots[job.uid] = generations.pending(job, captured, segment)
    mx.async_eval(scheduled)
    return snapshots


def plain_capture(pairs: list[tuple[mx.array, mx.array]], held: int) -> CapturedCache:
    """What cache_records.capture makes of KVCache layers holding these (keys, values),
    built directly: no cache objects, no generic walk of their state, and no copy (each
    plane is a row of cut_plain's row-major copy, contiguous already). A round of 8 rows of a
    28-layer model spent ~4 ms of the MLX thread in the generic walk.
    tests/test_segment_capture.py holds the two to the same records."""
    arrays: dict[str, mx.array] = {}
    dtypes: dict[str, str] = {}
    skeleton: list[dict[str, Any]] = []
    for i, (keys, values) in enumerate(pairs):
        state: list[dict[str, Any]] = []
        for j, plane in enumerate((keys, values)):
            name, dtype = f"l{i}.{j}", dtype_name(plane)
            view = WORD_VIEWS.get(dtype)
            arrays[name] = plane.view(view[0]) if view else plane
            dtypes[name] = dtype
            state.append({"t": name})
        state.append({"v": keys.shape[2]})
        skeleton.append({"class": "KVCache", "meta": list(_KV_META), "state": {"l": state}})
    return CapturedCache(arrays, dtypes, skeleton, [_KV_LAYOUT] * len(pairs), held)
