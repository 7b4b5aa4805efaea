"""TurboQuant's decode and quantize steps as MLX-CUDA custom kernels (`mx.fast.cuda_kernel`).

The pure-MLX path (turboquant.py) is the reference and what the CPU and Metal run. On MLX-CUDA
its compiled elementwise graphs are specialized per shape, and a batch's shapes change as rows
join and planes grow, so each new shape compiled anew: a kernel written once per (head width,
bits, dtype) has no such cost, and reads each packed word once per output element.

- `decode`: codes (..., words) uint32 and norms (..., 1) float32 -> (..., head_dim) vectors in
  the rotated domain, one thread an element, a block a vector (head_dim threads);
- `quantize`: rotated vectors (..., head_dim) float32 and their norms -> codes, one thread a
  vector: the same comparisons against the codebook's boundaries as the reference, so the
  codes are the same bits.
Both are checked against the reference on the device (bench/turboquant_probe.py); CI has no GPU.
"""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx

# MLX-CUDA: a GPU that is not Metal. ENABLED lets a probe compare against the reference path.
AVAILABLE = mx.default_device() == mx.gpu and not mx.metal.is_available()
ENABLED = AVAILABLE

_DECODE = """
    uint32_t i = cooperative_groups::this_grid().thread_rank();
    uint32_t vec = i / D;
    uint32_t d = i - vec * D;
    uint32_t word = codes[vec * W + d / PW];
    uint32_t idx = (word >> ((d % PW) * BITS)) & ((1u << BITS) - 1u);
    out[i] = static_cast<T>(levels[idx] * norms[vec]);
"""

_QUANTIZE = """
    uint32_t vec = cooperative_groups::this_grid().thread_rank();
    if (vec >= count[0]) return;
    float norm = fmaxf(norms[vec], 1e-30f);
    for (uint32_t w = 0; w < W; ++w) {
        uint32_t packed = 0;
        for (uint32_t j = 0; j < PW; ++j) {
            uint32_t d = w * PW + j;
            if (d >= D) break;
            float y = rotated[vec * D + d] / norm;  // as the reference divides
            uint32_t idx = 0;
            for (uint32_t b = 0; b < NB; ++b) idx += (y > bounds[b]) ? 1u : 0u;
            packed |= idx << (j * BITS);
        }
        codes[vec * W + w] = packed;
    }
"""

_QUANTIZE_BLOCK = 128


class CudaKernels:
    """One codec's kernels (the codec's constants as template arguments)."""

    def __init__(self, head_dim: int, bits: int, words: int, levels: mx.array, bounds: mx.array):
        self.head_dim, self.bits, self.words = head_dim, bits, words
        self.levels, self.bounds = levels, bounds
        self._decode: Any = mx.fast.cuda_kernel(
            name=f"tandem_tq_decode_{head_dim}_{bits}",
            input_names=["codes", "norms", "levels"],
            output_names=["out"],
            source=_DECODE,
        )
        self._quantize: Any = mx.fast.cuda_kernel(
            name=f"tandem_tq_quantize_{head_dim}_{bits}",
            input_names=["rotated", "norms", "bounds", "count"],
            output_names=["codes"],
            source=_QUANTIZE,
        )
        self._template: list[tuple[str, Any]] = [
            ("D", head_dim),
            ("W", words),
            ("PW", 32 // bits),
            ("BITS", bits),
        ]

    def decode(self, codes: mx.array, norms: mx.array, dtype: mx.Dtype) -> mx.array:
        shape = (*codes.shape[:-1], self.head_dim)
        total = math.prod(shape)
        (out,) = self._decode(
            inputs=[codes, norms, self.levels],
            template=[("T", dtype), *self._template],
            grid=(total, 1, 1),
            threadgroup=(self.head_dim, 1, 1),  # a block a vector: no thread past the end
            output_shapes=[shape],
            output_dtypes=[dtype],
        )
        return out  # type: ignore[no-any-return]

    def quantize(self, rotated: mx.array, norms: mx.array) -> mx.array:
        vectors = math.prod(rotated.shape[:-1])
        blocks = -(-vectors // _QUANTIZE_BLOCK)
        (codes,) = self._quantize(
            inputs=[
                rotated.astype(mx.float32),
                norms,
                self.bounds,
                mx.array([vectors], dtype=mx.uint32),
            ],
            template=[*self._template, ("NB", self.bounds.size)],
            grid=(blocks * _QUANTIZE_BLOCK, 1, 1),
            threadgroup=(_QUANTIZE_BLOCK, 1, 1),
            output_shapes=[(*rotated.shape[:-1], self.words)],
            output_dtypes=[mx.uint32],
        )
        return codes  # type: ignore[no-any-return]
