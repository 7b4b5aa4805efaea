"""Batched KV caches whose rows may be quantized (affine or TurboQuant), each on its own
schedule.

mlx-lm quantizes a solo request's cache (`QuantizedKVCache`, `--kv-bits`) but its
`BatchGenerator` cannot batch one: `QuantizedKVCache` has no `merge`, and `BatchKVCache`
holds one plain tensor for every row. No library has a batch cache whose rows differ in
codec, so this module writes one, on mlx-lm's cache contract (merge, extend, filter,
extract, prepare/finalize, make_mask, trim, state/meta_state/from_state).

Rows are kept in *groups* by storage format (kv/planes.py): one plain group (the model's
dtype), one affine group per (bits, group size), holding packed planes (values, scales,
biases) as mlx-lm's `QuantizedKVCache` does, and one TurboQuant group per (key bits, value
bits), holding (codes, norms) planes (kv/turboquant.py). Every group shares the batch's column
axis: a row's tokens end at column `_written` and begin after its left padding, exactly as in
`BatchKVCache`.

A row with a quantized codec stays plain until it holds `start` tokens after a model call,
then moves into its packed group once (mlx-lm's `maybe_quantize_kv_cache` converts a solo
cache at the same point). Attention then runs on:
- one plain group: the plain tensors, mlx's fused SDPA (what BatchKVCache does);
- one affine group: the packed planes through mlx-lm's `quantized_scaled_dot_product_attention`
  (`bits`/`group_size` are visible on the cache only in this state, which is how
  `scaled_dot_product_attention` picks the quantized path);
- one TurboQuant group: the planes are handed to attention as `TurboQuantPlanes`, which
  kv/attention_routing.py sends to `turboquant_attention` (rotated domain);
- several groups: packed rows are dequantized for this step into one plain tensor. The values
  are those the packed path reads; only the rounding order of the arithmetic differs.

Moving rows (merge, extend, filter, extract) copies packed bytes; nothing is decoded and
re-encoded. Sliding-window (rotating) layers are kv/ring_cache.py's.

Here: the batch's rows joining, leaving, cut out and rolled back, the rows that merge into it,
and `adopt_row`; its writes, conversion and mask are kv/batch_writes.py's, its
state/meta_state kv/batch_state.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as cache_lib
from mlx_lm.models.cache import dynamic_roll

from engine_service.kv.batch_state import BatchState
from engine_service.kv.batch_writes import BatchWrites
from engine_service.kv.planes import (
    PlaneGroup,
    keep_rows,
    row_shape,
    storage_of,
)
from engine_service.kv.ring_cache import PackedRingRow, PlainRingRow
from engine_service.kv.rows import PackedLayer, PlainLayer, TurboQuantLayer, codec_of
from engine_service.model.mlx_compat import BaseCache, ring_position, set_ring_position
from engine_service.protocol.kv_codec import PLAIN, PLAIN_KV, KVCodec, Storage, StorageKind

__all__ = [
    "BatchQuantizedKVCache",
    "ColumnCut",
    "PackedRow",
    "PlainRow",
    "TurboQuantRow",
    "adopt_row",
]


class BatchQuantizedKVCache(BatchWrites, BatchState, BaseCache):
    """A left-padded batch of KV rows in mixed storage formats (see the module docstring)."""

    step = 256
    # Attention reads whole step-grown planes, the mask hiding the columns past `_written`: set
    # by speculative batches, whose multi-position calls would otherwise meet a new key length
    # every round (MLX-CUDA builds attention kernels per shape).
    wide_reads = False

    def __init__(self, left_padding: list[int], codecs: list[KVCodec] | None = None) -> None:
        # Host copy of the per-row left padding; a row's offset (tokens held, RoPE position)
        # is always _written - _lp[row], as in BatchKVCache.
        self._lp = list(left_padding)
        self.left_padding = mx.array(self._lp)
        self.offset = mx.array([-p for p in left_padding])
        self._codecs = list(codecs) if codecs is not None else [PLAIN_KV] * len(left_padding)
        self._groups: list[PlaneGroup] = []
        self._written = 0
        self._cap = 0
        self._right_padding_to_roll: list[int] | None = None
        self._waiting: int | None = None  # plain rows with a quantized codec (None: recount)
        # (heads, key width, value width, dtype name), known once a row holds something
        # (a name, not an mx.Dtype: BatchGenerator deep-copies caches and Dtype won't copy).
        self._shape: tuple[int, int, int, str] | None = None

    @property
    def row_paddings(self) -> list[int]:
        """Each row's left padding, from the host copy (no device read)."""
        return list(self._lp)

    # -- rows joining and leaving ------------------------------------------------------------

    def filter(self, batch_indices: Any) -> None:
        keep = [int(i) for i in batch_indices]
        self._waiting = None
        self._groups = keep_rows(self._groups, keep)
        self._lp = [self._lp[i] for i in keep]
        self._codecs = [self._codecs[i] for i in keep]
        if self._right_padding_to_roll is not None:
            self._right_padding_to_roll = [self._right_padding_to_roll[i] for i in keep]
        shift = min(self._lp) if self._lp else 0
        if shift > 0 and self._groups:
            for group in self._groups:
                group.map_planes(lambda p: p[..., shift:, :])
            self._written -= shift
            self._cap -= shift
            self._lp = [p - shift for p in self._lp]
        self._sync_positions()

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if not isinstance(other, BatchQuantizedKVCache):
            raise TypeError(f"cannot batch {type(other).__name__} with BatchQuantizedKVCache")
        base = len(self._lp)
        self._waiting = None
        if self._groups or other._groups:
            shape = self._shape or other._shape
            assert shape is not None
            self._shape = shape
            self._materialize_empty(shape)
            other._materialize_empty(shape)
            width = max(self._written, other._written)
            columns = max(self._cap, other._cap)
            for side in (self, other):
                left = width - side._written
                right = columns - side._cap - left
                side._pad_columns(left, right)
            for group in other._groups:
                self._join(
                    PlaneGroup(
                        group.storage, [r + base for r in group.rows], group.keys, group.values
                    )
                )
            self._written, self._cap = width, columns
        self._lp += other._lp
        self._codecs += other._codecs
        if self._right_padding_to_roll is not None or other._right_padding_to_roll is not None:
            self._right_padding_to_roll = (self._right_padding_to_roll or [0] * base) + (
                other._right_padding_to_roll or [0] * len(other._lp)
            )
        self._sync_positions()

    def _materialize_empty(self, shape: tuple[int, int, int, str]) -> None:
        """Gives rows with nothing stored yet (a batch with no tensors) plain zero planes."""
        if self._groups or not self._lp:
            return
        self._groups = [PlaneGroup.empty_plain(len(self._lp), shape)]
        self._written = self._cap = 0

    def _pad_columns(self, left: int, right: int) -> None:
        for group in self._groups:
            group.pad_columns(left, right)
        self._lp = [p + left for p in self._lp]
        self._written += left
        self._cap += left + right

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedKVCache:
        """A batch of solo rows (PlainRow/PackedRow/TurboQuantRow or mlx-lm's
        KVCache/QuantizedKVCache), right-aligned at the longest; packed rows keep their bytes."""
        codecs = [codec_of(c) for c in caches]
        lengths = [0 if c.keys is None else int(c.offset) for c in caches]
        width = max(lengths)
        if width == 0:
            return cls([0] * len(caches), codecs)
        padding = [width - n for n in lengths]
        batch = cls(padding, codecs)
        batch._shape = row_shape(caches)
        formats: dict[Storage, list[int]] = {}
        for row, cache in enumerate(caches):
            formats.setdefault(storage_of(cache), []).append(row)
        # Room for a step's worth of positions: the rows' next tokens (a hit's new turn, the
        # first decode steps) are written in place, not by regrowing every plane.
        columns = width + cls.step
        for storage, rows in formats.items():
            batch._groups.append(
                PlaneGroup.gather(
                    storage, rows, caches, padding, lengths, width, batch._shape, columns
                )
            )
        batch._written, batch._cap = width, columns
        batch._sync_positions()
        return batch

    def extract(self, idx: int) -> PlainRow | PackedRow | TurboQuantRow:
        """Row idx as a solo cache: a copy of its plain tensors or of its packed bytes."""
        codec = self._codecs[idx]
        start, end = self._lp[idx], self._written
        for group in self._groups:
            if idx in group.rows:
                keys, values = group.cut(group.rows.index(idx), start, end)
                row: PlainRow | PackedRow | TurboQuantRow
                if group.turboquant:
                    row = TurboQuantRow(codec, self._shape)
                    row.keys, row.values = (keys[0], keys[1]), (values[0], values[1])
                elif group.packed:
                    row = PackedRow(codec)
                    row.keys, row.values = tuple(keys), tuple(values)
                else:
                    row = PlainRow(codec)
                    row.keys, row.values = keys[0], values[0]
                row.offset = end - start
                return row
        return PlainRow(codec)

    def holds_plain(self, rows: list[int]) -> bool:
        """Whether these rows are all held plain, in one plane group (plain_columns cuts them)."""
        return self._plain_group(rows) is not None

    def row_offset(self, row: int) -> int:
        """The positions a row holds, from the host copies (no device read)."""
        return self._written - self._lp[row]

    def _plain_group(self, rows: list[int]) -> PlaneGroup | None:
        group = next((g for g in self._groups if g.storage == PLAIN), None)
        if group is None or self._right_padding_to_roll is not None:
            return None
        return group if all(r in group.rows for r in rows) else None

    @property
    def columns(self) -> tuple[tuple[int, ...], int]:
        """Where rows lie: each row's left padding and the columns written (host copies)."""
        return tuple(self._lp), self._written

    def plain_columns(self, rows: list[int], starts: list[int]) -> list[ColumnCut] | None:
        """Rows' own positions [start, offset), grouped by the batch column they start at
        (one group when the rows were checkpointed on the same steps): per group its rows and
        their keys and values of shape (rows, heads, columns, width), a slice of the batch's
        planes when the rows are consecutive (no copy yet), else a gather. None when a row is
        not held plain (checkpoints/segment_capture.py)."""
        group = self._plain_group(rows)
        if group is None:
            return None
        by_column: dict[int, list[int]] = {}
        for row, start in zip(rows, starts, strict=True):
            by_column.setdefault(self._lp[row] + start, []).append(row)
        cuts = []
        for column, members in by_column.items():
            local = [group.rows.index(r) for r in members]
            keys, values = (_rows_of(p, local, column, self._written) for p in group.planes)
            cuts.append(ColumnCut(members, keys, values))
        return cuts

    # -- mlx-lm's cache contract -------------------------------------------------------------

    def row_storage(self, idx: int) -> Storage:
        for group in self._groups:
            if idx in group.rows:
                return group.storage
        return PLAIN

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._written, n)
        self._written -= n
        self.offset = self.offset - n
        return n

    def rollback(self, counts: list[int]) -> None:
        """Forgets each row's last `counts[row]` tokens (speculative rows' rejected drafts).

        The batch trims what every row gives back; a row giving back more is shifted right by
        the rest (dynamic_roll, as `finalize` does for right padding) and its left padding
        grows, so the rows keep one column axis and one `_written`. Tokens keep their order."""
        least = min(counts)
        self.trim(least)
        extra = [c - least for c in counts]
        if not any(extra):
            return
        for group in self._groups:
            if any(extra[r] for r in group.rows):
                shifts = mx.array([extra[r] for r in group.rows])[:, None]
                group.map_planes(lambda p, s=shifts: dynamic_roll(p, s, axis=2))
        self._lp = [p + e for p, e in zip(self._lp, extra, strict=True)]
        self._sync_positions()

    def size(self) -> int:
        return self._written

    def empty(self) -> bool:
        return not self._groups

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for g in self._groups for p in g.planes)


class PlainRow(PlainLayer):
    """One request's plain KV layer (mlx-lm's KVCache), with the codec it converts to, merging
    into BatchQuantizedKVCache."""

    batch_type = BatchQuantizedKVCache


class PackedRow(PackedLayer):
    """One request's converted affine KV layer (mlx-lm's QuantizedKVCache), merging into
    BatchQuantizedKVCache."""

    batch_type = BatchQuantizedKVCache


class TurboQuantRow(TurboQuantLayer):
    """One request's converted TurboQuant KV layer (kv/rows.py), merging into
    BatchQuantizedKVCache. It only ever runs inside a batch."""

    batch_type = BatchQuantizedKVCache


@dataclass
class ColumnCut:
    """Batch rows whose segments start at the same column: their keys and values planes."""

    rows: list[int]
    keys: mx.array  # (rows, heads, columns, width)
    values: mx.array


def _rows_of(plane: mx.array, local: list[int], first: int, end: int) -> mx.array:
    """Plane rows `local` (ascending), columns [first, end): a slice when consecutive."""
    if local == list(range(local[0], local[-1] + 1)):
        return plane[local[0] : local[-1] + 1, :, first:end]
    return mx.take(plane[:, :, first:end], mx.array(local, dtype=mx.int32), axis=0)


def adopt_row(cache: Any, codec: KVCodec) -> Any:
    """A request's layer cache as a row its batch can hold (a plain sliding window: a ring
    row of BatchQuantizedRingCache); other kinds unchanged.

    Every plain KV layer goes through this (plain requests too), so that any two requests can
    share a batch whatever their codecs.
    """
    if type(cache) is cache_lib.KVCache:
        return PlainRow.adopt(cache, codec)
    if type(cache) is cache_lib.RotatingKVCache and cache.keep == 0:
        ring = PlainRingRow(cache.max_size, codec)
        ring.keys, ring.values, ring.offset = cache.keys, cache.values, cache.offset
        set_ring_position(ring, ring_position(cache))
        return ring
    if isinstance(cache, PackedRingRow) and codec.storage != cache.stored_as:
        raise ValueError(f"a {cache.layout_id} cache cannot continue as {codec}")
    if type(cache) is cache_lib.QuantizedKVCache:
        if codec.storage != Storage(StorageKind.AFFINE, cache.bits, cache.group_size):
            raise ValueError(
                f"a {cache.bits}-bit/{cache.group_size} cache cannot continue as {codec}"
            )
        return PackedRow.adopt(cache, codec)
    if isinstance(cache, TurboQuantRow) and codec.storage != cache.stored_as:
        raise ValueError(f"a {cache.codec.signature()} cache cannot continue as {codec}")
    if isinstance(cache, (PlainRow, PackedRow, TurboQuantRow, PlainRingRow, PackedRingRow)):
        cache.codec = codec
    return cache
