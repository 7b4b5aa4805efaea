"""Rows of one storage format and the planes they live in, for the batch KV cache
(quantized_kv.py): plain rows in one tensor per side, packed rows in (values, scales, biases)
planes as mlx-lm's QuantizedKVCache lays them out, all of shape (rows, heads, columns, width).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as cache_lib

from engine_service.kv_codec import PLAIN


def storage_of(cache: Any) -> Any:
    """The storage format a solo cache holds its tokens in (PLAIN when it holds none)."""
    if cache.keys is None or not isinstance(cache, cache_lib.QuantizedKVCache):
        return PLAIN
    return (cache.bits, cache.group_size)


class PlaneGroup:
    """Rows of one storage format: planes of shape (rows, heads, columns, width)."""

    def __init__(self, storage: Any, rows: list[int], keys: list[mx.array], values: list[mx.array]):
        self.storage = storage
        self.rows = rows  # batch row of each plane row, ascending
        self.keys = keys  # [tensor] when plain, [packed, scales, biases] when quantized
        self.values = values
        self._index: mx.array | None = None

    @property
    def packed(self) -> bool:
        return bool(self.storage != PLAIN)

    @property
    def planes(self) -> list[mx.array]:
        return [*self.keys, *self.values]

    def index(self) -> mx.array:
        if self._index is None:
            self._index = mx.array(self.rows, dtype=mx.int32)
        return self._index

    def map_planes(self, fn: Any) -> None:
        self.keys = [fn(p) for p in self.keys]
        self.values = [fn(p) for p in self.values]

    def take(self, local: list[int]) -> None:
        """Keeps the plane rows at `local` positions, in that order."""
        if local == list(range(len(self.rows))):
            return
        idx = mx.array(local, dtype=mx.int32)
        self.map_planes(lambda p: p[idx])
        self.rows = [self.rows[i] for i in local]
        self._index = None

    def concat(self, incoming: PlaneGroup) -> None:
        """Appends another group's rows (planes of equal column count), in row order."""
        self.keys = [mx.concatenate([a, b]) for a, b in zip(self.keys, incoming.keys, strict=True)]
        self.values = [
            mx.concatenate([a, b]) for a, b in zip(self.values, incoming.values, strict=True)
        ]
        self.rows = self.rows + incoming.rows
        self._index = None
        self.sort()

    def pad_columns(self, left: int, right: int) -> None:
        """Adds `left` columns before and `right` after (right < 0: drops columns)."""

        def pad(p: mx.array) -> mx.array:
            r = right
            if r < 0:
                p, r = p[..., :r, :], 0
            if left or r:
                p = mx.pad(p, [(0, 0), (0, 0), (left, r), (0, 0)])
            return p

        self.map_planes(pad)

    def cut(self, local: int, start: int, end: int) -> tuple[list[mx.array], list[mx.array]]:
        """Copies of plane row `local`'s columns [start, end): its keys and values planes."""

        def piece(p: mx.array) -> mx.array:
            return mx.contiguous(p[local : local + 1, :, start:end])

        return [piece(p) for p in self.keys], [piece(p) for p in self.values]

    @classmethod
    def gather(
        cls,
        storage: Any,
        rows: list[int],
        caches: list[Any],
        padding: list[int],
        lengths: list[int],
        width: int,
        shape: tuple[int, int, int, str],
    ) -> PlaneGroup:
        """The batch rows `rows` of solo caches stored as `storage`, right-aligned at `width`
        columns (packed rows keep their bytes)."""
        heads, kdim, vdim = shape[:3]
        dtype = getattr(mx, shape[3])
        keys = zeros_like_storage(storage, len(rows), heads, width, kdim, dtype)
        values = zeros_like_storage(storage, len(rows), heads, width, vdim, dtype)
        for local, row in enumerate(rows):
            cache, p, n = caches[row], padding[row], lengths[row]
            if cache.keys is None:
                continue
            src_k = [cache.keys] if storage == PLAIN else list(cache.keys)
            src_v = [cache.values] if storage == PLAIN else list(cache.values)
            for dst, src in zip(keys, src_k, strict=True):
                dst[local : local + 1, :, p : p + n] = src[..., :n, :]
            for dst, src in zip(values, src_v, strict=True):
                dst[local : local + 1, :, p : p + n] = src[..., :n, :]
        return cls(storage, rows, keys, values)

    def sort(self) -> None:
        order = sorted(range(len(self.rows)), key=self.rows.__getitem__)
        self.take(order)

    def encode(self, x: mx.array) -> list[mx.array]:
        if not self.packed:
            return [x]
        bits, group = self.storage
        return list(mx.quantize(x, group_size=group, bits=bits))

    def decode(self, planes: list[mx.array], dtype: mx.Dtype) -> mx.array:
        if not self.packed:
            return planes[0]
        bits, group = self.storage
        packed, scales, biases = planes
        return mx.dequantize(packed, scales, biases, group_size=group, bits=bits).astype(dtype)


def zeros_like_storage(
    storage: Any, rows: int, heads: int, columns: int, dim: int, dtype: mx.Dtype
) -> list[mx.array]:
    if storage == PLAIN:
        return [mx.zeros((rows, heads, columns, dim), dtype=dtype)]
    bits, group = storage
    return [
        mx.zeros((rows, heads, columns, dim * bits // 32), dtype=mx.uint32),
        mx.zeros((rows, heads, columns, dim // group), dtype=dtype),
        mx.zeros((rows, heads, columns, dim // group), dtype=dtype),
    ]


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).removeprefix("mlx.core.")


def row_shape(caches: list[Any]) -> tuple[int, int, int, str]:
    """(heads, key width, value width, dtype) of the first row holding anything."""
    for cache in caches:
        if cache.keys is None:
            continue
        if isinstance(cache, cache_lib.QuantizedKVCache):
            assert cache.keys is not None and cache.values is not None
            packed, scales, _ = cache.keys
            per_word = 32 // cache.bits
            return (
                packed.shape[1],
                packed.shape[-1] * per_word,
                cache.values[0].shape[-1] * per_word,
                dtype_name(scales.dtype),
            )
        keys, values = cache.keys, cache.values
        return keys.shape[1], keys.shape[3], values.shape[3], dtype_name(keys.dtype)
    raise ValueError("no row holds any tokens")
