"""A checkpoint round's segments, cut from the running batch together (MLX thread).

Every due row of a checkpoint round snapshots its newest positions. Cut row by row (extract
the row, slice its segment, copy), each row costs a copy per layer for keys and for values,
each a kernel launch on a GPU, and the Python around them: 8 rows of a 28-layer model made 448
copies a round. Here the rows whose segments start at the same batch column (the common case:
rows checkpointed on the same steps) share one copy per layer and plane
(BatchQuantizedKVCache.cut_plain), every row's tensors are views of it, and one async_eval
schedules the whole round. The records are the very ones the row-by-row path writes.

Rows this cannot cut (a layout that is not plain KV, a row not held plain, a layer cache of
another kind) are left to the row-by-row path (loop/step_checkpoints.py).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as cache_lib

from engine_service.checkpoints.cache_records import capture
from engine_service.checkpoints.generation_meta import segmentable
from engine_service.checkpoints.generations import GenerationCheckpoints
from engine_service.kv.batch_cache import BatchQuantizedKVCache
from engine_service.loop.jobs import Job, PendingSnapshot


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
        layers = []
        for cut in cuts:
            assert cut is not None  # holds_plain said so
            part = cache_lib.KVCache()
            part.keys, part.values = cut[k]
            part.offset = part.keys.shape[2]
            layers.append(part)
        captured = capture(layers, generations.held(job), wait=False, schedule=False)
        scheduled.extend(captured.arrays.values())
        snapshots[job.uid] = generations.pending(job, captured, segment)
    mx.async_eval(scheduled)
    return snapshots
