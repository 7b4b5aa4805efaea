"""Batched sliding-window (ring) KV caches whose rows may be quantized: issue 18's quantized
sliding-window rows.

mlx-lm's `BatchRotatingKVCache` holds one plain tensor for every row, and mlx-lm cannot
quantize a `RotatingKVCache` at all (`to_quantized` is not implemented). This is its ring
bookkeeping, step for step (the ring position, its `_idx`, here `_write_at`; tokens seen, its
`_offset`, here `_tokens_seen`; `rotated`; the trims that keep `max_size` columns; the
temporal reordering before rows join; the per-row left padding and offsets; `make_mask`
unchanged), carried over to plane groups (kv/planes.py)
as BatchQuantizedKVCache does for full attention: plain, affine and TurboQuant rows share one
column axis, so one mask serves every row. Column operations apply to every plane of every
group; row operations (filter, per-row rolls, extract) to each group's rows.

A row with a quantized codec is plain until its first model call has stored its tokens, then
moves into its packed group once (whole columns are encoded: quantization is per position).
The request's `quantized_kv_start` applies to full-attention layers; a ring holds at most its
window, so it converts at once. Attention per layer: one group reads its planes as
kv/batch_cache.py does (plain SDPA, affine SDPA, TurboQuant planes); mixed groups decode the
packed rows for the step.

Here: the batch's rows joining, leaving, cut out and rolled back, and the ring rows that merge
into it; its writes, conversion and mask are kv/ring_writes.py's.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine_service.kv.planes import (
    PlaneGroup,
    join_group,
    keep_rows,
    storage_of,
    zeros_like_storage,
)
from engine_service.kv.ring_writes import RingWrites
from engine_service.kv.rows import PackedRingLayer, PlainRingLayer, RingRow, codec_of, ring_shape
from engine_service.model.mlx_compat import BaseCache
from engine_service.protocol.kv_codec import PLAIN, PLAIN_KV, KVCodec, Storage


class BatchQuantizedRingCache(RingWrites, BaseCache):
    """A left-padded batch of ring rows in mixed storage formats (see the module docstring)."""

    step = 256

    def __init__(self, max_size: int, left_padding: list[int], codecs: list[KVCodec] | None = None):
        self.max_size = max_size
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._codecs = list(codecs) if codecs is not None else [PLAIN_KV] * len(left_padding)
        self._groups: list[PlaneGroup] = []
        self._write_at = 0
        self._tokens_seen = 0
        self.rotated = False
        self._prefill_lengths: mx.array | None = None
        self._shape: tuple[int, int, int, str] | None = None
        self._waiting: int | None = None  # plain rows with a quantized codec (None: recount)

    # -- rows joining and leaving ------------------------------------------------------------

    def filter(self, batch_indices: Any) -> None:
        keep = [int(i) for i in batch_indices]
        self._groups = keep_rows(self._groups, keep)
        idx = mx.array(keep, dtype=mx.int32)
        self.offset = self.offset[idx]
        self.left_padding = self.left_padding[idx]
        self._codecs = [self._codecs[i] for i in keep]
        self._waiting = None

    def extend(self, other: BatchQuantizedRingCache) -> None:
        if not isinstance(other, BatchQuantizedRingCache):
            raise TypeError(f"cannot batch {type(other).__name__} with BatchQuantizedRingCache")
        base = int(self.offset.shape[0])
        codecs = self._codecs + other._codecs
        self._waiting = None
        if not self._groups and not other._groups:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            self._codecs = codecs
            return
        if self.rotated != other.rotated or self._write_at != other._write_at:
            self._to_temporal_order()
            other._to_temporal_order()
        self._shape = self._shape or other._shape
        assert self._shape is not None
        for side in (self, other):
            side._materialize_empty(self._shape)
        width = max(self._write_at, other._write_at)
        columns = max(self._cols(), other._cols())
        for side in (self, other):
            left = width - side._write_at
            right = columns - side._cols() - left
            for g in side._groups:
                g.pad_columns(left, right)
            side.left_padding = side.left_padding + left
        for g in other._groups:
            join_group(
                self._groups, PlaneGroup(g.storage, [r + base for r in g.rows], g.keys, g.values)
            )
        self.offset = mx.concatenate([self.offset, other.offset])
        self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
        self._codecs = codecs
        self._write_at = width
        self._tokens_seen = max(self._tokens_seen, other._tokens_seen)

    def _materialize_empty(self, shape: tuple[int, int, int, str]) -> None:
        """Rows with nothing stored yet get plain planes of no columns."""
        if self._groups:
            return
        self._groups = [PlaneGroup.empty_plain(int(self.offset.shape[0]), shape)]
        self._write_at = 0

    def extract(self, idx: int) -> RingRow:
        """Row idx as a solo ring in temporal order: a copy of its plain tensors or of its
        packed planes."""
        mx.eval(self.left_padding, self.offset)
        padding = max(0, int(self.left_padding[idx].item()))  # type: ignore[arg-type]
        offset = int(self.offset[idx].item())  # type: ignore[arg-type]
        codec = self._codecs[idx]
        for g in self._groups:
            if idx not in g.rows:
                continue
            local = g.rows.index(idx)
            keys = [self._row_window(p, local, padding) for p in g.keys]
            values = [self._row_window(p, local, padding) for p in g.values]
            row: RingRow
            if g.packed:
                row = PackedRingRow(self.max_size, codec, self._shape)
                row.keys, row.values = tuple(keys), tuple(values)
            else:
                row = PlainRingRow(self.max_size, codec)
                row.keys, row.values = keys[0], values[0]
            row.offset = offset
            row.set_columns(int(keys[0].shape[2]))
            return row
        return PlainRingRow(self.max_size, codec)

    def _row_window(self, plane: mx.array, local: int, padding: int) -> mx.array:
        """One row of a plane in temporal order, past its left padding (a copy)."""
        p = plane[local : local + 1]
        if self.rotated:
            p = mx.roll(p, -self._write_at, 2)
        return mx.contiguous(p[:, :, padding : self.max_size if self.rotated else self._write_at])

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchQuantizedRingCache:
        """A batch of solo ring rows (temporal order), right-aligned at the longest; packed
        rows keep their bytes."""
        max_size = caches[0].max_size
        if any(c.max_size != max_size for c in caches):
            raise ValueError("ring rows of one batch need one window size")
        codecs = [codec_of(c) for c in caches]
        lengths = [0 if c.keys is None else c.size() for c in caches]
        width = max(lengths)
        if width == 0:
            return cls(max_size, [0] * len(caches), codecs)
        padding = [width - n for n in lengths]
        batch = cls(max_size, padding, codecs)
        batch._shape = ring_shape(caches)
        formats: dict[Storage, list[int]] = {}
        for row, cache in enumerate(caches):
            formats.setdefault(storage_of(cache), []).append(row)
        heads, kdim, vdim, dtype = batch._shape[:3] + (getattr(mx, batch._shape[3]),)
        for storage, rows in formats.items():
            n = len(rows)
            keys = zeros_like_storage(storage, n, heads, width, kdim, dtype)
            values = zeros_like_storage(storage, n, heads, width, vdim, dtype, values=True)
            for local, row in enumerate(rows):
                if caches[row].keys is None:
                    continue
                src_k, src_v = caches[row].temporal_planes()
                p, length = padding[row], lengths[row]
                for dst, src in zip(keys, src_k, strict=True):
                    dst[local : local + 1, :, p : p + length] = src[..., -length:, :]
                for dst, src in zip(values, src_v, strict=True):
                    dst[local : local + 1, :, p : p + length] = src[..., -length:, :]
            batch._groups.append(PlaneGroup(storage, rows, keys, values))
        batch.offset = mx.array([int(c.offset) for c in caches])
        batch._write_at = batch._tokens_seen = width
        return batch

    # -- mlx-lm's cache contract -------------------------------------------------------------

    def row_storage(self, idx: int) -> Storage:
        for g in self._groups:
            if idx in g.rows:
                return g.storage
        return PLAIN

    def is_trimmable(self) -> bool:
        return self._tokens_seen < self.max_size

    def trim(self, n: int) -> int:
        n = min(self._tokens_seen, n)
        self._tokens_seen -= n
        self._write_at -= n
        self.offset = self.offset - n
        return n

    def rollback(self, counts: list[int]) -> None:
        """Forgets each row's last `counts[row]` tokens, written by the last call (speculative
        rows' rejected drafts). A multi-token call leaves the ring in temporal order
        (`_concat_update` keeps max_size - 1 older columns), so they are its last columns: the
        batch trims what every row gives back, and a row giving back more is shifted right by
        the rest, its left padding grown (the seeds' `rotatingRollbackPlan`)."""
        if not any(counts):
            return
        if self.rotated:
            raise RuntimeError("a ring rolls back only what a multi-token call wrote")
        least = min(counts)
        self.trim(least)
        end = self._write_at
        self._map(lambda p: p[..., :end, :])
        extra = mx.array([c - least for c in counts])
        if least != max(counts):
            self._roll_rows(extra)
            self.left_padding = self.left_padding + extra
            self.offset = self.offset - extra

    def size(self) -> int:
        return min(self._tokens_seen, self.max_size)

    def empty(self) -> bool:
        return not self._groups

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for g in self._groups for p in g.planes)


class PlainRingRow(PlainRingLayer):
    """One request's plain sliding-window layer (mlx-lm's RotatingKVCache), with its codec,
    merging into BatchQuantizedRingCache."""

    batch_type = BatchQuantizedRingCache


class PackedRingRow(PackedRingLayer):
    """One request's converted sliding-window layer (kv/rows.py), merging into
    BatchQuantizedRingCache. It only ever runs inside a batch."""

    batch_type = BatchQuantizedRingCache
