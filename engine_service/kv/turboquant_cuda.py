"""TurboQuant's decode and quantize steps as MLX-CUDA custom kernels (`mx.fast.cuda_kernel`).

The pure-MLX path (kv/turboquant.py) is the reference and what the CPU and Metal run. On MLX-CUDA
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

from engine_service.kv.cuda_chunk_softmax import chunk_results, chunk_softmax, merge_chunks

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


# One decode step's attention read straight from the codes (flash-decoding): a block per
# (row, KV head, chunk of CHUNK positions) holds the G query heads that share the KV head,
# scores its positions from the key codes, and accumulates the value codes weighted by the
# softmax numerators; the chunks' partial sums are merged afterwards (combine). Nothing of
# the size of the cache is written: the decode + SDPA path writes two bf16 copies of it.
_ATTEND = (
    """
    constexpr int NT = 128;
    constexpr float NEG = -1e30f;
    __shared__ float q_s[G * D];
    __shared__ float score[G * CHUNK];
    __shared__ float red[G * NT];
    const int tid = threadIdx.x;
    const uint32_t S = sizes[0];
    const uint32_t splits = sizes[1];
    const uint32_t blk = blockIdx.x;
    const uint32_t split = blk % splits;
    const uint32_t bh = blk / splits;
    const uint32_t b = bh / HKV;
    for (int i = tid; i < G * D; i += NT) q_s[i] = q[(size_t)bh * G * D + i];
    __syncthreads();
    const uint32_t s0 = split * CHUNK;
    for (int j = tid; j < CHUNK; j += NT) {
        const uint32_t s = s0 + j;
        float acc[G];
        for (int g = 0; g < G; ++g) acc[g] = 0.f;
        const bool ok = s < S && mask[(size_t)b * S + s] != 0;
        if (ok) {
            const uint32_t* row = kcodes + ((size_t)bh * S + s) * KW;
            for (int w = 0; w < KW; ++w) {
                const uint32_t word = row[w];
                for (int e = 0; e < KPW; ++e) {
                    const int d = w * KPW + e;
                    if (d >= D) break;
                    const float c = klevels[(word >> (e * KB)) & ((1u << KB) - 1u)];
                    for (int g = 0; g < G; ++g) acc[g] += q_s[g * D + d] * c;
                }
            }
            const float n = knorms[(size_t)bh * S + s];
            for (int g = 0; g < G; ++g) score[g * CHUNK + j] = acc[g] * n;
        } else {
            for (int g = 0; g < G; ++g) score[g * CHUNK + j] = NEG;
        }
    }
"""
    + chunk_softmax("__expf")
    + """    for (int d = tid; d < D; d += NT) {
        float acc[G];
        for (int g = 0; g < G; ++g) acc[g] = 0.f;
        const int w = d / VPW;
        const int shift = (d % VPW) * VB;
        for (int j = 0; j < CHUNK; ++j) {
            const uint32_t s = s0 + j;
            if (s >= S) break;
            const uint32_t word = vcodes[((size_t)bh * S + s) * VW + w];
            const float n = vnorms[(size_t)bh * S + s];
            const float c = vlevels[(word >> shift) & ((1u << VB) - 1u)] * n;
            for (int g = 0; g < G; ++g) acc[g] += score[g * CHUNK + j] * c;
        }
"""
    + chunk_results("D")
)

# The chunks' partial sums merged (each weighted by exp(its max - the overall max)), then the
# output un-rotated out of the values' domain and written in the model's dtype: one kernel
# where the MLX ops were eleven (a max, exps, sums, a division, the un-rotation's matmul, a
# cast). A block per (row, head), a thread per output coordinate.
_COMBINE = (
    """
    __shared__ float y[D];
"""
    + merge_chunks("D")
    + """    y[d] = acc / total;
    __syncthreads();
    float out_d = 0.f;
    for (uint32_t e = 0; e < D; ++e) out_d += y[e] * rot[d * D + e];  // (y @ R^T)[d]
    out[(size_t)bh * D + d] = static_cast<T>(out_d);
"""
)

CHUNK = 256  # positions a block scores


class FusedAttention:
    """`_ATTEND` for one pair of key/value codecs and one grouped-query shape."""

    def __init__(self, keys: CudaKernels, values: CudaKernels, group: int, kv_heads: int):
        self.keys, self.values = keys, values
        self.group, self.kv_heads = group, kv_heads
        self._kernel: Any = mx.fast.cuda_kernel(
            name=f"tandem_tq_attend_{keys.head_dim}_{keys.bits}_{values.bits}_{group}_{kv_heads}",
            input_names=[
                "q", "kcodes", "knorms", "vcodes", "vnorms", "klevels", "vlevels", "mask", "sizes",
            ],
            output_names=["partial", "tops", "sums"],
            source=_ATTEND,
        )  # fmt: skip
        self._combine: Any = mx.fast.cuda_kernel(
            name=f"tandem_tq_combine_{keys.head_dim}",
            input_names=["partial", "tops", "sums", "rot", "sizes"],
            output_names=["out"],
            source=_COMBINE,
        )
        self._template: list[tuple[str, Any]] = [
            ("G", group),
            ("D", keys.head_dim),
            ("HKV", kv_heads),
            ("KB", keys.bits),
            ("VB", values.bits),
            ("KW", keys.words),
            ("VW", values.words),
            ("KPW", 32 // keys.bits),
            ("VPW", 32 // values.bits),
            ("CHUNK", CHUNK),
        ]

    def __call__(
        self,
        q: mx.array,  # (B, H, D) float32: rotated and scaled
        kcodes: mx.array,
        knorms: mx.array,
        vcodes: mx.array,
        vnorms: mx.array,
        mask: mx.array,  # (B, S) uint8: 1 where a position is attended
        unrotation: mx.array,  # the values' rotation R (D, D) float32: the output is y @ R^T
        dtype: mx.Dtype,
    ) -> mx.array:
        rows, heads, dim = q.shape
        positions = kcodes.shape[2]
        splits = -(-positions // CHUNK)
        blocks = rows * self.kv_heads * splits
        sizes = _sizes(positions, splits)
        partial, tops, sums = self._kernel(
            inputs=[
                q, kcodes, knorms, vcodes, vnorms,
                self.keys.levels, self.values.levels, mask, sizes,
            ],
            template=self._template,
            grid=(blocks * 128, 1, 1),
            threadgroup=(128, 1, 1),
            output_shapes=[
                (rows, heads, splits, dim), (rows, heads, splits), (rows, heads, splits),
            ],
            output_dtypes=[mx.float32] * 3,
        )  # fmt: skip
        (out,) = self._combine(
            inputs=[partial, tops, sums, unrotation, sizes],
            template=[("D", dim), ("T", dtype)],
            grid=(rows * heads * dim, 1, 1),
            threadgroup=(dim, 1, 1),
            output_shapes=[(rows, heads, dim)],
            output_dtypes=[dtype],
        )
        return out  # type: ignore[no-any-return]


_SIZES: dict[tuple[int, int], mx.array] = {}


def _sizes(positions: int, splits: int) -> mx.array:
    """The kernels' (positions, splits) argument, made once per shape rather than per layer
    (planes grow 256 columns at a time, so there are few)."""
    sizes = _SIZES.get((positions, splits))
    if sizes is None:
        sizes = _SIZES[(positions, splits)] = mx.array([positions, splits], dtype=mx.uint32)
    return sizes


class _StepMask:
    """The last attention mask seen and its (B, S) uint8 form: one model call hands every
    layer the same mask array, so it is converted once per step, not once per layer."""

    mask: Any = None
    flat: Any = None


FUSED: bool | None = None  # None: not yet checked on this device (kv/turboquant.py checks once)
_fused: dict[tuple[int, int, int, int, int], FusedAttention] = {}


def fused_attention(
    q: mx.array,  # (B, H, 1, D) float32, rotated and scaled
    keys: tuple[mx.array, mx.array, CudaKernels],
    values: tuple[mx.array, mx.array, CudaKernels],
    mask: Any,
    unrotation: mx.array,
    dtype: mx.Dtype,
) -> mx.array | None:
    """One decode step's attention from the codes, un-rotated, (B, H, 1, D) in `dtype`; None
    where the kernel does not apply (several query positions, unequal key and value widths, a
    mask that is not a boolean array)."""
    kcodes, knorms, kk = keys
    vcodes, vnorms, vk = values
    rows, heads, length, dim = q.shape
    kv_heads, positions = kcodes.shape[1], kcodes.shape[2]
    if length != 1 or kk.head_dim != vk.head_dim or heads % kv_heads:
        return None
    if mask is None:
        flat = mx.ones((rows, positions), dtype=mx.uint8)
    elif isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.shape[-1] == positions:
        if mask is not _StepMask.mask:
            flat = mx.broadcast_to(mask, (rows, 1, 1, positions)).reshape(rows, positions)
            _StepMask.mask, _StepMask.flat = mask, flat.astype(mx.uint8)
        flat = _StepMask.flat
    else:
        return None
    key = (kk.head_dim, kk.bits, vk.bits, heads // kv_heads, kv_heads)
    attend = _fused.get(key)
    if attend is None:
        attend = _fused[key] = FusedAttention(kk, vk, heads // kv_heads, kv_heads)
    flat_q = q.reshape(rows, heads, dim)
    out = attend(flat_q, kcodes, knorms, vcodes, vnorms, flat, unrotation, dtype)
    return out.reshape(rows, heads, 1, dim)
