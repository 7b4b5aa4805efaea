"""Deterministic mode's decode projections on MLX-CUDA: `x @ w.T` for a few rows, each row's
bits independent of how many rows come with it (model/deterministic.py).

MLX picks a GEMV for one row and a cuBLAS GEMM for more, so a row's bits depend on its batch.
Padding every batch to one block of 128 rows fixes the kernel, but a lone stream then pays a
GEMM where it paid a GEMV (docs/determinism.md: 32-46% of its decode speed on an H200). Here
one kernel serves any number of rows up to ROWS, as fast as a GEMV at one row:

- a block owns 8 output columns (8 rows of w) and SPLITS warps, each reducing its quarter of
  K; the quarters are summed in a fixed order;
- a warp walks its K range 64 at a time with tensor-core `mma.m16n8k16` over every 16-row
  tile of x: w's bytes are read once whatever the row count, and a row's products and their
  order are the same in every tile, at any place in it (the padded-GEMM build showed the
  tensor cores give a row the same bits at any place in its tile);
- inside a 64-wide step each lane reads 16 consecutive values of x and w (two 16-byte
  loads), and the mma's k positions are mapped onto them the same way for x and w: a fixed
  permutation of a sum's terms, so still one fixed order.

Rows beyond the batch are zeros in the registers, never read. No well-kept library has a
batch-invariant skinny matmul for MLX (Thinking Machines' and SGLang's are Triton/CUDA for
PyTorch). Checked against MLX's matmul on the device (bench/determinism_bench.py); CI has no
GPU.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

ROWS = 128  # rows one call serves; more run as blocks of ROWS
SPLITS = 4  # warps per block, each a quarter of K
STEP = 64  # K values a warp takes per step
SUPPORTED = {mx.bfloat16: "bf16", mx.float16: "f16"}
AVAILABLE = mx.default_device() == mx.gpu and not mx.metal.is_available()

_SOURCE = """
    constexpr int TILES = ROWS / 16;
    __shared__ float partial[SPLITS * TILES * 32 * 4];
    const int lane = threadIdx.x & 31;
    const int split = threadIdx.x >> 5;
    const int g = lane >> 2;  // the mma's group: a row of x, a column of the output
    const int t = lane & 3;   // the thread in the group: which 16 values of a step
    const int n0 = blockIdx.x * 8;
    const int rows = (int)sizes[0];
    const int tiles = (rows + 15) / 16;
    float acc[TILES][4];
#pragma unroll
    for (int i = 0; i < TILES; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    const int span = K / SPLITS;
    const int k_begin = split * span;
    const uint4* w_row = reinterpret_cast<const uint4*>(w + (size_t)(n0 + g) * K);
    for (int k = k_begin; k < k_begin + span; k += STEP) {
        const int at = (k + t * 16) / 8;  // in uint4s: this lane's 16 values
        const uint4 wa = w_row[at];
        const uint4 wb = w_row[at + 1];
        const unsigned int wv[8] = {wa.x, wa.y, wa.z, wa.w, wb.x, wb.y, wb.z, wb.w};
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
            if (i < tiles) {
                const int r0 = i * 16 + g;
                const int r1 = r0 + 8;
                uint4 xa = make_uint4(0, 0, 0, 0), xb = xa, ya = xa, yb = xa;
                if (r0 < rows) {
                    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)r0 * K);
                    xa = xr[at];
                    xb = xr[at + 1];
                }
                if (r1 < rows) {
                    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)r1 * K);
                    ya = xr[at];
                    yb = xr[at + 1];
                }
                const unsigned int xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
                const unsigned int yv[8] = {ya.x, ya.y, ya.z, ya.w, yb.x, yb.y, yb.z, yb.w};
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    asm volatile(
                        "mma.sync.aligned.m16n8k16.row.col.f32.MMA_TYPE.MMA_TYPE.f32 "
                        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
                        : "+f"(acc[i][0]), "+f"(acc[i][1]), "+f"(acc[i][2]), "+f"(acc[i][3])
                        : "r"(xv[2 * s]), "r"(yv[2 * s]), "r"(xv[2 * s + 1]), "r"(yv[2 * s + 1]),
                          "r"(wv[2 * s]), "r"(wv[2 * s + 1]));
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < TILES; ++i) {
        if (i < tiles) {
            float* mine = partial + ((split * TILES + i) * 32 + lane) * 4;
            mine[0] = acc[i][0]; mine[1] = acc[i][1]; mine[2] = acc[i][2]; mine[3] = acc[i][3];
        }
    }
    __syncthreads();
    // The splits summed in order, a tile per warp in turn.
    for (int i = split; i < tiles; i += SPLITS) {
        float c[4] = {0.f, 0.f, 0.f, 0.f};
        for (int s = 0; s < SPLITS; ++s) {
            const float* theirs = partial + ((s * TILES + i) * 32 + lane) * 4;
            c[0] += theirs[0]; c[1] += theirs[1]; c[2] += theirs[2]; c[3] += theirs[3];
        }
        const int r0 = i * 16 + g;
        const int col = n0 + t * 2;
        if (r0 < rows) {
            out[(size_t)r0 * N + col] = static_cast<T>(c[0]);
            out[(size_t)r0 * N + col + 1] = static_cast<T>(c[1]);
        }
        if (r0 + 8 < rows) {
            out[(size_t)(r0 + 8) * N + col] = static_cast<T>(c[2]);
            out[(size_t)(r0 + 8) * N + col + 1] = static_cast<T>(c[3]);
        }
    }
"""

_kernels: dict[str, Any] = {}
_sizes: dict[int, mx.array] = {}


def applies(x: mx.array, weight: mx.array) -> bool:
    """Whether invariant_matmul serves x @ weight.T: MLX-CUDA, a 16-bit float weight (not a
    quantized one), K a multiple of SPLITS * STEP and N of 8."""
    if not AVAILABLE:
        return False
    if weight.ndim != 2 or weight.dtype not in SUPPORTED or x.dtype != weight.dtype:
        return False
    n, k = weight.shape
    return k % (SPLITS * STEP) == 0 and n % 8 == 0


def invariant_matmul(x: mx.array, weight: mx.array) -> mx.array:
    """x @ weight.T for x (rows, K), weight (N, K): each row's bits the same alone or among
    others (module docstring); more than ROWS rows run as blocks of ROWS."""
    rows = x.shape[0]
    if rows > ROWS:
        blocks = [invariant_matmul(x[at : at + ROWS], weight) for at in range(0, rows, ROWS)]
        return mx.concatenate(blocks)
    n, k = weight.shape
    name = SUPPORTED[weight.dtype]
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(
            name=f"tandem_invariant_matmul_{name}",
            input_names=["x", "w", "sizes"],
            output_names=["out"],
            source=_SOURCE.replace("MMA_TYPE", name),
        )
    if rows not in _sizes:
        _sizes[rows] = mx.array([rows], dtype=mx.uint32)
    (out,) = _kernels[name](
        inputs=[x, weight, _sizes[rows]],
        template=[
            ("T", weight.dtype),
            ("K", k),
            ("N", n),
            ("ROWS", ROWS),
            ("SPLITS", SPLITS),
            ("STEP", STEP),
        ],
        grid=(n // 8 * SPLITS * 32, 1, 1),
        threadgroup=(SPLITS * 32, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[weight.dtype],
    )
    return out  # type: ignore[no-any-return]
