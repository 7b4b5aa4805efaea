"""Our MLX-CUDA kernels compile, as MLX compiles them, for the launches their modules make on
the shapes we serve (the projection's: each tiling it chooses at its extremes; every one, and
more attention shapes, under `make soak`), and each launch fits an SM (tests/nvrtc_check.py).
CI has no GPU: before this, a kernel that did not compile, or asked for more registers than
an SM has ("too many resources requested for launch"), was found only on a lent device.

The modules run as on MLX-CUDA, on the CPU's arrays, with `mx.fast.cuda_kernel` recording
each call: their launch arithmetic (grids, blocks, template arguments, output shapes) is the
real one. Covered: the invariant projection and row attention kernels (deterministic mode),
TurboQuant's (decode, quantize, fused attention), a direct hit's plane gather, and the pinned
region's pull and push (device_landing.py). Not yet: a direct hit's group gather
(direct_landing.py), whose module needs an MLX-CUDA stream.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import pytest

from engine_service.checkpoints.device_landing import PinnedLanding
from engine_service.checkpoints.direct_planes import (
    PlaneGather,
    kernel_outputs,
    launch_width,
    plane_pieces,
)
from engine_service.kv import row_attention_cuda, turboquant_cuda
from engine_service.model import invariant_matmul_cuda
from engine_service.model.invariant_matmul_cuda import ROWS, Asked, invariant_matmul
from tandem_client.records import Tensor
from tandem_client.regions import SharedRegion
from tests.nvrtc_check import Compiled, Launch, Nvrtc, Recorder, cuda_root

MAX_THREADS = 1024  # a block's threads on any CUDA device


@pytest.fixture(scope="module")
def nvrtc() -> Iterator[Nvrtc]:
    root = cuda_root()
    assert root is not None, "NVIDIA's CUDA 13 wheels are dev dependencies (pyproject.toml)"
    compiler = Nvrtc(root)
    yield compiler
    compiler.close()


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    recording = Recorder()
    monkeypatch.setattr(mx.fast, "cuda_kernel", recording)
    # Kernels made before (none on the CPU) would bypass the recorder.
    monkeypatch.setattr(invariant_matmul_cuda, "_kernels", {})
    monkeypatch.setattr(row_attention_cuda, "_kernels", {})
    return recording


def _check(
    nvrtc: Nvrtc, recorder: Recorder, choose: Callable[[list[Launch]], list[Launch]] | None = None
) -> list[Compiled]:
    launches = recorder.distinct()
    assert launches, "nothing was launched"
    if choose is not None:
        launches = choose(launches)
    results = [nvrtc.compile(launch) for launch in launches]
    for result in results:
        name = result.launch.name
        assert result.ok, f"{name} does not compile:\n{result.log}"
        assert result.registers > 0, f"no ptxas report for {name}:\n{result.log}"
        assert result.launch.threads <= MAX_THREADS, name
        assert result.fits_an_sm, (
            f"{name}: {result.registers} registers x {result.launch.threads} threads"
            " pass an SM's 65,536: the launch would fail on the device"
        )
        assert result.spilled_bytes == 0, f"{name} spills {result.spilled_bytes} bytes"
        assert result.shared_bytes <= 48 * 1024, f"{name}: {result.shared_bytes} bytes shared"
    return results


# (K, N): Qwen3-0.6B's projections and vocabulary, Llama-3-8B's, and an odd width.
PROJECTIONS = [
    (1024, 2048),
    (1024, 3072),
    (3072, 1024),
    (2048, 1024),
    (4096, 4096),
    (4096, 1024),
    (4096, 14336),
    (14336, 4096),
    (1024, 151936),
    (4096, 128256),
    (512, 24),
]
ROW_COUNTS = [1, 2, 8, 9, 16, 17, 32, 33, 64, 128, 129]


# Every launch the projections make (63 compiles, ~20 s of CPU) under `make soak`.
ALL_TILINGS = os.environ.get("TANDEM_ALL_TILINGS") == "1"


def _each_tiling(launches: list[Launch]) -> list[Launch]:
    """Of the launches of one tiling (its constants but K and N), those of its smallest and
    largest K (a loop's trips, unrolled or not, change its registers) and of its narrowest N
    (the odd width's edge tiles); every launch under TANDEM_ALL_TILINGS=1."""
    if ALL_TILINGS:
        return launches
    tilings: dict[tuple[tuple[str, Any], ...], list[Launch]] = {}
    for launch in launches:
        tiling = tuple(c for c in launch.template if c[0] not in ("K", "N"))
        tilings.setdefault(tiling, []).append(launch)
    chosen: dict[int, Launch] = {}
    for group in tilings.values():
        constants = [dict(launch.template) for launch in group]
        picks = [
            min(range(len(group)), key=lambda i: constants[i]["K"]),
            max(range(len(group)), key=lambda i: constants[i]["K"]),
        ]
        narrowest = min(range(len(group)), key=lambda i: constants[i]["N"])
        if constants[narrowest]["N"] < min(constants[i]["N"] for i in picks):
            picks.append(narrowest)
        for pick in picks:
            chosen[id(group[pick])] = group[pick]
    return list(chosen.values())


def test_the_projection_kernel_compiles_and_fits_for_every_tiling_it_chooses(
    nvrtc: Nvrtc, recorder: Recorder
) -> None:
    for k, n in PROJECTIONS:
        weight = mx.zeros((n, k), dtype=mx.bfloat16)
        for rows in ROW_COUNTS:
            out = invariant_matmul(mx.zeros((rows, k), dtype=mx.bfloat16), weight)
            assert out.shape == (rows, n)
    half = mx.zeros((4096, 4096), dtype=mx.float16)
    invariant_matmul(mx.zeros((8, 4096), dtype=mx.float16), half)
    # The prefetching variant the bench sweeps at a few rows (off by default).
    for rows in (1, 8):
        x = mx.zeros((rows, 4096), dtype=mx.bfloat16)
        invariant_matmul(x, mx.zeros((1024, 4096), dtype=mx.bfloat16), Asked(prefetch=True))
    results = _check(nvrtc, recorder, _each_tiling)
    # Every block size the chosen tilings ask for was compiled (a block is the K splits).
    assert {r.launch.threads for r in results} == {invariant_matmul_cuda.SPLITS * 32}
    # Calls past ROWS rows run as blocks of ROWS: launches of at most ROWS rows each.
    assert len(recorder.launches) >= len(PROJECTIONS) * len(ROW_COUNTS)
    assert ROWS == 128


# (heads, KV heads, head dim): each head dim, and the query groups' extremes (7 and 8 a KV
# head, 1); Qwen3-0.6B's and Llama-3-8B's groups (2, 4) too under `make soak`.
ATTENTION_SHAPES = [(14, 2, 64), (64, 8, 128), (8, 8, 256)]
if ALL_TILINGS:
    ATTENTION_SHAPES += [(16, 8, 128), (32, 8, 128)]


def test_the_decode_attention_kernels_compile_eager_and_as_a_compiled_step_calls_them(
    nvrtc: Nvrtc, recorder: Recorder
) -> None:
    for heads, kv_heads, dim in ATTENTION_SHAPES:
        for dtype in (mx.bfloat16, mx.float16, mx.float32):
            q = mx.zeros((3, heads, 1, dim), dtype=dtype)
            kv = mx.zeros((3, kv_heads, 300, dim), dtype=dtype)
            out = row_attention_cuda.row_attention(q, kv, kv, dim**-0.5, [0, 100, 299])
            assert out.shape == (3, heads, 1, dim)
        # As the compiled step calls it: paddings and the written length as arrays.
        pads = mx.array([0, 100, 299], dtype=mx.int32)
        written = mx.array([300], dtype=mx.int32)
        row_attention_cuda.row_attention(q, kv, kv, dim**-0.5, pads, written)
    _check(nvrtc, recorder)


def test_the_turboquant_kernels_compile(nvrtc: Nvrtc, recorder: Recorder) -> None:
    for dim, bits in [(128, 4), (64, 3)]:
        words = -(-dim // (32 // bits))
        levels = mx.zeros((2**bits,), dtype=mx.float32)
        bounds = mx.zeros((2**bits - 1,), dtype=mx.float32)
        kernels = turboquant_cuda.CudaKernels(dim, bits, words, levels, bounds)
        codes = kernels.quantize(mx.zeros((2, 8, 40, dim)), mx.zeros((2, 8, 40, 1)))
        assert codes.shape == (2, 8, 40, words)
        assert kernels.decode(codes, mx.zeros((2, 8, 40, 1)), mx.bfloat16).shape[-1] == dim
        attend = turboquant_cuda.FusedAttention(kernels, kernels, 4, 8)
        out = attend(
            mx.zeros((2, 32, dim)),
            codes,
            mx.zeros((2, 8, 40, 1)),
            codes,
            mx.zeros((2, 8, 40, 1)),
            mx.ones((2, 40), dtype=mx.uint8),
            mx.zeros((dim, dim)),
            mx.bfloat16,
        )
        assert out.shape == (2, 32, dim)
    _check(nvrtc, recorder)


def test_the_plane_gather_compiles_at_each_launch_width(nvrtc: Nvrtc, recorder: Recorder) -> None:
    """checkpoints/direct_planes.py: a direct store hit's planes gathered by one launch of each
    width the engine's kernels have (64 outputs: up to 32 layers; 256: up to 128, a pointer
    an output in the kernel's parameters) or of 8, from a file's chunks (here one chunk a
    tensor)."""
    group = []
    for index in range(3):
        shape = (1, 8, 40 + index, 128)
        tensor = Tensor("k", "bfloat16", shape, bytes(2 * 8 * (40 + index) * 128))
        pieces = plane_pieces(tensor, [(4096 * 64 * index, tensor.nbytes)], 40 + index, 296)
        assert pieces is not None
        group.append((tensor, pieces))
    widths = {kernel_outputs(launch_width(planes)) for planes in (56, 64, 80, 160, 256, 400)}
    assert widths == {64, 128, 192, 256}
    for outputs in (*sorted(widths), 8):
        planes = PlaneGather().launch(group, 1 << 20, 296, outputs)
        assert [p.shape for p in planes.values()] == [(1, 8, 296, 128)] * 3
    _check(nvrtc, recorder)


class _HostAddresses:
    """The CUDA runtime calls a PinnedLanding makes, on a host without CUDA: registering is
    nothing, and a device address is the host's (CUDA's unified addressing)."""

    def register(self, address: int, nbytes: int, flags: int = 0) -> None:
        pass

    def unregister(self, address: int) -> None:
        pass

    def device_pointer(self, address: int) -> int:
        return address


def test_the_pinned_regions_pull_and_push_compile(nvrtc: Nvrtc, recorder: Recorder) -> None:
    """checkpoints/device_landing.py: a tensor in the shared region pulled into a device
    array, and a capture pushed into a span of it."""
    region = SharedRegion(1 << 20)
    try:
        landing = PinnedLanding(region, _HostAddresses())
        held = memoryview(region.buf)[4096 : 4096 + 8 * 64 * 2]
        pulled = landing.array(Tensor("k", "bfloat16", (1, 8, 64), held))
        assert pulled.shape == (1, 8, 64)
        flags, done = landing.push_many([([mx.zeros((1, 8, 64), dtype=mx.bfloat16)], held)])
        assert flags[0] is not None and len(done) == 1
        landing.close()
    finally:
        region.close()
    names = {compiled.launch.name for compiled in _check(nvrtc, recorder)}
    assert names == {"custom_kernel_tandem_pull_pinned", "custom_kernel_tandem_push_pinned"}
