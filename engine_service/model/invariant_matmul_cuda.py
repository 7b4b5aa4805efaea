"""Deterministic mode's decode projections on MLX-CUDA: `x @ w.T` for a few rows, each row's
bits independent of how many rows come with it (model/deterministic.py).

MLX picks a GEMV for one row and a cuBLAS GEMM for more, so a row's bits depend on its batch.
Padding every batch to one block of 128 rows fixes the kernel, but a lone stream then pays a
GEMM where it paid a GEMV (docs/determinism.md: 32-46% of its decode speed on an H200). Here
one kernel serves any number of rows up to ROWS, within 10-15% of a GEMV at one row on a
large projection (docs/determinism.md has the figures):

- a block owns COLUMNS tiles of 8 output columns (rows of w) and SPLITS warps, each reducing
  its eighth of K; the eighths are summed in a fixed order;
- a warp walks its K range 64 at a time with tensor-core `mma.m16n8k16` over every 16-row
  tile of x: w's bytes are read once whatever the row count, and a row's products and their
  order are the same in every tile, at any place in it (the padded-GEMM build showed the
  tensor cores give a row the same bits at any place in its tile);
- inside a 64-wide step each lane reads 16 consecutive values of x and w (two 16-byte
  loads), and the mma's k positions are mapped onto them the same way for x and w: a fixed
  permutation of a sum's terms, so still one fixed order;
- COLUMNS (output column tiles a block) and BLOCK_TILES (row tiles a block) only say which
  warp computes which outputs, never how a sum is ordered, so they are chosen per call
  (`column_tiles`, `row_tiles`, by measurement): four column tiles let one x fragment serve
  four, and a block takes all of a call's row tiles, reading its columns of w once;
- UNROLL steps' w are loaded before their mma run (more bytes in flight a warp, which is what
  a memory-bound call at a few rows needs); the steps still run in k order, so it does not
  change a sum's order either (`unroll_steps`). With PREFETCH (off until measured:
  PREFETCH_AT_FEW_ROWS) a call of at most 8 rows loads their x with their w too.

Rows beyond the batch are zeros in the registers, never read. No well-kept library has a
batch-invariant skinny matmul for MLX (Thinking Machines' and SGLang's are Triton/CUDA for
PyTorch). Checked against MLX's matmul on the device (bench/determinism_bench.py); CI has no
GPU, but compiles it for every tiling chosen (tests/test_cuda_kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

ROWS = 128  # rows one call serves; more run as blocks of ROWS
# Warps per block, each reducing an eighth of K: at a few rows a warp's loads wait on memory
# (ncu on an H200: 88% of its cycles), so occupancy is what hides them; four a block was 3.4x
# MLX's GEMV at one row of a 4096 x 1024 projection.
SPLITS = 8
STEP = 64  # K values a warp takes per step
VOCABULARY_WIDE = 65536  # a w of more columns (an output projection) is tiled apart
FEW_ROWS = 8  # up to this many rows a call is a memory-bound GEMV: one column tile a block
# Whether a call of at most FEW_ROWS rows loads the x of its UNROLL steps with their w
# (PREFETCH in the kernel): off until measured on the device (bench/invariant_matmul_bench.py
# sweeps it; bench/kernel_sass.py shows where the loads sit).
PREFETCH_AT_FEW_ROWS = False
SUPPORTED = {mx.bfloat16: "bf16", mx.float16: "f16"}
AVAILABLE = mx.default_device() == mx.gpu and not mx.metal.is_available()

_SOURCE = """
    constexpr int TILES = BLOCK_TILES;  // row tiles of 16 this block computes
    __shared__ float partial[SPLITS * TILES * 32 * 4];
    const int lane = threadIdx.x & 31;
    const int split = threadIdx.x >> 5;
    const int g = lane >> 2;  // the mma's group: a row of x, a column of the output
    const int t = lane & 3;   // the thread in the group: which 16 values of a step
    // Row groups vary fastest, so the blocks that read the same columns of w run together
    // and all but the first find them in L2.
    const int groups = (int)sizes[1];
    const int n0 = (blockIdx.x / groups) * 8 * COLUMNS;
    const int first_row = (blockIdx.x % groups) * TILES * 16;
    const int rows = min((int)sizes[0] - first_row, TILES * 16);
    const int tiles = (rows + 15) / 16;
    const auto* xs = x + (size_t)first_row * K;
    auto* os = out + (size_t)first_row * N;
    float acc[TILES][COLUMNS][4];
#pragma unroll
    for (int i = 0; i < TILES; ++i)
#pragma unroll
        for (int j = 0; j < COLUMNS; ++j)
            acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
    const int span = K / SPLITS;
    const int k_begin = split * span;
    const int k_end = k_begin + span;
    // One step: this lane's 16 values of each column tile's w row (loaded by `load`) against
    // every row tile of x, the mma's k positions mapped onto the values the same way for both.
    auto load = [&](unsigned int (&wv)[COLUMNS][8], int k) {
        const int at = (k + t * 16) / 8;  // in uint4s: this lane's 16 values
#pragma unroll
        for (int j = 0; j < COLUMNS; ++j) {
            const uint4* w_row = reinterpret_cast<const uint4*>(w + (size_t)(n0 + j * 8 + g) * K);
            const uint4 wa = w_row[at];
            const uint4 wb = w_row[at + 1];
            wv[j][0] = wa.x; wv[j][1] = wa.y; wv[j][2] = wa.z; wv[j][3] = wa.w;
            wv[j][4] = wb.x; wv[j][5] = wb.y; wv[j][6] = wb.z; wv[j][7] = wb.w;
        }
    };
    auto mma = [&](int i, const unsigned int (&xv)[8], const unsigned int (&yv)[8],
                   const unsigned int (&wv)[COLUMNS][8]) {
#pragma unroll
        for (int j = 0; j < COLUMNS; ++j) {
#pragma unroll
            for (int s = 0; s < 4; ++s) {
                asm volatile(
                    "mma.sync.aligned.m16n8k16.row.col.f32.MMA_TYPE.MMA_TYPE.f32 "
                    "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
                    : "+f"(acc[i][j][0]), "+f"(acc[i][j][1]), "+f"(acc[i][j][2]),
                      "+f"(acc[i][j][3])
                    : "r"(xv[2 * s]), "r"(yv[2 * s]), "r"(xv[2 * s + 1]),
                      "r"(yv[2 * s + 1]), "r"(wv[j][2 * s]), "r"(wv[j][2 * s + 1]));
            }
        }
    };
    auto step = [&](const unsigned int (&wv)[COLUMNS][8], int k) {
        const int at = (k + t * 16) / 8;
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
            if (i < tiles) {
                const int r0 = i * 16 + g;
                const int r1 = r0 + 8;
                uint4 xa = make_uint4(0, 0, 0, 0), xb = xa, ya = xa, yb = xa;
                if (r0 < rows) {
                    const uint4* xr = reinterpret_cast<const uint4*>(xs + (size_t)r0 * K);
                    xa = xr[at];
                    xb = xr[at + 1];
                }
                if (r1 < rows) {
                    const uint4* xr = reinterpret_cast<const uint4*>(xs + (size_t)r1 * K);
                    ya = xr[at];
                    yb = xr[at + 1];
                }
                const unsigned int xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
                const unsigned int yv[8] = {ya.x, ya.y, ya.z, ya.w, yb.x, yb.y, yb.z, yb.w};
                mma(i, xv, yv, wv);
            }
        }
    };
    // PREFETCH (the host sets it for calls of at most 8 rows, one row tile): the x of every
    // step loaded with its w, before the branches, as ptxas keeps loads issued ahead of
    // branches where it would sink them into one straight block. The same sums.
    auto load_x = [&](unsigned int (&xv)[8], int k) {
        const int at = (k + t * 16) / 8;
        const uint4* xr = reinterpret_cast<const uint4*>(xs + (size_t)g * K);
        const uint4 zero = make_uint4(0, 0, 0, 0);
        const uint4 xa = g < rows ? xr[at] : zero, xb = g < rows ? xr[at + 1] : zero;
        xv[0] = xa.x; xv[1] = xa.y; xv[2] = xa.z; xv[3] = xa.w;
        xv[4] = xb.x; xv[5] = xb.y; xv[6] = xb.z; xv[7] = xb.w;
    };
    const unsigned int none[8] = {0u, 0u, 0u, 0u, 0u, 0u, 0u, 0u};  // rows 8-15: none
    // UNROLL steps' w loaded before any of their mma runs, so a warp has that many bytes in
    // flight; the steps still run in k order, so the sums' order is the same at any UNROLL.
    int k = k_begin;
    for (; k + STEP * UNROLL <= k_end; k += STEP * UNROLL) {
        unsigned int wv[UNROLL][COLUMNS][8];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) load(wv[u], k + u * STEP);
        if constexpr (PREFETCH) {
            unsigned int xq[UNROLL][8];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) load_x(xq[u], k + u * STEP);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (tiles > 0) mma(0, xq[u], none, wv[u]);
            }
        } else {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) step(wv[u], k + u * STEP);
        }
    }
    for (; k < k_end; k += STEP) {
        unsigned int wv[COLUMNS][8];
        load(wv, k);
        step(wv, k);
    }
    // One column tile at a time through shared memory: the splits summed in order, a row
    // tile per warp in turn.
#pragma unroll
    for (int j = 0; j < COLUMNS; ++j) {
#pragma unroll
        for (int i = 0; i < TILES; ++i) {
            if (i < tiles) {
                float* mine = partial + ((split * TILES + i) * 32 + lane) * 4;
                mine[0] = acc[i][j][0]; mine[1] = acc[i][j][1];
                mine[2] = acc[i][j][2]; mine[3] = acc[i][j][3];
            }
        }
        __syncthreads();
        for (int i = split; i < tiles; i += SPLITS) {
            float c[4] = {0.f, 0.f, 0.f, 0.f};
            for (int s = 0; s < SPLITS; ++s) {
                const float* theirs = partial + ((s * TILES + i) * 32 + lane) * 4;
                c[0] += theirs[0]; c[1] += theirs[1]; c[2] += theirs[2]; c[3] += theirs[3];
            }
            const int r0 = i * 16 + g;
            const int col = n0 + j * 8 + t * 2;
            if (r0 < rows) {
                os[(size_t)r0 * N + col] = static_cast<T>(c[0]);
                os[(size_t)r0 * N + col + 1] = static_cast<T>(c[1]);
            }
            if (r0 + 8 < rows) {
                os[(size_t)(r0 + 8) * N + col] = static_cast<T>(c[2]);
                os[(size_t)(r0 + 8) * N + col + 1] = static_cast<T>(c[3]);
            }
        }
        __syncthreads();
    }
"""

_kernels: dict[str, Any] = {}
_sizes: dict[tuple[int, int], mx.array] = {}


def applies(x: mx.array, weight: mx.array) -> bool:
    """Whether invariant_matmul serves x @ weight.T: MLX-CUDA, a 16-bit float weight (not a
    quantized one), K a multiple of SPLITS * STEP and N of 8."""
    if not AVAILABLE:
        return False
    if weight.ndim != 2 or weight.dtype not in SUPPORTED or x.dtype != weight.dtype:
        return False
    n, k = weight.shape
    return k % (SPLITS * STEP) == 0 and n % 8 == 0


def column_tiles(rows: int, n: int) -> int:
    """Tiles of 8 output columns a block computes (measured on an H200, bench/
    invariant_matmul_bench.py): one at a few rows, where x is small and more blocks (each
    with 8 steps of w in flight) stream w faster, and for a vocabulary-wide w up to 16 rows;
    else four where w has 2,048 columns or more, so each x fragment serves four. It never
    changes a sum's order, so any choice gives the same bits."""
    if rows <= FEW_ROWS or (n > VOCABULARY_WIDE and rows <= 16):
        return 1
    for tiles in (4, 2):
        if n % (8 * tiles) == 0 and n // (8 * tiles) >= 64:
            return tiles
    return 1


def row_tiles(rows: int) -> int:
    """Row tiles of 16 a block computes: all of the call's, so a block reads its columns of w
    once. With eight warps a block the registers of any tiling leave one block an SM, so
    splitting the rows among blocks only adds waves and reads of w: on an H100, a 4096 x 4096
    w at 128 rows took 55 us with 8 row tiles a block against 128 us with 2 (and on an H200,
    with four warps a block, the 0.6B's projections were fastest with all tiles too). It
    never changes a sum's order either."""
    return (rows + 15) // 16


def unroll_steps(columns: int) -> int:
    """Steps whose w a warp loads before their mma run: 8 column-tile steps' worth (64
    registers a thread) however they are split. It never changes a sum's order either."""
    return max(1, 8 // columns)


@dataclass(frozen=True)
class Asked:
    """A tiling asked for instead of the chosen one (bench/invariant_matmul_bench.py): None
    leaves a part to `column_tiles`, `row_tiles`, `unroll_steps` and PREFETCH_AT_FEW_ROWS.
    No part changes a sum's order."""

    columns: int | None = None
    block_tiles: int | None = None
    unroll: int | None = None
    prefetch: bool | None = None


@dataclass(frozen=True)
class Tiling:
    """How one call's outputs are split among blocks: `columns` tiles of 8 output columns and
    `block_tiles` tiles of 16 rows a block, `groups` row groups covering the call's rows;
    `unroll` steps loaded together, and whether their x is loaded with their w."""

    columns: int
    block_tiles: int
    groups: int
    unroll: int
    prefetch: bool


def tiling(rows: int, n: int, asked: Asked = Asked()) -> Tiling:
    """The tiling of a call of `rows` rows (at most ROWS) against a w of `n` columns. A
    prefetch asked for a call of more than FEW_ROWS rows is not taken."""
    per_block = asked.block_tiles or row_tiles(rows)
    across = asked.columns or column_tiles(rows, n)
    groups = -(-rows // (16 * per_block))
    unroll = asked.unroll or unroll_steps(across)
    prefetch = asked.prefetch if asked.prefetch is not None else PREFETCH_AT_FEW_ROWS
    return Tiling(across, per_block, groups, unroll, prefetch and rows <= FEW_ROWS)


def invariant_matmul(x: mx.array, weight: mx.array, asked: Asked = Asked()) -> mx.array:
    """x @ weight.T for x (rows, K), weight (N, K): each row's bits the same alone or among
    others (module docstring); more than ROWS rows run as blocks of ROWS. `asked` overrides
    the chosen tiling (bench/invariant_matmul_bench.py)."""
    rows = x.shape[0]
    if rows > ROWS:
        blocks = [invariant_matmul(x[at : at + ROWS], weight, asked) for at in range(0, rows, ROWS)]
        return mx.concatenate(blocks)
    n, k = weight.shape
    split = tiling(rows, n, asked)
    name = SUPPORTED[weight.dtype]
    if name not in _kernels:
        _kernels[name] = mx.fast.cuda_kernel(
            name=f"tandem_invariant_matmul_{name}",
            input_names=["x", "w", "sizes"],
            output_names=["out"],
            source=_SOURCE.replace("MMA_TYPE", name),
        )
    if (rows, split.groups) not in _sizes:
        _sizes[rows, split.groups] = mx.array([rows, split.groups], dtype=mx.uint32)
    (out,) = _kernels[name](
        inputs=[x, weight, _sizes[rows, split.groups]],
        template=[
            ("T", weight.dtype),
            ("K", k),
            ("N", n),
            ("BLOCK_TILES", split.block_tiles),
            ("SPLITS", SPLITS),
            ("STEP", STEP),
            ("COLUMNS", split.columns),
            ("UNROLL", split.unroll),
            ("PREFETCH", split.prefetch),  # a bool: MLX passes it as a constexpr bool
        ],
        grid=(n // (8 * split.columns) * split.groups * SPLITS * 32, 1, 1),
        threadgroup=(SPLITS * 32, 1, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[weight.dtype],
    )
    return out  # type: ignore[no-any-return]
