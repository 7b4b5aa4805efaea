"""Decode attention over a batch's KV, plain vs quantized: where the quantized path's time goes.

One decode step's attention (one query per row) over `--context` cached positions held in a
step-grown buffer, repeated for `--layers` layers, for: mlx's fused SDPA on the plain slice
(what mlx-lm's BatchKVCache gives attention: the baseline); mlx-lm's
quantized_scaled_dot_product_attention on the packed planes (sliced, or copied contiguous
first, as MLX-CUDA needs); and dequantize-then-fused-SDPA. Then whole cache steps (update one
position per row, attend through the cache) for mlx-lm's BatchKVCache and ours. Prints ms per
step and the ratio.

    python bench/kv_attention_probe.py [--batch 32] [--context 2112] [--heads 16] [--kv-heads 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

# isort: off
import engine_service  # noqa: E402, F401  (the fast BLAS must load before mlx)

import mlx.core as mx  # noqa: E402
from mlx_lm.models.base import (  # noqa: E402
    create_causal_mask,
    quantized_scaled_dot_product_attention,
    scaled_dot_product_attention,
)
from mlx_lm.models.cache import KVCache  # noqa: E402
# isort: on

from engine_service.kv.batch_cache import BatchQuantizedKVCache, PlainRow  # noqa: E402
from engine_service.protocol.kv_codec import KVCodec  # noqa: E402


def timed(fn: Any, repeat: int) -> float:
    mx.eval(fn())  # warm-up: kernels compile on first use
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=2112)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--repeat", type=int, default=10)
    return p.parse_args()


def main(a: argparse.Namespace) -> None:
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    cap = (a.context + 255) // 256 * 256
    n = a.context
    shape = (a.batch, a.kv_heads, cap, a.dim)
    keys = [mx.random.normal(shape).astype(dtype) for _ in range(a.layers)]
    values = [mx.random.normal(shape).astype(dtype) for _ in range(a.layers)]
    q = mx.random.normal((a.batch, a.heads, 1, a.dim)).astype(dtype)
    mask = create_causal_mask(1, offset=n - 1, left_padding=mx.zeros((a.batch,), mx.int32))
    scale = a.dim**-0.5
    mx.eval(keys, values, q, mask)

    def plain() -> list[mx.array]:
        return [
            mx.fast.scaled_dot_product_attention(
                q, k[..., :n, :], v[..., :n, :], scale=scale, mask=mask
            )
            for k, v in zip(keys, values, strict=True)
        ]

    base = timed(plain, a.repeat)
    print(
        f"batch {a.batch}, context {n}, {a.layers} layers, {a.heads}/{a.kv_heads} heads x "
        f"{a.dim}, {dtype}: fused SDPA on plain slices {base:.2f} ms"
    )
    for bits in (8, 4):
        qk = [mx.quantize(k, group_size=64, bits=bits) for k in keys]
        qv = [mx.quantize(v, group_size=64, bits=bits) for v in values]
        mx.eval(qk, qv)

        def sliced(planes: Any, copy: bool) -> Any:
            out = tuple(p[..., :n, :] for p in planes)
            return tuple(mx.contiguous(p) for p in out) if copy else out

        def quantized(copy: bool, qk: Any = qk, qv: Any = qv, bits: int = bits) -> Any:
            return [
                quantized_scaled_dot_product_attention(
                    q, sliced(k, copy), sliced(v, copy), scale, mask, 64, bits
                )
                for k, v in zip(qk, qv, strict=True)
            ]

        def dequantized(qk: Any = qk, qv: Any = qv, bits: int = bits) -> Any:
            out = []
            for k, v in zip(qk, qv, strict=True):
                dk = mx.dequantize(*sliced(k, False), group_size=64, bits=bits).astype(dtype)
                dv = mx.dequantize(*sliced(v, False), group_size=64, bits=bits).astype(dtype)
                out.append(mx.fast.scaled_dot_product_attention(q, dk, dv, scale=scale, mask=mask))
            return out

        variants = {"quantized SDPA, contiguous copy": lambda: quantized(True)}
        if not (mx.default_device() == mx.gpu and not mx.metal.is_available()):
            variants["quantized SDPA on slices"] = lambda: quantized(False)
        variants["dequantize + fused SDPA"] = dequantized
        for name, fn in variants.items():
            try:
                ms = timed(fn, a.repeat)
                print(f"  {bits}-bit {name:<32} {ms:7.2f} ms  (x{base / ms:.2f} of plain speed)")
            except Exception as exc:  # noqa: BLE001  (MLX-CUDA lacks some kernels: report it)
                print(f"  {bits}-bit {name:<32} failed: {str(exc)[:80]}")


def cache_steps(a: argparse.Namespace, dtype: mx.Dtype) -> None:
    """Decode steps through the caches themselves: per layer, update_and_fetch one position
    per row, then mlx-lm's scaled_dot_product_attention with the cache (as a model layer
    does); mlx-lm's BatchKVCache beside ours (plain, 8-bit, 4-bit)."""

    def rows(codec: KVCodec) -> list[Any]:
        out = []
        for _ in range(a.batch):
            row = PlainRow(codec)
            row.keys = mx.random.normal((1, a.kv_heads, a.context, a.dim)).astype(dtype)
            row.values = mx.random.normal((1, a.kv_heads, a.context, a.dim)).astype(dtype)
            row.offset = a.context
            out.append(row)
        return out

    q = mx.random.normal((a.batch, a.heads, 1, a.dim)).astype(dtype)
    k_new = mx.random.normal((a.batch, a.kv_heads, 1, a.dim)).astype(dtype)
    scale = a.dim**-0.5
    variants: dict[str, Any] = {}
    base_rows = rows(KVCodec())
    plain_solo = []
    for r in base_rows:
        c = KVCache()
        c.keys, c.values, c.offset = r.keys, r.values, r.offset
        plain_solo.append(c)
    variants["mlx-lm BatchKVCache"] = lambda: [KVCache.merge(plain_solo) for _ in range(a.layers)]
    for name, codec in (
        ("ours plain", KVCodec()),
        ("ours 8-bit", KVCodec(8, 64, 0)),
        ("ours 4-bit", KVCodec(4, 64, 0)),
    ):
        solo = rows(codec)
        variants[name] = lambda solo=solo: [
            BatchQuantizedKVCache.merge(solo) for _ in range(a.layers)
        ]
    results = {}
    for name, make in variants.items():
        caches = make()
        for c in caches:  # first step converts quantized rows; not timed
            c.update_and_fetch(k_new, k_new)
        mx.eval([c.state for c in caches])

        def step(caches: list[Any] = caches) -> list[mx.array]:
            outs = []
            for c in caches:
                mask = c.make_mask(1, return_array=True)
                keys, values = c.update_and_fetch(k_new, k_new)
                outs.append(scaled_dot_product_attention(q, keys, values, c, scale, mask))
            return outs

        results[name] = timed(step, a.repeat)
    base = results["mlx-lm BatchKVCache"]
    for name, ms in results.items():
        print(f"  cache step {name:<22} {ms:7.2f} ms  (x{base / ms:.2f} of BatchKVCache)")


if __name__ == "__main__":
    args = _parse()
    main(args)
    cache_steps(args, mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16)
