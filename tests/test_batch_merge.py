"""Rows merged into a batch cache (a store hit, resumed rows, parked rows coming back) keep
their positions exactly and leave room for the next ones: the first step after a merge
writes in place instead of regrowing every plane (a copy of the whole cache)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as cache_lib
from mlx_lm.models.base import create_causal_mask

from engine_service.checkpoints.device_landing import host_plane
from engine_service.kv.batch_cache import BatchQuantizedKVCache, adopt_row
from engine_service.protocol.kv_codec import PLAIN_KV, KVCodec
from tandem_client.records import Tensor

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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_a_plane_landed_with_room_holds_its_positions_then_zeros(dtype: str) -> None:
    """device_landing.host_plane: a stored tensor's first `keep` positions in a plane of
    `columns`, the rest zero."""
    source = mx.random.normal((1, HEADS, 40, DIM)).astype(getattr(mx, dtype))
    raw = np.array(source.view(mx.uint8)).tobytes()
    stored = Tensor("k", dtype, (1, HEADS, 40, DIM), raw)
    plane = host_plane(stored, 33, 33 + 256)
    assert plane.shape == (1, HEADS, 33 + 256, DIM) and plane.dtype == source.dtype
    assert mx.array_equal(plane[..., :33, :], source[..., :33, :])
    assert not mx.any(plane[..., 33:, :]).item()
    with pytest.raises(ValueError):
        host_plane(stored, 41, 300)  # more positions than the tensor holds


def test_a_lone_row_landed_with_room_joins_its_batch_without_a_copy() -> None:
    """A store hit landed with a step of room (prefix_reuse: the matched positions only) is
    the batch's plane itself; its step then writes in place, past the landed positions."""
    row = _row(300, 3)
    keys, values = _held(row)
    landed = cache_lib.KVCache()
    landed.keys = mx.concatenate([keys, mx.zeros((1, HEADS, 256, DIM))], axis=2)
    landed.values = mx.concatenate([values, mx.zeros((1, HEADS, 256, DIM))], axis=2)
    landed.offset = 300
    mx.eval(landed.keys, landed.values)
    batch = BatchQuantizedKVCache.merge([adopt_row(landed, PLAIN_KV)])
    (group,) = batch._groups
    assert group.keys[0] is landed.keys and group.values[0] is landed.values
    new = mx.random.normal((1, HEADS, 15, DIM))
    got_keys, _ = batch.update_and_fetch(new, new)
    assert mx.array_equal(got_keys[..., :300, :], keys)
    assert mx.array_equal(got_keys[..., 300:, :], new)


def test_plain_rows_without_padding_get_the_fused_causal_mask() -> None:
    """A batch whose rows are plain KV with no left padding (a lone row: a store hit, a
    single stream) masks as mlx-lm's own KVCache does ("causal", None for one token), so
    MLX's fused attention runs; the same bits as the array mask here. Padding, a quantized
    codec or an asked-for array keep the array."""
    lone = BatchQuantizedKVCache.merge([adopt_row(_row(300, 1), PLAIN_KV)])
    assert lone.make_mask(16) == "causal" and lone.make_mask(1) is None
    assert isinstance(lone.make_mask(16, return_array=True), mx.array)
    assert isinstance(lone.make_mask(16, window_size=64), mx.array)
    padded = BatchQuantizedKVCache.merge([adopt_row(_row(n, n), PLAIN_KV) for n in (300, 170)])
    assert isinstance(padded.make_mask(16), mx.array)
    quantized = BatchQuantizedKVCache.merge([adopt_row(_row(300, 2), KVCodec(8, 64, 0))])
    assert isinstance(quantized.make_mask(16), mx.array)

    mx.random.seed(3)
    queries = mx.random.normal((1, HEADS * 2, 16, DIM))
    keys, values = lone.update_and_fetch(
        mx.random.normal((1, HEADS, 16, DIM)), mx.random.normal((1, HEADS, 16, DIM))
    )
    array_mask = create_causal_mask(16, offset=300, left_padding=mx.array([0]))
    fused = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.3, mask="causal")
    masked = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.3, mask=array_mask)
    assert bool(mx.array_equal(fused, masked))
