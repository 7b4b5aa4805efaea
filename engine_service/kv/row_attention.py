"""Deterministic mode's call state and attention (model/deterministic.py has the mode).

A deterministic call (`deterministic_call`) marks its thread with the decode matmul block and
each row's left padding in the batch caches; attention routing (kv/attention_routing.py)
then sends plain planes to `row_invariant_attention`, and mlx's projections run in fixed row
blocks (model/deterministic.py). The state is per thread, so other models in the process are
untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from engine_service.kv import row_attention_cuda


class _Active(threading.local):
    rows: int = 0  # 0: not inside a deterministic call
    pads: list[int] | None = None  # each row's left padding in this call's batch caches


_active = _Active()


def active_pads() -> list[int] | None:
    """The left padding of the deterministic call running on this thread, else None."""
    return _active.pads if _active.rows else None


def active_rows() -> int:
    """The decode matmul block of the deterministic call on this thread; 0 outside one."""
    return _active.rows


@contextmanager
def deterministic_call(rows: int, pads: list[int]) -> Iterator[None]:
    _active.rows, _active.pads = rows, pads
    try:
        yield
    finally:
        _active.rows, _active.pads = 0, None


def row_invariant_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    pads: list[int],
    sinks: mx.array | None = None,
) -> mx.array:
    """Attention row by row over each row's own keys: what a row computes does not depend on
    the other rows' lengths. Queries standing for left padding (a batched prefill) get zeros,
    as nothing reads them."""
    rows, heads, q_len, _ = queries.shape
    k_len = keys.shape[2]
    if q_len == 1 and sinks is None and row_attention_cuda.AVAILABLE:
        if keys.dtype in row_attention_cuda.SUPPORTED:  # one kernel for the batch
            return row_attention_cuda.row_attention(queries, keys, values, scale, pads)
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
