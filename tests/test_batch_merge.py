"""Rows merged into a batch cache (a store hit, resumed rows, parked rows coming back) keep
their positions exactly and leave room for the next ones: the first step after a merge
writes in place instead of regrowing every plane (a copy of the whole cache)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models import cache as cache_lib

from engine_service.kv.batch_cache import BatchQuantizedKVCache, adopt_row
from engine_service.protocol.kv_codec import PLAIN_KV

HEADS, DIM = 2, 8


def _row(length: int, seed: int) -> cache_lib.KVCache:
    mx.random.seed(seed)
    row = cache_lib.KVCache()
    row.update_and_fetch(
        mx.random.normal((1, HEADS, length, DIM)), mx.random.normal((1, HEADS, length, DIM))
    )
    return row


def _held(row: cache_lib.KVCache) -> tuple[mx.array, mx.array]:
    """The keys and values of the positions a row holds (copies)."""
    assert row.keys is not None and row.values is not None
    return mx.array(row.keys[..., : row.offset, :]), mx.array(row.values[..., : row.offset, :])


@pytest.mark.parametrize("lengths", [[300], [300, 170, 1]])
def test_merged_rows_keep_their_positions_and_take_a_step_in_place(lengths: list[int]) -> None:
    rows = [_row(n, seed) for seed, n in enumerate(lengths)]
    sources = [_held(r) for r in rows]
    batch = BatchQuantizedKVCache.merge([adopt_row(r, PLAIN_KV) for r in rows])
    width = max(lengths)
    assert batch.size() == width and batch._cap == width + batch.step  # room for a step
    (group,) = batch._groups
    planes = [p.shape for p in group.planes]

    new_keys = mx.random.normal((len(rows), HEADS, 15, DIM))
    new_values = mx.random.normal((len(rows), HEADS, 15, DIM))
    keys, values = batch.update_and_fetch(new_keys, new_values)
    assert batch._cap == width + batch.step and [p.shape for p in group.planes] == planes
    assert keys.shape[2] == width + 15

    for i, (n, (k, v)) in enumerate(zip(lengths, sources, strict=True)):
        pad = width - n
        assert mx.array_equal(keys[i : i + 1, :, pad:width], k)
        assert mx.array_equal(values[i : i + 1, :, pad:width], v)
        assert mx.array_equal(keys[i : i + 1, :, width:], new_keys[i : i + 1])
        assert mx.array_equal(values[i : i + 1, :, width:], new_values[i : i + 1])
        assert not mx.any(keys[i, :, :pad]).item()  # left padding stays empty
