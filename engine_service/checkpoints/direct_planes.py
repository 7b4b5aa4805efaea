"""A direct store hit's KV tensors gathered straight into planes with room (MLX-CUDA), the GPU's
counterpart of device_landing.host_plane.

A plain-KV prefix record holds each layer's keys and values as [1, heads, positions, dim]. A
batch takes a lone row's plane of `columns` positions as it is (kv/planes.py), and writes the
next tokens into it in place, but only when the plane owns its buffer: the group gather
(direct_landing.py) lands a group's tensors as views of one buffer, which the batch's merge
must copy whole, on the generation stream, before the first layer's forward pass can start.
So here each plane is its own kernel output: the first `keep` positions of each head read
from the data file's pinned pages, the rest of the plane zeros (KV past a row's length is
never read unmasked, but must be finite), every plane of a hit in one launch (up to
MAX_PLANES_PER_LAUNCH), in the model's layer order. (On the H200 the merge's copy went and the
hit's time moved within the runs' noise: docs/performance.md, 2026-12-05, fifth session.)

One launch, not a launch every few layers: a launch allocates its outputs, and allocating while
earlier gathers read pinned pages over PCIe cost ~1 ms of CUDA's host time a plane (46 ms of
a 32k-token hit's launches on an H100). Launches of 8 planes let the forward pass start on
layer 0 while later layers crossed PCIe, but a 32k-token hit took 1.16-1.25x as long, and an
8k one as long (docs/performance.md, eighth session). A launch's outputs are fixed when its
kernel is made, so widths come in steps of WIDTH_STEP (a few kernels, the model's compiled at
start-up): a model of more than 32 layers (Qwen3-32B's 64, Llama-3-70B's 80) still lands in one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from tandem_client.records import Tensor

WIDTH_STEP = 64  # a launch's outputs: a multiple of this (the planes of 32 layers)
# The most outputs a launch takes: a pointer each in the kernel's parameters (2 KiB of CUDA's
# 4 KiB), and the planes of a 128-layer model.
MAX_PLANES_PER_LAUNCH = 256
# Planes a launch when set (0: all of a hit's, up to the maximum): bench/direct_landing_check.py
# --planes-per-launch times others, and TANDEM_PLANES_PER_LAUNCH sets an engine's, for
# bench/hit_floor_bench.py --routes direct,direct-8-a-launch.
PLANES_PER_LAUNCH = int(os.environ.get("TANDEM_PLANES_PER_LAUNCH", "0"))
THREADS_PER_BLOCK = 256
MAX_BLOCKS_PER_PIECE = 64
GATHER_BLOCKS = 512  # thread blocks a launch uses at most: PCIe bounds it, not the SMs
# p holds, per piece: (device address of its bytes or 0 for zeros, output, offset in it,
# 16-byte words).
_SOURCE = """
  size_t piece = blockIdx.y;
  uint8_t* outs[OUTPUTS] = {OUTPUT_LIST};
  const uint4* src = reinterpret_cast<const uint4*>(p[piece * 4]);
  uint4* dst = reinterpret_cast<uint4*>(outs[p[piece * 4 + 1]] + p[piece * 4 + 2]);
  size_t n16 = (size_t)p[piece * 4 + 3];
  size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (src == nullptr) {
    for (; i < n16; i += stride) { dst[i] = make_uint4(0, 0, 0, 0); }
    return;
  }
  for (; i + 3 * stride < n16; i += 4 * stride) {
    uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
    dst[i] = a; dst[i + stride] = b; dst[i + 2 * stride] = c; dst[i + 3 * stride] = d;
  }
  for (; i < n16; i += stride) { dst[i] = src[i]; }
"""


@dataclass(frozen=True)
class PlanePieces:
    """The copies that make one plane, as arrays (a 32k-token record has thousands: numpy,
    not a Python object each): `nbytes[i]` at `target[i]` bytes into the plane, from the file
    at `source[i]`, or zeros where that is -1."""

    source: np.ndarray
    target: np.ndarray
    nbytes: np.ndarray


def plane_pieces(
    tensor: Tensor, chunks: list[tuple[int, int]], keep: int, columns: int
) -> PlanePieces | None:
    """How a KV tensor [1, heads, positions, dim] whose bytes lie in `chunks` (file offset,
    length) becomes a plane [1, heads, columns, dim] holding its first `keep` positions; None
    when it cannot be gathered so (another shape, or a piece not on 16 bytes)."""
    if len(tensor.shape) != 4 or tensor.shape[0] != 1 or not chunks:
        return None
    _, heads, positions, dim = tensor.shape
    row = dim * np.dtype(_numpy_dtype(tensor.dtype)).itemsize
    if not 0 < keep <= positions <= columns or row % 16:
        return None
    offsets, lengths = (np.asarray(c, dtype=np.int64) for c in zip(*chunks, strict=True))
    if (offsets % 16).any() or (lengths % 16).any() or (lengths <= 0).any():
        return None
    starts = np.concatenate([[0], np.cumsum(lengths)])  # each chunk's place in the tensor
    if starts[-1] != heads * positions * row:
        return None
    head = np.arange(heads, dtype=np.int64)
    low, high = head * positions * row, (head * positions + keep) * row  # a head's kept bytes
    first = np.searchsorted(starts, low, side="right") - 1  # the chunks they lie in
    last = np.searchsorted(starts, high, side="left") - 1
    counts = last - first + 1
    of_head = np.repeat(head, counts)
    chunk = (
        np.repeat(first, counts)
        + np.arange(counts.sum())
        - np.repeat(np.cumsum(counts) - counts, counts)
    )
    begin = np.maximum(starts[chunk], low[of_head])
    end = np.minimum(starts[chunk + 1], high[of_head])
    room = (columns - keep) * row
    zeros = head if room else head[:0]
    return PlanePieces(
        np.concatenate([offsets[chunk] + begin - starts[chunk], np.full(zeros.size, -1)]),
        np.concatenate(
            [of_head * columns * row + begin - low[of_head], zeros * columns * row + keep * row]
        ),
        np.concatenate([end - begin, np.full(zeros.size, room)]),
    )


def plane_bytes(tensor: Tensor, columns: int) -> int:
    """The bytes of a KV tensor's plane of `columns` positions (a launch's output for it)."""
    _, heads, _, dim = tensor.shape
    return heads * columns * dim * np.dtype(_numpy_dtype(tensor.dtype)).itemsize


def launch_width(planes: int) -> int:
    """How many planes each launch of a hit of `planes` gathers (PLANES_PER_LAUNCH, read at
    the call: a probe may set it)."""
    return PLANES_PER_LAUNCH or min(MAX_PLANES_PER_LAUNCH, max(1, planes))


def kernel_outputs(width: int) -> int:
    """The outputs of the kernel a launch of `width` planes uses (the spare ones are 16
    bytes each): few kernels to compile, one for every model of up to 32 layers (a width
    PLANES_PER_LAUNCH forces, its own)."""
    return PLANES_PER_LAUNCH or -(-width // WIDTH_STEP) * WIDTH_STEP


def _numpy_dtype(name: str) -> str:
    return "uint16" if name == "bfloat16" else name


class PlaneGather:
    """The kernels: up to `outputs` planes a launch, each its own output."""

    def __init__(self) -> None:
        self._kernels: dict[int, Any] = {}  # by outputs a launch

    def launch(
        self,
        group: list[tuple[Tensor, PlanePieces]],
        base: int,
        columns: int,
        outputs: int = WIDTH_STEP,
    ) -> dict[int, mx.array]:
        """One launch of the kernel with `outputs` outputs (at least len(group)): each
        tensor's plane from its pieces (file offsets + base: the file's device address).
        id(tensor) -> plane, not yet evaluated."""
        if outputs not in self._kernels:
            names = [f"out{i}" for i in range(outputs)]
            self._kernels[outputs] = mx.fast.cuda_kernel(
                name=f"tandem_gather_planes_{outputs}",
                input_names=["p"],
                output_names=names,
                source=_SOURCE.replace("OUTPUT_LIST", ", ".join(names)).replace(
                    "OUTPUTS", str(outputs)
                ),
            )
        rows = []
        sizes: list[int] = []
        for index, (tensor, pieces) in enumerate(group):
            source = np.where(pieces.source < 0, 0, base + pieces.source)
            target, index_column = pieces.target, np.full(pieces.source.size, index)
            rows.append(np.stack([source, index_column, target, pieces.nbytes // 16], axis=1))
            sizes.append(plane_bytes(tensor, columns))
        table = np.concatenate(rows).astype(np.uint64)
        count = table.shape[0]
        longest = int(table[:, 3].max()) * 16
        per_piece = min(
            MAX_BLOCKS_PER_PIECE,
            -(-(longest // 16) // THREADS_PER_BLOCK),
            max(1, GATHER_BLOCKS // count),
        )
        spare = outputs - len(group)
        made: list[mx.array] = self._kernels[outputs](
            inputs=[mx.array(table.reshape(-1))],
            output_shapes=[(n,) for n in sizes] + [(16,)] * spare,
            output_dtypes=[mx.uint8] * outputs,
            grid=(per_piece * THREADS_PER_BLOCK, count, 1),
            threadgroup=(THREADS_PER_BLOCK, 1, 1),
        )
        planes = {}
        for (tensor, _), raw in zip(group, made, strict=False):
            _, heads, _, dim = tensor.shape
            typed = raw.view(getattr(mx, tensor.dtype))
            planes[id(tensor)] = typed.reshape(1, heads, columns, dim)
        return planes
