"""Attention over TurboQuant rows inside mlx-lm's models.

mlx-lm's attention layers call `scaled_dot_product_attention(queries, keys, values, cache=...)`
from `mlx_lm.models.base`, imported by name into each model module. It picks affine-quantized
attention when the cache has `bits`, and mlx's fused SDPA otherwise; there is no hook for
another codec. So `install` swaps that name, in every loaded mlx-lm model module, for
`routed_attention`: the keys a batch cache returns decide the path. TurboQuant planes
(`TurboQuantPlanes`, only ever returned by BatchQuantizedKVCache for a batch of TurboQuant
rows) go to `turboquant_attention`; plain planes inside a deterministic call go to
`row_invariant_attention` (kv/row_attention.py, for model/deterministic.py); anything else
goes to mlx-lm's function unchanged.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

from engine_service.kv.row_attention import active_pads, row_invariant_attention
from engine_service.kv.turboquant import TurboQuantPlanes, turboquant_attention

__all__ = ["install", "routed_attention", "turboquant_attention"]

_MLX_LM_SDPA = base.scaled_dot_product_attention


def routed_attention(
    queries: mx.array,
    keys: Any,
    values: Any,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    if isinstance(keys, TurboQuantPlanes):
        return turboquant_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    pads = active_pads()
    if pads is not None and isinstance(keys, mx.array):  # --deterministic (model/deterministic)
        written = getattr(cache, "written", None)  # a compiled step's DecodeKV: an array
        return row_invariant_attention(queries, keys, values, scale, pads, sinks, written)
    return _MLX_LM_SDPA(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def install() -> int:
    """Routes every loaded mlx-lm model module's attention (idempotent; call after a model
    loads, as its module is imported then). Returns the modules routed by this call."""
    routed = 0
    for name, module in list(sys.modules.items()):
        if not name.startswith("mlx_lm.models.") or module is None:
            continue
        if getattr(module, "scaled_dot_product_attention", None) is _MLX_LM_SDPA:
            setattr(module, "scaled_dot_product_attention", routed_attention)  # noqa: B010
            routed += 1
    return routed
