"""One request's KV layer as a row BatchQuantizedKVCache can batch: `PlainRow` (plain tensors,
with the codec it converts to) and `PackedRow` (affine planes), both mlx-lm's own solo caches
underneath, adopted without a copy, and `TurboQuantRow` (codes and norms: no mlx-lm cache holds
them). kv/batch_cache.py explains the batch."""

from __future__ import annotations

from typing import Any, ClassVar

import mlx.core as mx
from mlx_lm.models import cache as cache_lib

from engine_service.model.mlx_compat import BaseCache
from engine_service.protocol.kv_codec import PLAIN_KV, KVCodec, Storage, StorageKind, ring_signature


class Row:
    """What PlainRow and PackedRow share: a codec, adoption of mlx-lm's solo cache (no copy),
    and batching as a BatchQuantizedKVCache."""

    codec: KVCodec
    keys: Any
    values: Any
    offset: int
    # The batch cache rows merge into (BatchQuantizedKVCache): set by kv/batch_cache.py, which
    # imports this module (the other way round would be an import cycle).
    batch_type: ClassVar[Any] = None

    @classmethod
    def adopt(cls, cache: Any, codec: KVCodec) -> Any:
        row = cls(codec)  # type: ignore[call-arg]
        row.keys, row.values, row.offset = cache.keys, cache.values, cache.offset
        return row

    @classmethod
    def merge(cls, caches: list[Any]) -> Any:
        return cls.batch_type.merge(caches)


class PlainRow(Row, cache_lib.KVCache):
    """One request's plain KV layer, with the codec it converts to."""

    def __init__(self, codec: KVCodec = PLAIN_KV) -> None:
        cache_lib.KVCache.__init__(self)
        self.codec = codec


class PackedRow(Row, cache_lib.QuantizedKVCache):
    """One request's converted (quantized) KV layer."""

    def __init__(self, codec: KVCodec) -> None:
        cache_lib.QuantizedKVCache.__init__(self, group_size=codec.group_size, bits=codec.bits)
        self.codec = codec


class TurboQuantRow(Row, BaseCache):
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
    """What the solo ring rows share: batching as a BatchQuantizedRingCache (set by
    kv/ring_cache.py) and their planes in temporal order."""

    max_size: int

    def temporal_planes(self) -> tuple[list[mx.array], list[mx.array]]:
        raise NotImplementedError


class PlainRingRow(RingRow, cache_lib.RotatingKVCache):
    """One request's plain sliding-window layer (mlx-lm's RotatingKVCache), with its codec."""

    def __init__(self, max_size: int, codec: KVCodec = PLAIN_KV) -> None:
        cache_lib.RotatingKVCache.__init__(self, max_size)
        self.codec = codec

    def temporal_planes(self) -> tuple[list[mx.array], list[mx.array]]:
        return [self._temporal_order(self.keys)], [self._temporal_order(self.values)]


class PackedRingRow(RingRow, BaseCache):
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
        self._idx = 0  # columns held

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
            self._idx,
            self.codec.to_json(),
            list(self.row_shape),
        ]

    @state.setter
    def state(self, v: list[Any]) -> None:
        keys, values, offset, max_size, idx, codec, shape = v
        self.keys, self.values = tuple(keys), tuple(values)
        self.offset, self.max_size, self._idx = int(offset), int(max_size), int(idx)
        self.codec = KVCodec.from_json(codec)
        heads, kdim, vdim, dtype = shape
        self.row_shape = (int(heads), int(kdim), int(vdim), str(dtype))

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
            end = self._idx - n
            self.keys = tuple(p[..., :end, :] for p in self.keys)
            self.values = tuple(p[..., :end, :] for p in self.values)
            self._idx = end
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


def adopt_row(cache: Any, codec: KVCodec) -> Any:
    """A request's layer cache as one BatchQuantizedKVCache can batch; other kinds unchanged.

    Every plain KV layer goes through this (plain requests too), so that any two requests can
    share a batch whatever their codecs.
    """
    if type(cache) is cache_lib.KVCache:
        return PlainRow.adopt(cache, codec)
    if type(cache) is cache_lib.RotatingKVCache and cache.keep == 0:
        ring = PlainRingRow(cache.max_size, codec)
        ring.keys, ring.values, ring.offset, ring._idx = (
            cache.keys,
            cache.values,
            cache.offset,
            cache._idx,
        )
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


def codec_of(cache: Any) -> KVCodec:
    codec = getattr(cache, "codec", None)
    if codec is not None:
        return codec  # type: ignore[no-any-return]
    if isinstance(cache, cache_lib.QuantizedKVCache):
        return KVCodec(cache.bits, cache.group_size)
    return KVCodec()
