"""A direct store hit's KV tensors as planes with room (checkpoints/direct_planes.py): the copy
list the GPU's plane gather follows, applied here to a file's bytes, gives the bytes the host
landing gives (device_landing.host_plane), zeros in the room included (in-process; the
kernel itself is checked against the host at every MLX-CUDA engine's start)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine_service.checkpoints import direct_planes
from engine_service.checkpoints.device_landing import host_plane
from engine_service.checkpoints.direct_planes import plane_pieces
from tandem_client.records import Tensor


def _laid_out(
    values: np.ndarray, chunk: int, rng: np.random.Generator
) -> tuple[bytearray, list[tuple[int, int]]]:
    """values' bytes in a file of garbage, in chunks of `chunk` bytes at 16-byte-aligned places
    with gaps between them: the file and the chunks (offset, length)."""
    raw = values.tobytes()
    file = bytearray(rng.integers(0, 256, 64, dtype=np.uint8).tobytes())
    chunks = []
    for at in range(0, len(raw), chunk):
        piece = raw[at : at + chunk]
        chunks.append((len(file), len(piece)))
        file += piece + rng.integers(0, 256, 48, dtype=np.uint8).tobytes()
    return file, chunks


@pytest.mark.parametrize(
    ("shape", "keep", "columns", "chunk"),
    [
        ((1, 2, 64, 8), 40, 96, 1024),  # chunks straddle the heads
        ((1, 4, 33, 8), 33, 33, 48),  # all kept, no room; chunks of three positions
        ((1, 3, 50, 16), 17, 273, 4096),  # a chunk holds more than a head
        ((1, 1, 8, 8), 1, 256, 16),  # one position kept
    ],
)
def test_the_pieces_give_the_host_landings_plane(
    shape: tuple[int, int, int, int], keep: int, columns: int, chunk: int
) -> None:
    rng = np.random.default_rng(keep)
    values = rng.integers(1, 1 << 16, shape, dtype=np.uint16)  # no zero: the room shows
    tensor = Tensor("k", "bfloat16", shape, values.tobytes())
    file, chunks = _laid_out(values, chunk, rng)
    pieces = plane_pieces(tensor, chunks, keep, columns)
    assert pieces is not None
    _, heads, _, dim = shape
    plane = bytearray(b"\xff" * (heads * columns * dim * 2))  # garbage the room must replace
    for source, target, nbytes in zip(
        pieces.source.tolist(), pieces.target.tolist(), pieces.nbytes.tolist(), strict=True
    ):
        assert not (source % 16 if source >= 0 else 0) and not target % 16 and not nbytes % 16
        if source < 0:
            plane[target : target + nbytes] = bytes(nbytes)
        else:
            plane[target : target + nbytes] = file[source : source + nbytes]
    expected = np.array(host_plane(tensor, keep, columns).view(mx.uint16))
    assert np.frombuffer(bytes(plane), np.uint16).reshape(1, heads, columns, dim).tolist() == (
        expected.tolist()
    )


def test_what_the_plane_gather_cannot_read_is_left_to_the_host() -> None:
    tensor = Tensor("k", "bfloat16", (1, 2, 8, 8), bytes(256))
    whole = [(0, 256)]
    assert plane_pieces(tensor, whole, 9, 16) is None  # more kept than held
    assert plane_pieces(tensor, whole, 4, 7) is None  # a plane narrower than the tensor
    assert plane_pieces(tensor, [(8, 256)], 4, 16) is None  # a chunk off 16 bytes
    assert plane_pieces(tensor, [(0, 128)], 4, 16) is None  # chunks short of the tensor
    narrow = Tensor("k", "bfloat16", (1, 2, 8, 4), bytes(128))  # a position of 8 bytes
    assert plane_pieces(narrow, [(0, 128)], 4, 16) is None
    flat = Tensor("k", "bfloat16", (16, 8), bytes(256))
    assert plane_pieces(flat, whole, 4, 16) is None


def test_a_hit_lands_in_one_launch_up_to_the_widest_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every plane of a hit in one launch (allocating while earlier gathers read over PCIe
    cost ~1 ms a plane on an H100), from a few kernels of WIDTH_STEP steps: Qwen3-0.6B's 56
    planes and Llama-3-8B's 64 take the 64-output kernel, Qwen3-32B's 128 and Llama-3-70B's
    160 one launch of a wider one; past the widest, launches of it."""
    assert direct_planes.PLANES_PER_LAUNCH == 0  # the engine's default: not set
    widths = {planes: direct_planes.launch_width(planes) for planes in (1, 56, 64, 128, 160, 300)}
    assert widths == {1: 1, 56: 56, 64: 64, 128: 128, 160: 160, 300: 256}
    outputs = {w: direct_planes.kernel_outputs(w) for w in widths.values()}
    assert outputs == {1: 64, 56: 64, 64: 64, 128: 128, 160: 192, 256: 256}
    monkeypatch.setattr(direct_planes, "PLANES_PER_LAUNCH", 8)  # a bench's forced width
    assert direct_planes.launch_width(160) == 8
    assert direct_planes.kernel_outputs(8) == 8
