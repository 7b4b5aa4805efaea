"""The TurboQuant codec (engine_service/kv/turboquant.py) beside the KV stores a user has today,
before it is wired into the batch rows (issue 18): bytes per token of a model's KV and the
streams a memory budget holds, and the time of one decode step's attention over a batch's
cached positions.

Bytes are of bf16 keys and values (a GPU model's). Attention runs in the engine's dtype
(bf16 on a GPU, float32 on the CPU), sides each over the same random keys and values:
- plain planes through mlx's fused SDPA (what a plain batch row runs);
- mlx-lm's affine 4-bit planes through `quantized_scaled_dot_product_attention` (our
  `--kv-bits 4` rows);
- TurboQuant planes through `rotated_attention` (the reference: matmuls and softmax in MLX
  ops) and through `turboquant_attention` (what the engine's TurboQuant rows run: one compiled
  graph, the codes decoded to rotated vectors in a fused elementwise kernel, then mlx's fused
  SDPA).

Bytes are those of the encoded arrays; times alternate the sides' order each round after a
warm-up; medians of per-round ratios to bf16, with min-max.

    python bench/turboquant_bench.py [--shape qwen3-0.6b|llama3-8b] [--rows 8,32]
        [--positions 4096] [--rounds 7] [--budget-gib 64] [--context 8192]
"""

from __future__ import annotations

import argparse
import math
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
from mlx_lm.models.base import quantized_scaled_dot_product_attention  # noqa: E402

from engine_service.kv.turboquant import (  # noqa: E402
    TurboQuantCodec,
    rotated_attention,
    turboquant_attention,
)
# isort: on

# (layers, query heads, KV heads, head dim) of the shapes the engine benches use.
SHAPES = {"qwen3-0.6b": (28, 16, 8, 128), "llama3-8b": (32, 32, 8, 128)}
# Attention runs in the engine's dtype: bf16 on a GPU, float32 on the CPU (no bf16 compute).
DTYPE = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16


def _nbytes(*arrays: mx.array) -> int:
    return sum(a.nbytes for a in arrays)


def bytes_per_token(shape: tuple[int, int, int, int]) -> dict[str, float]:
    """One token's keys and values over every layer, measured on encoded arrays."""
    layers, _, kv_heads, dim = shape
    x = mx.random.normal((1, kv_heads, 256, dim)).astype(mx.bfloat16)
    per = {"bf16": _nbytes(x, x)}
    q = mx.quantize(x, group_size=64, bits=4)
    per["affine 4-bit"] = 2 * _nbytes(*q)
    for kb, vb in ((4, 4), (3, 3), (4, 2), (2, 2)):
        k = TurboQuantCodec(dim, kb).encode(x)
        v = TurboQuantCodec(dim, vb).encode(x)
        per[f"TurboQuant {kb}/{vb}"] = _nbytes(k.codes, k.norms, v.codes, v.norms)
    return {name: layers * b / 256 for name, b in per.items()}


def attention_sides(
    rows: int, positions: int, shape: tuple[int, int, int, int]
) -> dict[str, Callable[[], mx.array]]:
    _, heads, kv_heads, dim = shape
    scale = 1 / math.sqrt(dim)
    dtype = DTYPE
    q = mx.random.normal((rows, heads, 1, dim)).astype(dtype)
    k = mx.random.normal((rows, kv_heads, positions, dim)).astype(dtype)
    v = mx.random.normal((rows, kv_heads, positions, dim)).astype(dtype)
    qk, qv = mx.quantize(k, group_size=64, bits=4), mx.quantize(v, group_size=64, bits=4)
    kc, vc = TurboQuantCodec(dim, 3, seed=1), TurboQuantCodec(dim, 3, seed=2)
    tk, tv = kc.encode(k), vc.encode(v)
    mx.eval(q, k, v, *qk, *qv, tk.codes, tk.norms, tv.codes, tv.norms)
    return {
        "plain SDPA": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale),
        "affine 4-bit": lambda: quantized_scaled_dot_product_attention(
            q, qk, qv, scale=scale, mask=None, group_size=64, bits=4
        ),
        "TurboQuant 3/3 reference": lambda: rotated_attention(q, tk, tv, kc, vc, scale),
        "TurboQuant 3/3 engine": lambda: turboquant_attention(q, tk, tv, scale),
    }


def time_sides(sides: dict[str, Callable[[], mx.array]], rounds: int) -> dict[str, list[float]]:
    for fn in sides.values():  # warm
        mx.eval(fn())
    times: dict[str, list[float]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            t = time.perf_counter()
            for _ in range(5):
                mx.eval(sides[name]())
            times[name].append((time.perf_counter() - t) / 5)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    p.add_argument("--rows", default="8,32")
    p.add_argument("--positions", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--budget-gib", type=float, default=64)
    p.add_argument("--context", type=int, default=8192)
    a = p.parse_args()
    shape = SHAPES[a.shape]
    layers, _, kv_heads, dim = shape
    print(f"{a.shape} KV: {layers} layers, {kv_heads} KV heads x {dim}; {mx.default_device()}")
    per_token = bytes_per_token(shape)
    base = per_token["bf16"]
    for name, b in per_token.items():
        streams = int(a.budget_gib * 2**30 // (b * a.context))
        print(f"  {name:>16}: {b / 1024:7.1f} KiB a token ({base / b:4.2f}x fewer than bf16), "
              f"{streams} streams of {a.context} tokens in {a.budget_gib:g} GiB")  # fmt: skip
    for rows in (int(x) for x in a.rows.split(",")):
        times = time_sides(attention_sides(rows, a.positions, shape), a.rounds)
        ref = times["plain SDPA"]
        line = [f"attention, {rows} rows x {a.positions} positions, one layer:"]
        for name, ts in times.items():
            ratios = [t / r for t, r in zip(ts, ref, strict=True)]
            line.append(
                f"{name} {statistics.median(ts) * 1e3:.2f} ms ({statistics.median(ratios):.2f}x"
                f" plain, {min(ratios):.2f}-{max(ratios):.2f})"
            )
        print("  " + "; ".join(line))


if __name__ == "__main__":
    main()
