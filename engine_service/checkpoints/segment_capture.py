"""A checkpoint round's segments, cut from the running batch together (MLX thread).

Every due row of a checkpoint round snapshots its newest positions. Cut row by row (extract
the row, slice its segment, copy), each row costs a copy per layer for keys and for values,
each a kernel launch on a GPU, and the Python around them: 8 rows of a 28-layer model made 448
copies a round. Here the rows whose segments start at the same batch column (the common case:
rows checkpointed on the same steps) share one copy per layer and plane
(BatchQuantizedKVCache.plain_columns), every row's tensors are views of it, built without the
generic walk of cache state, and one async_eval schedules the whole round. The records are
the very ones the row-by-row path writes.

Rows this cannot cut (a layout that is not plain KV, a row not held plain, a layer cache of
another kind) are left to the row-by-row path (loop/step_checkpoints.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as cache_lib

from engine_service.checkpoints.cache_records import CapturedCache, Packed, dtype_name, stored_view
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
    segments in one buffer (None: when the device pushes captures to the host, MLX-CUDA's
    pinned region; on the CPU the stacking would only add a graph node per tensor)."""
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

    Packed (planes of one shape and dtype, the common case), the planes are stacked into one
    buffer, a copy each into it: every row's tensors are views of it, and the round moves to
    host memory as one array (on MLX-CUDA one push into the region, not one per tensor).
    Otherwise each plane is copied on its own and its rows viewed."""
    rows = len(helds)
    packed = pack and len({(p.shape, p.dtype) for p in planes}) == 1
    dtype: str | None = None  # set when the rows' planes are viewed as stored already
    if packed:
        dtype = dtype_name(planes[0])
        # Plane q's row i at q * rows + i: a concatenation along the rows (a stack added a
        # node a plane to the graph the MLX thread evaluates, and a reshape).
        flat = mx.concatenate(planes, axis=0)
        buffers = [flat]
        plane_bytes = flat[0:1].nbytes
        # Every row's plane in one split of the buffer viewed as stored (bf16 as uint16): a
        # slice and a view each cost a round of 8 rows of a 28-layer model ~1 ms in Python.
        stored = stored_view(flat, dtype)
        pieces = mx.split(stored, stored.shape[0]) if stored.shape[0] > 1 else [stored]

        def row(q: int, i: int) -> mx.array:
            return pieces[q * rows + i]
    else:
        buffers = [mx.contiguous(p) for p in planes]  # a gather's is already: no copy then

        def row(q: int, i: int) -> mx.array:
            return buffers[q][i : i + 1]

    captures = []
    for i, held in enumerate(helds):
        captured = plain_capture(
            [(row(q, i), row(q + 1, i)) for q in range(0, len(planes), 2)], held, dtype
        )
        if packed:
            offsets = {name: (q * rows + i) * plane_bytes for q, name in enumerate(captured.arrays)}
            captured.packed = Packed(buffers[0], offsets)
        captures.append(captured)
    return captures, buffers


@dataclass(frozen=True)
class _PlainForm:
    """What every plain capture of `layers` layers of `positions` positions of one dtype has
    in common. Shared, never changed in place: a round of 8 rows of a 28-layer model built
    and encoded it 8 times (~1 ms of the MLX thread)."""

    skeleton: list[dict[str, Any]]
    dtypes: dict[str, str]  # every tensor name, in order: l0.0, l0.1, l1.0, ...
    layout: list[str]
    encoded: dict[str, str]  # CapturedCache.meta()


@functools.lru_cache(maxsize=256)
def _plain_form(layers: int, positions: int, dtype: str) -> _PlainForm:
    dtypes = {f"l{i}.{j}": dtype for i in range(layers) for j in (0, 1)}
    skeleton = [
        {
            "class": "KVCache",
            "meta": list(_KV_META),
            "state": {"l": [{"t": f"l{i}.0"}, {"t": f"l{i}.1"}, {"v": positions}]},
        }
        for i in range(layers)
    ]
    layout = [_KV_LAYOUT] * layers
    encoded = CapturedCache({}, dtypes, skeleton, layout, 0).meta()
    return _PlainForm(skeleton, dtypes, layout, encoded)


def plain_capture(
    pairs: list[tuple[mx.array, mx.array]], held: int, stored_as: str | None = None
) -> CapturedCache:
    """What cache_records.capture makes of KVCache layers holding these (keys, values),
    built directly: no cache objects, no generic walk of their state, and no copy (each
    plane is a row of a row-major copy of the batch's planes, contiguous already). A round of
    8 rows of a 28-layer model spent ~4 ms of the MLX thread in the generic walk.
    tests/test_segment_capture.py holds the two to the same records.

    stored_as: the planes' dtype when they are given viewed as stored already (stored_view):
    every plane then has one shape, and the capture's form (skeleton, dtypes, record metadata)
    is shared with every other capture of that form (_plain_form)."""
    if stored_as is not None:
        form = _plain_form(len(pairs), pairs[0][0].shape[2], stored_as)
        planes = (plane for pair in pairs for plane in pair)
        arrays = dict(zip(form.dtypes, planes, strict=True))
        return CapturedCache(
            arrays, form.dtypes, form.skeleton, form.layout, held, encoded=form.encoded
        )
    arrays = {}
    dtypes: dict[str, str] = {}
    skeleton: list[dict[str, Any]] = []
    for i, (keys, values) in enumerate(pairs):
        state: list[dict[str, Any]] = []
        for j, plane in enumerate((keys, values)):
            name = f"l{i}.{j}"
            if stored_as is None:
                dtypes[name] = dtype_name(plane)
                arrays[name] = stored_view(plane, dtypes[name])
            else:
                dtypes[name], arrays[name] = stored_as, plane
            state.append({"t": name})
        state.append({"v": keys.shape[2]})
        skeleton.append({"class": "KVCache", "meta": list(_KV_META), "state": {"l": state}})
    return CapturedCache(arrays, dtypes, skeleton, [_KV_LAYOUT] * len(pairs), held)
