"""The launch arithmetic of deterministic mode's projection kernel
(model/invariant_matmul_cuda.py), in-process: CI has no GPU, where a wrong grid would skip or
overrun rows and columns. Every tiling the kernel may be given must cover each output once."""

from __future__ import annotations

import pytest

from engine_service.model.invariant_matmul_cuda import FEW_ROWS, ROWS, Asked, tiling

# Output widths of the shapes served (Qwen3-0.6B, Llama-3-8B, their vocabularies) and odd ones
# the kernel accepts (a multiple of 8).
WIDTHS = [8, 24, 1024, 2048, 3072, 4096, 14336, 128256, 151936]


@pytest.mark.parametrize("n", WIDTHS)
def test_the_chosen_tiling_covers_every_row_and_column_once(n: int) -> None:
    for rows in range(1, ROWS + 1):
        split = tiling(rows, n)
        assert n % (8 * split.columns) == 0, (rows, split)
        rows_a_group = 16 * split.block_tiles
        assert split.block_tiles <= ROWS // 16  # the shared memory is sized for at most 8
        # Row groups cover the rows, and none starts past the last row (the kernel's `rows`
        # for a group would be <= 0).
        assert split.groups * rows_a_group >= rows > (split.groups - 1) * rows_a_group
        # The steps loaded together hold at most 8 column tiles' w (64 registers a thread).
        assert 1 <= split.unroll and split.unroll * split.columns <= 8, (rows, split)


def test_an_override_is_taken_as_given() -> None:
    split = tiling(128, 4096, Asked(columns=1, block_tiles=8, unroll=3))
    assert (split.columns, split.block_tiles, split.groups, split.unroll) == (1, 8, 1, 3)
    assert tiling(33, 4096, Asked(block_tiles=1)).groups == 3
    # The x prefetch serves one half row tile: asked past FEW_ROWS rows, it is not taken.
    assert tiling(FEW_ROWS, 4096, Asked(prefetch=True)).prefetch
    assert not tiling(FEW_ROWS + 1, 4096, Asked(prefetch=True)).prefetch
