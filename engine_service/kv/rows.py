"""One request's KV layer as a row a batch can hold: `PlainLayer` (plain tensors, with the
codec it converts to) and `PackedLayer` (affine planes), both mlx-lm's own solo caches
underneath, adopted without a copy, `TurboQuantLayer` (codes and norms: no mlx-lm cache holds
them), and the sliding-window `PlainRingLayer` and `PackedRingLayer`.

Each batch module declares the rows that merge into it, where the batch is defined:
kv/batch_cache.py's PlainRow, PackedRow and TurboQuantRow (BatchQuantizedKVCache) and
kv/ring_cache.py's PlainRingRow and PackedRingRow (BatchQuantizedRingCache). This module
cannot name the batches: they import it."""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
from mlx_lm.models import cache as cache_lib

from engine_service.model.mlx_compat import BaseCache, ring_in_temporal_order, set_ring_position
from engine_service.protocol.kv_codec import PLAIN_KV, KVCodec, Storage, ring_signature


class Row:
    """What every row shares: a codec, adoption of mlx-lm's solo cache (no copy), and merging
    into its batch."""

    codec: KVCodec
    keys: Any
    values: Any
    offset: int
    # The batch cache the row merges into: declared by each row class, in its batch's module.
    batch_type: ClassVar[Any]

    @classmethod
    def adopt(cls, cache: Any, codec: KVCodec) -> Any:
        row = cls(codec)  # type: ignore[call-arg]
        row.keys, row.values, row.offset = cache.keys, cache.values, cache.offset
        return row

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        return cls.batch_type.merge(caches)


class PlainLayer(Row, cache_lib.KVCache):
    """One request's plain KV layer, with the codec it converts to."""

    def __init__(self, codec: KVCodec = PLAIN_KV) -> None:
        cache_lib.KVCache.__init__(self)
        self.codec = codec


class PackedLayer(Row, cache_lib.QuantizedKVCache):
    """One request's converted (quantized) KV layer."""

    def __init__(self, codec: KVCodec) -> None:
        cache_lib.QuantizedKVCache.__init__(self, group_size=codec.group_size, bits=codec.bits)
        self.codec = codec


class TurboQuantLayer(Row, BaseCache):
    """One request's converted TurboQuant KV layer: keys and values each (codes, norms)
    planes of shape (1, heads, tokens, width), cut from a batch (BatchQuantizedKVCache.extract)
    or restored from a checkpoint. It only ever runs inside a batch (merge)."""

    def __init__(self, codec: KVCodec, shape: tuple[int, int, int, str] | None = None) -> None:
        self.codec = codec
        self.keys: tuple[mx.array, mx.array] | None = None
        self.values: tuple[mx.array, mx.array] | None = None
        self.offset = 0
        # (heads, key width, value width, model dtype): widths are not readable off packed
        # words, and mixed batches decode to the model's dtype.
        self.row_shape = shape

    @property
    def stored_as(self) -> Storage:
        return self.codec.storage

    @property
    def state(self) -> list[Any]:
        assert self.keys is not None and self.values is not None and self.row_shape
        return [*self.keys, *self.values, self.offset, self.codec.to_json(), list(self.row_shape)]

    @state.setter
    def state(self, v: list[Any]) -> None:
        kc, kn, vc, vn, offset, codec, shape = v
        self.keys, self.values, self.offset = (kc, kn), (vc, vn), int(offset)
        self.codec = KVCodec.from_json(codec)
        heads, kdim, vdim, dtype = shape
        self.row_shape = (int(heads), int(kdim), int(vdim), str(dtype))

    def size(self) -> int:
        return self.offset

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drops the last n positions (a prefix saved without the token fed after it)."""
        n = min(self.offset, n)
        if n and self.keys is not None and self.values is not None:
            end = self.offset - n
            self.keys = (self.keys[0][..., :end, :], self.keys[1][..., :end, :])
            self.values = (self.values[0][..., :end, :], self.values[1][..., :end, :])
        self.offset -= n
        return n

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in (*(self.keys or ()), *(self.values or ())))


class RingRow(Row):
    """What the solo ring rows share: their planes in temporal order, and how many columns
    those hold."""

    max_size: int

    def temporal_planes(self) -> tuple[list[mx.array], list[mx.array]]:
        raise NotImplementedError

    def set_columns(self, columns: int) -> None:
        """The columns its planes hold, in temporal order (planes set from a batch)."""
        raise NotImplementedError


class PlainRingLayer(RingRow, cache_lib.RotatingKVCache):
    """One request's plain sliding-window layer (mlx-lm's RotatingKVCache), with its codec."""

    def __init__(self, max_size: int, codec: KVCodec = PLAIN_KV) -> None:
        cache_lib.RotatingKVCache.__init__(self, max_size)
        self.codec = codec

    def temporal_planes(self) -> tuple[list[mx.array], list[mx.array]]:
        keys, values = (
            ring_in_temporal_order(self, self.keys),
            ring_in_temporal_order(self, self.values),
        )
        return [keys], [values]

    def set_columns(self, columns: int) -> None:
        set_ring_position(self, columns)  # in temporal order: the next write follows them


class PackedRingLayer(RingRow, BaseCache):
    """One request's converted sliding-window layer: its window's packed planes (affine or
    TurboQuant) in temporal order, cut from a batch. It only ever runs inside a batch."""

    keep = 0

    def __init__(
        self, max_size: int, codec: KVCodec, shape: tuple[int, int, int, str] | None = None
    ) -> None:
        self.max_size, self.codec, self.row_shape = max_size, codec, shape
        self.keys: tuple[mx.array, ...] | None = None
        self.values: tuple[mx.array, ...] | None = None
        self.offset = 0  # tokens seen (RoPE position)
        self.columns = 0  # columns held

    @property
    def stored_as(self) -> Storage:
        return self.codec.storage

    @property
    def layout_id(self) -> str:
        return ring_signature(self.max_size, self.keep, self.codec.storage)

    def temporal_planes(self) -> tuple[list[mx.array], list[mx.array]]:
        assert self.keys is not None and self.values is not None
        return list(self.keys), list(self.values)

    @property
    def state(self) -> list[Any]:
        assert self.keys is not None and self.values is not None and self.row_shape
        return [
            list(self.keys),
            list(self.values),
            self.offset,
            self.max_size,
            self.columns,
            self.codec.to_json(),
            list(self.row_shape),
        ]

    @state.setter
    def state(self, v: list[Any]) -> None:
        keys, values, offset, max_size, idx, codec, shape = v
        self.keys, self.values = tuple(keys), tuple(values)
        self.offset, self.max_size, self.columns = int(offset), int(max_size), int(idx)
        self.codec = KVCodec.from_json(codec)
        heads, kdim, vdim, dtype = shape
        self.row_shape = (int(heads), int(kdim), int(vdim), str(dtype))

    def set_columns(self, columns: int) -> None:
        self.columns = columns

    def size(self) -> int:
        return min(self.offset, self.max_size)

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return self.offset < self.max_size

    def trim(self, n: int) -> int:
        """Drops the last n positions of a ring that has not wrapped (a saved prefix)."""
        n = min(self.offset, n)
        if n and self.keys is not None and self.values is not None:
            end = self.columns - n
            self.keys = tuple(p[..., :end, :] for p in self.keys)
            self.values = tuple(p[..., :end, :] for p in self.values)
            self.columns = end
        self.offset -= n
        return n

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in (*(self.keys or ()), *(self.values or ())))


def ring_shape(caches: list[Any]) -> tuple[int, int, int, str]:
    """(heads, key width, value width, dtype) of the first ring row holding anything."""
    for cache in caches:
        if cache.keys is None:
            continue
        if getattr(cache, "row_shape", None) is not None:
            return cache.row_shape  # type: ignore[no-any-return]
        k, v = cache.keys, cache.values
        return k.shape[1], k.shape[3], v.shape[3], str(k.dtype).removeprefix("mlx.core.")
    raise ValueError("no row holds any tokens")


def codec_of(cache: Any) -> KVCodec:
    codec = getattr(cache, "codec", None)
    if codec is not None:
        return codec  # type: ignore[no-any-return]
    if isinstance(cache, cache_lib.QuantizedKVCache):
        return KVCodec(cache.bits, cache.group_size)
    return KVCodec()
