"""TurboQuant's MLX-CUDA kernels (engine_service/kv/turboquant_cuda.py) against the pure-MLX
reference, on the device: the same codes and the same decoded vectors, the time of a decode
and of one layer's attention at two batch sizes, and what a new shape costs each (the
reference's compiled graphs are traced per shape; the kernels are built once).

    python bench/turboquant_probe.py [--rows 8,32] [--positions 2304]
"""

# ruff: noqa: B023  (the lambdas run inside the loop iteration that binds them)

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402

from engine_service.kv import turboquant_cuda  # noqa: E402
from engine_service.kv.turboquant import TurboQuantCodec, turboquant_attention  # noqa: E402
# isort: on

HEADS, KV_HEADS, DIM = 16, 8, 128  # the Qwen3-0.6B shape's attention


def timed(fn: Callable[[], mx.array], n: int = 10) -> float:
    mx.eval(fn())
    start = time.perf_counter()
    for _ in range(n):
        mx.eval(fn())
    return (time.perf_counter() - start) / n


def first_call(fn: Callable[[], mx.array]) -> float:
    start = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - start


def with_kernels(on: bool, fn: Callable[[], mx.array]) -> mx.array:
    turboquant_cuda.ENABLED = on
    try:
        out = fn()
        mx.eval(out)
        return out
    finally:
        turboquant_cuda.ENABLED = turboquant_cuda.AVAILABLE


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="8,32")
    p.add_argument("--positions", type=int, default=2304)
    a = p.parse_args()
    print(f"{mx.default_device()}, kernels available: {turboquant_cuda.AVAILABLE}")
    for bits in (2, 3, 4):
        codec = TurboQuantCodec(DIM, bits)
        x = mx.random.normal((4, KV_HEADS, 300, DIM)).astype(mx.bfloat16)
        ref = with_kernels(False, lambda c=codec: c.encode(x).codes)
        got = with_kernels(True, lambda c=codec: c.encode(x).codes)
        same = float(mx.mean(ref == got))
        planes = codec.encode(x)
        for dtype in (mx.float32, mx.bfloat16):
            want = with_kernels(False, lambda c=codec, d=dtype: c.decode_rotated(planes, d))
            have = with_kernels(True, lambda c=codec, d=dtype: c.decode_rotated(planes, d))
            diff = float(mx.abs(want.astype(mx.float32) - have.astype(mx.float32)).max())
            print(f"  {bits}-bit: codes equal {same:.6f}; decode {dtype} max diff {diff:.3g}")
    codec = TurboQuantCodec(DIM, 3)
    for rows in (int(r) for r in a.rows.split(",")):
        k = mx.random.normal((rows, KV_HEADS, a.positions, DIM)).astype(mx.bfloat16)
        v = mx.random.normal((rows, KV_HEADS, a.positions, DIM)).astype(mx.bfloat16)
        q = mx.random.normal((rows, HEADS, 1, DIM)).astype(mx.bfloat16)
        kp, vp = codec.encode(k), codec.encode(v)
        mx.eval(k, v, q, kp.codes, kp.norms, vp.codes, vp.norms)
        mask = mx.ones((rows, 1, 1, a.positions), dtype=mx.bool_)
        mask[:, :, :, : a.positions // 4] = False  # left padding of a kind
        attend = lambda: turboquant_attention(q, kp, vp, 0.088, mask)  # noqa: E731
        turboquant_cuda.FUSED = None  # the engine's first-call check
        mx.eval(attend())
        print(f"  fused attention after its check: {turboquant_cuda.FUSED}")
        if turboquant_cuda.AVAILABLE:
            turboquant_cuda.FUSED = True
            fused = attend().astype(mx.float32)
            turboquant_cuda.FUSED = False
            unfused = attend().astype(mx.float32)
            print(f"  fused vs decode+SDPA: max diff {float(mx.abs(fused - unfused).max()):.3g}")
        sides: dict[str, tuple[bool, bool, Callable[[], mx.array]]] = {  # kernels, fused, fn
            "plain SDPA": (False, False, lambda: mx.fast.scaled_dot_product_attention(
                q, k, v, scale=0.088, mask=mask)),
            "TQ fused kernel": (True, True, attend),
            "TQ decode kernel+SDPA": (True, False, attend),
            "TQ reference": (False, False, attend),
            "decode kernel": (True, False, lambda: codec.decode_rotated(kp, mx.bfloat16)),
            "decode reference": (False, False, lambda: codec.decode_rotated(kp, mx.bfloat16)),
        }  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in sides}
        for r in range(5):
            for name in sides if r % 2 == 0 else list(sides)[::-1]:
                kernels, fused_on, fn = sides[name]
                turboquant_cuda.ENABLED = kernels and turboquant_cuda.AVAILABLE
                turboquant_cuda.FUSED = fused_on
                times[name].append(timed(fn))
        turboquant_cuda.ENABLED = turboquant_cuda.AVAILABLE
        turboquant_cuda.FUSED = None
        print(f"  {rows} rows x {a.positions} positions, one layer (ms, median of 5):")
        for name, ts in times.items():
            print(f"    {name:>18}: {statistics.median(ts) * 1e3:.3f}")
        # A shape never seen: the planes grown by 256 columns, one row more.
        k2 = mx.random.normal((rows + 1, KV_HEADS, a.positions + 256, DIM)).astype(mx.bfloat16)
        kp2 = codec.encode(k2)
        mx.eval(kp2.codes, kp2.norms)
        for on in (True, False):
            turboquant_cuda.ENABLED = on and turboquant_cuda.AVAILABLE
            secs = first_call(lambda: codec.decode_rotated(kp2, mx.bfloat16))
            print(f"    first decode at a new shape, kernels {on}: {secs * 1e3:.1f} ms")
            kp2 = codec.encode(k2[:, :, :-1])
            mx.eval(kp2.codes)
        turboquant_cuda.ENABLED = turboquant_cuda.AVAILABLE


if __name__ == "__main__":
    main()
