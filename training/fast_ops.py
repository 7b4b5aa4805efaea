"""Cheaper element-wise work for training on a CPU: the same functions as mlx-lm's
attention and SwiGLU, computed with fewer of MLX's slow CPU primitives.

Why by hand: MLX's Linux CPU build computes `exp` and `sigmoid` with a scalar polynomial
(~14 and ~19 ns an element here), while its `power` calls libm's (~6 ns); a training step
of `tandem-tiny` takes ~30 M exps on each rank (the attention softmaxes, the SiLUs, the
loss). And a causal softmax over whole rows computes the exps of the masked half too; in
query blocks, a block's scores stop at its last key.

Installed only while a model trains on the CPU (`installed_for`): serving runs mlx-lm's own
ops, and so does a GPU, where `mx.fast.scaled_dot_product_attention` is one fused kernel.
Measured on one core (tandem-tiny, 16 windows of 256): 1.94 s a step with mlx-lm's ops,
1.50 s with these.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import mlx.core as mx
from mlx_lm.models import lfm2, llama

LOG2_E = 1 / math.log(2)
QUERY_BLOCK = 128  # queries per block of the causal softmax (the context is 256)


def exp(x: mx.array) -> mx.array:
    """e**x as 2**(x log2 e): MLX's CPU `power` is libm's, ~2.5x faster than its `exp`."""
    return mx.power(mx.array(2.0, dtype=x.dtype), x * LOG2_E)


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `swiglu`: silu(gate) * x, with silu(g) = g / (1 + e**-g)."""
    return gate / (1 + exp(-gate)) * x


def _softmax(scores: mx.array) -> mx.array:
    # Differentiated by MLX itself: measured faster than a custom VJP, which MLX's compiler
    # does not fuse with its neighbours.
    peak = mx.stop_gradient(scores.max(axis=-1, keepdims=True))
    exps = exp(scores - peak)
    return exps / exps.sum(axis=-1, keepdims=True)


def causal_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: Any,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `scaled_dot_product_attention` for a causal mask without a cache, in query
    blocks that see only the keys up to their last query; any other call goes to mlx-lm's."""
    if not (isinstance(mask, str) and mask == "causal") or cache is not None or sinks is not None:
        library: mx.array = _LIBRARY_ATTENTION(queries, keys, values, cache, scale, mask, sinks)
        return library
    batch, heads, length, dim = queries.shape
    kv_heads = keys.shape[1]
    # Grouped-query attention: query head h reads key head h // (heads / kv_heads).
    grouped = (queries * scale).reshape(batch, kv_heads, heads // kv_heads, length, dim)
    keys, values = keys[:, :, None], values[:, :, None]
    outputs = []
    for start in range(0, length, QUERY_BLOCK):
        end = min(start + QUERY_BLOCK, length)
        scores = grouped[:, :, :, start:end] @ keys[:, :, :, :end].swapaxes(-1, -2)
        visible = mx.arange(start, end)[:, None] >= mx.arange(end)[None]
        scores = mx.where(visible, scores, -mx.inf)
        outputs.append(_softmax(scores) @ values[:, :, :, :end])
    attended = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=3)
    return attended.reshape(batch, heads, length, dim)


_MODULES: tuple[Any, ...] = (llama, lfm2)  # the trained models' architectures (CONFIGS)
_LIBRARY_ATTENTION = _MODULES[0].scaled_dot_product_attention


@contextmanager
def installed_for(device: Any) -> Iterator[None]:
    """These ops in place of mlx-lm's in the trained models' modules while training on
    `device`, when it is a CPU."""
    if device != mx.cpu:
        yield
        return
    saved = [(m, m.scaled_dot_product_attention, m.swiglu) for m in _MODULES]
    for module in _MODULES:
        module.scaled_dot_product_attention = causal_attention
        module.swiglu = swiglu
    try:
        yield
    finally:
        for module, attention, activation in saved:
            module.scaled_dot_product_attention = attention
            module.swiglu = activation
