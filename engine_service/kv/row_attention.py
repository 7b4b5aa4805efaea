"""Deterministic mode's call state and attention (model/deterministic.py has the mode).

A deterministic call (`deterministic_call`) marks its thread with the decode matmul block and
each row's left padding in the batch caches; attention routing (kv/attention_routing.py)
then sends plain planes to `row_invariant_attention`, and mlx's projections run in fixed row
blocks (model/deterministic.py). The state is per thread, so other models in the process are
untouched.

Inside a compiled decode step (loop/compiled_decode.py) the paddings and the written length
are arrays, not Python ints: a decode step's attention takes them as either, so the compiled
and the eager step compute the same bits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from engine_service.kv import row_attention_cuda

Paddings = list[int] | mx.array  # each row's left padding: ints, or an array in a trace

# Key positions reduced together, counted from a row's start, in the MLX-ops algorithm (Metal;
# the CUDA kernel has its own, and no device runs both).
CHUNK = 256
_MASKED = -1e30


class _Active(threading.local):
    rows: int = 0  # 0: not inside a deterministic call
    pads: Paddings | None = None  # each row's left padding in this call's batch caches
    matmul_kernel: bool = False  # projections through model/invariant_matmul_cuda.py
    alone: bool = False  # a decode step's rows attend one at a time (eager steps only)


_active = _Active()


def active_pads() -> Paddings | None:
    """The left padding of the deterministic call running on this thread, else None."""
    return _active.pads if _active.rows else None


def active_rows() -> int:
    """The decode matmul block of the deterministic call on this thread; 0 outside one."""
    return _active.rows


def active_matmul_kernel() -> bool:
    """Whether the deterministic call on this thread runs its projections through the
    batch-invariant kernel where it applies (else in blocks of active_rows() rows)."""
    return _active.matmul_kernel


@contextmanager
def deterministic_call(
    rows: int, pads: Paddings, matmul_kernel: bool = False, alone: bool = False
) -> Iterator[None]:
    _active.rows, _active.pads, _active.matmul_kernel = rows, pads, matmul_kernel
    _active.alone = alone
    try:
        yield
    finally:
        _active.rows, _active.pads, _active.matmul_kernel, _active.alone = 0, None, False, False


def row_invariant_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    pads: Paddings,
    sinks: mx.array | None = None,
    written: mx.array | None = None,
) -> mx.array:
    """Attention in which what a row computes does not depend on the other rows' lengths.

    A decode step (one query a row) reduces each row's keys in chunks counted from its own
    first key: one CUDA kernel for the batch on MLX-CUDA, the same algorithm in MLX ops
    elsewhere, or, in a call that asks for it (the CPU's default: `alone`), each row on its own
    through MLX's SDPA over its own keys, as a prefill chunk runs. `written`: the planes'
    columns holding keys, where they are wider (a compiled step's planes); None: all of them.
    A prefill chunk runs row by row over each row's own keys; queries standing for left
    padding get zeros, as nothing reads them."""
    rows, heads, q_len, _ = queries.shape
    k_len = keys.shape[2]
    if q_len == 1 and sinks is None:
        if row_attention_cuda.AVAILABLE and keys.dtype in row_attention_cuda.SUPPORTED:
            return row_attention_cuda.row_attention(queries, keys, values, scale, pads, written)
        if _active.alone:
            if not isinstance(pads, list) or written is not None:
                # A compiled step would take the chunks: other bits than the eager steps'.
                raise ValueError("a deterministic model whose rows attend alone steps eagerly")
            return _each_row_alone(queries, keys, values, scale, pads)
        return chunked_row_attention(queries, keys, values, scale, pads, written)
    if not isinstance(pads, list):
        raise ValueError("a compiled deterministic step decodes one token a row without sinks")
    out = []
    for row, pad in enumerate(pads):
        first = max(0, pad - (k_len - q_len))  # queries before it are padding
        attended = mx.fast.scaled_dot_product_attention(
            queries[row : row + 1, :, first:],
            keys[row : row + 1, :, pad:],
            values[row : row + 1, :, pad:],
            scale=scale,
            mask="causal" if q_len - first > 1 else None,
            sinks=sinks,
        )
        if first:
            padding = mx.zeros((1, heads, first, attended.shape[-1]), attended.dtype)
            attended = mx.concatenate([padding, attended], axis=2)
        out.append(attended)
    return out[0] if rows == 1 else mx.concatenate(out, axis=0)


def _each_row_alone(
    queries: mx.array, keys: mx.array, values: mx.array, scale: float, pads: list[int]
) -> mx.array:
    """A decode step's attention a row at a time, over its own keys only (its padding sliced
    off): what a row computes has the shapes of that row alone, whatever else is in the batch.
    On the CPU this took a layer of 8 rows from 1.9 ms (the chunks in MLX ops) to 0.5 ms."""
    out = [
        mx.fast.scaled_dot_product_attention(
            queries[row : row + 1], keys[row : row + 1, :, pad:], values[row : row + 1, :, pad:],
            scale=scale,
        )
        for row, pad in enumerate(pads)
    ]  # fmt: skip
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)


def chunked_row_attention(
    queries: mx.array,  # (B, Hq, 1, D)
    keys: mx.array,  # (B, Hkv, L, D), row b's keys from column pads[b] to `written`
    values: mx.array,
    scale: float,
    pads: Paddings,
    written: mx.array | None = None,
) -> mx.array:
    """kv/row_attention_cuda.py's algorithm in MLX ops: each row's keys moved to the front,
    scored in chunks of CHUNK (each a reduction of fixed shape), the chunks merged in order.
    Chunks past a row's end weigh exactly 0, so neither the batch's width nor the row's place
    in it changes a bit. Every reduction runs over an axis of fixed size, and the chunks merge
    one by one in Python, since a reduction's order over an axis may depend on its length.
    Chunks are scored GROUP at a time, which bounds the temporaries at long contexts and does
    not change a bit (each chunk's arithmetic is the same)."""
    rows, heads, _, dim = queries.shape
    kv_heads, width = keys.shape[1], keys.shape[2]
    splits = -(-width // CHUNK)
    pad = mx.array(pads, dtype=mx.int32) if isinstance(pads, list) else pads.astype(mx.int32)
    end = mx.array(width, dtype=mx.int32) if written is None else written.reshape(())
    q = queries.reshape(rows, kv_heads, heads // kv_heads, 1, dim).astype(mx.float32) * scale
    stats = [
        _chunk_stats(q, keys, values, pad, end, first, min(GROUP, splits - first))
        for first in range(0, splits, GROUP)
    ]
    top = mx.concatenate([t for t, _, _ in stats], axis=-1)  # (B, Hkv, G, splits)
    sums = mx.concatenate([s for _, s, _ in stats], axis=-1)
    partial = mx.concatenate([p for _, _, p in stats], axis=-2)  # (B, Hkv, G, splits, Dv)
    overall = top.max(-1)
    weight = mx.exp(top[..., 0] - overall)
    total, acc = weight * sums[..., 0], weight[..., None] * partial[..., 0, :]
    for split in range(1, splits):
        weight = mx.exp(top[..., split] - overall)
        total = total + weight * sums[..., split]
        acc = acc + weight[..., None] * partial[..., split, :]
    out = acc / total[..., None]
    return out.reshape(rows, heads, 1, values.shape[3]).astype(queries.dtype)


GROUP = 4  # chunks scored together by chunked_row_attention: 1,024 positions


def _chunk_stats(
    q: mx.array,  # (B, Hkv, G, 1, D), float32, scaled
    keys: mx.array,
    values: mx.array,
    pad: mx.array,
    end: mx.array,
    first: int,
    count: int,
) -> tuple[mx.array, mx.array, mx.array]:
    """Chunks first .. first + count - 1 of each row's keys (counted from the row's first
    key): each chunk's max score, sum of exp(score - max), and those weights times values."""
    rows, kv_heads, group = q.shape[:3]
    width, value_dim = keys.shape[2], values.shape[3]
    at = first * CHUNK + mx.arange(count * CHUNK, dtype=mx.int32)
    index = mx.minimum(pad[:, None] + at[None, :], width - 1)[:, None, :, None]
    valid = (at[None, :] < (end - pad)[:, None])[:, None, None, :]
    k = mx.take_along_axis(keys, index, axis=2).astype(mx.float32)
    v = mx.take_along_axis(values, index, axis=2).astype(mx.float32)
    scores = mx.where(valid, (q * k[:, :, None]).sum(-1), _MASKED)
    scores = scores.reshape(rows, kv_heads, group, count, CHUNK)
    top = scores.max(-1)
    numerators = mx.where(scores <= 0.5 * _MASKED, 0.0, mx.exp(scores - top[..., None]))
    v = v.reshape(rows, kv_heads, 1, count, CHUNK, value_dim)
    partial = (numerators[..., None] * v).sum(-2)
    return top, numerators.sum(-1), partial
