"""A checkpoint round's segments, cut from the running batch together (MLX thread).

Every due row of a checkpoint round snapshots its newest positions. Cut row by row (extract
the row, slice its segment, copy), each row costs a copy per layer for keys and for values,
each a kernel launch on a GPU, and the Python around them: 8 rows of a 28-layer model made 448
copies a round. Here the rows whose segments start at the same batch column (the common case:
rows checkpointed on the same steps) share one copy (BatchQuantizedKVCache.plain_columns, then
one stack of every layer's keys and values), every row's record is one tensor viewing it,
built without the generic walk of cache state, and one async_eval schedules the whole round.
Such a record names its layers' planes inside its one tensor (cache_records
STACKED_CODEC_VERSION) and restores to the very caches the row-by-row path's record does.

Rows this cannot cut (a layout that is not plain KV, a row not held plain, a layer cache of
another kind) are left to the row-by-row path (loop/step_checkpoints.py).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as cache_lib

from engine_service.checkpoints.cache_records import (
    STACKED_CODEC_VERSION,
    CapturedCache,
    Packed,
    dtype_name,
    stacked_plane,
    stored_view,
)
from engine_service.checkpoints.generation_meta import segmentable
from engine_service.checkpoints.generations import GenerationCheckpoints
from engine_service.kv.batch_cache import BatchQuantizedKVCache, ColumnCut
from engine_service.loop.jobs import Job, PendingSnapshot
from engine_service.model.loading import layout_codec

# What capture() records of a KVCache layer beside its planes (its meta state, its codec).
_KV_META = list(getattr(cache_lib.KVCache(), "meta_state", ()) or ())
_KV_LAYOUT = layout_codec(cache_lib.KVCache())


def capture_together(
    generations: GenerationCheckpoints,
    jobs: list[Job],
    uids: list[int],
    layer_caches: list[Any],
    pack: bool | None = None,
) -> dict[int, PendingSnapshot]:
    """Snapshots of the jobs this can cut, by uid; uids and layer_caches: the running batch's
    rows and its cache per layer. The jobs left out have not been touched. pack: the round's
    captures share their buffer as one (Packed) to move to host memory at once (None: when
    the device pushes captures to the host, MLX-CUDA's pinned region; elsewhere each row's
    tensor is viewed where it lies)."""
    if pack is None:
        pack = generations.staging.landing.kind == "pinned"
    if not layer_caches or not all(isinstance(c, BatchQuantizedKVCache) for c in layer_caches):
        return {}
    first = layer_caches[0]
    if any(c.columns != first.columns for c in layer_caches):
        return {}  # the layers' rows lie differently: cut row by row
    where = {uid: row for row, uid in enumerate(uids)}
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
    by_row = {where[job.uid]: job for job in chosen}
    segments = {job.uid: generations.next_segment(job) for job in chosen}
    starts = [segments[job.uid].start for job in chosen]
    per_layer = [c.plain_columns(rows, starts) for c in layer_caches]
    snapshots: dict[int, PendingSnapshot] = {}
    scheduled: list[mx.array] = []
    for g, cut in enumerate(per_layer[0] or []):
        planes = [p for layer in per_layer for p in _planes(layer, g)]
        jobs_here = [by_row[row] for row in cut.rows]
        captures, buffers = _captures(planes, [generations.held(j) for j in jobs_here], pack)
        scheduled.extend(buffers)
        for job, captured in zip(jobs_here, captures, strict=True):
            snapshots[job.uid] = generations.pending(job, captured, segments[job.uid])
    mx.async_eval(scheduled)
    return snapshots


def _planes(layer: list[ColumnCut] | None, group: int) -> tuple[mx.array, mx.array]:
    assert layer is not None  # holds_plain said so
    return layer[group].keys, layer[group].values


def _captures(
    planes: list[mx.array], helds: list[int], pack: bool
) -> tuple[list[CapturedCache], list[mx.array]]:
    """Each row's capture out of a column group's planes (keys and values of every layer,
    each of shape (rows, heads, columns, width)); helds: the positions each row holds. Also
    the arrays to evaluate for them.

    Planes of one shape and dtype (the common case) are stacked row by row, one copy: a row's
    record is then one tensor [2 x layers, heads, columns, width] (its skeleton names each
    layer's keys and values as planes of it), a view of the round's buffer. Its bytes cost the
    engine, the spill queue and the store one tensor a record, not one a layer and plane (a
    round of 8 rows of a 28-layer model: 8 tensors, not 448). pack: the captures carry the
    buffer as shared (Packed), so the round moves to host memory as one array (on MLX-CUDA one
    push into the region). Planes that differ are copied each on its own and named one by
    one (the record format of cache_records.capture)."""
    rows = len(helds)
    if len({(p.shape, p.dtype) for p in planes}) == 1:
        dtype = dtype_name(planes[0])
        stacked = stored_view(mx.stack(planes, axis=1), dtype)  # (rows, planes, h, c, w)
        form = _stacked_form(len(planes) // 2, planes[0].shape[2], dtype)
        row_bytes = stacked.nbytes // rows
        captures = []
        for i, held in enumerate(helds):
            captured = CapturedCache(
                {STACKED: stacked[i]},
                form.dtypes,
                form.skeleton,
                form.layout,
                held,
                encoded=form.encoded,
            )
            if pack:
                captured.packed = Packed(stacked, {STACKED: i * row_bytes})
            captures.append(captured)
        return captures, [stacked]
    buffers = [mx.contiguous(p) for p in planes]  # a gather's is already: no copy then
    captures = [
        plain_capture(
            [(buffers[q][i : i + 1], buffers[q + 1][i : i + 1]) for q in range(0, len(planes), 2)],
            held,
        )
        for i, held in enumerate(helds)
    ]
    return captures, buffers


# The stacked tensor of a row's segment record (_captures).
STACKED = "kv"


@dataclass(frozen=True)
class _StackedForm:
    """What every stacked capture of `layers` layers of `positions` positions of one dtype has
    in common. Shared, never changed in place: a round of 8 rows of a 28-layer model built
    and encoded it 8 times (~1 ms of the MLX thread)."""

    skeleton: list[dict[str, Any]]
    dtypes: dict[str, str]
    layout: list[str]
    encoded: dict[str, str]  # CapturedCache.meta()


@functools.lru_cache(maxsize=256)
def _stacked_form(layers: int, positions: int, dtype: str) -> _StackedForm:
    """Layer i's keys are plane 2i of the stacked tensor, its values plane 2i + 1."""
    skeleton = [
        {
            "class": "KVCache",
            "meta": list(_KV_META),
            "state": {
                "l": [
                    stacked_plane(STACKED, 2 * i),
                    stacked_plane(STACKED, 2 * i + 1),
                    {"v": positions},
                ]
            },
        }
        for i in range(layers)
    ]
    dtypes = {STACKED: dtype}
    layout = [_KV_LAYOUT] * layers
    encoded = {
        "codec": STACKED_CODEC_VERSION,
        "cache": json.dumps(skeleton),
        "dtypes": json.dumps(dtypes),
        "layout": "|".join(layout),
    }
    return _StackedForm(skeleton, dtypes, layout, encoded)


def plain_capture(pairs: list[tuple[mx.array, mx.array]], held: int) -> CapturedCache:
    """What cache_records.capture makes of KVCache layers holding these (keys, values),
    built directly: no cache objects, no generic walk of their state, and no copy (each
    plane is a row of a row-major copy of the batch's planes, contiguous already). A round of
    8 rows of a 28-layer model spent ~4 ms of the MLX thread in the generic walk.
    tests/test_segment_capture.py holds the two to the same records."""
    arrays = {}
    dtypes: dict[str, str] = {}
    skeleton: list[dict[str, Any]] = []
    for i, (keys, values) in enumerate(pairs):
        state: list[dict[str, Any]] = []
        for j, plane in enumerate((keys, values)):
            name = f"l{i}.{j}"
            dtypes[name] = dtype_name(plane)
            arrays[name] = stored_view(plane, dtypes[name])
            state.append({"t": name})
        state.append({"v": keys.shape[2]})
        skeleton.append({"class": "KVCache", "meta": list(_KV_META), "state": {"l": state}})
    return CapturedCache(arrays, dtypes, skeleton, [_KV_LAYOUT] * len(pairs), held)
