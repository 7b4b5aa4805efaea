"""Batched sliding-window (ring) KV caches whose rows may be quantized: issue 18's quantized
sliding-window rows.

mlx-lm's `BatchRotatingKVCache` holds one plain tensor for every row, and mlx-lm cannot
quantize a `RotatingKVCache` at all (`to_quantized` is not implemented). This is its ring
bookkeeping, step for step (the ring position `_idx`, tokens seen `_offset`, `rotated`, the
trims that keep `max_size` columns, the temporal reordering before rows join, the per-row
left padding and offsets, `make_mask` unchanged), carried over to plane groups (kv/planes.py)
as BatchQuantizedKVCache does for full attention: plain, affine and TurboQuant rows share one
column axis, so one mask serves every row. Column operations apply to every plane of every
group; row operations (filter, per-row rolls, extract) to each group's rows.

A row with a quantized codec is plain until its first model call has stored its tokens, then
moves into its packed group once (whole columns are encoded: quantization is per position).
The request's `quantized_kv_start` applies to full-attention layers; a ring holds at most its
window, so it converts at once. Attention per layer: one group reads its planes as
kv/batch_cache.py does (plain SDPA, affine SDPA, TurboQuant planes); mixed groups decode the
packed rows for the step.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import dynamic_roll

from engine_service.kv.planes import (
    FULL_WIDTH_PLANES,
    PlaneGroup,
    attention_planes,
    convert_rows,
    dtype_name,
    group_of,
    join_group,
    keep_rows,
    only_affine,
    storage_of,
    zeros_like_storage,
)
from engine_service.kv.rows import PackedRingRow, PlainRingRow, RingRow, codec_of, ring_shape
from engine_service.model.mlx_compat import BaseCache
from engine_service.protocol.kv_codec import PLAIN, PLAIN_KV, KVCodec, Storage


class BatchQuantizedRingCache(BaseCache):
    """A left-padded batch of ring rows in mixed storage formats (see the module docstring)."""

    step = 256

    def __init__(self, max_size: int, left_padding: list[int], codecs: list[KVCodec] | None = None):
        self.max_size = max_size
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._codecs = list(codecs) if codecs is not None else [PLAIN_KV] * len(left_padding)
        self._groups: list[PlaneGroup] = []
        self._idx = 0
        self._offset = 0
        self.rotated = False
        self._lengths: mx.array | None = None
        self._shape: tuple[int, int, int, str] | None = None
        self._waiting: int | None = None  # plain rows with a quantized codec (None: recount)

    # -- what attention sees -----------------------------------------------------------------

    @property
    def bits(self) -> int:
        return only_affine(self._groups, "bits").bits

    @property
    def group_size(self) -> int:
        return only_affine(self._groups, "group_size").group_size

    def _fetch(self, dtype: mx.Dtype) -> tuple[Any, Any]:
        assert self._shape is not None
        n = self._offset

        def live(p: mx.array) -> mx.array:
            if n >= p.shape[2]:
                return p
            # MLX-CUDA's quantized matmul cannot read a column slice (kv/batch_cache.py).
            return mx.contiguous(p[..., :n, :]) if FULL_WIDTH_PLANES else p[..., :n, :]

        return attention_planes(self._groups, self._shape, dtype, live)

    # -- column and row operations over every group -----------------------------------------

    def _cols(self) -> int:
        return int(self._groups[0].keys[0].shape[2]) if self._groups else 0

    def _map(self, fn: Any) -> None:
        for g in self._groups:
            g.map_planes(fn)

    def _roll_rows(self, roll: mx.array) -> None:
        for g in self._groups:
            shifts = roll[g.index()][:, None]
            g.map_planes(lambda p, s=shifts: dynamic_roll(p, s, axis=2))

    def _temporal_order(self) -> None:
        if self.rotated:
            idx = self._idx
            self._map(lambda p: mx.roll(p, -idx, 2))
            self._idx = self._cols()
            self.rotated = False

    def _encoded(self, keys: mx.array, values: mx.array) -> list[tuple[list[Any], list[Any]]]:
        whole = len(self._groups) == 1
        out = []
        for g in self._groups:
            k = keys if whole else keys[g.index()]
            v = values if whole else values[g.index()]
            out.append(g.encode_pair(k, v))
        return out

    def _convert_due(self) -> None:
        """Moves plain rows with a quantized codec into their packed groups (after their
        first call: a ring converts at once). A row that joined a batch already holding
        columns (a prompt batch extended while another row prefills) holds only padding until
        its own first call, which attends over its plain keys as alone: it waits."""
        if self._waiting == 0:
            return  # most steps: nothing waits (recounted after rows join or leave)
        plain = group_of(self._groups, PLAIN)
        if plain is None or not plain.keys:
            return
        held = self.offset.tolist()  # tokens each row holds (read only while rows wait)
        due: dict[Storage, list[int]] = {}
        waiting = 0
        for local, row in enumerate(plain.rows):
            if not self._codecs[row].quantized:
                continue
            if held[row] > 0:  # type: ignore[index,operator]
                due.setdefault(self._codecs[row].storage, []).append(local)
            else:
                waiting += 1
        if due:
            self._groups = convert_rows(self._groups, due)
        self._waiting = waiting

    # -- updates (mlx-lm's BatchRotatingKVCache, on groups) ----------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if self._shape is None:
            b, heads, _, kdim = keys.shape
            self._shape = (heads, kdim, values.shape[3], dtype_name(keys.dtype))
        self._convert_due()
        if keys.shape[2] == 1:
            self._update_in_place(keys, values)
        else:
            self._update_concat(keys, values)
        first = self._groups[0]
        first.keys[0] = mx.depends(first.keys[0], (self.left_padding, self.offset))
        return self._fetch(keys.dtype)

    def _update_concat(self, keys: mx.array, values: mx.array) -> None:
        steps = keys.shape[2]
        if not self._groups:
            self._groups = [PlaneGroup(PLAIN, list(range(keys.shape[0])), [keys], [values])]
        else:
            self._temporal_order()
            if self._cols() > self._idx:
                end = self._idx
                self._map(lambda p: p[..., :end, :])
            if self._lengths is not None:
                roll = mx.maximum(0, self.offset - self._lengths)
                self._roll_rows(roll)
                self.left_padding = self.left_padding + roll
                self.offset = self.offset - roll
            trim = self._idx - self.max_size + 1  # every token keeps max_size of context
            if trim > 0:
                self.left_padding = self.left_padding - trim
            for g, (ks, vs) in zip(self._groups, self._encoded(keys, values), strict=True):
                cut = max(trim, 0)
                g.keys = [
                    mx.concatenate([p[..., cut:, :], n], axis=2)
                    for p, n in zip(g.keys, ks, strict=True)
                ]
                g.values = [
                    mx.concatenate([p[..., cut:, :], n], axis=2)
                    for p, n in zip(g.values, vs, strict=True)
                ]
        self.offset = self.offset + steps
        self._offset += steps
        self._idx = self._cols()

    def _update_in_place(self, keys: mx.array, values: mx.array) -> None:
        if self._lengths is not None:
            raise RuntimeError("finalize() must be called before decoding")
        assert self._shape is not None
        steps = keys.shape[2]
        prev = self._offset
        if not self._groups:
            self._groups = [PlaneGroup(PLAIN, list(range(keys.shape[0])), [], [])]
        if not self._groups[0].keys or (prev >= self._cols() and self._cols() < self.max_size):
            size = min(self.step, self.max_size - prev)
            for g in self._groups:
                g.append_columns(size, self._shape)
            self._idx = prev
        trim = self._cols() - self.max_size
        if trim > 0:
            self._map(lambda p: p[..., trim:, :])
            self._idx = self.max_size
            self.left_padding = self.left_padding - trim
        if self._idx == self.max_size:
            self.rotated = True
            self._idx = 0
        if self.rotated:
            self.left_padding = self.left_padding - steps
        at = self._idx
        for g, (ks, vs) in zip(self._groups, self._encoded(keys, values), strict=True):
            for plane, part in zip(g.keys, ks, strict=True):
                plane[..., at : at + steps, :] = part
            for plane, part in zip(g.values, vs, strict=True):
                plane[..., at : at + steps, :] = part
        self._offset += steps
        self.offset = self.offset + steps
        self._idx += steps

    def prepare(
        self,
        *,
        left_padding: list[int] | None = None,
        lengths: list[int] | None = None,
        right_padding: list[int] | None = None,
    ) -> None:
        if left_padding is not None:
            if self._groups:
                raise ValueError("Left padding can only be added to an empty batch cache")
            pad = mx.array(left_padding)
            self.left_padding = self.left_padding + pad
            self.offset = self.offset - pad
        if right_padding is not None and max(right_padding) > 0:
            assert lengths is not None
            self._lengths = mx.array(lengths) + self.offset

    def finalize(self) -> None:
        if self._lengths is not None:
            roll = mx.maximum(0, self.offset - self._lengths)
            self._roll_rows(roll)
            self.left_padding = self.left_padding + roll
            self.offset = self.offset - roll
            self._lengths = None

    def make_mask(
        self,
        N: int,  # noqa: N803
        window_size: int | None = None,
        return_array: bool = False,
    ) -> mx.array:
        """mlx-lm's BatchRotatingKVCache.make_mask, unchanged (it reads only the bookkeeping)."""
        left_padding = self.left_padding
        window_size = window_size or self.max_size
        offset = min(self.max_size - 1, self._offset)
        rinds = mx.arange(offset + N)
        linds = mx.arange(offset, offset + N) if offset else rinds
        linds = linds[:, None]
        rinds = rinds[None]
        mask = linds >= rinds
        mask &= linds < rinds + window_size
        if (trim_size := self._idx - self.max_size + int(N > 1)) > 0:
            left_padding = left_padding - trim_size
        rotated = N == 1 and (self.rotated or self._idx >= self.max_size)
        if rotated:
            left_padding = left_padding - 1
        mask = mask & (rinds >= mx.expand_dims(left_padding, (1, 2, 3)))
        if rotated:
            idx = self._idx
            if idx >= self.max_size:
                idx = 0
            mask = mx.roll(mask, idx + 1, -1)
        return mask

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
        if self.rotated != other.rotated or self._idx != other._idx:
            self._temporal_order()
            other._temporal_order()
        self._shape = self._shape or other._shape
        assert self._shape is not None
        for side in (self, other):
            side._materialize_empty(self._shape)
        width = max(self._idx, other._idx)
        columns = max(self._cols(), other._cols())
        for side in (self, other):
            left = width - side._idx
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
        self._idx = width
        self._offset = max(self._offset, other._offset)

    def _materialize_empty(self, shape: tuple[int, int, int, str]) -> None:
        """Rows with nothing stored yet get plain planes of no columns."""
        if self._groups:
            return
        self._groups = [PlaneGroup.empty_plain(int(self.offset.shape[0]), shape)]
        self._idx = 0

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
            row._idx = int(keys[0].shape[2])
            return row
        return PlainRingRow(self.max_size, codec)

    def _row_window(self, plane: mx.array, local: int, padding: int) -> mx.array:
        """One row of a plane in temporal order, past its left padding (a copy)."""
        p = plane[local : local + 1]
        if self.rotated:
            p = mx.roll(p, -self._idx, 2)
        return mx.contiguous(p[:, :, padding : self.max_size if self.rotated else self._idx])

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
        batch._idx = batch._offset = width
        return batch

    # -- mlx-lm's cache contract -------------------------------------------------------------

    def row_storage(self, idx: int) -> Storage:
        for g in self._groups:
            if idx in g.rows:
                return g.storage
        return PLAIN

    def is_trimmable(self) -> bool:
        return self._offset < self.max_size

    def trim(self, n: int) -> int:
        n = min(self._offset, n)
        self._offset -= n
        self._idx -= n
        self.offset = self.offset - n
        return n

    def rollback(self, counts: list[int]) -> None:
        """Forgets each row's last `counts[row]` tokens, written by the last call (speculative
        rows' rejected drafts). A multi-token call leaves the ring in temporal order
        (`_update_concat` keeps max_size - 1 older columns), so they are its last columns: the
        batch trims what every row gives back, and a row giving back more is shifted right by
        the rest, its left padding grown (the seeds' `rotatingRollbackPlan`)."""
        if not any(counts):
            return
        if self.rotated:
            raise RuntimeError("a ring rolls back only what a multi-token call wrote")
        least = min(counts)
        self.trim(least)
        end = self._idx
        self._map(lambda p: p[..., :end, :])
        extra = mx.array([c - least for c in counts])
        if least != max(counts):
            self._roll_rows(extra)
            self.left_padding = self.left_padding + extra
            self.offset = self.offset - extra

    def size(self) -> int:
        return min(self._offset, self.max_size)

    def empty(self) -> bool:
        return not self._groups

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for g in self._groups for p in g.planes)


def register() -> None:
    """Solo ring rows merge into this batch (kv/rows.py cannot import it: it imports that).
    Called by kv/batch_cache.py, which every user of the rows imports."""
    RingRow.batch_type = BatchQuantizedRingCache


register()
