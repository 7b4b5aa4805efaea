"""One request's KV layer as a row BatchQuantizedKVCache can batch: `PlainRow` (plain tensors,
with the codec it converts to) and `PackedRow` (quantized planes), both mlx-lm's own solo
caches underneath, adopted without a copy (quantized_kv.py explains the batch)."""

from __future__ import annotations

from typing import Any, ClassVar

from mlx_lm.models import cache as cache_lib

from engine_service.kv_codec import PLAIN_KV, KVCodec


class Row:
    """What PlainRow and PackedRow share: a codec, adoption of mlx-lm's solo cache (no copy),
    and batching as a BatchQuantizedKVCache."""

    codec: KVCodec
    keys: Any
    values: Any
    offset: int
    # The batch cache rows merge into (BatchQuantizedKVCache): set by quantized_kv.py, which
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


def adopt_row(cache: Any, codec: KVCodec) -> Any:
    """A request's layer cache as one BatchQuantizedKVCache can batch; other kinds unchanged.

    Every plain KV layer goes through this (plain requests too), so that any two requests can
    share a batch whatever their codecs.
    """
    if type(cache) is cache_lib.KVCache:
        return PlainRow.adopt(cache, codec)
    if type(cache) is cache_lib.QuantizedKVCache:
        if codec.storage != (cache.bits, cache.group_size):
            raise ValueError(
                f"a {cache.bits}-bit/{cache.group_size} cache cannot continue as {codec}"
            )
        return PackedRow.adopt(cache, codec)
    if isinstance(cache, (PlainRow, PackedRow)):
        cache.codec = codec
    return cache


def codec_of(cache: Any) -> KVCodec:
    codec = getattr(cache, "codec", None)
    if codec is not None:
        return codec  # type: ignore[no-any-return]
    if isinstance(cache, cache_lib.QuantizedKVCache):
        return KVCodec(cache.bits, cache.group_size)
    return KVCodec()
