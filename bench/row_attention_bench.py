"""Deterministic mode's decode attention kernel (kv/row_attention_cuda.py) on MLX-CUDA, alone:
its time a call against MLX's fused SDPA over the same left-padded batch (what the default
mode runs) and, with --legacy FILE, against another build of the kernel (a copy of an earlier
row_attention_cuda.py), interleaved in rounds (ABAB) with the median of paired ratios.

Also checked: each row alone is bit-identical to the same row in the batch, and the largest
difference from SDPA over the row's own keys (bf16).

    python bench/row_attention_bench.py [--shapes 8b,0.6b] [--cases 1x160,1x2048,8x512,32x1024]
        [--rounds 15] [--reps 32] [--legacy bench/_legacy_row_attention_cuda.py] [--device-time]

The wall's times at one row are mostly the host's; --device-time adds the kernels' own
(bench/device_timing.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import mlx.core as mx  # noqa: E402

from bench.device_timing import total_micros  # noqa: E402
from engine_service.kv import row_attention_cuda  # noqa: E402

# (query heads, KV heads, head dim): Llama-3-8B's and Qwen3-0.6B's attention.
SHAPES = {"8b": (32, 8, 128), "0.6b": (16, 8, 128)}


def timed(call: Callable[[], Any], reps: int) -> float:
    """Seconds a call takes: `reps` calls evaluated together, as a step's layers are."""
    start = time.perf_counter()
    mx.eval([call() for _ in range(reps)])
    return (time.perf_counter() - start) / reps


def load_legacy(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("legacy_row_attention", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8b,0.6b")
    parser.add_argument("--cases", default="1x160,1x2048,8x512,32x1024", help="rows x keys")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=32)
    parser.add_argument("--legacy", default="", help="another build of row_attention_cuda.py")
    parser.add_argument(
        "--device-time", action="store_true", help="also each side's kernels' device time"
    )
    args = parser.parse_args()
    if not row_attention_cuda.AVAILABLE:
        print("not MLX-CUDA: the kernel does not run here")
        return
    legacy = load_legacy(args.legacy) if args.legacy else None
    print(
        f"MLX {mx.__version__}, bf16, microseconds a call ({args.reps} evaluated together),"
        f" medians of {args.rounds} rounds; ratios are medians of paired ratios (spread)"
    )
    for shape in args.shapes.split(","):
        heads, kv_heads, dim = SHAPES[shape]
        for case in args.cases.split(","):
            rows, keys = (int(v) for v in case.split("x"))
            # Rows of different lengths, the longest `keys`, left-padded as a batch cache is.
            lengths = [keys - (i * keys) // (2 * rows) for i in range(rows)]
            pads = [keys - n for n in lengths]
            q = mx.random.normal((rows, heads, 1, dim), key=mx.random.key(0)).astype(mx.bfloat16)
            k = mx.random.normal((rows, kv_heads, keys, dim), key=mx.random.key(1))
            v = mx.random.normal((rows, kv_heads, keys, dim), key=mx.random.key(2))
            k, v = k.astype(mx.bfloat16), v.astype(mx.bfloat16)
            scale = dim**-0.5
            ours = row_attention_cuda.row_attention(q, k, v, scale, pads)
            alone_same, worst = 0, 0.0
            for row, pad in enumerate(pads):
                one = (q[row : row + 1], k[row : row + 1, :, pad:], v[row : row + 1, :, pad:])
                alone = row_attention_cuda.row_attention(*one, scale, [0])
                alone_same += mx.array_equal(alone, ours[row : row + 1]).item()
                ref = mx.fast.scaled_dot_product_attention(*one, scale=scale)
                worst = max(worst, mx.max(mx.abs(ref - ours[row : row + 1])).item())
            mask = mx.arange(keys)[None, :] >= mx.array(pads)[:, None]
            mask = mask[:, None, None, :]

            def sdpa(q: Any = q, k: Any = k, v: Any = v, mask: Any = mask, s: float = scale) -> Any:
                return mx.fast.scaled_dot_product_attention(q, k, v, scale=s, mask=mask)

            sides: dict[str, Callable[[], Any]] = {
                "kernel": lambda: row_attention_cuda.row_attention(q, k, v, scale, pads),  # noqa: B023
                "sdpa": sdpa,
            }
            if legacy is not None:
                sides["legacy"] = lambda: legacy.row_attention(q, k, v, scale, pads)  # noqa: B023
            times: dict[str, list[float]] = {name: [] for name in sides}
            for call in sides.values():  # warm: compile each kernel's shape
                timed(call, args.reps)
            for turn in range(args.rounds):
                order = list(sides.items())
                for name, call in order if turn % 2 == 0 else order[::-1]:
                    times[name].append(timed(call, args.reps))
            cells = [f"{name} {statistics.median(t) * 1e6:.1f}" for name, t in times.items()]
            if args.device_time:
                for name, call in sides.items():
                    micros = total_micros(call, args.reps)
                    cells.append(f"{name} device {micros:.1f}" if micros else f"{name} device ?")
            for other in [n for n in sides if n != "kernel"]:
                ratios = [a / b for a, b in zip(times["kernel"], times[other], strict=True)]
                cells.append(
                    f"kernel/{other} {statistics.median(ratios):.2f}"
                    f" ({min(ratios):.2f}-{max(ratios):.2f})"
                )
            print(
                f"  {shape} {rows:3d} rows x {keys:5d} keys: alone = batched"
                f" {alone_same}/{rows}, max |kernel - SDPA| {worst:.3g}; {'; '.join(cells)}"
            )


if __name__ == "__main__":
    main()
