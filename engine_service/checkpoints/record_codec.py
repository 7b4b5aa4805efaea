"""Compressed prefix records: a prefix's plain KV stored as 8- or 4-bit affine codes (MLX's
`mx.quantize`, groups along the head dimension) or as 4-, 3- or 2-bit TurboQuant codes (each
head vector's norm and its rotated unit vector's codebook indices: kv/turboquant.py), and
expanded back to plain KV on the device that restores it.

Why: a store hit moves the record's bytes (store copy, region, landing); 8 bits halve a
bf16 record's bytes and quarter a float32 one's, 4 bits about halve them again. The cost is
quality: the restored prefix's KV is not the one a prefill computes, so a compressed hit is
never exact (docs/checkpoints.md gives the measured difference). A request asks for it
(`GenerateRequest.prefix_record_bits`, `prefix_record_scheme`); its records live under their
own scope, so a request that did not ask for that format never restores one.

Only plain `KVCache` layers are compressed (keys and values: the bulk of any record);
quantized, TurboQuant, ring and recurrent layers are stored as they are. In the record's
skeleton a compressed array is a node {"q": {codes, scales, biases, bits, group, dtype}}, a
TurboQuant one {"tq": {codes, norms, bits, dim, dtype}} (cache_records.py expands both).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from engine_service.checkpoints.cache_records import (
    COMPRESSIBLE_DTYPES,
    CapturedCache,
    dtype_name,
    stored_view,
)
from engine_service.checkpoints.device_landing import WORD_VIEWS
from engine_service.kv.turboquant import codec_for
from engine_service.protocol.kv_codec import Scheme
from engine_service.protocol.requests import RecordFormat

COMPRESSED_CLASSES = frozenset({"KVCache"})


def group_for(width: int) -> int | None:
    """The quantization group along a head of `width`: 64, else 32; None: not divisible."""
    return next((g for g in (64, 32) if width % g == 0), None)


def compress(captured: CapturedCache, record: RecordFormat) -> CapturedCache:
    """The capture with its plain KV layers' arrays as codes of the record's format (MLX
    thread; the codes are computed on the device and evaluated before this returns)."""
    if not record.bits:
        return captured
    arrays = dict(captured.arrays)
    dtypes = dict(captured.dtypes)

    def keep(name: str, part: str, array: mx.array) -> str:
        part_name = f"{name}.{part}"
        part_dtype = dtype_name(array)
        arrays[part_name] = stored_view(array, part_dtype)
        dtypes[part_name] = part_dtype
        return part_name

    def visit(node: Any) -> Any:
        if "t" in node:
            name = node["t"]
            dtype = dtypes[name]
            stored = arrays[name]
            group = group_for(stored.shape[-1]) if stored.ndim else None
            if dtype not in COMPRESSIBLE_DTYPES or group is None:
                return node
            value = stored.view(getattr(mx, dtype)) if dtype in WORD_VIEWS else stored
            del arrays[name], dtypes[name]
            if record.scheme is Scheme.TURBOQUANT:
                planes = codec_for(value.shape[-1], record.bits).encode(value)
                tq = {
                    "codes": keep(name, "codes", planes.codes),
                    "norms": keep(name, "norms", planes.norms),
                    "bits": record.bits,
                    "dim": int(value.shape[-1]),
                    "dtype": dtype,
                }
                return {"tq": tq}
            codes, scales, biases = mx.quantize(value, group_size=group, bits=record.bits)
            parts = {"codes": codes, "scales": scales, "biases": biases}
            named = {part: keep(name, part, array) for part, array in parts.items()}
            return {"q": {**named, "bits": record.bits, "group": group, "dtype": dtype}}
        if "l" in node:
            return {"l": [visit(child) for child in node["l"]]}
        return node

    skeleton = [
        {**layer, "state": visit(layer["state"])} if layer["class"] in COMPRESSED_CLASSES else layer
        for layer in captured.skeleton
    ]
    mx.eval(list(arrays.values()))
    return CapturedCache(arrays, dtypes, skeleton, captured.layout, captured.tokens)
