"""Deterministic mode's projection kernel (model/invariant_matmul_cuda.py) on MLX-CUDA, alone:
against MLX's own matmul (which picks a GEMV for one row and a GEMM for more) and against the
padded block of 128 rows that the mode used before it.

For each weight shape and row count: the largest difference from MLX's `x @ w.T` (relative to
its largest value), whether a target row's bits are the same alone and as the last row of the
batch, whether every tiling of the output gives the same bits, and the time of one call at each
(median of rounds; each round evaluates --reps calls together, as a model's step would).

    python bench/invariant_matmul_bench.py [--rows 1,8,32,128] [--rounds 20] [--reps 32]
        [--shapes 8b] [--unrolls 1,2,4,8] [--device-time]

Wall time at a few rows is mostly the host's (Python, graph building); --device-time reports
the kernels' own durations (on the lent device, where torch is).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import mlx.core as mx  # noqa: E402

from bench.device_timing import total_micros  # noqa: E402
from engine_service.model.invariant_matmul_cuda import (  # noqa: E402
    AVAILABLE,
    FEW_ROWS,
    PREFETCH_AT_FEW_ROWS,
    ROWS,
    Asked,
    column_tiles,
    invariant_matmul,
    row_tiles,
    unroll_steps,
)

# (K, N): Qwen3-0.6B's q_proj, gate/up, down; Llama-3-8B's gate/up, down; a 0.6B's vocabulary.
SHAPES = [(1024, 2048), (1024, 3072), (3072, 1024), (4096, 14336), (14336, 4096), (1024, 151936)]
FIRST = Asked(1, ROWS // 16, 1, False)  # the first kernel's tiling: the bits every one gives
# Every projection of Llama-3-8B's step: q and o, k and v, gate and up, down, the vocabulary.
SHAPES_8B = [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256)]


def timed(call: object, rounds: int, reps: int) -> float:
    """Seconds a call takes on the device: `reps` calls evaluated together (so launches
    overlap the work as in a model's step), the median over rounds, after a warm round."""

    def batch() -> None:
        mx.eval([call() for _ in range(reps)])  # type: ignore[operator]

    batch()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        batch()
        times.append(time.perf_counter() - start)
    return statistics.median(times) / reps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,32,128")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--reps", type=int, default=32, help="calls evaluated together")
    parser.add_argument("--shapes", choices=["default", "8b"], default="default")
    parser.add_argument("--unrolls", default="1,2,4,8", help="steps unrolled, swept")
    parser.add_argument(
        "--device-time",
        action="store_true",
        help="the kernels' own time (CUPTI through torch) instead of the wall's",
    )
    args = parser.parse_args()

    def measure(call: Callable[[], mx.array]) -> float:
        """Seconds a call: its kernels' device time, or the wall's (bench/device_timing.py)."""
        if args.device_time:
            micros = total_micros(call, args.reps)
            if micros is not None:
                return micros / 1e6
        return timed(call, args.rounds, args.reps)

    unrolls = [int(u) for u in args.unrolls.split(",")]
    if not AVAILABLE:
        print("not MLX-CUDA: the kernel does not run here")
        return
    version = getattr(mx, "__version__", "?")
    how = "device time (CUPTI)" if args.device_time else "wall"
    print(f"MLX {version}, bf16; microseconds a call, {how} ({args.reps} calls together)")
    print(
        "K x N, rows: max |diff| / max |ref|, target bits alone = batched, every column"
        " tiling the same bits; the kernel at c column tiles and b row tiles a block (* the"
        " chosen one) and u steps unrolled; MLX's matmul; the padded block"
    )
    for k, n in SHAPES_8B if args.shapes == "8b" else SHAPES:
        w = (mx.random.normal((n, k), key=mx.random.key(1)) * k**-0.5).astype(mx.bfloat16)
        target = mx.random.normal((1, k), key=mx.random.key(2)).astype(mx.bfloat16)
        alone = invariant_matmul(target, w, FIRST)
        for rows in [int(r) for r in args.rows.split(",")]:
            others = mx.random.normal((rows - 1, k), key=mx.random.key(3)).astype(mx.bfloat16)
            x = mx.concatenate([others, target]) if rows > 1 else target
            ours = invariant_matmul(x, w, FIRST)
            ref = x @ w.T
            diff = mx.max(mx.abs(ours.astype(mx.float32) - ref.astype(mx.float32))).item()
            scale = mx.max(mx.abs(ref.astype(mx.float32))).item()
            same = mx.array_equal(ours[-1:], alone).item()
            chosen_columns = column_tiles(rows, n)
            chosen = (
                chosen_columns,
                row_tiles(rows),
                unroll_steps(chosen_columns),
                PREFETCH_AT_FEW_ROWS and rows <= FEW_ROWS,
            )
            all_tiles = (rows + 15) // 16
            # (column tiles, row tiles, steps unrolled, x loaded with w): the first kernel's,
            # the chosen row tiles at every column tiling and unroll that keeps w's registers
            # few, with and without the prefetch where a call may take it (few rows).
            prefetch = (False, True) if rows <= FEW_ROWS else (False,)
            tilings = sorted(
                {chosen, (1, all_tiles, 1, False)}
                | {
                    (c, chosen[1], u, p)
                    for c in (1, 2, 4)
                    for u in unrolls
                    for p in prefetch
                    if n % (8 * c) == 0 and c * u <= 8
                }
                | {(chosen[0], b, chosen[2], False) for b in (1, 2, all_tiles) if b <= all_tiles}
            )
            tiled_same = all(
                mx.array_equal(invariant_matmul(x, w, Asked(c, b, u, p)), ours).item()
                for c, b, u, p in tilings
            )
            padded = mx.pad(x, [(0, -rows % ROWS), (0, 0)])
            kernel_times = []
            for c, b, u, p in tilings:
                t = measure(lambda: invariant_matmul(x, w, Asked(c, b, u, p)))  # noqa: B023
                star = "*" if (c, b, u, p) == chosen else ""
                kernel_times.append(f"c{c}b{b}u{u}{'p' if p else ''}={t * 1e6:.1f}{star}")
            t_mlx = measure(lambda: x @ w.T)  # noqa: B023
            t_block = measure(lambda: (padded @ w.T)[:rows])  # noqa: B023
            print(
                f"  {k:5d} x {n:6d}, {rows:3d} rows: {diff / scale:.2e}, {same}, {tiled_same};"
                f" {' '.join(kernel_times)}; MLX {t_mlx * 1e6:.1f}; block {t_block * 1e6:.1f}"
            )


if __name__ == "__main__":
    main()
